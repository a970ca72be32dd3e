"""Stop 42 on the GPU: stacks and cats written by the kernel (passes/join_outputs.py) under the CUDA
graph, and an LM head wider than the launch grid (review42a)."""
import pytest
import torch
from torch import nn

import fxfuse
from test_join_outputs import JOINED, Wrap, _joins_left

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


@pytest.mark.parametrize("name", ["rotary stack", "sin cos cat", "encoding with the input", "concat middle dim",
                                  "one piece twice", "fp16 pieces"])
@pytest.mark.parametrize("rows", [1, 37, 1024])
def test_joined_outputs_on_the_gpu(name, rows):
    fn, shape = JOINED[name]
    model = Wrap(fn).eval()
    shape = (rows,) + shape[1:]
    opt = fxfuse.optimize(model, torch.randn(*shape, device="cuda"), strict=True)
    assert _joins_left(opt) == 0 and fxfuse.stats(opt)["fused_kernels"] == 1
    kept = []
    for _ in range(3):
        x = torch.randn(*shape, device="cuda")
        with torch.no_grad():
            got, want = opt(x), model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kept.append((got, want.clone()))
    for got, want in kept:   # call 1's output untouched by the later calls
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("words", [262144, 262208])
def test_an_lm_head_wider_than_the_grid_runs(words):
    model = nn.Sequential(nn.Linear(256, words), nn.ReLU()).eval().cuda()
    for options in ({}, {"gemm": "force"}):
        opt = fxfuse.optimize(model, torch.randn(1, 256, device="cuda"), strict=True, **options)
        x = torch.randn(1, 256, device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
        assert not any(type(m).__name__ == "EpilogueGemm" for m in opt.modules())


@pytest.mark.parametrize("op", [lambda h: h.sub(0.1, alpha=3), lambda h: torch.add(h, 1e-3, alpha=-7.5)])
def test_a_number_scaled_by_alpha_matches_cuda_eager_bitwise(op):
    model = Wrap(op).eval()
    x = torch.cat([torch.full((1, 33), 0.3, device="cuda"), torch.randn(300, 33, device="cuda")])
    opt = fxfuse.optimize(model, x, strict=True)
    for sample in (x, torch.randn(301, 33, device="cuda")):
        with torch.no_grad():
            assert torch.equal(opt(sample), model(sample))
    assert fxfuse.stats(opt)["fused_kernels"] == 1


@pytest.mark.parametrize("exponent", [5, 7, -3])
def test_an_odd_power_keeps_the_sign_of_zero(exponent):
    # review42d: Triton 3.6 / 3.7 compile unary minus as 0 - x, so -(+0.0) was +0.0 for (-0.0) ** 5
    model = Wrap(lambda h: torch.stack([h ** exponent, 1.0 / (h ** exponent)])).eval()
    x = torch.tensor([[-0.0, 0.0, -2.0, 3.0, -1e-20, float("-inf")]], device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        got, want = opt(x), model(x)
    torch.testing.assert_close(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
