"""Stop 42 (review42e): state forward() keeps in a set, a deque, a numpy array, or a dict that starts
empty and counts or logs (not a memo of tensors), was neither refused nor put back: the trace's
Proxies stayed in the user's set, and counters read the build's runs."""
import collections

import numpy as np
import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_warned

GLOBAL_LOG = {}


class SeenRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def forward(self, x):
        self.seen.add(x.shape[0])
        return x.relu() * 2


class RecentRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.recent = collections.deque(maxlen=4)

    def forward(self, x):
        self.recent.append(x.shape[0])
        return x.relu() * 2


class NumpyCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.counts = np.zeros(2)

    def forward(self, x):
        self.counts[0] += 1
        return x.relu() * 2


class DictCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.stats = {}

    def forward(self, x):
        self.stats["calls"] = self.stats.get("calls", 0) + 1
        return x.relu() * 2


class DictLog(nn.Module):
    def __init__(self):
        super().__init__()
        self.stats = {}

    def forward(self, x):
        self.stats.setdefault("rows", []).append(x.shape[0])
        return x.relu() * 2


class GlobalLog(nn.Module):
    def forward(self, x):
        GLOBAL_LOG[len(GLOBAL_LOG)] = x.shape[0]
        return x.relu() * 2


class CounterCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def forward(self, x):
        self.calls["forward"] += 1
        return x.relu() * 2


def _state(model):
    if isinstance(model, GlobalLog):
        return dict(GLOBAL_LOG)
    value = next(v for k, v in vars(model).items() if not k.startswith("_") and k != "training")
    return value.copy() if isinstance(value, np.ndarray) else collections.deque(value) \
        if isinstance(value, collections.deque) else type(value)(value) if not isinstance(value, dict) \
        else {k: list(v) if isinstance(v, list) else v for k, v in value.items()}


@pytest.mark.parametrize("make", [SeenRows, RecentRows, NumpyCounter, DictCounter, DictLog, GlobalLog, CounterCalls])
def test_state_in_sets_deques_arrays_and_counting_dicts_is_refused_and_put_back(make):
    GLOBAL_LOG.clear()
    model = make().eval()
    before = _state(model)
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
    assert opt is model and len(messages) == 1 and "changes the module's state" in messages[0]
    after = _state(model)
    if isinstance(before, np.ndarray):
        assert np.array_equal(after, before)
    else:
        assert after == before   # no Proxy left, no count of the build's runs
    with torch.no_grad():
        opt(torch.randn(5, 8))
    now = _state(model)   # the original ran: eager's state
    assert now[0] == 1 if isinstance(model, NumpyCounter) else now != before


class TensorMemo(nn.Module):
    """A dict memo of tensors filled on a miss (rotary tables): no state, optimized."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        n = x.shape[-1]
        if n not in self.cache:
            self.cache[n] = torch.arange(n, dtype=x.dtype) / n
        return (x + self.cache[n]).relu()


class TupleMemo(nn.Module):
    """HF-style rotary cache: a tuple of tensors per length (review42f: refused by a first fix)."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        n = x.shape[-1]
        if n not in self.cache:
            angle = torch.arange(n, dtype=x.dtype) / n
            self.cache[n] = (angle.cos(), angle.sin())
        cos, sin = self.cache[n]
        return x * cos + x.flip(-1) * sin


class NumberMemo(nn.Module):
    """A scale memo per width, and a warned-once flag (review42f)."""

    def __init__(self):
        super().__init__()
        self.scales, self.warned = {}, {}

    def forward(self, x):
        n = x.shape[-1]
        if n not in self.scales:
            self.scales[n] = n ** -0.5
        self.warned.setdefault("once", True)
        return (x * self.scales[n]).relu()


class TensorLog(nn.Module):
    """A dict that gains one tensor per call (review42f: kept 7 entries as a memo)."""

    def __init__(self):
        super().__init__()
        self.history = {}

    def forward(self, x):
        y = x.relu() * 2
        self.history[len(self.history)] = torch.ones(1)
        return y


@pytest.mark.parametrize("make", [TensorMemo, TupleMemo, NumberMemo])
def test_memos_of_tensors_tuples_and_numbers_are_still_optimized(make):
    model = make().eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
        assert isinstance(opt, fxfuse.OptimizedModule) and not messages
        for width in (8, 8, 6):
            assert_matches_eager(opt, model, torch.randn(3, width))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("make", [TensorLog, DictCounter, DictLog, CounterCalls])
def test_dicts_that_move_on_every_call_are_state(make, verify):
    model = make().eval()
    before = _state(model) if make is not TensorLog else {}
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8), verify=verify)
    assert opt is model and len(messages) == 1 and "changes the module's state" in messages[0]
    assert (_state(model) if make is not TensorLog else model.history) == before


class RotaryHelper:
    """A plain helper object with a cache of its own (fuzz42h: the trace's Proxy stayed in it, and
    the user's eager model returned a Proxy afterwards)."""

    def __init__(self):
        self.cache = {}

    def cos(self, n):
        if "cos" not in self.cache:
            self.cache["cos"] = torch.cos(torch.arange(n) * 0.1)
        return self.cache["cos"]


class HelperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rope = RotaryHelper()

    def forward(self, x):
        return x * self.rope.cos(x.shape[-1]) + 1


class CallCounter:
    def __init__(self):
        self.calls = 0


class CountsInAnObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.state = CallCounter()

    def forward(self, x):
        self.state.calls += 1
        return x.relu()


def test_a_helper_objects_cache_holds_no_proxy_after_optimize():
    model = HelperNet().eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
        assert isinstance(opt, fxfuse.OptimizedModule) and not messages
        assert all(type(v) is torch.Tensor for v in model.rope.cache.values())
        assert type(model(torch.randn(3, 8))) is torch.Tensor
        assert_matches_eager(opt, model, torch.randn(5, 8))


def test_a_counter_in_a_plain_object_is_state():
    model = CountsInAnObject().eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
    assert opt is model and len(messages) == 1 and model.state.calls == 0


GLOBAL_SEEN = set()


class StateKinds(nn.Module):
    """State fxfuse did not snapshot before fuzz42h: long containers, bytearray, array.array, a
    dict four levels down, a global set, a base class's container."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.long = list(range(100))
        self.raw = bytearray(4)
        self.arr = __import__("array").array("d", [0.0])
        self.deep = {"a": {"b": {"c": {"n": 0}}}}

    def forward(self, x):
        if self.kind == "long":
            self.long.append(x.shape[0])
        elif self.kind == "bytearray":
            self.raw[0] += 1
        elif self.kind == "array":
            self.arr.append(1.0)
        elif self.kind == "deep":
            self.deep["a"]["b"]["c"]["n"] += 1
        elif self.kind == "global set":
            GLOBAL_SEEN.add(x.shape[0])
        return x.relu() * 2


class RegistryBase(nn.Module):
    registry = []


class Registered(RegistryBase):
    def forward(self, x):
        RegistryBase.registry.append(x.shape[0])
        return x.relu()


def _python_state(model):
    import copy
    return copy.deepcopy({k: v for k, v in vars(model).items() if not k.startswith("_")}), set(GLOBAL_SEEN), \
        list(RegistryBase.registry)


@pytest.mark.parametrize("make", [lambda: StateKinds("long"), lambda: StateKinds("bytearray"),
                                  lambda: StateKinds("array"), lambda: StateKinds("deep"),
                                  lambda: StateKinds("global set"), Registered])
def test_more_kinds_of_state_are_refused_and_put_back(make):
    GLOBAL_SEEN.clear()
    RegistryBase.registry.clear()
    model = make().eval()
    before = _python_state(model)
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
    assert opt is model and len(messages) == 1 and "changes the module's state" in messages[0]
    assert repr(_python_state(model)) == repr(before)


class TensorCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.stats = {}

    def forward(self, x):
        self.stats.setdefault("calls", torch.zeros(())).add_(1)   # created on first use, then in place
        return x.relu()


class ScratchRefill(nn.Module):
    def __init__(self):
        super().__init__()
        self.scratch = {}

    def forward(self, x):
        self.scratch["scale"] = torch.full((x.shape[-1],), 0.5)   # an equal fresh tensor every call
        return x * self.scratch["scale"] + 1


class SeenWidths(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen, self.meta = {}, {}

    def forward(self, x):
        if x.shape[-1] not in self.seen:
            self.seen[x.shape[-1]] = True
            self.meta["desc"] = f"width {x.shape[-1]}"
        return x.relu() + 1


def test_a_tensor_counter_written_in_place_is_state():
    model = TensorCounter().eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
    assert opt is model and len(messages) == 1 and model.stats == {}


@pytest.mark.parametrize("make", [ScratchRefill, SeenWidths])
def test_refilled_scratch_and_shape_memos_are_optimized_without_trace_leftovers(make):
    # review42j: an equal fresh tensor per call was refused; a Proxy key and a "Proxy(getitem)" string stayed
    model = make().eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
        assert isinstance(opt, fxfuse.OptimizedModule) and not messages
        assert_matches_eager(opt, model, torch.randn(3, 8))
    if make is SeenWidths:
        assert list(model.seen) == [8] and model.meta == {"desc": "width 8"}
    else:   # the eager calls in between refill the scratch: rebuilt, not sent to the original
        assert not opt._original_calls


class LoggingModel(nn.Module):
    """A forward() that only logs, through a handler that keeps its records (fuzz42k: refused as state
    once plain objects were walked: the logger's handler buffer moved)."""

    def __init__(self):
        import logging.handlers
        super().__init__()
        self.log = logging.getLogger("fxfuse-test-memory-logger")
        self.log.setLevel(logging.INFO)
        self.log.handlers[:] = [logging.handlers.MemoryHandler(capacity=10 ** 6)]
        self.log.propagate = False

    def forward(self, x):
        self.log.info("rows %d", x.shape[0])
        return x.relu() * 2


def test_a_model_that_logs_is_still_optimized():
    model = LoggingModel().eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(3, 8))
        assert isinstance(opt, fxfuse.OptimizedModule) and not messages
        assert_matches_eager(opt, model, torch.randn(3, 8))
