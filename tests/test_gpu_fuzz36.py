"""Stop 36 on the GPU: expm1 / tanh rewritten for accuracy, hardswish as CUDA eager, transposes
and expands inside fused chains."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


class _Pointwise(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x * 1.0)


def _ulps(got, truth):
    t = truth.float().abs()
    step = (torch.nextafter(t, torch.full_like(t, float("inf"))) - t).double()
    return ((got.double() - truth).abs() / step).max().item()


# (GELU's tanh form and tanhshrink cancel in eager too, by other amounts: compared with a tolerance elsewhere)
FUNCTIONS = {"expm1": torch.expm1, "elu": F.elu, "selu": F.selu, "tanh": torch.tanh, "mish": F.mish}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_expm1_and_tanh_forms_are_about_as_accurate_as_cuda_eager(name):
    fn = FUNCTIONS[name]
    # up to x = 1: beyond, expm1 is exp's (tl.exp is ex2.approx of x * log2(e) on the GPU, |x| * 6e-8
    # relative error, 13 ulp at x = 12: as the fused exp op and Inductor's; CUDA's expf is within 2)
    x = torch.cat([torch.linspace(-1, 1, 20001), torch.linspace(-12, 1, 20001)]).cuda()
    opt = fxfuse.optimize(_Pointwise(fn).eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    truth = fn(x.double())
    got, eager = opt(x), fn(x)
    slack = 16 if name == "mish" else 8   # mish's softplus: tl.exp and tl.log, approximate on the GPU (13.5
    assert _ulps(got, truth) <= _ulps(eager, truth) + slack, (_ulps(got, truth), _ulps(eager, truth))   # ulp)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 0.5, -0.5,
                            0.0625, -0.0625], device="cuda")
    torch.testing.assert_close(opt(special), fn(special), equal_nan=True)
    assert torch.equal(opt(special[:2]).signbit(), fn(special[:2]).signbit())


def test_hardswish_is_cuda_eagers_to_the_bit():
    x = torch.linspace(-3.5, 3.5, 70001, device="cuda")
    opt = fxfuse.optimize(_Pointwise(F.hardswish).eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert torch.equal(opt(x), F.hardswish(x))


class _TransposedChain(nn.Module):
    def forward(self, x, b):
        z = torch.relu(x).t() * 2 + 1
        return (z.expand(3, *z.shape) + b).sigmoid().mT.exp()


def test_transposes_and_expands_inside_one_kernel_on_cuda():
    torch.manual_seed(0)
    x, b = torch.randn(40, 50, device="cuda"), torch.randn(3, 50, 40, device="cuda")
    opt = fxfuse.optimize(_TransposedChain().eval(), (x, b), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    for _ in range(2):
        got, want = opt(x, b), _TransposedChain()(x, b)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)
        x, b = torch.randn_like(x), torch.randn_like(b)


class _Binary(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x * 1.0, y * 1.0)


SIGNED_ZERO_OPS = {"maximum": torch.maximum, "minimum": torch.minimum, "relu": lambda x, y: torch.relu(x),
                   "clamp_min_0": lambda x, y: torch.clamp(x, min=0.0), "relu6": lambda x, y: F.relu6(x),
                   "clamp_tensor_min": lambda x, y: torch.clamp(x, min=y),
                   "clamp_tensor_max": lambda x, y: torch.clamp(x, max=y), "leaky_relu": lambda x, y: F.leaky_relu(x)}


@pytest.mark.parametrize("name", sorted(SIGNED_ZERO_OPS))
def test_signed_zeros_and_nans_as_cuda_eager(name):
    fn = SIGNED_ZERO_OPS[name]
    a = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, float("nan"), 2.0, -3.0, 5.0], device="cuda")
    b = torch.tensor([-0.0, 0.0, 0.0, -0.0, 1.0, 1.0, float("nan"), -3.0, -5.0], device="cuda")
    opt = fxfuse.optimize(_Binary(fn).eval(), (torch.randn(9, device="cuda"), torch.randn(9, device="cuda")), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    got, want = opt(a, b), fn(a, b)
    assert torch.equal(got.signbit(), want.signbit()) and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True)
