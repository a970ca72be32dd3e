"""Bad inputs and fallbacks: untraceable and training-mode models, guard misses, bounded
specializations, non-tensor example inputs, autograd calls; and silence by default."""
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from conftest import assert_fast_path, assert_matches_eager


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x.relu()
        return -x


class Pointwise(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x * 2) - x.tanh()


class Residual(nn.Module):
    def __init__(self, n=11):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


def fxfuse_warnings(record):
    return [w for w in record if issubclass(w.category, fxfuse.FxfuseWarning)]


def test_untraceable_model_returned_unchanged_with_one_warning():
    model = DataDependent().eval()
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, x)
    assert opt is model
    ws = fxfuse_warnings(record)
    assert len(ws) == 1, [str(w.message) for w in record]
    assert "original module" in str(ws[0].message)
    assert fxfuse.stats(opt)["optimized"] is False
    assert "not optimized" in fxfuse.explain(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_untraceable_model_strict_raises_trace_error():
    with pytest.raises(fxfuse.TraceError, match="DataDependent"):
        fxfuse.optimize(DataDependent().eval(), torch.randn(3, 4), strict=True)


def test_training_mode_is_unsupported():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())        # modules start in training mode
    with pytest.raises(fxfuse.UnsupportedError, match=r"eval\(\)"):
        fxfuse.optimize(model, torch.randn(2, 4))
    model.eval()
    model[0].train()                                          # one submodule still training
    with pytest.raises(fxfuse.UnsupportedError, match="training"):
        fxfuse.optimize(model, torch.randn(2, 4))


@pytest.mark.parametrize("bad", ["a string", 3.0, None, {"y": torch.randn(2)}])   # {"x": ...} binds (stop 35)
def test_non_tensor_example_input_is_a_clear_error(bad):
    with pytest.raises(fxfuse.FxfuseError, match="example_input"):
        fxfuse.optimize(Pointwise().eval(), bad)


def test_non_module_is_a_clear_error():
    with pytest.raises(fxfuse.FxfuseError, match="nn.Module"):
        fxfuse.optimize(lambda x: x + 1, torch.randn(2))


@pytest.mark.parametrize("options,match", [({"max_specializations": 0}, "max_specializations"),
                                           ({"no_such_option": 1}, "unknown option"),
                                           ({"tolerance": -1}, "tolerance=-1"),
                                           ({"tolerance": float("nan")}, "tolerance=nan"),
                                           ({"tolerance": float("inf")}, "tolerance=inf"),
                                           ({"strict": "yes"}, "strict='yes'"),
                                           ({"cuda_graphs": 1}, "cuda_graphs=1"),
                                           ({"max_specializations": 1.5}, "max_specializations=1.5"),
                                           ({"strassen_levels": True}, "strassen_levels=True"),
                                           ({"use_kernels": "auto"}, "use_kernels='auto'"),
                                           ({"calibration": 3}, "calibration=3")])
def test_bad_options(options, match):
    with pytest.raises(fxfuse.FxfuseError, match=match):
        fxfuse.optimize(Pointwise().eval(), torch.randn(2), **options)
    with pytest.raises(ValueError, match=match):          # an OptionError is both
        fxfuse.optimize(Pointwise().eval(), torch.randn(2), **options)


def test_new_shape_builds_second_specialization():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 11), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches_eager(opt, model, torch.randn(7, 11))
        assert_matches_eager(opt, model, torch.randn(4, 11))
        assert_matches_eager(opt, model, torch.randn(7, 11))
    s = assert_fast_path(opt)
    assert s["specializations"] == 2
    assert "shape" in opt._misses[0]


def test_new_dtype_builds_second_specialization():
    model = Pointwise().eval()
    opt = fxfuse.optimize(model, torch.randn(5, 6), strict=True)
    out = assert_matches_eager(opt, model, torch.randn(5, 6).half(), rtol=1e-3, atol=1e-3)
    assert out.dtype == torch.float16
    assert fxfuse.stats(opt)["specializations"] == 2
    assert "dtype" in opt._misses[0]


def test_specializations_bounded_falls_back_with_one_warning():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 11), max_specializations=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for rows in (5, 6, 5):
            assert_matches_eager(opt, model, torch.randn(rows, 11))
    ws = fxfuse_warnings(record)
    assert len(ws) == 1 and "max_specializations" in str(ws[0].message)
    assert fxfuse.stats(opt)["specializations"] == 1
    assert_matches_eager(opt, model, torch.randn(4, 11))     # the built one still runs


def test_specializations_bounded_strict_raises_guard_error():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 11), max_specializations=1, strict=True)
    with pytest.raises(fxfuse.GuardError, match="shape"):
        with torch.no_grad():
            opt(torch.randn(5, 11))


def test_grad_enabled_call_runs_original_with_one_warning():
    model = Residual().eval()                                  # parameters require grad
    x = torch.randn(3, 11)
    opt = fxfuse.optimize(model, x)
    launches = fxfuse.stats(opt)["kernel_launches"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = opt(x)
        out2 = opt(x)
    assert out.requires_grad and out2.requires_grad
    assert len(fxfuse_warnings(record)) == 1
    torch.testing.assert_close(out, model(x))
    out.sum().backward()                                       # autograd works through it
    assert model.fc.weight.grad is not None
    assert fxfuse.stats(opt)["kernel_launches"] == launches   # the kernels did not run
    with torch.inference_mode():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.stats(opt)["kernel_launches"] > launches


def test_grad_enabled_call_under_strict_raises():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 11), strict=True)
    with pytest.raises(fxfuse.GuardError, match="autograd"):
        opt(torch.randn(3, 11))


def test_input_requiring_grad_runs_original():
    model = Pointwise().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 4))
    x = torch.randn(4, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = opt(x)
    assert out.requires_grad and len(fxfuse_warnings(record)) == 1
    out.sum().backward()
    assert x.grad is not None


def test_nothing_printed_by_plain_use(capsys):
    model = nn.Sequential(nn.Linear(9, 9), nn.ReLU(inplace=True), nn.Linear(9, 3)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(2, 9))
        with torch.no_grad():
            opt(torch.randn(2, 9))
            opt(torch.randn(5, 9))                             # a new specialization is quiet too
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_failed_trace_prints_nothing(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxfuse.optimize(DataDependent().eval(), torch.randn(3, 4))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_train_after_optimize_is_not_silently_eval():
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.ReLU()).eval()
    x = torch.randn(4, 6)
    opt = fxfuse.optimize(model, x)
    opt.train()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            a, b = opt(x), opt(x)
    # either the original module runs (dropout: two calls differ) with one warning, or it raises
    assert len(fxfuse_warnings(record)) == 1 and not torch.equal(a, b)


def test_frozen_parameters_with_grad_enabled_take_the_fast_path():
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU()).eval().requires_grad_(False)
    x = torch.randn(4, 6)
    opt = fxfuse.optimize(model, x, strict=True)
    launches = fxfuse.stats(opt)["kernel_launches"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = opt(x)                                         # grad mode on, but nothing to record
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.stats(opt)["kernel_launches"] > launches


def test_keyword_arguments_are_accepted():
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU()).eval()
    x = torch.randn(4, 6)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(input=x), model(input=x), rtol=1e-5, atol=1e-5)


def test_keyword_argument_past_a_defaulted_parameter():
    """opt(x, scale=3.0) for forward(x, y=None, scale=1.0): y takes its default (second fuzz round:
    this ran the original with a warning that scale does not bind)."""
    class Scaled(nn.Module):
        def forward(self, x, y=None, scale=1.0):
            return (x if y is None else x + y).relu() * scale

    model, x = Scaled().eval(), torch.randn(4, 6)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(opt(x, scale=3.0), model(x, scale=3.0))
        torch.testing.assert_close(opt(x), model(x))
    assert len(opt._specializations) == 2


def test_nondeterministic_model_falls_back_with_a_clear_reason():
    """(torch's random ops are no longer this case: verify runs both sides from one random state.)"""
    class OsRandom(nn.Module):
        def forward(self, x):              # each run scales by another number; the trace kept one
            return x * 2 * (1 + int.from_bytes(os.urandom(4), "little"))

    model = OsRandom().eval()
    with pytest.raises(fxfuse.UnsupportedError, match="not deterministic"):
        fxfuse.optimize(model, torch.randn(64, 32), strict=True)
    with pytest.warns(fxfuse.FxfuseWarning, match="not deterministic"):
        assert fxfuse.optimize(model, torch.randn(64, 32)) is model


def test_verification_at_the_overflow_boundary():
    """gelu(3e38): eager overflows to inf, the kernel stays at 3e38 (as float64 does). That is
    rounding at the edge of the range, not a wrong answer; other inf differences still are."""
    from fxfuse.api import _mismatch
    inf = float("inf")
    assert _mismatch(torch.tensor([inf, 1.0]), torch.tensor([3e38, 1.0])) is None
    assert _mismatch(torch.tensor([-3e38, 1.0]), torch.tensor([-inf, 1.0])) is None
    assert _mismatch(torch.tensor([inf, 2.0]), torch.tensor([inf, 2.0])) is None
    assert "inf" in _mismatch(torch.tensor([inf, 1.0]), torch.tensor([5.0, 1.0]))
    assert "inf" in _mismatch(torch.tensor([inf, 1.0]), torch.tensor([-inf, 1.0]))
    assert "relative error" in _mismatch(torch.tensor([inf, 1.0]), torch.tensor([inf, 2.0]))

    class Gelu(nn.Module):
        def forward(self, x):
            return F.gelu(x * 1.0)

    x = torch.tensor([[1.0, -2.0, 3e38, 0.5], [88.0, -89.0, 7.0, -0.25]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxfuse.FxfuseWarning)
        opt = fxfuse.optimize(Gelu().eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
