"""Stop 44: views and conversions with an uncommon spelling, read as their common one so they no
longer split a kernel (fuzz44d, fuzz44e)."""
import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict


class Between(nn.Module):
    """fn between two pointwise steps: sigmoid before it, relu(+ w) after."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, w):
        return torch.relu(self.fn(torch.sigmoid(x) * 2) + w)


PAIRS = {   # name: (spelling, its common form, x's shape, w's shape)
    "h.ravel()": (lambda h: h.ravel(), lambda h: h.reshape(-1), (5, 3), (15,)),
    "torch.ravel(h)": (lambda h: torch.ravel(h), lambda h: h.reshape(-1), (5, 3), (15,)),
    "h.mH": (lambda h: h.mH, lambda h: h.mT, (2, 5, 3), (5,)),
    "h.H": (lambda h: h.H, lambda h: h.T, (5, 3), (5,)),
    "h.adjoint()": (lambda h: h.adjoint(), lambda h: h.mT, (5, 3), (5,)),
    "torch.adjoint(h)": (lambda h: torch.adjoint(h), lambda h: h.mT, (5, 3), (5,)),
    "torch.real(h)": (lambda h: torch.real(h), lambda h: h, (5, 3), (3,)),
    "h.to(memory_format=contiguous)": (lambda h: h.to(memory_format=torch.contiguous_format), lambda h: h,
                                       (5, 3), (3,)),
    "torch.atleast_2d(h)": (lambda h: torch.atleast_2d(h), lambda h: h, (5, 3), (3,)),
    "h.type('torch.HalfTensor')": (lambda h: h.type("torch.HalfTensor").float(), lambda h: h.half().float(),
                                   (5, 3), (3,)),
    "h[:, 1:2].squeeze(-1)": (lambda h: h[:, 1:2].squeeze(-1), lambda h: h[:, 1], (5, 3), (5,)),
    "h.narrow(1, 2, 1).squeeze(1)": (lambda h: h.narrow(1, 2, 1).squeeze(1), lambda h: h.select(1, 2), (5, 3), (5,)),
    "h.repeat(4, 1, 1)": (lambda h: h.repeat(4, 1, 1), lambda h: h.expand(4, 5, 3), (5, 3), (3,)),
    "h.tile((2, 1))": (lambda h: h[:1].tile((2, 1)), lambda h: h[:1].expand(2, 3), (5, 3), (3,)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_spelling_fuses_as_its_common_form(name):
    spelling, common, x_shape, w_shape = PAIRS[name]
    counts = []
    for fn in (spelling, common):
        model = Between(fn).eval()
        opt = optimize_strict(model, torch.randn(x_shape), torch.randn(w_shape))
        counts.append((fxfuse.stats(opt)["fused_kernels"], fxfuse.stats(opt)["library_calls"]))
        assert_matches_eager(opt, model, torch.randn(x_shape), torch.randn(w_shape))
    assert counts[0] == counts[1], counts


class AtLeastAndReal(nn.Module):
    def forward(self, x):
        return torch.atleast_3d(x) + 1, torch.real(x), torch.atleast_2d(x)


def test_identities_keep_eager_results_where_they_are_not_identities():
    """atleast_3d of a 2-D tensor adds a dim; a returned torch.real(x) / atleast_2d(x) is x itself."""
    model = AtLeastAndReal().eval()
    opt = optimize_strict(model, torch.randn(5, 3))
    got = assert_matches_eager(opt, model, torch.randn(5, 3))
    assert got[0].shape == (5, 3, 1)


class MaskAssignment(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        h = x * 2
        if self.how == "h[mask] = 0.0":
            h[h > 0.5] = 0.0
        elif self.how == "h[mask] = tensor":
            h[h < 0] = torch.tensor(-0.25)
        else:
            h.masked_fill_(h > 0.5, 0.0)
        return h + 1


@pytest.mark.parametrize("how", ["h[mask] = 0.0", "h[mask] = tensor", "masked_fill_"])
def test_a_bool_mask_assignment_joins_the_kernel(how):
    """`h[h > 0.5] = 0.0` (export's index_put_) was kept in place: 1 kernel and 4 library calls,
    against 1 kernel for masked_fill_ (fuzz44e)."""
    model = MaskAssignment(how).eval()
    opt = optimize_strict(model, torch.randn(3, 5))
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, torch.randn(3, 5))


class MaskAssignmentKept(nn.Module):
    """A mask of other shape (rows), and an assignment into an input: as eager, in place."""

    def forward(self, x, rows):
        h = x * 2
        h[rows] = 0.0
        x[x > 1] = 1.0
        return h + x


def test_mask_assignments_that_are_not_masked_fills_stay_writes():
    model = MaskAssignmentKept().eval()
    opt = optimize_strict(model, torch.randn(3, 5), torch.tensor([True, False, True]))
    assert_matches_eager(opt, model, torch.randn(3, 5) * 2, torch.tensor([False, True, True]), fresh=False)


JOIN_PAIRS = {   # name: (spelling, the stack / cat it equals, x's shape); each split a kernel (fuzz44e)
    "hstack of 1-D": (lambda h, g: torch.hstack([h, g]), lambda h, g: torch.cat([h, g], 0), (5,)),
    "vstack of 1-D": (lambda h, g: torch.vstack([h, g]), lambda h, g: torch.stack([h, g], 0), (5,)),
    "row_stack of 1-D": (lambda h, g: torch.row_stack([h, g]), lambda h, g: torch.stack([h, g], 0), (5,)),
    "column_stack of 1-D": (lambda h, g: torch.column_stack([h, g]), lambda h, g: torch.stack([h, g], 1), (5,)),
    "dstack of 2-D": (lambda h, g: torch.dstack([h, g]), lambda h, g: torch.stack([h, g], 2), (3, 5)),
    "cat of h[..., None]": (lambda h, g: torch.cat([h[..., None], g[..., None]], -1),
                            lambda h, g: torch.stack([h, g], -1), (5, 3)),
    "cat of unsqueeze(0)": (lambda h, g: torch.cat([h.unsqueeze(0), g.unsqueeze(0)], 0),
                            lambda h, g: torch.stack([h, g], 0), (5, 3)),
    "vstack of h[None]": (lambda h, g: torch.vstack([h[None], g[None]]), lambda h, g: torch.stack([h, g], 0), (5, 3)),
}


class Joined(nn.Module):
    def __init__(self, join):
        super().__init__()
        self.join = join

    def forward(self, x):
        return self.join(torch.sigmoid(x) * 2, torch.tanh(x)) * 3 + 1


@pytest.mark.parametrize("name", list(JOIN_PAIRS))
def test_a_join_spelling_is_written_by_the_kernel_as_its_stack_or_cat(name):
    spelling, common, shape = JOIN_PAIRS[name]
    counts = []
    for join in (spelling, common):
        model = Joined(join).eval()
        opt = optimize_strict(model, torch.randn(shape))
        counts.append((fxfuse.stats(opt)["fused_kernels"], fxfuse.stats(opt)["library_calls"]))
        assert_matches_eager(opt, model, torch.randn(shape))
    assert counts[0] == counts[1] == (1, 0), counts


class RepeatKept(nn.Module):
    """A repeat of a non-unit dim, and one that is returned, stay copies."""

    def forward(self, x):
        h = torch.relu(x)
        return h.repeat(2, 1) + 1, h.repeat(3, 1, 1)


def test_repeats_that_are_not_expands_stay_copies():
    model = RepeatKept().eval()
    opt = optimize_strict(model, torch.randn(5, 3))
    got = assert_matches_eager(opt, model, torch.randn(5, 3))
    assert got[1].is_contiguous() and got[1].stride() == (15, 3, 1)


FACTORIES_OF_A_SHAPE = {   # each read h (a kernel's value) for its shape only, and split the kernel (fuzz44d)
    "zeros_like": lambda h, x: (torch.maximum(h, torch.zeros_like(h)) + x) * 0.5,
    "new_zeros(())": lambda h, x: (torch.max(h, h.new_zeros(())) + x) * 0.5,
    "full_like": lambda h, x: (torch.maximum(h, torch.full_like(h, 0.25)) + x) * 0.5,
    "new_full": lambda h, x: (torch.relu(h) + x) * h.new_full(h.shape, 0.5),
    "ones_like(dtype=)": lambda h, x: (torch.relu(h) + x) * torch.ones_like(h, dtype=torch.float16),
}


class ShapeFactory(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.lin = fn, nn.Linear(17, 17)

    def forward(self, x):
        return self.fn(self.lin(x), x)


@pytest.mark.parametrize("name", list(FACTORIES_OF_A_SHAPE))
def test_a_factory_of_a_values_shape_does_not_split_its_kernel(name):
    model = ShapeFactory(FACTORIES_OF_A_SHAPE[name]).eval()
    opt = optimize_strict(model, torch.randn(3, 17))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(3, 17))


class FactoryOfATransposed(nn.Module):
    def forward(self, x):
        h = torch.relu(x).t()
        return torch.zeros_like(h) + h, torch.ones_like(h)   # zeros_like keeps h's (transposed) strides


def test_a_factory_keeps_its_templates_strides():
    model = FactoryOfATransposed().eval()
    opt = optimize_strict(model, torch.randn(3, 5))
    got = assert_matches_eager(opt, model, torch.randn(3, 5))
    with torch.no_grad():
        assert got[1].stride() == model(torch.randn(3, 5))[1].stride()
