"""Stop 49 on the GPU: this stop's rewrites against CUDA eager."""
import pytest
import torch
from torch import nn

import fxfuse
from test_fuzz49 import ClampJoin, InfChecks, TruncDivisions

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def test_trunc_division_matches_cuda_eager_bit_for_bit():
    """CUDA's trunc division by a number multiplies by its reciprocal (BinaryDivTruncKernel.cu), which can
    land below an integer where the true quotient is one: the fused form must do the same."""
    x = torch.randn(64, 5, device="cuda")
    y = torch.rand(5, device="cuda") + 0.5
    opt = fxfuse.optimize(TruncDivisions().eval(), (x, y), strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 0
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(64, 5, device="cuda") * 10
            for got, want in zip(opt(x, y), TruncDivisions()(x, y)):
                assert torch.equal(got, want)


class Divisions(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return torch.div(x * 1.0, self.c, rounding_mode="trunc") + 0.0


@pytest.mark.parametrize("c", [0.1, 1e-3, 2.5e-4, 3.0, 0.7])
def test_trunc_division_near_integers(c):
    k = torch.arange(-2000, 2000, device="cuda", dtype=torch.float32)
    x = (k * c).reshape(40, 100)   # quotients at or next to integers: where a*(1/c) and a/c part
    model = Divisions(c).eval()
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


def test_inf_checks_and_signed_zero_joins_on_cuda():
    x = torch.randn(3, 5, device="cuda") * 4
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    opt = fxfuse.optimize(InfChecks().eval(), x, strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 0
    with torch.no_grad():
        torch.testing.assert_close(opt(x), InfChecks()(x), equal_nan=True)
    a, b = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
    opt = fxfuse.optimize(ClampJoin().eval(), (a, b), strict=True)
    with torch.no_grad():
        got, want = opt(a, b), ClampJoin()(a, b)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("options", [{"gemm": "force"}, {"fused_mlp": "force"}])
def test_generated_gemm_and_mlp_outputs_take_inplace_ops_with_grad(options):
    model = nn.Sequential(nn.Linear(17, 33), nn.ReLU()).cuda().eval()
    x = torch.randn(2, 5, 17, device="cuda")
    opt = fxfuse.optimize(model, x, cuda_graphs=False, strict=True, **options)
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert got._base is None
    p = torch.rand(33, device="cuda", requires_grad=True)
    torch.testing.assert_close(got.mul_(p), want.mul_(p))


@pytest.mark.parametrize("case", ["compare", "hf"])
def test_arange_masks_fold_on_cuda(case):
    from test_fuzz49 import ArangeMasks
    model, x = ArangeMasks(case).eval(), torch.randn(2, 7, 7, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 0
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
