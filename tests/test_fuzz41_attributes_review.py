"""Stop 41 (review41, fuzz41h, review41b-d): the per-call watch of Python state, from the reviews of
test_fuzz41_attributes.py's fixes: equal-but-other values, containers and objects compared by what
they hold, slots, no rebuild per call where nothing the model reads changed."""
import collections
import dataclasses
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager
from test_fuzz41_attributes import Holder


ScaleTuple = collections.namedtuple("ScaleTuple", "s")


@dataclasses.dataclass
class ScaleRecord:
    s: float


@pytest.mark.parametrize("before, after", [([2], [2.0]), ({"s": 0.0}, {"s": -0.0}), (ScaleTuple(2), ScaleTuple(2.0)),
                                           (ScaleRecord(0.0), ScaleRecord(-0.0))],
                         ids=["list int->float", "dict sign of zero", "namedtuple", "dataclass"])
def test_an_equal_but_other_value_replacing_an_attribute_rebuilds(before, after):
    # review41: compared with ==, [2] and [2.0] (and 0.0, -0.0 inside) were the same: int64 results, lost signs
    def read(s):
        held = s.held
        value = held[0] if isinstance(held, list) else held["s"] if isinstance(held, dict) else held.s
        return torch.copysign(torch.tensor(1.0), torch.tensor(float(value))) * value if isinstance(value, float) \
            else value
    model = Holder(before, read).eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    model.held = after
    with torch.no_grad():
        got, expected = opt(x), model(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)


def test_a_numpy_array_inside_a_dict_edited_in_place_rebuilds():
    # review41: the identity shortcut skipped the array's bytes (an observation normalizer's `mean += 1`)
    stats = {"mean": np.array([0.5, 1.5])}
    model = Holder(stats, lambda s: float(s.held["mean"][1])).eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    stats["mean"] += 1
    assert_matches_eager(opt, model, x)


class CountedLinear(nn.Linear):
    created = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountedLinear.created += 1


class TokenizerLike:
    def __init__(self):
        self.vocab = {"a": 0}


class NestedState(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = {"scale": 2.0, "stats": {"step": 0}}
        self.tok = TokenizerLike()
        self.lin = CountedLinear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * getattr(self, "cfg")["scale"] + 1   # getattr: every attribute watched


def test_state_the_model_does_not_read_changing_between_calls_does_not_rebuild():
    # review41: a stats dict the loop bumps, a vocabulary that grows, a class counter of a torch
    # subclass: each rebuilt the graph on every call (and warned after 8)
    model = NestedState().eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(10):
            model.cfg["stats"]["step"] = step
            model.tok.vocab[f"w{step}"] = step
            CountedLinear(2, 2)
            assert_matches_eager(opt, model, x)
    assert opt._state_rebuilds == 0
    model.cfg["scale"] = 3.0   # what it reads still rebuilds
    assert_matches_eager(opt, model, x)


def test_calls_under_a_cpu_device_context_or_another_mode_keep_the_specializations():
    # review41: the default-device entry compared 0 with None: every such call dropped them
    model = Holder(2.0, lambda s: s.held).eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    for _ in range(4):
        with torch.device("cpu"):
            assert_matches_eager(opt, model, x)
        assert_matches_eager(opt, model, x)
    assert opt._state_rebuilds == 0


class EqualsAlways:
    def __init__(self, s):
        self.s = s

    def __eq__(self, other):   # ignores the field forward() reads
        return isinstance(other, EqualsAlways)

    __hash__ = None


class ConfigClass:
    scale = 2.0


@pytest.mark.parametrize("make, edit", [
    (lambda: types.SimpleNamespace(s=0.0), lambda m: setattr(m, "held", types.SimpleNamespace(s=-0.0))),
    (lambda: EqualsAlways(2.0), lambda m: setattr(m, "held", EqualsAlways(3.0))),
    (lambda: collections.UserDict(s=2.0), lambda m: m.held.__setitem__("s", 3.0)),
    (lambda: collections.ChainMap({}, {"s": 2.0}), lambda m: m.held.maps[1].__setitem__("s", 3.0)),
    (lambda: ConfigClass, lambda m: setattr(ConfigClass, "scale", 3.0)),
], ids=["SimpleNamespace sign", "own __eq__", "UserDict", "ChainMap", "a class as config"])
def test_more_holders_are_watched(make, edit):
    # fuzz41h: each edit kept the traced value, silently
    def read(s):
        held = s.held
        value = held.scale if isinstance(held, type) else held["s"] if hasattr(held, "keys") else held.s
        return torch.copysign(torch.tensor(1.0), torch.tensor(value)) * (abs(value) + 1)
    saved = ConfigClass.scale
    try:
        model = Holder(make(), read).eval()
        x = torch.randn(4, 8)
        opt = fxfuse.optimize(model, x, strict=True)
        edit(model)
        assert_matches_eager(opt, model, x)
    finally:
        ConfigClass.scale = saved


class Block(nn.Module):
    def forward(self, x):
        return x * 2


class ChildProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for blk in self.blocks:
            try:
                x = blk(x) * blk.temperature
            except AttributeError:
                x = blk(x)
        return torch.relu(x)


def test_a_child_attribute_probed_by_try_except_is_watched():
    # review41b: only self's own attributes counted as probed
    model = ChildProbe().eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    model.blocks[0].temperature = 3.0
    assert_matches_eager(opt, model, x)


@dataclasses.dataclass(slots=True)
class SlotsScale:
    s: float


class TreeNode:
    def __init__(self, s, parent=None):
        self.s, self.parent, self.children = s, parent, []


def test_slots_and_back_referencing_configs_replaced_by_equal_ones():
    # review41b: a slots dataclass compared by ==, and a tree with back-references hit RecursionError
    def read(s):
        return torch.copysign(torch.tensor(1.0), torch.tensor(s.held.s)) * (abs(s.held.s) + 1)
    for old, new in ((SlotsScale(0.0), SlotsScale(-0.0)), (TreeNode(2.0), TreeNode(2.0))):
        if isinstance(old, TreeNode):
            for node in (old, new):
                node.children.append(TreeNode(1.0, node))
        model = Holder(old, read).eval()
        x = torch.randn(4, 8)
        opt = fxfuse.optimize(model, x, strict=True)
        model.held = new
        assert_matches_eager(opt, model, x)


class SlottedBase:
    __slots__ = ("s",)

    def __init__(self, s):
        self.s = s


class MixedCfg(SlottedBase):   # a __dict__ beside its base's slots
    pass


class KeyErrorRecord:
    __slots__ = ("_data",)

    def __init__(self, **fields):
        object.__setattr__(self, "_data", dict(fields))

    def __getattr__(self, name):
        return self._data[name]   # a KeyError, not an AttributeError


def test_slots_beside_a_dict_and_records_raising_key_errors():
    # review41c: a subclass's __dict__ hid its base's slots (edits missed), and a record whose lookup
    # raises KeyError made every call raise once it was replaced
    for make, edit in ((lambda: MixedCfg(2.0), lambda m: setattr(m.held, "s", 5.0)),
                       (lambda: KeyErrorRecord(s=2.0), lambda m: setattr(m, "held", KeyErrorRecord(s=5.0)))):
        model = Holder(make(), lambda s: s.held.s).eval()
        x = torch.randn(4, 8)
        opt = fxfuse.optimize(model, x, strict=True)
        edit(model)
        assert_matches_eager(opt, model, x)
        assert_matches_eager(opt, model, x)


def test_an_equal_deep_config_recreated_each_call_does_not_rebuild():
    # review41c: the depth limit counted each object twice: an HF-like config compared unequal each call
    def make():
        return types.SimpleNamespace(text_config=types.SimpleNamespace(
            rope_scaling={"short_factor": [1.0, 2.0], "type": "longrope"}, scale=2.0))
    model = Holder(make(), lambda s: s.held.text_config.scale).eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    for _ in range(4):
        model.held = make()
        assert_matches_eager(opt, model, x)
    assert opt._state_rebuilds == 0


@dataclasses.dataclass(slots=True)
class RunOpts:
    s: float


class PrivateSlots:
    __slots__ = ("__scale",)

    def __init__(self, s):
        self.__scale = s

    @property
    def s(self):
        return self.__scale

    def set(self, s):
        self.__scale = s


def test_slots_objects_compare_by_their_fields():
    # review41d: every slots object compared unequal to an equal copy (a rebuild per call), private slots
    # were never read, and np.float64(-0.0) replacing 0.0 was the same
    model = Holder(RunOpts(2.0), lambda s: s.held.s).eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    for _ in range(3):
        model.held = RunOpts(2.0)
        assert_matches_eager(opt, model, x)
    assert opt._state_rebuilds == 0
    model = Holder(PrivateSlots(2.0), lambda s: s.held.s).eval()
    opt = fxfuse.optimize(model, x, strict=True)
    model.held.set(5.0)
    assert_matches_eager(opt, model, x)
    model = Holder(np.float64(0.0), lambda s: torch.copysign(torch.tensor(1.0), torch.tensor(float(s.held)))).eval()
    opt = fxfuse.optimize(model, x, strict=True)
    model.held = np.float64(-0.0)
    assert_matches_eager(opt, model, x)
