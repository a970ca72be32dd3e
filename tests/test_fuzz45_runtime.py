"""Stop 45: options given as numpy numbers or path-likes, explain() and stats() saying what runs,
a model's warning shown once per place, tensors read by functions a module holds, decorators on
forward() that read keywords, global module hooks, loads into submodules assigned after optimize."""
import functools
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.errors import OptionError

from conftest import assert_matches_eager, optimize_strict


def _model():
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU()).eval()


@pytest.mark.parametrize("options", [{"max_specializations": np.int64(2)}, {"strassen_levels": np.int32(1)},
                                     {"tolerance": np.float32(1e-3)}, {"tolerance": np.int64(1)}],
                         ids=lambda o: f"{next(iter(o))}={type(next(iter(o.values()))).__name__}")
def test_numpy_numbers_are_taken_as_numbers(options):
    opt = optimize_strict(_model(), torch.randn(3, 6), **options)
    value = getattr(opt._options, next(iter(options)))
    assert type(value) in (int, float) and value == next(iter(options.values()))


@pytest.mark.parametrize("options", [{"gemm": np.array(["auto", "off"])}, {"strassen": np.array("auto")},
                                     {"tolerance": 10 ** 400}, {"tolerance": np.float32("nan")},
                                     {"max_specializations": np.bool_(True)}, {"max_specializations": 2.0}])
def test_odd_option_values_are_option_errors(options):
    with pytest.raises(OptionError, match=next(iter(options))):
        fxfuse.optimize(_model(), torch.randn(3, 6), **options)


class CalibrationPath:
    """A path-like whose str() is not its path."""

    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        return self.path


def test_a_path_like_calibration_is_read_by_its_path(tmp_path):
    from fxfuse.cost_model import CALIBRATION_DIR
    shipped = sorted(CALIBRATION_DIR.glob("*.json"))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a CalibrationWarning ("cannot read '<...object at 0x..>'") fails
        opt = fxfuse.optimize(_model(), torch.randn(3, 6), calibration=CalibrationPath(str(shipped)))
    assert opt._options.calibration == str(shipped)


@pytest.mark.parametrize("force", ["gemm", "fused_mlp", "strassen"])
def test_explain_says_a_generated_gemm_runs_its_torch_reference(force):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    opt = optimize_strict(model, torch.randn(4, 16), use_kernels=False, **{force: "force"})
    text = " ".join(fxfuse.explain(opt).split())
    kernels = [line for line in fxfuse.explain(opt).splitlines() if " fused kernel " in line]
    assert kernels and text.count("runs the torch reference (option use_kernels=False)") == len(kernels)


def test_views_are_counted_apart_from_library_calls():
    class Glu(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 8)

        def forward(self, x):
            a, b = self.lin(x).chunk(2, -1)
            return a * torch.sigmoid(b.t().t())

    opt = optimize_strict(Glu().eval(), torch.randn(3, 6))
    st = fxfuse.stats(opt)
    assert st["library_calls"] == 1 and st["views"] >= 3 and st["fused_kernels"] == 1
    kinds = [line.split()[1] for line in fxfuse.explain(opt).splitlines() if line.startswith(("chunk", "getitem"))]
    assert kinds and set(kinds) == {"view"}


class Warns(nn.Module):
    def forward(self, x):
        warnings.warn("deprecated thing used")
        return x * 2


def test_a_models_warning_shown_by_the_build_is_not_shown_again_by_eager():
    model, x = Warns().eval(), torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        Warns.forward.__globals__.pop("__warningregistry__", None)
        opt = fxfuse.optimize(model, x)
        for _ in range(3):
            opt(x.clone().requires_grad_())   # runs the original (records autograd), as eager would
            model(x)
    assert [str(w.message) for w in caught if w.category is UserWarning] == ["deprecated thing used"]


TABLE = torch.randn(16, 8)
with torch.no_grad():
    TABLE.mul_(0.5)   # its version is 1: written before optimize, long ago


def project(x):
    return torch.relu(x @ TABLE)


class HeldHelper(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) * 2


@pytest.mark.parametrize("wrap", ["function", "partial"])
def test_a_tensor_read_by_a_function_a_module_holds_is_not_taken_for_a_written_constant(wrap):
    """It was refused as "writes in place into a tensor it makes from constants" (fuzz45d)."""
    model = HeldHelper(project if wrap == "function" else functools.partial(project)).eval()
    opt = optimize_strict(model, torch.randn(2, 16))
    assert_matches_eager(opt, model, torch.randn(2, 16))
    with torch.no_grad():
        TABLE.mul_(3)   # edited after optimize: seen
        x = torch.randn(2, 16)
        torch.testing.assert_close(opt(x), model(x))
        TABLE.div_(3)


def doubles_scale(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if "scale" in kwargs:
            kwargs["scale"] = kwargs["scale"] * 2
        return fn(self, *args, **kwargs)
    return wrapper


class Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    @doubles_scale
    def forward(self, x, scale=1.0):
        return torch.relu(self.lin(x)) * scale


def test_a_decorator_reading_a_keyword_sees_the_call_as_made():
    """fxfuse passed `scale=3.0` by position: the wrapper never saw it (3.58 off, no warning)."""
    model, x = Decorated().eval(), torch.randn(3, 6)
    opt = fxfuse.optimize(model, x)
    with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="wrapped by wrapper"):
        got = opt(x, scale=3.0)
    torch.testing.assert_close(got, model(x, scale=3.0))
    with torch.no_grad():
        torch.testing.assert_close(opt(x, 3.0), model(x, 3.0))   # by position: the optimized graph
    with pytest.raises(fxfuse.FxfuseError, match="wrapped by wrapper"):
        fxfuse.optimize(model, {"x": x, "scale": 3.0})


def test_torchs_own_decorators_keep_keyword_calls_optimized():
    class NoGrad(nn.Module):
        @torch.no_grad()
        def forward(self, x, scale=1.0):
            return torch.sigmoid(x) * scale

    model, x = NoGrad().eval(), torch.randn(3, 6)
    opt = optimize_strict(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(opt(x, scale=3.0), model(x, scale=3.0))


def test_a_keyword_hook_on_the_fallback_gets_the_keywords():
    class Scaled(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    seen = []
    model = Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 3))
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append((len(args), dict(kwargs))), with_kwargs=True)
    with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="pre-hook"):
        opt(torch.randn(2, 3), scale=3.0)
    assert seen == [(1, {"scale": 3.0})]


def test_a_global_hook_runs_once_per_module_as_in_eager():
    model, x = _model(), torch.randn(3, 6)
    opt = fxfuse.optimize(model, x)
    ran = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: ran.append(type(m).__name__) or out * 2)
    try:
        with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="global module forward hook"):
            got = opt(x)
        n = len(ran)
        with torch.no_grad():
            expected = model(x)
    finally:
        handle.remove()
    assert ran[:n] == ran[n:] == ["Linear", "ReLU", "Sequential"]
    torch.testing.assert_close(got, expected)


def test_a_load_into_a_submodule_assigned_after_optimize_is_seen_under_inference_mode():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn, self.out = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)

        def forward(self, x):
            return self.out(torch.relu(self.bn(self.lin(x))))

    with torch.inference_mode():
        model = Net().eval()
        x = torch.randn(4, 8)
        opt = fxfuse.optimize(model, x)
        model.bn = nn.BatchNorm1d(8).eval()     # seen: the next call rebuilds
        opt(x)
        model.bn.load_state_dict({"weight": torch.randn(8), "bias": torch.randn(8), "running_mean": torch.randn(8),
                                  "running_var": torch.rand(8) + 0.5, "num_batches_tracked": torch.tensor(0)})
        torch.testing.assert_close(opt(x), model(x))


class AttentionBehindASizeBranch(nn.Module):
    """symbolic_trace fails on the branch: torch.export records MultiheadAttention's slow path,
    whose batch_first result is a transposed view; eager's fast path returns it contiguous."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        if x.shape[0] in (2, 3):
            return self.attn(x, x, x, need_weights=False)[0] + x
        return x


def test_an_output_the_trace_lays_out_otherwise_gets_eagers_strides():
    model, x = AttentionBehindASizeBranch().eval(), torch.randn(3, 5, 8)
    opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["optimized"]
    got = assert_matches_eager(opt, model, x)
    with torch.no_grad():
        assert got.stride() == model(x).stride() == (40, 8, 1)
    got.view(-1)


def other_default(fn):
    @functools.wraps(fn)
    def wrapper(self, x, scale=2.0):   # the names and kinds of forward's, another default
        return fn(self, x, scale)
    return wrapper


def fewer_parameters(fn):
    @functools.wraps(fn)
    def wrapper(self, x):
        return fn(self, x, 2.0)
    return wrapper


class WrappedDefault(nn.Module):
    @other_default
    def forward(self, x, scale=1.0):
        return x * scale


class WrappedFewer(nn.Module):
    @fewer_parameters
    def forward(self, x, scale=1.0):
        return x * scale


def test_a_wrappers_own_defaults_and_parameters_are_the_calls():
    """review45h: `opt(x, 1.0)` was trimmed to `opt(x)` by the wrapped function's default (the
    wrapper's is 2.0); `opt(x, 1.0)` of a wrapper taking x alone returned a number where eager raises."""
    x = torch.randn(3, 5)
    model = WrappedDefault().eval()
    opt = fxfuse.optimize(model, (x, 1.0))
    with torch.no_grad():
        torch.testing.assert_close(opt(x, 1.0), model(x, 1.0))
        torch.testing.assert_close(opt(x), model(x))
    fewer = WrappedFewer().eval()
    opt = fxfuse.optimize(fewer, x)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), fewer(x))
        with pytest.raises(TypeError):
            opt(x, 1.0)


class CallableForward:
    __hash__ = None   # unhashable

    def __call__(self, x):
        return x * 2


def test_an_unhashable_forward_with_a_dict_example_gets_the_documented_error():
    model = nn.Module()
    model.forward = CallableForward()
    with pytest.raises(fxfuse.FxfuseError):
        fxfuse.optimize(model, {"x": torch.randn(3)}, strict=True)


class Gathers(nn.Module):
    def forward(self, x, idx):
        return x[idx] * 2, x[:, [0, 2, 4]] + 1


def test_a_gather_by_index_is_a_library_call_not_a_view():
    opt = optimize_strict(Gathers().eval(), torch.randn(6, 8), torch.tensor([0, 3, 5]))
    assert fxfuse.stats(opt)["library_calls"] == 2 and fxfuse.stats(opt)["views"] == 0
    assert "gather" in fxfuse.explain(opt)


ROW = torch.randn(8)
ROW.mul_(2)   # version 1, before optimize


class AddTable:
    def __call__(self, x):
        return x + ROW


def test_a_tensor_read_by_a_callable_object_a_module_holds_is_not_a_written_constant():
    model = HeldHelper(AddTable()).eval()
    opt = optimize_strict(model, torch.randn(2, 8))
    assert_matches_eager(opt, model, torch.randn(2, 8))


G = torch.ones(4).mul_(2)   # built in place at import


class CallsG:
    def __call__(self, x):
        return x * G


class InheritsCall(CallsG):
    pass


class OwnTable:
    def __init__(self):
        self.t = torch.ones(4).mul_(3)

    def __call__(self, x):
        return x * self.t


class PartialSubclass(functools.partial):
    pass


def times_g(x, k):
    return x * G * k


@pytest.mark.parametrize("make", [InheritsCall, OwnTable, lambda: PartialSubclass(times_g, k=2)],
                         ids=["inherited __call__", "own attribute", "partial subclass"])
def test_callable_objects_a_module_holds_are_walked(make):
    """review45i: refused as writing into a tensor forward() makes from constants."""
    model = HeldHelper(make()).eval()
    opt = optimize_strict(model, torch.randn(3, 4))
    assert_matches_eager(opt, model, torch.randn(3, 4))


def negative_zero_default(fn):
    @functools.wraps(fn)
    def wrapper(self, x, scale=-0.0):
        return fn(self, x, scale)
    return wrapper


class NegativeZero(nn.Module):
    @negative_zero_default
    def forward(self, x, scale=0.0):
        return 1.0 / (x * scale)


def test_a_wrappers_negative_zero_default_is_its_own():
    model, x = NegativeZero().eval(), torch.tensor([1.0, -2.0, 3.0, -4.0])
    opt = fxfuse.optimize(model, x, verify=False)
    with torch.no_grad():
        for args in [(x,), (x, 0.0), (x, -0.0)]:
            assert torch.equal(opt(*args), model(*args))


def test_a_keyword_a_wrapper_does_not_take_raises_eagers_error_without_a_warning():
    x = torch.randn(3, 5)
    opt = fxfuse.optimize(WrappedFewer().eval(), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="unexpected keyword"):
            opt(x, scale=3.0)
