"""Stop 37: numerics and fusion: exp computed as Cody-Waite, fixes from the fuzz37 helper rounds
(tracing, state, warnings and arguments: test_fuzz37_state.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse


class ExpOps(nn.Module):
    def forward(self, x):
        return torch.exp(x) * 1.0, torch.sigmoid(x) + 0.0, F.softplus(x) * 1.0, F.logsigmoid(x) * 1.0


def test_exp_over_its_whole_range_edges_and_specials():
    # the exp form (fxfuse/ops.py _exp) takes 2 ** n apart from exp(r): results near the overflow edge,
    # subnormal results, infinities and nan must come out as eager's (the GPU's accuracy is a GPU test)
    x = torch.cat([torch.linspace(-110, 95, 2001), torch.tensor(
        [float("inf"), float("-inf"), float("nan"), -0.0, 88.72, 88.7228, 88.73, -87.3, -100.0, -103.9, -103.98])])
    opt = fxfuse.optimize(ExpOps().eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        for got, want in zip(opt(x), ExpOps()(x)):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
            torch.testing.assert_close(got, want, rtol=3e-7, atol=1.5e-45, equal_nan=True)   # one subnormal step
            assert (got[want.abs() > 1e-44] != 0).all()   # subnormal results are not flushed


class CompareWithZeroDim(nn.Module):
    def forward(self, x, t):
        return (x > t).float() * 2.0


def test_a_narrow_integer_comparison_with_a_zero_dim_tensor_of_another_dtype_wraps_as_eager():
    # uint8 > a 0-dim int8 compares in uint8: -5 is 251 there (fuzz37c); the kernel compared unwrapped
    x = torch.tensor([[0, 1, 2, 100, 200, 252, 255, 250]], dtype=torch.uint8)
    model = CompareWithZeroDim().eval()
    opt = fxfuse.optimize(model, (x, torch.tensor(5, dtype=torch.int8)), strict=True)
    for t in (torch.tensor(-5, dtype=torch.int8), torch.tensor(5, dtype=torch.int8)):
        assert torch.equal(opt(x, t), model(x, t))
    x8 = torch.tensor([[44, -56, 1, 0]], dtype=torch.int8)
    for t in (torch.tensor(300, dtype=torch.int16), torch.tensor(200, dtype=torch.uint8)):
        opt = fxfuse.optimize(model, (x8, t), strict=True)
        assert torch.equal(opt(x8, t), model(x8, t))


class NegativeBase(nn.Module):
    def forward(self, x):
        return (-2) ** x + (-1.5) ** x.floor() + 1


def test_a_negative_number_raised_to_a_tensor_is_not_negated():
    # torch.fx prints operator.pow(-2, x) as `-2 ** x`, which Python reads as -(2 ** x) (fuzz37c)
    model = NegativeBase().eval()
    example = torch.tensor([[1.0, 3.0, 5.0, -1.0]])   # odd exponents: the wrong form agreed with eager
    for verify in (True, False):
        opt = fxfuse.optimize(model, example, strict=True, verify=verify)
        x = torch.tensor([[2.0, 4.0, 0.5, 0.0, -2.0, 3.0]])
        torch.testing.assert_close(opt(x), model(x), equal_nan=True)


class MaskArithmetic(nn.Module):
    def forward(self, x):
        both = (x > 0) * (x < 1)
        either = (x > 0.5) + (x < -0.5)
        return both.float() + x, either * x


def test_products_and_sums_of_masks_fuse_as_logical_ops():
    x = torch.randn(6, 7)
    model = MaskArithmetic().eval()
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    x = torch.randn(6, 7)
    for got, want in zip(opt(x), model(x)):
        assert torch.equal(got, want)


class SplitSpellings(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        h = x * 2 + 1
        if self.spelling == "hsplit":
            a, b = torch.hsplit(h, 2)
        elif self.spelling == "vsplit":
            a, b = torch.vsplit(h, [2])
        else:
            a, b = h.hsplit([3])
        return a.exp() - b.sigmoid()


@pytest.mark.parametrize("spelling", ["hsplit", "vsplit", "hsplit-method"])
def test_hsplit_and_vsplit_parts_join_the_producers_kernel(spelling):
    model = SplitSpellings(spelling).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1   # 2 before: the parts were not seen as slices (fuzz37e)
    x = torch.randn(4, 6)
    torch.testing.assert_close(opt(x), model(x))


class ViewAsUnderExport(nn.Module):
    def forward(self, x):
        if x.shape[0] > 0:   # symbolic_trace cannot take it: torch.export's aten.view_as
            return (x * 2).reshape(-1).view_as(x) + 1
        return x


def test_export_view_as_between_pointwise_ops_keeps_one_kernel():
    model = ViewAsUnderExport().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 7, 13))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(3, 7, 13)
    torch.testing.assert_close(opt(x), model(x))


class PermutedBroadcast(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x, s, z):
        return x.permute(*self.dims) + (s * z).permute(*self.dims)


@pytest.mark.parametrize("dims", [(1, 0, 2), (2, 0, 1), (0, 2, 1)])
@pytest.mark.parametrize("s_shape", [(4, 1, 5), (1, 6, 1), (4, 1, 1)])
def test_a_permute_after_an_op_of_two_broadcast_operands_joins_one_kernel(dims, s_shape):
    # s * z is [4, 6, 5] only by broadcasting: its permuted form had other strides than the permute's,
    # which kept it unmoved (2 kernels; fuzz37e); the readers' strides are what must stay eager's
    model = PermutedBroadcast(dims).eval()
    args = (torch.randn(4, 6, 5), torch.randn(s_shape), torch.randn(6, 5))
    opt = fxfuse.optimize(model, args, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    args = tuple(torch.randn_like(a) for a in args)
    got, want = opt(*args), model(*args)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want)


class LiteralScale(nn.Module):
    def forward(self, x):
        scale = torch.sqrt(torch.tensor(24.0, dtype=torch.float32, device=x.device))   # folded at optimize time
        return (x / scale).relu() * torch.tensor(1.7)


def test_a_pointwise_op_of_literals_is_computed_once_as_eager_computes_it():
    model = LiteralScale().eval()
    opt = fxfuse.optimize(model, torch.randn(5, 7), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert "sqrt" not in fxfuse.explain(opt)   # no sqrt node left, in the graph or in the kernel
    x = torch.randn(5, 7)
    assert torch.equal(opt(x), model(x))


def test_softshrink_zeros_are_positive_as_cuda_eagers():
    # fuzz37a: `a * 0.0` kept a negative input's sign; CUDA eager (and CPU's vectorized loop) give +0.0
    x = torch.cat([torch.linspace(-1, 1, 41), torch.tensor([-0.0, float("nan")])])
    opt = fxfuse.optimize(nn.Softshrink(0.5).eval(), x, strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    got = opt(x)
    inside = x.abs() <= 0.5
    assert (got[inside] == 0).all() and not got[inside].signbit().any() and got[-1].isnan()


class FlatWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(13 * 17) * 0.2)
        self.b = nn.Parameter(torch.randn(13))

    def forward(self, x):
        return F.relu(F.linear(x, self.w.view(13, 17), self.b))


def test_a_weight_viewed_in_forward_is_a_weight_of_the_model():
    # fuzz37d: w.view(out, in) was "a weight computed in the graph", a library GEMM even under gemm="force"
    model = FlatWeight().eval()
    opt = fxfuse.optimize(model, torch.randn(5, 17), gemm="force", strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 0 and fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(5, 17)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.w.mul_(-2.0)   # an in-place edit after optimize is seen, as for the weight itself
        torch.testing.assert_close(opt(x), model(x))


SCALE = torch.tensor([4.0, 9.0])


class GlobalScale(nn.Module):
    def forward(self, x):
        return x / SCALE.to(x.device).sqrt() + 1.0   # the cast and sqrt are graph nodes: folded at optimize time


def test_a_value_folded_from_a_global_tensor_follows_in_place_edits():
    # review37: folding `SCALE.to(..).sqrt()` froze it; the runtime now watches the tensors the trace read
    model = GlobalScale().eval()
    x = torch.randn(3, 2)
    try:
        opt = fxfuse.optimize(model, x, strict=True)
        torch.testing.assert_close(opt(x), model(x))
        SCALE.mul_(4.0)
        torch.testing.assert_close(opt(x), model(x))
    finally:
        SCALE.copy_(torch.tensor([4.0, 9.0]))


class SignBySize(nn.Module):
    def forward(self, x):
        return (-1) ** x.shape[-1] * x + 1.0


class LiteralUnderExport(nn.Module):
    def forward(self, x):
        if x.shape[-1] > 1:   # symbolic_trace cannot follow it: torch.export's lift_fresh_copy + detach_
            x = x * 2.0
        return x / torch.sqrt(torch.tensor(24.0)) + 1.0


def test_negative_base_with_a_size_exponent_and_export_literals():
    opt = fxfuse.optimize(SignBySize().eval(), torch.randn(2, 3), strict=True)
    assert "symbolic_trace" in fxfuse.explain(opt)   # torch.pow(-1, <int>) failed and sent it to torch.export
    for n in (3, 4):
        x = torch.randn(2, n)
        torch.testing.assert_close(fxfuse.optimize(SignBySize().eval(), x)(x), SignBySize()(x))
    opt = fxfuse.optimize(LiteralUnderExport().eval(), torch.randn(3, 2), strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 0 and "sqrt" not in fxfuse.explain(opt)   # folded (review37)
    x = torch.randn(3, 2)
    assert torch.equal(opt(x), LiteralUnderExport()(x))


class DeadSplit(nn.Module):
    def forward(self, x):
        h = x + 1
        unused = h.hsplit(2)   # noqa: F841 -- dead code that still reads h
        a, b = h.chunk(2, 0)
        return a.relu() * b


def test_a_dead_split_of_a_pointwise_result_does_not_break_the_build():
    # fuzz37g: hoist_slices erased h under the dead hsplit ("still had 1 users"): the whole model fell back
    model = DeadSplit().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 4), strict=True)
    x = torch.randn(4, 4)
    torch.testing.assert_close(opt(x), model(x))


def test_negative_zero_literals_are_written_from_their_bits():
    # H100 (stop 37): Triton made a -0.0 constant +0.0, so F.threshold(x, 0.1, -0.0) gave +0.0 (a GPU test
    # checks the values there); the source now builds it from its bits
    from fxfuse.ops import literal
    assert literal(-0.0) == "_neg_zero()" and literal(0.0) == "0.0"
    x = torch.linspace(-1, 1, 41)
    model = nn.Threshold(0.1, -0.0).eval()
    opt = fxfuse.optimize(model, x, strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert torch.equal(opt(x).signbit(), model(x).signbit())


class SizesInATuple(nn.Module):
    def forward(self, x):
        self.dims = (x.shape[-1], 3)   # the same value every call: no change of state
        return x * self.dims[1]


class NoOpCasts(nn.Module):
    def forward(self, x):
        h = (x * 2).to(x.device, x.dtype).to(device=x.device).to(device=x.device, dtype=x.dtype)
        return h.relu()


def test_tuple_attributes_no_op_casts_and_dead_splits():
    model = SizesInATuple().eval()
    model.dims = (8, 3)
    for verify in (True, False):   # review37b: refused with verify=False (the Proxy sat inside the tuple)
        opt = fxfuse.optimize(model, torch.randn(2, 8), strict=True, verify=verify)
        torch.testing.assert_close(opt(torch.ones(2, 8)), model(torch.ones(2, 8)))
    assert model.dims == (8, 3)
    opt = fxfuse.optimize(NoOpCasts().eval(), torch.randn(3, 4), strict=True)   # review37b: library calls each
    assert fxfuse.stats(opt)["library_calls"] == 0 and fxfuse.stats(opt)["fused_kernels"] == 1
    opt = fxfuse.optimize(DeadSplit().eval(), torch.randn(4, 4), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1   # the dead hsplit goes (a view): h is no extra kernel output
    assert "hsplit" not in fxfuse.explain(opt)
