"""Stop 39: numerics and fusion of the pointwise path (review39, fuzz39a-c)."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse

from conftest import optimized_graph


class Clamp(nn.Module):
    def forward(self, x, lo, hi):
        return torch.clamp(x * 1.0, lo, hi)


@pytest.mark.parametrize("x, lo, hi", [
    (torch.tensor(0.3, dtype=torch.float16), torch.randint(-2, 2, (3, 5), dtype=torch.int16), torch.tensor(0.1)),
    (torch.randint(-5, 5, (3, 4)), torch.tensor(-1.5), torch.tensor(0.1, dtype=torch.float64)),
], ids=["fp16-int16-fp32", "int-fp32-fp64"])
def test_clamp_with_tensor_bounds_of_other_dtypes_promotes_as_eager(x, lo, hi):
    # rewritten to maximum then minimum, it promoted a pair at a time: fp16 where eager gives fp32, fp32 where it
    # gives fp64 (review39; with verify=False silently)
    model = Clamp().eval()
    opt = fxfuse.optimize(model, (x, lo, hi), verify=False)
    got, want = opt(x, lo, hi), model(x, lo, hi)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_clamp_with_tensor_bounds_of_one_dtype_still_fuses():
    model, x = Clamp().eval(), torch.randn(4, 8)
    lo, hi = -torch.rand(4, 8), torch.rand(8)
    opt = fxfuse.optimize(model, (x, lo, hi), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x, lo, hi), model(x, lo, hi), rtol=0, atol=0)


BIG = 2 ** 60 + 2 ** 36 + 1   # int64 -> fp32 is 2**60 + 2**37; through fp64 it is 2**60


class ComparesWithABigInt(nn.Module):
    def forward(self, x):
        return (x * 1.0) == BIG, (x * 1.0) + BIG


def test_an_int_literal_past_2_53_is_rounded_once_as_eager():
    model = ComparesWithABigInt().eval()
    opt = fxfuse.optimize(model, torch.randn(4), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    x = torch.tensor([2.0 ** 60 + 2.0 ** 37, 2.0 ** 60, 1.0, 3.0])
    for got, want in zip(opt(x), model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class ReverseSubtract(nn.Module):
    def forward(self, x):
        return torch.rsub(x * 1.0, 0.1, alpha=2)


def test_a_number_operand_is_read_as_fp32_as_eager_reads_it():
    # 0.1 was written unrounded into the fp64 expression of add_scaled: 0.1 - 2 * 0.05 gave -1.5e-9 (review39)
    model = ReverseSubtract().eval()
    opt = fxfuse.optimize(model, torch.randn(4), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.tensor([0.05, 0.05000001, -1.0, 2.0])
    torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


class ClampTensorAndNumber(nn.Module):
    def forward(self, x):
        return torch.clamp(x * 2, torch.tensor(-0.75), 3.0) + 1


def test_clamp_with_a_tensor_bound_and_a_number_bound_fuses():
    # torch.minimum(h, 3.0) failed in shape propagation: an internal error and the original (fuzz39a)
    model = ClampTensorAndNumber().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(4, 8) * 3
    torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


class PReLUOnAScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.PReLU()

    def forward(self, x):
        return self.act(x * 2) + 1


def test_prelu_of_a_0_dim_input_keeps_its_shape():
    # x * w with w of shape [1] made the result [1] (fuzz39a; with verify=False silently)
    model = PReLUOnAScalar().eval()
    opt = fxfuse.optimize(model, torch.tensor(0.5), verify=False)
    for value in (-0.35, 0.8):
        x = torch.tensor(value)
        got = opt(x)
        assert got.shape == torch.Size([])
        torch.testing.assert_close(got, model(x))


class ExportedActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) * 0.5)

    def forward(self, x):
        n = int(x.shape[0] / 2)   # symbolic_trace fails on int(Proxy): torch.export traces
        return F.prelu(x * 2, self.w) + F.rrelu(x, training=False) * n


def test_prelu_and_eval_rrelu_fuse_under_torch_export():
    # torch.export spells them aten.prelu / aten.rrelu, which stayed library calls (fuzz39a)
    model = ExportedActivations().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert not [n for n in optimized_graph(opt).graph.nodes if "relu" in str(n.target)]   # only w.view(8) besides
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(opt(x), model(x))


@pytest.mark.parametrize("options", [{}, {"fused_mlp": "force"}], ids=["default", "forced-mlp"])
def test_an_fp64_linear_keeps_its_bias_in_the_library_gemm(options):
    # no fused kernel takes fp64, so the split-off bias add was a library call of its own: one more pass
    # over the output and a second rounding (2501 of 3400 elements differed from eager; fuzz39b)
    model = nn.Sequential(nn.Linear(17, 33), nn.GELU(), nn.Linear(33, 17), nn.Tanh()).eval().double()
    opt = fxfuse.optimize(model, torch.randn(40, 17, dtype=torch.float64), **options)
    assert not [n for n in optimized_graph(opt).graph.nodes if n.target is operator.add]
    with torch.no_grad():
        x = torch.randn(40, 17, dtype=torch.float64)
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
    assert "take fp32, fp16 and bf16 only" in fxfuse.explain(opt)   # not "no calibration table"


class BoxDecode(nn.Module):
    """YOLOv3's decode: chains on slices of one prediction tensor."""

    def forward(self, p, grid, anchors):
        x = torch.sigmoid(p[..., 0]) + grid[..., 0]
        y = torch.sigmoid(p[..., 1]) + grid[..., 1]
        w = torch.exp(p[..., 2]) * anchors[..., 0]
        h = torch.exp(p[..., 3]) * anchors[..., 1]
        return x, y, w, h, torch.sigmoid(p[..., 4:])


def test_chains_on_slices_of_one_tensor_share_a_kernel():
    # each chain was a kernel of its own: the sibling merge saw only direct readers (fuzz39c: 5 kernels)
    model = BoxDecode().eval()
    args = (torch.randn(2, 3, 5, 7, 9), torch.randn(1, 1, 5, 7, 2), torch.rand(1, 3, 1, 1, 2))
    opt = fxfuse.optimize(model, args, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 2   # x, y, w, h in one; the [..., 4:] sigmoid has another shape
    args = (torch.randn(2, 3, 5, 7, 9), args[1], args[2])
    for got, want in zip(opt(*args), model(*args)):
        torch.testing.assert_close(got, want)   # exp and sigmoid within 2 ulp of the CPU's


class MaskedFill(nn.Module):
    def forward(self, x, m):
        return x.masked_fill(m < 0, -1.0)


def test_masked_fill_of_a_permuted_broadcast_view_is_row_major_as_eager():
    # meta tensors gave torch.where's result row-major, real ones (1, 15, 1, 3): no layout restored, and
    # .view(-1) of the result raised (fuzz39e)
    def inputs():
        x = torch.randn(2, 5, 1).permute(2, 0, 1)[:, :, None, :].expand(1, 2, 3, 5)   # strides (1, 5, 0, 1)
        return x, torch.randn(2, 1, 5)
    model = MaskedFill().eval()
    opt = fxfuse.optimize(model, inputs(), strict=True)
    x, m = inputs()
    got, want = opt(x, m), model(x, m)
    assert got.stride() == want.stride() == (30, 15, 5, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fxfuse.stats(opt)["fused_kernels"] == 1


class ClampBetweenTensors(nn.Module):
    def forward(self, a, lo, hi):
        return torch.clamp(a, min=lo, max=hi)


def test_clamp_with_tensor_bounds_keeps_eagers_layout():
    # maximum(a, lo) fixed the layout before hi was seen: row-major where eager follows the transposed hi (fuzz39e)
    def inputs():
        return torch.randn(1, 4).expand(3, 4), torch.randn(1, 4).expand(3, 4), torch.randn(4, 3).t()
    model = ClampBetweenTensors().eval()
    opt = fxfuse.optimize(model, inputs(), strict=True)
    args = inputs()
    got, want = opt(*args), model(*args)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
