"""Stop 48 on the GPU: this stop's rewrites and the direct-run choice, against CUDA eager."""
import pytest
import torch
from torch import nn

import fxfuse
from test_fuzz48 import CausalScores, HandBiasLone, RsubAfterLinear

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


class GeluOfScaled(nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x * 1.5, approximate="tanh")


def test_a_graph_of_large_copies_runs_directly_and_a_small_one_replays():
    """A GELU over 512 MiB: the CUDA graph would copy the input in and the output out (1787 us against
    eager's 1014 for 1 GiB on an H200), so the build times both ways and runs the kernel directly."""
    model = GeluOfScaled().eval()
    big = torch.randn(128, 1024, 1024, device="cuda")
    opt = fxfuse.optimize(model, big, strict=True)
    assert "running the graph directly measured faster" in fxfuse.explain(opt), fxfuse.explain(opt)
    with torch.no_grad():
        x = torch.randn_like(big)
        first = opt(x)
        torch.testing.assert_close(first, model(x), rtol=1e-5, atol=1e-5)
        kept = first.clone()
        opt(torch.randn_like(big))
        assert torch.equal(first, kept)   # a later call leaves an earlier output alone
    small = fxfuse.optimize(nn.Sequential(nn.Linear(64, 64), nn.ReLU()).cuda().eval(),
                            torch.randn(8, 64, device="cuda"), strict=True)
    assert "captured: one CUDA graph replay per call" in fxfuse.explain(small)


@pytest.mark.parametrize("options", [{}, {"gemm": "force"}, {"fused_mlp": "force"}])
@pytest.mark.parametrize("c,bias", [(0.1, 0.05), (3.5e38, 1e37)])
def test_epilogue_numbers_as_cuda_eager_reads_them(options, c, bias):
    model = RsubAfterLinear(c).eval().cuda()
    with torch.no_grad():
        model.l.weight.zero_()
        model.l.bias.fill_(bias)
    x = torch.randn(4, 16, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, **options)
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


def test_an_fp16_bias_the_model_adds_rounds_as_cuda_eager():
    """With the library's GEMM (gemm/fused_mlp "off": the generated ones add in fp32 before their one
    rounding, as the README says) the bias stays out of the GEMM, as in eager."""
    hand = HandBiasLone().eval().half().cuda()
    opt = fxfuse.optimize(hand, torch.randn(3, 8, dtype=torch.float16, device="cuda"), strict=True,
                          gemm="off", fused_mlp="off")
    x = torch.full((3, 8), 9000.0, dtype=torch.float16, device="cuda")   # product 72000: inf before the bias
    x[1] = 1.0
    xr = (torch.randn(64, 8, device="cuda") * 3000).half()
    with torch.no_grad():
        assert torch.equal(opt(x), hand(x))
        torch.testing.assert_close(opt(xr), hand(xr), rtol=2e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tanh_gelu_tail_on_the_gpu(dtype):
    model = nn.Sequential(nn.Identity(), nn.GELU(approximate="tanh")).eval()
    x = torch.linspace(-5.0, 5.0, 4097, device="cuda").to(dtype)
    opt = fxfuse.optimize(model, x * 1.0001, strict=True)
    with torch.no_grad():
        want = torch.nn.functional.gelu(x.double(), approximate="tanh")
        tail = x < -3.5
        err_opt = ((opt(x).double() - want).abs() / want.abs().clamp_min(1e-30))[tail].mean()
        err_eager = ((model(x).double() - want).abs() / want.abs().clamp_min(1e-30))[tail].mean()
        assert err_opt <= 1.5 * err_eager + 1e-6
        torch.testing.assert_close(opt(x), model(x), rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_a_constant_mask_is_made_once_on_the_gpu(kind):
    model = CausalScores(kind).eval()
    q, k = torch.randn(2, 2, 5, 8, device="cuda"), torch.randn(2, 2, 5, 8, device="cuda")
    opt = fxfuse.optimize(model, (q, k), strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 2
    with torch.no_grad():
        q2 = torch.randn_like(q)
        torch.testing.assert_close(opt(q2, k), model(q2, k))
