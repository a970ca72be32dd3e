"""Stop 44: review44h's findings in this stop's own rewrites (copies read as .contiguous() or as no-op
conversions, set_ aliasing, layouts of expands and mask assignments, keyword spellings, views of one
returned constant)."""
import pytest
import torch
from torch import nn

import fxfuse

from conftest import optimize_strict


class Copy(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y=None):   # (not *args: torch.export traces that, and drops a `to` it deems a no-op)
        return self.fn(x) if y is None else self.fn(x, y)


def _fresh_and_eager(fn, make, verify=True):
    """opt's result equals eager's, with eager's strides, and is fresh memory where eager's is."""
    model = Copy(fn).eval()
    opt = fxfuse.optimize(model, make(), strict=True, verify=verify)
    args = make()
    with torch.no_grad():
        got, want = opt(*args), model(*[a.clone(memory_format=torch.preserve_format) for a in args])
        same = model(*args)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()
    aliases = any(same.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in args)
    assert aliases == any(got.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in args)
    return opt


COPIES_OF_CONTIGUOUS = {   # .contiguous() / to() would return these inputs themselves; eager's op copies
    "t().clone(contiguous) of [1, N]": (lambda x: x.t().clone(memory_format=torch.contiguous_format),
                                        lambda: [torch.randn(1, 5)]),
    "clone(contiguous) of 1-channel channels_last": (
        lambda x: x.clone(memory_format=torch.contiguous_format),
        lambda: [torch.randn(2, 1, 3, 3).to(memory_format=torch.channels_last)]),
    "to(channels_last) of [2, 1, 1, 1]": (lambda x: x.to(memory_format=torch.channels_last),
                                          lambda: [torch.randn(2, 1, 1, 1)]),
    "to(float32, channels_last_3d)": (lambda x: x.to(torch.float32, memory_format=torch.channels_last_3d),
                                      lambda: [torch.randn(2, 1, 1, 1, 1)]),
}


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("name", list(COPIES_OF_CONTIGUOUS))
def test_a_copy_of_a_contiguous_input_stays_a_copy(name, verify):
    """Read as `.contiguous()` (or a no-op `to`), the copy returned the caller's input (review44h)."""
    fn, make = COPIES_OF_CONTIGUOUS[name]
    _fresh_and_eager(fn, make, verify)


def test_set_makes_an_alias_that_later_writes_reach():
    """After h.set_(g), the kept h.add_(1) writes g: g's readers after it must not run before it."""
    def fn(x, y):
        h, g = x * 1, y * 2
        h.set_(g)
        a = g + 1
        h.add_(1)
        return a * g
    _fresh_and_eager(fn, lambda: [torch.randn(3, 4), torch.randn(3, 4)], verify=False)


LAYOUTS = {
    "repeat then channels_last x": (lambda x: x.mean((2, 3), keepdim=True).sigmoid().repeat(1, 1, 4, 4) * x,
                                    lambda: [torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)]),
    "h[mask] = 0 on channels_last h": (lambda x, y: _masked(x * 2, y > 0),
                                       lambda: [torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last),
                                                torch.randn(2, 3, 2, 2)]),
    "h[mask] = 0 on a transposed h": (lambda x, y: _masked(x.t() * 2, y > 0),
                                      lambda: [torch.randn(4, 3), torch.randn(3, 4)]),
}


def _masked(h, mask):
    h[mask] = 0.0
    return h


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rewrites_keep_eager_layouts(name):
    """An expand read beside a channels_last operand follows it where the repeat's copy is row-major; a
    mask assignment read as torch.where returned a row-major h where eager's keeps its strides."""
    fn, make = LAYOUTS[name]
    _fresh_and_eager(fn, make)


KEYWORDS = {   # each fused as its positional form, or at least no longer an internal error
    "torch.clone(input=)": lambda h: torch.clone(input=h) + 1,
    "torch.ravel(input=)": lambda h: torch.ravel(input=h) + 1,
    "torch.adjoint(input=)": lambda h: torch.adjoint(input=h) + 1,
    "repeat(repeats=)": lambda h: h.repeat(repeats=(2, 1, 1)) + 1,
    "torch.squeeze(dim=)": lambda h: torch.squeeze(h[:, 1:2], dim=1) + 1,
    "zeros_like(input=)": lambda h: torch.zeros_like(input=h) + h,
    "full_like(input=, fill_value=)": lambda h: torch.full_like(input=h, fill_value=0.5) * h,
}


@pytest.mark.parametrize("name", list(KEYWORDS))
def test_keyword_spellings_of_this_stops_rewrites(name):
    model = Copy(lambda x: KEYWORDS[name](torch.sigmoid(x) * 2)).eval()
    opt = optimize_strict(model, torch.randn(4, 3))
    if "like" not in name:   # (an expand between pointwise ops costs a second kernel, as h.expand(...) does)
        assert fxfuse.stats(opt)["fused_kernels"] == (2 if "repeat" in name else 1)
    with torch.no_grad():
        x = torch.randn(4, 3)
        torch.testing.assert_close(opt(x), model(x))


class TwoWindows(nn.Module):
    def forward(self, x):
        c = torch.arange(3000.0)
        return c[:16], c[8:24], x + 1


def test_overlapping_views_of_a_returned_constant_keep_their_aliasing():
    opt = optimize_strict(TwoWindows().eval(), torch.randn(3))
    with torch.no_grad():
        a, b, _ = opt(torch.randn(3))
    a.fill_(-99.0)
    assert (b[:8] == -99.0).all() and (b[8:] != -99.0).all()
