"""Stop 39: tracing and the user's Python state (module-level values read through helper modules).
Numerics and fusion: test_fuzz39.py."""
import copy
import types

import pytest
import torch
from torch import nn

import fxfuse

HELPERS = '''
import torch
TABLE = torch.zeros(8)
TABLE.add_(torch.arange(8.))          # written once, at import
def scale(x):
    return x * TABLE
def scale_and_write(x):
    TABLE.mul_(1.0)                   # a write on every call: a written constant of the trace
    return x * TABLE
'''


def _model(call: str) -> nn.Module:
    """A model whose forward reads a helper module's function (`helpers.scale(x)`), as a model in a
    file importing its project's utilities does."""
    helpers = types.ModuleType("fxfuse_test_helpers39")
    exec(HELPERS, helpers.__dict__)
    scope = {"__name__": "fxfuse_test_models39", "torch": torch, "nn": nn, "helpers": helpers}
    exec(f"class ReadsAHelperModule(nn.Module):\n    def forward(self, x):\n"
         f"        return torch.relu(helpers.{call}(x)) + 1\n", scope)
    return scope["ReadsAHelperModule"]().eval()


def test_a_tensor_written_at_import_and_read_through_a_helper_module_is_optimized():
    # the helper module's TABLE was not among the tensors the model holds, so its version (moved at import)
    # counted as a write of the trace (stop 38's note: refused as "writes in place into a tensor it makes
    # from constants")
    model = _model("scale")
    opt = fxfuse.optimize(model, torch.randn(3, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    for _ in range(2):
        x = torch.randn(3, 8)
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


def test_a_helper_module_function_that_writes_its_table_on_every_call_is_still_refused():
    with pytest.raises(fxfuse.UnsupportedError, match="writes in place"):
        fxfuse.optimize(_model("scale_and_write"), torch.randn(3, 8), strict=True)


def test_the_aliasing_guard_knows_a_helper_modules_table():
    # a forward writing its input in place, called with the helper module's own table: eager writes the
    # table first, then reads it; the graph holds it as a constant
    helpers = types.ModuleType("fxfuse_test_helpers39b")
    exec(HELPERS, helpers.__dict__)
    scope = {"__name__": "fxfuse_test_models39", "torch": torch, "nn": nn, "helpers": helpers}
    exec("class WritesItsInput(nn.Module):\n    def forward(self, x):\n        x.mul_(2)\n"
         "        return torch.relu(helpers.scale(x)) + 1\n", scope)
    model = scope["WritesItsInput"]().eval()
    opt = fxfuse.optimize(model, torch.randn(8))
    with pytest.warns(fxfuse.FxfuseWarning, match="share memory"):
        got = opt(helpers.TABLE)
    helpers.TABLE.copy_(torch.arange(8.))
    torch.testing.assert_close(got, model(helpers.TABLE))


class OwnMethods(nn.Module):
    """A model whose class overrides nn.Module's load_state_dict (old checkpoint key names), to() (a plain
    tensor attribute moved too, as rotary caches are) and eval()."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.freq = torch.randn(16)
        self.frozen = False

    def forward(self, x):
        return torch.tanh(self.l2(torch.relu(self.l1(x)))) * self.freq

    def load_state_dict(self, state_dict, strict=True, assign=False):
        state_dict = {k.replace("fc1.", "l1.").replace("fc2.", "l2."): v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def to(self, *args, **kwargs):
        module = super().to(*args, **kwargs)
        module.freq = module.freq.to(*args, **kwargs)
        return module

    def eval(self):
        self.frozen = True
        return super().eval()


@pytest.mark.parametrize("strict", [True, False])
def test_load_state_dict_on_opt_runs_the_models_own_override(strict):
    # opt ran nn.Module's: the old names were unexpected keys, and with strict=False nothing loaded (fuzz39d)
    model = OwnMethods().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    legacy = {k.replace("l1.", "fc1.").replace("l2.", "fc2."): v for k, v in OwnMethods().state_dict().items()}
    result = opt.load_state_dict(legacy, strict=strict)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(model.l1.weight, legacy["fc1.weight"])
    with torch.no_grad():
        x = torch.randn(4, 16)
        torch.testing.assert_close(opt(x), model(x))
    assert not opt._original_calls and opt._specializations   # the graph rebuilt from the loaded weights


def test_to_and_eval_on_opt_run_the_models_own_overrides():
    model = OwnMethods().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    assert opt.to(torch.float64) is opt
    assert model.freq.dtype == torch.float64 and model.l1.weight.dtype == torch.float64
    with torch.no_grad():
        x = torch.randn(4, 16, dtype=torch.float64)
        assert opt(x).dtype == torch.float64
        torch.testing.assert_close(opt(x), model(x))
    assert not opt._original_calls
    model.frozen = False
    assert opt.eval() is opt and model.frozen


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 32)

    def forward(self, x):
        return torch.relu(self.l1(x))


def test_a_size_mismatch_on_opt_names_the_models_class_and_keys():
    opt = fxfuse.optimize(Plain().eval(), torch.randn(4, 16))
    with pytest.raises(RuntimeError, match=r"for Plain:\s+size mismatch for l1\.weight") as caught:
        opt.load_state_dict({"l1.weight": torch.randn(3, 3), "l1.bias": torch.randn(32)})
    assert "original." not in str(caught.value) and "OptimizedModule" not in str(caught.value)


class LazyTable(nn.Module):
    """A positional table made on first use and kept as an attribute (review39b: refused as state)."""

    def __init__(self):
        super().__init__()
        self.lin, self.pe = nn.Linear(8, 8), None

    def forward(self, x):
        if self.pe is None or self.pe.shape[0] < x.shape[0]:
            pos = torch.arange(x.shape[0], dtype=torch.float32, device=x.device)[:, None]
            self.pe = torch.sin(pos * 0.1 + torch.arange(8.0, device=x.device))
        return torch.relu(self.lin(x) + self.pe[: x.shape[0]])


class GridHead(nn.Module):
    """YOLOv5's Detect head: a grid cached in a list, made again when the feature map's size changes
    (fuzz39c: refused without a warm-up call; after one call at another size, never built again)."""

    def __init__(self, no=8, ch=8, na=2):
        super().__init__()
        self.no, self.na, self.grid = no, na, [torch.empty(0)]
        self.m = nn.Conv2d(ch, no * na, 1)

    def forward(self, x):
        x = self.m(x)
        bs, _, ny, nx = x.shape
        x = x.view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
        if self.grid[0].shape[2:4] != x.shape[2:4]:
            yv, xv = torch.meshgrid(torch.arange(ny, device=x.device).float(),
                                    torch.arange(nx, device=x.device).float(), indexing="ij")
            self.grid[0] = torch.stack((xv, yv), 2).view(1, 1, ny, nx, 2)
        y = x.sigmoid()
        xy = (y[..., :2] * 2 - 0.5 + self.grid[0]) * 8.0
        return torch.cat((xy, y[..., 2:]), -1).view(bs, -1, self.no)


@pytest.mark.parametrize("cls, shape", [(LazyTable, (4, 8)), (GridHead, (1, 8, 6, 5))], ids=["table", "grid"])
def test_a_memo_filled_on_first_use_is_refused_and_left_as_it_was(cls, shape):
    # taken after a probe during this stop, then taken back: calibrations and size-dependent tables passed the
    # probe and gave wrong answers (review39d). Refused, the model as before, the original's answers
    model = cls().eval()
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's state"):
        opt = fxfuse.optimize(model, torch.randn(shape))
    assert opt is model
    assert (model.pe is None) if cls is LazyTable else (model.grid[0].numel() == 0)


class Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls, self.history = 0, []

    def forward(self, x):
        self.calls = self.calls + 1
        return torch.relu(x) * 2


class KeepsHistory(Counts):
    def forward(self, x):
        self.history = self.history + [1]
        return torch.relu(x) * 2


class FlipsAFlag(Counts):
    def forward(self, x):
        self.flag = not getattr(self, "flag", False)
        return torch.relu(x) * (2 if self.flag else 3)


@pytest.mark.parametrize("cls", [Counts, KeepsHistory, FlipsAFlag])
def test_state_that_moves_on_every_call_is_still_refused(cls):
    model = cls().eval()
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's state"):
        opt = fxfuse.optimize(model, torch.randn(4, 8))
    assert opt is model and model.calls == 0 and model.history == [] and not hasattr(model, "flag")


class DataInit(nn.Module):
    """ActNorm's data-dependent init: filled from the first call's values, then kept."""

    def __init__(self):
        super().__init__()
        self.loc = self.scale = None

    def forward(self, x):
        if self.loc is None:
            self.loc, self.scale = -x.mean(0), 1 / (x.std(0) + 1e-6)
        return torch.tanh((x + self.loc) * self.scale)


def test_a_value_filled_from_the_inputs_values_is_state_not_a_memo():
    # the probe ran forward() on the example again only, so the fill looked like a memo: the graph normalized
    # every call by its own statistics, eager by the first call's (review39c: wrong by 1.4 from call 2 on)
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's state"):
        opt = fxfuse.optimize(DataInit().eval(), torch.randn(16, 8))
    assert isinstance(opt, DataInit) and opt.loc is None


class ArgumentMemo(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = None

    def forward(self, x, scale: float = 1.0):
        if self.s is None:
            self.s = scale
        return torch.relu(x) * self.s


def test_a_memo_made_from_the_first_calls_argument_stays_as_in_eager():
    # each specialization traced the filling branch from the empty memo: opt followed the argument, eager
    # keeps the first call's value (review39c)
    model, reference = ArgumentMemo().eval(), ArgumentMemo().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with torch.no_grad():
        for scale in (1.0, 2.0):
            torch.testing.assert_close(opt(x, scale), reference(x, scale))


class CopyOnConvert(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2

    def to(self, *args, **kwargs):   # converts a copy, leaves self as it is
        return nn.Module.to(copy.deepcopy(self), *args, **kwargs)


def test_a_to_override_returning_a_new_module_hands_that_module_back_with_a_warning():
    # opt.to() threw the new module away and went on wrapping the fp32 model: the fp64 call raised (review39c)
    model = CopyOnConvert().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    with pytest.warns(fxfuse.FxfuseWarning, match="returned a new module"):
        converted = opt.to(torch.float64)
    assert isinstance(converted, CopyOnConvert) and converted.lin.weight.dtype == torch.float64
    assert model.lin.weight.dtype == torch.float32 and fxfuse.stats(opt)["specializations"] == 1


class Constants:
    TABLE = torch.ones(8).mul_(2)   # written once, at import


NESTED_TABLES = {"a": {"b": torch.ones(8).mul_(2)}}
HELPER_TABLE = torch.ones(8).mul_(0.5)


def _scale(x):
    return x * HELPER_TABLE


def _scale_twice_removed(x):
    return _scale(x) + 1


class ReadsAClassAttribute(nn.Module):
    def forward(self, x):
        return torch.relu(x) * Constants.TABLE


class ReadsANestedGlobalDict(nn.Module):
    def forward(self, x):
        return torch.relu(x) * NESTED_TABLES["a"]["b"]


class ReadsThreeLevelsIntoItsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = {"a": {"b": {"c": torch.ones(8).mul_(2)}}}

    def forward(self, x):
        return torch.relu(x) * self.cfg["a"]["b"]["c"]


class ReadsThroughTwoHelpers(nn.Module):
    def forward(self, x):
        return _scale_twice_removed(torch.relu(x))


@pytest.mark.parametrize("cls", [ReadsAClassAttribute, ReadsANestedGlobalDict, ReadsThreeLevelsIntoItsDict,
                                 ReadsThroughTwoHelpers])
def test_a_tensor_written_before_optimize_and_read_deeper_is_no_written_constant(cls):
    # refused as "writes in place into a tensor it makes from constants" (review39c)
    model = cls().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))


class DictRecord:
    def __init__(self, **fields):
        self.__dict__["_fields"] = dict(fields)

    def __getattr__(self, name):
        return self.__dict__["_fields"][name]   # KeyError for any other name


class Settings:
    cfg = DictRecord(scale=2.0)


class ReadsARecordOnAClass(nn.Module):
    def forward(self, x):
        return torch.relu(x) * Settings.cfg.scale


def test_a_record_whose_attribute_lookup_raises_on_a_user_class_is_optimized():
    # the walk asked it for __func__: an internal error (review39d)
    model = ReadsARecordOnAClass().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))


ANCHORS = [[float(i)] * 4 for i in range(250)]   # a global the blocks' code names
WRITTEN_TABLE = torch.zeros(8)
WRITTEN_TABLE.add_(1)   # written once, at import


class BlockWithAnchors(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def anchor(self, i):
        return ANCHORS[i]

    def forward(self, x):
        return self.lin(x)


class ReadsTheWrittenTable(nn.Module):
    def forward(self, x):
        return torch.relu(x) * WRITTEN_TABLE + 1


def test_a_table_read_after_many_blocks_naming_a_large_global_is_no_written_constant():
    # each of 60 blocks walked the 250-item global again, the walk stopped at its cap before the written table,
    # and the table was refused as a written constant (review39d)
    model = nn.Sequential(*[BlockWithAnchors() for _ in range(60)], ReadsTheWrittenTable()).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(opt(x), model(x))


class DefaultMemo(nn.Module):
    def forward(self, x, cache={}):   # noqa: B006 -- the classic memo default
        n = x.shape[0]
        if n not in cache:
            cache[n] = torch.sin(torch.arange(n, dtype=x.dtype)[:, None] * 0.1)
        return torch.relu(x + cache[n])


def test_a_memo_default_holds_no_trace_value_after_a_build():
    # a FakeTensor of the trace stayed in the default dict: the model's own calls then returned one (review39d)
    from torch._subclasses.fake_tensor import FakeTensor
    model = DefaultMemo().eval()
    fxfuse.optimize(model, torch.randn(4, 4))
    memo = DefaultMemo.forward.__defaults__[0]
    assert not any(isinstance(v, (FakeTensor, torch.fx.Proxy)) for v in memo.values())
    out = model(torch.randn(4, 4))
    assert type(out) is torch.Tensor
    memo.clear()


class DataInitInADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.init = {}

    def forward(self, x):
        if "loc" not in self.init:   # ActNorm's init, kept in a dict
            self.init["loc"], self.init["scale"] = -x.mean(0), 1 / (x.std(0) + 1e-6)
        return torch.tanh((x + self.init["loc"]) * self.init["scale"])


class ShapeMemoInADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        t = x.shape[0]
        if t not in self.cache:   # made from x's size, dtype and device only
            pos = torch.arange(t, device=x.device, dtype=x.dtype)[:, None] + x.new_zeros(1, x.size(1))
            self.cache[t] = torch.sin(pos * 0.1)
        return torch.relu(x + self.cache[t])


def test_a_dict_memo_filled_from_the_inputs_values_is_state():
    # accepted as a memo: the graph recomputed it from every call's values, eager kept the first call's (review39d)
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's state"):
        opt = fxfuse.optimize(DataInitInADict().eval(), torch.randn(16, 8))
    assert isinstance(opt, DataInitInADict) and opt.init == {}


def test_a_dict_memo_made_from_sizes_dtypes_and_devices_is_still_a_memo():
    model = ShapeMemoInADict().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))
