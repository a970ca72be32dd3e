"""Stop 41 (fuzz41f): Python state forward() reads, changed after optimize(), rebuilds the graph.

Each case: a model whose forward reads a value through one more kind of object or class, an edit
after optimize() that changes what eager computes, and the check that the optimized module follows
it silently (a rebuild, no warning) with its pointwise work still fused.
"""
import collections
import dataclasses
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager


class HubMixin:
    """A library mixin placed after nn.Module (huggingface_hub's documented order)."""


class MixinAfterModule(nn.Module, HubMixin):
    scale = 2.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale * getattr(self, "gain", 1.0) + 1


class ScaledLinear(nn.Linear):
    """A subclass of a torch module: torch's forward reads what no hook sees."""
    scale = 2.0

    def forward(self, x):
        return torch.tanh(super().forward(x)) * self.scale * getattr(self, "gain", 1.0) + 1


class Lookups(nn.Module):
    """Attributes looked up while absent by spellings other than getattr/hasattr."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        if self.spelling == "try":
            try:
                t = self.temperature
            except AttributeError:
                t = 1.0
        elif self.spelling == "vars":
            t = self.temperature if "temperature" in vars(self) else 1.0
        else:
            t = self.__dict__.get("temperature", 1.0)
        return torch.sigmoid(x / t) * 2 + 1


class ClassLevelState(nn.Module):
    table = {"relu": 2.0}
    scales = [1.0, 2.0]

    def forward(self, x):
        return torch.relu(x) * self.table["relu"] + self.scales[1] * torch.exp(x)


class Record:
    """A dict-backed config (ml_collections' ConfigDict, EasyDict-like records)."""

    def __init__(self, **fields):
        object.__setattr__(self, "_data", dict(fields))

    def __getattr__(self, name):
        try:
            return self._data[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._data[name] = value


class Helper:
    def __init__(self):
        self.k = 2.0

    def __call__(self, t):
        return t * self.k

    def apply(self, t):
        return t * self.k


class ClassCfg:
    scale = 2.0


@dataclasses.dataclass(slots=True)
class SlotsCfg:
    scale: float = 2.0


def make_scaler(c):
    def scale(t):
        return t * c

    def set_c(v):
        nonlocal c
        c = v
    return scale, set_c


class Holder(nn.Module):
    """forward reads `read(self)` from whatever `self.held` is."""

    def __init__(self, held, read):
        super().__init__()
        self.held, self.read = held, read

    def forward(self, x):
        return torch.relu(x) * self.read(self) + torch.sigmoid(x)


SCALER, SET_C = make_scaler(2.0)


def _cases():
    def setattr_(obj, name, value):
        return lambda model: setattr(obj(model), name, value)
    return {
        "mixin class attribute": (MixinAfterModule, lambda m: setattr(MixinAfterModule, "scale", 3.0)),
        "mixin absent name": (MixinAfterModule, setattr_(lambda m: m, "gain", 4.0)),
        "torch subclass class attribute": (lambda: ScaledLinear(8, 8), lambda m: setattr(ScaledLinear, "scale", 3.0)),
        "torch subclass absent name": (lambda: ScaledLinear(8, 8), setattr_(lambda m: m, "gain", 4.0)),
        "try/except AttributeError": (lambda: Lookups("try"), setattr_(lambda m: m, "temperature", 0.25)),
        "in vars(self)": (lambda: Lookups("vars"), setattr_(lambda m: m, "temperature", 0.25)),
        "__dict__.get": (lambda: Lookups("dict"), setattr_(lambda m: m, "temperature", 0.25)),
        "class-level dict": (ClassLevelState, lambda m: ClassLevelState.table.__setitem__("relu", 5.0)),
        "class-level list": (ClassLevelState, lambda m: ClassLevelState.scales.__setitem__(1, 5.0)),
        "dict-backed config": (lambda: Holder(Record(scale=2.0), lambda s: s.held.scale),
                               lambda m: setattr(m.held, "scale", 5.0)),
        "callable helper": (lambda: Holder(Helper(), lambda s: s.held(1.0)), setattr_(lambda m: m.held, "k", 3.0)),
        "bound method": (lambda: Holder(Helper().apply, lambda s: s.held(1.0)),
                         lambda m: setattr(m.held.__self__, "k", 3.0)),
        "numpy array": (lambda: Holder(np.array([2.0, 3.0]), lambda s: float(s.held[0])),
                        lambda m: m.held.__setitem__(0, 5.0)),
        "deque": (lambda: Holder(collections.deque([1.0, 2.0], maxlen=2), lambda s: sum(s.held)),
                  lambda m: m.held.append(10.0)),
        "slots dataclass": (lambda: Holder(SlotsCfg(), lambda s: s.held.scale), setattr_(lambda m: m.held, "scale", 3.0)),
        "class attribute of a held object": (lambda: Holder(ClassCfg(), lambda s: s.held.scale),
                                             lambda m: setattr(ClassCfg, "scale", 3.0)),
        "closure cell": (lambda: Holder(SCALER, lambda s: s.held(1.0)), lambda m: SET_C(3.0)),
        "sign of zero in a tuple": (lambda: Holder((0.0,), lambda s: torch.copysign(torch.tensor(1.0), torch.tensor(
            s.held[0])).item()), lambda m: setattr(m, "held", (-0.0,))),
    }


@pytest.fixture
def restore_classes():
    saved = (MixinAfterModule.scale, ScaledLinear.scale, dict(ClassLevelState.table), list(ClassLevelState.scales),
             ClassCfg.scale)
    yield
    MixinAfterModule.scale, ScaledLinear.scale, ClassCfg.scale = saved[0], saved[1], saved[4]
    ClassLevelState.table.clear()
    ClassLevelState.table.update(saved[2])
    ClassLevelState.scales[:] = saved[3]
    SET_C(2.0)


@pytest.mark.parametrize("case", sorted(_cases()))
def test_an_edit_after_optimize_rebuilds(case, restore_classes):
    # before (fuzz41f): each edit left the traced value in the graph: |opt - eager| 0.7 to 49, silently
    make, edit = _cases()[case]
    model = make().eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    assert_matches_eager(opt, model, x)
    edit(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches_eager(opt, model, x)
        assert_matches_eager(opt, model, x)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


class TupleScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = (2, 3)

    def forward(self, x):
        return (x * self.k[0] + 1) * self.k[1]


def test_an_int_replaced_by_an_equal_float_in_a_tuple_changes_the_dtype():
    # before: (2, 3) == (2.0, 3), so the int64 graph stayed where eager now returns float32
    model = TupleScale().eval()
    x = torch.randint(-5, 6, (4, 8))
    opt = fxfuse.optimize(model, x, strict=True)
    model.k = (2.0, 3)
    with torch.no_grad():
        got, expected = opt(x), model(x)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected)


class ChildWithDefault(nn.Module):
    def forward(self, x, cfg={"scale": 2.0}):   # noqa: B006 -- the mutable default under test
        return torch.relu(x) * cfg["scale"] + 1


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = ChildWithDefault()

    def forward(self, x):
        return torch.sigmoid(self.child(x))


def test_a_submodules_mutable_default_edited_in_place_rebuilds():
    # before: only the top model's forward() defaults were fingerprinted (|opt - eager| 0.95)
    model = Parent().eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    default = ChildWithDefault.forward.__defaults__[0]
    try:
        default["scale"] = 3.0
        assert_matches_eager(opt, model, x)
    finally:
        default["scale"] = 2.0
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


def test_unchanged_nested_state_does_not_rebuild():
    # the deeper watch must not rebuild per call: same objects, or equal values assigned again
    cfg = Record(scale=2.0, table={"a": 1.0})
    model = Holder(cfg, lambda s: s.held.scale + s.held.table["a"]).eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    builds = len(opt._specializations)
    for _ in range(3):
        cfg.scale = 2.0
        cfg.table["a"] = 1.0
        assert_matches_eager(opt, model, x)
    assert len(opt._specializations) == builds
