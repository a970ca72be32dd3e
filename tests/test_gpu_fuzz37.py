"""Stop 37 on the GPU: exp as Cody-Waite (2 ** n times exp of a small remainder) instead of
tl.exp, which flushed subnormal results to 0 there and was off by up to 61 ulp (af2e516 failed
these tests: exp_literal_ab_20261127-0430.txt); -0.0 literals; CPU scalar literals in CUDA chains."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from test_gpu_fuzz36 import _Pointwise

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def _ulps(got, truth):
    """Largest error in units of the fp32 step at the true value (subnormal steps below 2 ** -126)."""
    t = truth.float().abs()
    step = (torch.nextafter(t, torch.full_like(t, float("inf"))) - t).double()
    finite = torch.isfinite(truth)
    return ((got.double() - truth).abs() / step)[finite].nan_to_num(0.0).max().item()


FUNCTIONS = {"exp": torch.exp, "sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus,
             "logsigmoid": F.logsigmoid, "expm1": torch.expm1, "elu": F.elu, "mish": F.mish}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_exp_based_ops_are_as_accurate_as_cuda_eager_over_the_whole_range(name):
    fn = FUNCTIONS[name]
    # the whole range where exp is finite and nonzero, its subnormal results and overflow edge included
    x = torch.cat([torch.linspace(-104, 89, 200001), torch.linspace(-2, 2, 20001),
                   torch.tensor([88.72, 88.7228, 88.73, -87.3, -100.0, -103.9, -103.98])]).cuda()
    opt = fxfuse.optimize(_Pointwise(fn).eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    truth = fn(x.double())
    got, eager = opt(x), fn(x)
    assert torch.equal(torch.isinf(got), torch.isinf(eager))
    # expm1 and elu above x = 0.5 are exp(x) - 1, which cancels up to 1.6 bits (3.3 ulp where eager has 1.3);
    # mish is tanh of softplus
    slack = {"mish": 8, "expm1": 3, "elu": 3}.get(name, 2)
    assert _ulps(got, truth) <= _ulps(eager, truth) + slack, (_ulps(got, truth), _ulps(eager, truth))
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 30.0, -30.0],
                           device="cuda")
    torch.testing.assert_close(opt(special), fn(special), equal_nan=True)


def test_exp_of_large_arguments_passes_assert_close_against_eager():
    # tl.exp failed this: 2.4e-6 relative error at x = 40 against assert_close's 1.3e-6
    x = torch.linspace(20, 88, 10001, device="cuda")
    opt = fxfuse.optimize(_Pointwise(torch.exp).eval(), x, strict=True)
    torch.testing.assert_close(opt(x), torch.exp(x))


@pytest.mark.parametrize("name", ["log", "sin", "cos", "erf", "log1p", "tanh", "gelu"])
def test_other_transcendentals_record_their_accuracy(name, capsys):
    """Not a bound of ours to keep: prints each op's error next to eager's, for the results file."""
    fn = {"log": torch.log, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "log1p": torch.log1p,
          "tanh": torch.tanh, "gelu": F.gelu}[name]
    x = torch.cat([torch.linspace(1e-6, 10, 100001), torch.linspace(-10, 10, 100001)]).cuda()
    x = x.abs() if name == "log" else x.clamp_min(-0.999) if name == "log1p" else x
    opt = fxfuse.optimize(_Pointwise(fn).eval(), x, strict=True)
    got, eager, truth = opt(x), fn(x), fn(x.double())
    with capsys.disabled():
        print(f"\n[accuracy] {name}: fxfuse {_ulps(got, truth):.1f} ulp, eager {_ulps(eager, truth):.1f} ulp, "
              f"max |diff| to eager {(got - eager).abs().max().item():.3g}")
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5, equal_nan=True)


class _ScaledByLiteral(nn.Module):
    """Attention's scale spelled with a tensor made in forward (on the CPU: no device=)."""
    def forward(self, x):
        return (x / torch.sqrt(torch.tensor(24.0))).relu() * torch.tensor(1.7)


class _ScaledByLiteralOnDevice(nn.Module):
    def forward(self, x):
        scale = torch.sqrt(torch.tensor(24.0, dtype=torch.float32, device=x.device))
        return (x / scale).relu() - torch.tensor(0.25)


class _ScaledByInput(nn.Module):
    def forward(self, x, t):
        return (x * t).relu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_cpu_scalar_tensor_in_a_cuda_chain_matches_eager(dtype, capsys):
    # CUDA eager reads a CPU 0-dim tensor as an unrounded fp32 scalar, a CUDA one in x's dtype (fuzz37c)
    torch.manual_seed(0)
    x = torch.randn(64, 48, device="cuda", dtype=dtype)
    cases = [(_ScaledByLiteral(), (x,)), (_ScaledByLiteralOnDevice(), (x,)), (_ScaledByInput(), (x, torch.tensor(1.7))),
             (_ScaledByInput(), (x, torch.tensor(1.7, device="cuda")))]
    for model, args in cases:
        opt = fxfuse.optimize(model.eval(), args, strict=True)
        got, want = opt(*args), model(*args)
        stats = fxfuse.stats(opt)
        with capsys.disabled():
            print(f"\n[cpu scalar] {type(model).__name__} {args[-1].device} {dtype}: equal {torch.equal(got, want)}, "
                  f"max diff {(got.float() - want.float()).abs().max().item():.3g}, stats {stats}")
        torch.testing.assert_close(got, want)
        assert stats["fused_kernels"] >= 1
        if args[-1].device.type == "cuda":   # literals read as numbers, not a CPU operand (that took the
            assert stats["reference_fallbacks"] == 0 and torch.equal(got, want)   # reference ops each call)


def test_shrinks_and_threshold_give_cuda_eagers_signed_zeros():
    # fuzz37a: softshrink inside (-lambd, 0) was `a * 0.0`, -0.0, where CUDA eager's kernel gives +0.0
    x = torch.cat([torch.linspace(-1, 1, 4001), torch.tensor([0.0, -0.0, 0.5, -0.5])]).cuda()
    # and -0.0 literals: Triton made a -0.0 constant +0.0 on the GPU (threshold's value, a clamp bound, x + -0.0)
    for fn in (F.softshrink, F.hardshrink, lambda v: F.threshold(v, 0.1, -0.0), lambda v: v.clamp(min=-0.0),
               lambda v: (v * 0.0) + -0.0, lambda v: torch.where(v > 0, v, -0.0)):
        opt = fxfuse.optimize(_Pointwise(fn).eval(), x, strict=True)
        got, want = opt(x), fn(x)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), \
            (got[got.signbit() != want.signbit()][:4], want[got.signbit() != want.signbit()][:4])
