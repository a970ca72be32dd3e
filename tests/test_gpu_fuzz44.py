"""Stop 44 on the GPU: the fusions this stop added, compiled and under the CUDA graph, against CUDA
eager."""
import pytest
import torch

import fxfuse
from test_fuzz44 import (SPELLINGS_FUSED_NOW, HalfAddAlpha, HalfMinusNumber, HalfTimesOneElement, InPlaceRReLU,
                         SpellingPair)
from test_fuzz44_views import MaskAssignment

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


@pytest.mark.parametrize("alpha", [3, -2.5, 0.1, 1e-3])
@pytest.mark.parametrize("in_place", [False, True])
def test_an_fp16_add_with_alpha_is_cuda_eager_bit_for_bit(alpha, in_place):
    """CUDA's add kernel reads alpha as fp32 and computes x + alpha * y in fp32: so does the fused
    kernel, so the results are equal (CPU eager reads alpha in fp16 and may differ)."""
    model = HalfAddAlpha(alpha, in_place).eval().cuda()
    make = lambda: [torch.randn(37, 129, device="cuda", dtype=torch.float16) * 60 for _ in range(2)]   # noqa: E731
    opt = fxfuse.optimize(model, make(), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    for _ in range(3):
        x, y = make()
        with torch.no_grad():
            assert torch.equal(opt(x, y), model(x, y))


def test_numbers_beside_fp16_with_alpha_and_in_place_rrelu_on_the_gpu():
    for model, dtype in ((HalfMinusNumber(), torch.float16), (InPlaceRReLU("F.rrelu_"), torch.float32),
                         (InPlaceRReLU("nn.RReLU(inplace=True)"), torch.float16)):
        model = model.eval().cuda()
        opt = fxfuse.optimize(model, torch.randn(37, 129, device="cuda", dtype=dtype), strict=True)
        if isinstance(model, InPlaceRReLU):   # (a number beside fp16 with alpha stays the library's add)
            assert fxfuse.stats(opt)["fused_kernels"] == 1
        for _ in range(3):
            x = torch.randn(37, 129, device="cuda", dtype=dtype)
            with torch.no_grad():
                if isinstance(model, HalfMinusNumber):
                    assert torch.equal(opt(x), model(x))
                else:
                    torch.testing.assert_close(opt(x), model(x), rtol=1e-5 if dtype == torch.float32 else 1e-3,
                                               atol=1e-5)


def test_an_fp16_add_with_alpha_does_not_overflow_where_cuda_does_not():
    """x + 1000 * y with y * 1000 past fp16's range: CUDA computes it in fp32 and rounds once."""
    class AddAlpha(torch.nn.Module):
        def forward(self, x, y):
            return torch.add(x, y, alpha=1000).relu() + torch.sub(x, y, alpha=3)

    model = AddAlpha().eval().cuda()
    x, y = torch.rand(2, 4, device="cuda").half(), torch.rand(2, 4, device="cuda").half()
    opt = fxfuse.optimize(model, (x, y), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x[0, 0], y[0, 0] = -60000.0, 100.0
    with torch.no_grad():
        want = model(x, y)
        assert torch.isfinite(want).all() and torch.equal(opt(x, y), want)


@pytest.mark.parametrize("how", ["buffer", "argument", "divide", "int64"])
def test_an_fp16_tensor_times_a_one_element_tensor_is_cuda_eager_bit_for_bit(how):
    """On CUDA a CUDA one-element tensor is rounded to fp16 first (the kernel's dynamic cast) and a
    CPU one made in forward() is read as a number, unrounded: the kernel must do both as eager."""
    model = HalfTimesOneElement(how).eval().cuda()
    x = torch.randn(37, 129, device="cuda", dtype=torch.float16)
    opt = fxfuse.optimize(model, (x, torch.tensor(70000.0, device="cuda")), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    for value in (70000.0, 0.1, 1e-8):
        t = torch.tensor(value, device="cuda")
        with torch.no_grad():
            xi = torch.randn_like(x)
            assert torch.equal(opt(xi, t), model(xi, t))


@pytest.mark.parametrize("name", list(SPELLINGS_FUSED_NOW))
def test_spellings_fused_now_on_the_gpu(name):
    model = SpellingPair(SPELLINGS_FUSED_NOW[name]).eval().cuda()
    make = lambda: [torch.randn(37, 129, device="cuda") for _ in range(2)]   # noqa: E731
    opt = fxfuse.optimize(model, make(), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    for _ in range(3):
        x, y = make()
        with torch.no_grad():
            torch.testing.assert_close(opt(x, y), model(x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["h[mask] = 0.0", "h[mask] = tensor"])
def test_a_bool_mask_assignment_on_the_gpu(how):
    model = MaskAssignment(how).eval().cuda()
    opt = fxfuse.optimize(model, torch.randn(37, 129, device="cuda"), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(37, 129, device="cuda")
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))
