"""Stop 39: call-time guards and the model's state (review39b): submodules swapped through
_modules, config objects read by the standard library, object defaults, inputs without
storage, number subclasses, the model's own generators, miss messages, library switches."""
import collections
import dataclasses
import random
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fxfuse


def _calls_match(opt, model, *shape):
    """A call of opt gives eager's answer, from a specialization (a run of the original would too)."""
    with torch.no_grad():
        x = torch.randn(*shape)
        torch.testing.assert_close(opt(x), model(x))
    assert isinstance(opt, fxfuse.OptimizedModule) and not opt._original_calls and opt._specializations


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x)) * 2


def test_a_submodule_swapped_through_modules_is_seen():
    # torch.ao's convert and torchvision's _replace_relu write `module._modules[name] = new`, which fires
    # no registration hook and keeps the count of children: the graph kept running the old ReLU (review39b)
    model = Block().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    _calls_match(opt, model, 4, 8)
    model._modules["act"] = nn.Sigmoid()
    _calls_match(opt, model, 4, 8)
    prebuilt = nn.Linear(8, 8)
    model._modules["lin"] = prebuilt
    _calls_match(opt, model, 4, 8)


@dataclasses.dataclass
class Config:
    scale: float = 2.0
    shift: float = 0.5


class ReadsConfigAsTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = Config()

    def forward(self, x):
        scale, shift = dataclasses.astuple(self.cfg)   # the field names are read by the standard library
        return torch.relu(x) * scale + shift


class ReadsConfigAsDict(ReadsConfigAsTuple):
    def forward(self, x):
        return _affine(torch.relu(x), **dataclasses.asdict(self.cfg))


def _affine(x, scale, shift):
    return x * scale + shift


@pytest.mark.parametrize("cls", [ReadsConfigAsTuple, ReadsConfigAsDict])
def test_config_fields_read_through_asdict_or_astuple_are_watched(cls):
    model = cls().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    model.cfg.scale = 5.0   # silently stale before (review39b)
    _calls_match(opt, model, 4, 8)


DEFAULT_CONFIG = Config()
DEFAULT_NAMESPACE = types.SimpleNamespace(scale=2.0)


class ObjectDefaults(nn.Module):
    def forward(self, x, cfg=DEFAULT_CONFIG, ns=DEFAULT_NAMESPACE):
        return torch.relu(x) * cfg.scale + ns.scale


def test_an_object_default_of_forward_edited_between_calls_rebuilds():
    model = ObjectDefaults().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    try:
        _calls_match(opt, model, 4, 8)
        DEFAULT_CONFIG.scale = 5.0   # the graph held 2.0 (review39b)
        _calls_match(opt, model, 4, 8)
        DEFAULT_NAMESPACE.scale = -1.0
        _calls_match(opt, model, 4, 8)
    finally:
        DEFAULT_CONFIG.scale, DEFAULT_NAMESPACE.scale = 2.0, 2.0


class WritesItsSecondInput(nn.Module):
    def forward(self, adj, h):
        h.mul_(0.5)
        return torch.relu(adj @ h) + 1


def test_a_sparse_input_to_a_forward_writing_in_place_runs_the_original_with_one_warning():
    # the aliasing guard read the sparse tensor's storage before the layout check (review39b: a crash)
    model = WritesItsSecondInput().eval()
    opt = fxfuse.optimize(model, (torch.randn(5, 5), torch.randn(5, 3)))
    adj, h = torch.randn(5, 5).relu().to_sparse(), torch.randn(5, 3)
    with pytest.warns(fxfuse.FxfuseWarning, match="layout"):
        got = opt(adj, h.clone())
    torch.testing.assert_close(got, model(adj, h.clone()))


def test_two_meta_inputs_are_told_by_their_device_not_as_sharing_memory():
    model = WritesItsSecondInput().eval()
    opt = fxfuse.optimize(model, (torch.randn(5, 5), torch.randn(5, 3)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt(torch.randn(5, 5, device="meta"), torch.randn(5, 3, device="meta"))
    text = " ".join(str(w.message) for w in caught)
    assert "meta" in text and "share memory" not in text


class Scale(float):
    def __repr__(self):
        return "Scale"   # a repr that hides the value


class Scaled(nn.Module):
    def forward(self, x, s):
        return torch.relu(x) * s


def test_a_float_subclass_whose_repr_hides_its_value_is_guarded_by_value():
    model, x = Scaled().eval(), torch.randn(4, 8)
    opt = fxfuse.optimize(model, (x, Scale(2.0)))
    with torch.no_grad():
        torch.testing.assert_close(opt(x, Scale(3.0)), model(x, Scale(3.0)))   # 2.0's result before (review39b)


GENERATOR = torch.Generator().manual_seed(0)


class DrawsFromItsGenerator(nn.Module):
    def __init__(self, own: bool):
        super().__init__()
        self.gen = torch.Generator().manual_seed(0) if own else None

    def forward(self, x):
        return torch.relu(x) + torch.rand(x.shape, generator=self.gen if self.gen is not None else GENERATOR)


@pytest.mark.parametrize("own", [True, False], ids=["attribute", "global"])
def test_a_refused_build_leaves_the_models_generator_as_it_was_and_names_it(own):
    model, x = DrawsFromItsGenerator(own).eval(), torch.randn(4, 8)
    generator = model.gen if own else GENERATOR
    state = generator.get_state()
    with pytest.warns(fxfuse.FxfuseWarning, match="gen|GENERATOR") as caught:
        opt = fxfuse.optimize(model, x)
    assert opt is model
    assert "_opaque_obj" not in str(caught[0].message)   # torch.fx's name for it (review39b)
    assert torch.equal(generator.get_state(), state)     # the build's runs had advanced it


class TwoSettings(nn.Module):
    def forward(self, x, n, flag=True):
        for _ in range(n):
            x = torch.tanh(x)
        return x + 1 if flag else x


def test_a_miss_with_a_default_spelled_out_names_the_argument_that_changed():
    opt = fxfuse.optimize(TwoSettings().eval(), (torch.randn(4, 8), 2, True), max_specializations=1)
    with pytest.warns(fxfuse.FxfuseWarning, match=r"input 1 \(n\): the int 3 where the specialization has the "
                                                  r"int 2; the one specialization is in use"):
        opt(torch.randn(4, 8), 3, True)


def test_cublas_fp16_accumulation_switched_after_the_build_rebuilds():
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_fp16_accumulation
    try:
        model = Block().eval()
        opt = fxfuse.optimize(model, torch.randn(3, 8), strict=True)
        built = next(iter(opt._specializations.values()))
        matmul.allow_fp16_accumulation = not saved
        _calls_match(opt, model, 3, 8)
        assert next(iter(opt._specializations.values())) is not built
    finally:
        matmul.allow_fp16_accumulation = saved


class Inner:
    def __init__(self):
        self.scale = 2.0


class Outer:
    def __init__(self):
        self.inner = Inner()


NESTED, IN_LIST, HISTORY = Outer(), Inner(), collections.deque([2.0], maxlen=4)


class NestedDefaults(nn.Module):
    def forward(self, x, cfg=NESTED, cfgs=[IN_LIST], hist=HISTORY):   # noqa: B006 -- the point of the test
        return torch.relu(x) * cfg.inner.scale + cfgs[0].scale * hist[-1]


@pytest.mark.parametrize("edit", ["nested", "in_list", "deque"])
def test_defaults_are_watched_below_their_first_level(edit):
    # an object in an object or in a list, and a deque, kept the traced values (review39c)
    model = NestedDefaults().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    try:
        {"nested": lambda: setattr(NESTED.inner, "scale", 5.0), "in_list": lambda: setattr(IN_LIST, "scale", 5.0),
         "deque": lambda: HISTORY.append(-3.0)}[edit]()
        _calls_match(opt, model, 4, 8)
    finally:
        NESTED.inner.scale = IN_LIST.scale = 2.0
        HISTORY.append(2.0)


class Record:
    __slots__ = ("_data",)

    def __init__(self, **fields):
        object.__setattr__(self, "_data", dict(fields))

    def __getattr__(self, name):
        return self._data[name]   # KeyError for any other name


class Unprintable:
    def __repr__(self):
        raise RuntimeError("closed")


RECORD, HOLDS_UNPRINTABLE = Record(scale=2.0), types.SimpleNamespace(scale=2.0, handle=Unprintable())


class OddDefaults(nn.Module):
    def forward(self, x, rec=RECORD, cfg=HOLDS_UNPRINTABLE):
        return torch.relu(x) * rec.scale + cfg.scale


def test_defaults_whose_attributes_raise_are_optimized():
    # the fingerprint asked __dict__ of a record whose __getattr__ raises, and repr() of an unprintable
    # attribute: an internal error (review39c)
    model = OddDefaults().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    _calls_match(opt, model, 4, 8)
    HOLDS_UNPRINTABLE.scale = 3.0
    try:
        _calls_match(opt, model, 4, 8)
    finally:
        HOLDS_UNPRINTABLE.scale = 2.0


class PythonNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.rng, self.system = random.Random(0), random.SystemRandom()

    def forward(self, x):
        return torch.relu(x) + self.rng.random()


def test_a_refused_build_leaves_the_models_random_random_as_it_was():
    # only torch.Generators were put back: the build's runs of forward() advanced a random.Random (review39c)
    model = PythonNoise().eval()
    state = model.rng.getstate()
    with pytest.warns(fxfuse.FxfuseWarning):
        assert fxfuse.optimize(model, torch.randn(2, 2)) is model
    assert model.rng.getstate() == state


class FillsAFreshTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a, b):
        t = a - b
        t.fill_(0.5)   # written in place: a tensor forward() made, never an input
        return self.lin(t) + a


def test_one_tensor_twice_for_a_forward_writing_only_fresh_tensors_runs_the_graph():
    # the aliasing guard fired for any in-place op the graph keeps (fuzz39e: "the graph writes an input in
    # place", and GuardError under strict=True)
    model = FillsAFreshTensor().eval()
    opt = fxfuse.optimize(model, (torch.randn(3, 4), torch.randn(3, 4)), strict=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, x), model(x, x))
    assert not opt._original_calls


class WritesItsSecond(nn.Module):
    def forward(self, x0, x1):
        x1.transpose(0, -1).add_(x0 * 1)
        return x0 + 0.5


def test_an_example_of_one_tensor_twice_for_a_forward_writing_it_names_the_aliasing():
    # the warning blamed control flow, rounding or "a bug in fxfuse" (fuzz39e)
    x = torch.randn(3, 3)
    with pytest.warns(fxfuse.FxfuseWarning, match="share memory"):
        fxfuse.optimize(WritesItsSecond().eval(), (x, x))


class Gains:
    def __init__(self):
        self.scale = 1.5
        self.gains = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)


GAINS = Gains()


class ReadsGains(nn.Module):
    def forward(self, x, cfg=GAINS):
        return torch.relu(x) * cfg.scale + float(cfg.gains.sum())


def test_object_default_edits_are_seen_by_value_and_the_same_value_rebuilds_nothing():
    # by id alone, a float assigned twice between calls reused the freed one's address and was missed, and an
    # in-place edit of a numpy array was missed; a field assigned its own value again rebuilt (review39d)
    model = ReadsGains().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    try:
        for step in range(3):
            GAINS.scale = float(step + 2) * 1.25
            GAINS.scale = GAINS.scale + 0.5
            _calls_match(opt, model, 4, 8)
        GAINS.gains *= 10
        _calls_match(opt, model, 4, 8)
        built = next(iter(opt._specializations.values()))
        GAINS.scale = float(GAINS.scale)   # the same value, another float object
        _calls_match(opt, model, 4, 8)
        assert next(iter(opt._specializations.values())) is built
    finally:
        GAINS.scale, GAINS.gains = 1.5, np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
