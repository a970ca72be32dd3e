"""Stop 47 on the GPU: the new rewrites compiled and under the CUDA graph, against CUDA eager."""
import copy

import pytest
import torch
from torch import nn

import fxfuse
from test_fuzz47 import GQARotary, NeRFEncoding, OPTFlatResidualMLP, ShuffleBetweenActivations
from test_fuzz47_runtime import Holder

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def _check(model, args, kernels, dtype, tol):
    opt = fxfuse.optimize(model, args, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == kernels, fxfuse.explain(opt)
    for _ in range(3):
        fresh = [torch.randn_like(a) for a in args]
        with torch.no_grad():
            torch.testing.assert_close(opt(*fresh), model(*fresh), rtol=tol, atol=tol)
    return opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stop47_rewrites_on_the_gpu(dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    cuda = dict(device="cuda", dtype=dtype)
    _check(NeRFEncoding().eval().cuda().to(dtype), [torch.randn(64, 3, **cuda)], 1, dtype, tol)
    _check(GQARotary().eval(), [torch.randn(2, 9, 64, **cuda), torch.randn(2, 8, 9, 64, **cuda),
                                torch.randn(2, 2, 9, 64, **cuda)], 3, dtype, tol)
    _check(ShuffleBetweenActivations("shuffle").eval().cuda().to(dtype), [torch.randn(2, 3, 16, 12, **cuda)],
           1, dtype, max(tol, 1e-4))
    flat = OPTFlatResidualMLP().eval().cuda().to(dtype)
    opt = fxfuse.optimize(flat, [torch.randn(2, 5, 8, **cuda), torch.randn(2, 5, 8, **cuda)], strict=True)
    x, y = torch.randn(2, 5, 8, **cuda), torch.randn(2, 5, 8, **cuda)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, y), flat(x, y), rtol=max(tol, 1e-4), atol=max(tol, 1e-4))


def test_a_lone_batchnorm_keeps_its_digits_on_the_gpu():
    bn = nn.BatchNorm1d(256).eval().cuda()
    with torch.no_grad():
        bn.running_mean.fill_(1000.1)
        bn.running_var.fill_(0.01)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    model = nn.Sequential(bn, nn.ReLU()).eval()
    x = 1000.1 + 0.1 * torch.randn(512, 256, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        error = (opt(x).double() - exact).abs().max() / exact.abs().max()
        eager = (model(x).double() - exact).abs().max() / exact.abs().max()
    assert error <= 4 * eager + 1e-7, (error, eager)


def test_a_trace_time_fold_is_watched_under_the_cuda_graph():
    model = Holder("dict").eval()
    model.cfg["w"] = model.cfg["w"].cuda()
    x = torch.randn(3, 4, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        opt(x)
        opt(x)
        model.cfg["w"].mul_(-1)
        torch.testing.assert_close(opt(x), model(x))
