"""Stop 44: the wrapper's bookkeeping no longer shares names with the model's attributes
(review44g), and other state-related findings of this stop's helpers."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict


class NamedLikeTheWrapper(nn.Module):
    """A model whose own attributes carry the names fxfuse's wrapper used for its state."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.miss_count, self.dropped, self.options = 3, 0.25, {"scale": 2.0}
        self.specializations, self.misses, self.last_miss, self.original_calls = ["cpu"], 1, "x", 0

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x))) * self.options["scale"] * (1 - self.dropped) + self.miss_count


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = NamedLikeTheWrapper()

    def forward(self, x):
        return self.block(x) + self.block.miss_count + len(self.block.specializations)


def test_the_models_attributes_named_like_fxfuse_state_stay_the_models():
    """fxfuse's counters were written into the model (`miss_count` 3 -> 1 after one new shape, a tuple
    into `dropped` on load_state_dict: the eager model then raised), and a model's `specializations`
    kept fxfuse from dropping a stale build (2.6 off after load_state_dict)."""
    model = NamedLikeTheWrapper().eval()
    before = {k: getattr(model, k) for k in ("miss_count", "dropped", "options", "specializations", "misses",
                                             "last_miss", "original_calls")}
    opt = optimize_strict(model, torch.randn(4, 8))
    assert_matches_eager(opt, model, torch.randn(5, 8))   # a guard miss: a second specialization
    state = {k: (torch.randn_like(v) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    state["bn.running_var"] = state["bn.running_var"].abs() + 0.5
    opt.load_state_dict(state)
    with torch.no_grad():
        model.bn.running_mean.add_(1.0)
    assert_matches_eager(opt, model, torch.randn(4, 8))
    assert {k: getattr(model, k) for k in before} == before
    assert fxfuse.stats(opt)["optimized"] and fxfuse.stats(opt)["fused_kernels"] >= 1


def test_a_parent_reads_its_swapped_childs_own_attributes():
    model = Parent().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = model(x)
    model.block = optimize_strict(model.block, x)
    assert model.block.miss_count == 3 and model.block.options == {"scale": 2.0}
    with torch.no_grad():
        torch.testing.assert_close(model(x), want)
    model.block.options = {"scale": 3.0}   # the model's, which the graph follows (a rebuild)
    assert model.block.original.options == {"scale": 3.0}
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.block.original(x) + 3 + 1)


class PartialActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(8, 8), functools.partial(F.gelu, approximate="tanh")

    def forward(self, x):
        return self.act(self.lin(x)) * 3.0


@pytest.mark.parametrize("replacement", [functools.partial(F.gelu, approximate="none"), functools.partial(F.silu),
                                         functools.partial(torch.mul, other=2.0)])
def test_a_partial_replaced_by_another_rebuilds(replacement):
    """same_attr compared two partials by their (empty) __dict__: the graph kept the old one (fuzz44d)."""
    model = PartialActivation().eval()
    opt = optimize_strict(model, torch.randn(4, 8))
    assert_matches_eager(opt, model, torch.randn(4, 8))
    model.act = replacement
    assert_matches_eager(opt, model, torch.randn(4, 8))


class SizeArgument(nn.Module):
    def forward(self, x, size=torch.Size([2, 4])):
        if isinstance(size, torch.Size):
            return x.reshape(size) * size.numel() + 1
        return x


@pytest.mark.parametrize("verify", [True, False])
def test_a_torch_size_argument_reaches_forward_as_a_size(verify):
    """torch.fx's pytree rebuilt a Size among concrete_args as a tuple: the trace took the tuple's
    branch (a silent wrong answer with verify=False) and `size.numel()` failed (fuzz44c)."""
    model = SizeArgument().eval()
    opt = optimize_strict(model, (torch.randn(8), torch.Size([2, 4])), verify=verify)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(8), torch.Size([2, 4]))
    assert_matches_eager(opt, model, torch.randn(8))            # the default, another specialization
    assert_matches_eager(opt, model, torch.randn(8), torch.Size([4, 2]))


TABLE = torch.zeros(4)


def _closed_over():
    table = torch.zeros(4)

    class ClosedOver(nn.Module):
        def forward(self, x):
            return x + table, table
    return ClosedOver, table


class ReadsAGlobal(nn.Module):
    def forward(self, x):
        return x + TABLE, TABLE


def test_a_module_level_or_closed_over_tensor_is_returned_as_itself():
    """Eager returns the tensor itself; the graph returned a fresh copy per call, so a caller's write
    into it changed eager's next result but not opt's (fuzz44c)."""
    closed, table = _closed_over()
    for model, held in ((ReadsAGlobal().eval(), TABLE), (closed().eval(), table)):
        opt = optimize_strict(model, torch.randn(4))
        with torch.no_grad():
            _, got = opt(torch.randn(4))
            assert got is held
            got.add_(1)                        # the caller's write reaches the next call, as in eager
            x = torch.randn(4)
            torch.testing.assert_close(opt(x)[0], x + 1)
        held.zero_()


class BigConstantAndAWindow(nn.Module):
    def forward(self, x):
        buf = torch.zeros(2048)
        return x + 1, buf, buf[:16]


def test_a_big_constant_returned_with_a_small_view_of_it_keeps_their_aliasing():
    """A small view of a big constant got its own copy even where the whole constant was returned
    beside it: `window` no longer saw writes into `buf` (fuzz44c; fine up to ~1000 elements)."""
    model = BigConstantAndAWindow().eval()
    opt = optimize_strict(model, torch.randn(4))
    with torch.no_grad():
        _, buf, window = opt(torch.randn(4))
        _, again, _ = opt(torch.randn(4))
    buf[0] = 7
    assert window[0] == 7 and again[0] == 0 and buf.untyped_storage().data_ptr() != again.untyped_storage().data_ptr()
