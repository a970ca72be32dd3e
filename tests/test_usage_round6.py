"""Findings of the sixth fuzzing round (unseen models and calls, CPU), each kept fixed here.

- State a forward() updates in place inside a list, dict, namespace or module-level global was
  frozen at trace time (torch.fx runs a constant-only `add_` once): later calls were silently
  wrong and optimize() left the state advanced.
- A forward() branching on torch.is_inference_mode_enabled() ran its traced branch in the
  other mode.
- A returned torch.Size came back as a plain tuple where outputs pass through pytree.
- Model-side causes were reported as "a bug in fxfuse": an overridden __call__, lazy modules.
"""
import copy
import dataclasses
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402
from conftest import optimize_warned  # noqa: E402
from fxfuse.runtime import OptimizedModule  # noqa: E402

COUNTER = torch.zeros(8)   # module-level state, read and updated by GlobalState.forward


class HiddenState(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.lin, self.where = nn.Linear(8, 8), where
        self.holder = {"list": [torch.zeros(8)], "dict": {"acc": torch.zeros(8)}, "tuple": (torch.zeros(8),)}[where]

    def acc(self):
        return self.holder["acc"] if self.where == "dict" else self.holder[0]

    def forward(self, x):
        self.acc().add_(1.0)
        return self.lin(x) + self.acc()


class GlobalState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        COUNTER.add_(1.0)
        return self.lin(x) + COUNTER


@pytest.mark.parametrize("where", ["list", "dict", "tuple"])
def test_state_in_a_container_written_in_place_is_refused_and_restored(where):
    model = HiddenState(where).eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert opt is model and len(messages) == 1 and "changes the module's state" in messages[0]
    assert torch.equal(model.acc(), torch.zeros(8)), "optimize left the state advanced"
    with pytest.raises(fxfuse.FxfuseError, match="state"):
        fxfuse.optimize(HiddenState(where).eval(), torch.randn(4, 8), strict=True)


def test_module_level_tensor_written_in_place_is_refused_and_restored():
    COUNTER.zero_()
    model = GlobalState().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert opt is model and len(messages) == 1 and "global COUNTER" in messages[0]
    assert torch.equal(COUNTER, torch.zeros(8))


def test_state_read_but_never_written_still_optimizes():
    class ReadsList(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.scale = nn.Linear(8, 8), [torch.randn(8)]

        def forward(self, x):
            return torch.relu(self.lin(x)) * self.scale[0]

    model = ReadsList().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] >= 1
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class InferenceBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * (2.0 if torch.is_inference_mode_enabled() else 3.0)


def _inference(on: bool):
    """inference_mode, or no_grad (torch.inference_mode(False) turns grad mode back on)."""
    return torch.inference_mode() if on else torch.no_grad()


@pytest.mark.parametrize("built_in_inference_mode", [False, True])
def test_forward_branching_on_inference_mode_runs_the_original_in_the_other_mode(built_in_inference_mode):
    model = InferenceBranch().eval()
    x = torch.randn(4, 8)
    with _inference(built_in_inference_mode):
        opt = fxfuse.optimize(model, x)
    assert isinstance(opt, OptimizedModule)
    for mode in (built_in_inference_mode, not built_in_inference_mode, built_in_inference_mode):
        with _inference(mode), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, want = opt(x), model(x)
        torch.testing.assert_close(got, want)
        assert [("is_inference_mode_enabled" in str(w.message)) for w in caught] == \
            ([True] if mode != built_in_inference_mode else [])
    assert opt._original_calls["inference"] == 1


class ReturnsSize(nn.Module):
    def __init__(self, batchnorm):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8) if batchnorm else nn.Identity()

    def forward(self, x):
        h = self.bn(self.lin(x))
        return h.shape, {"size": h.relu().size(), "y": h.relu()}


@pytest.mark.parametrize("batchnorm,options", [(True, {}), (False, {"strassen": "force"}), (False, {})])
def test_a_returned_torch_size_stays_a_torch_size(batchnorm, options):
    model = ReturnsSize(batchnorm).eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, x, strict=True, **options)
    with torch.no_grad():
        shape, rest = opt(x)
        want = model(x)
    assert type(shape) is torch.Size and type(rest["size"]) is torch.Size and shape == want[0]
    torch.testing.assert_close(rest["y"], want[1]["y"])


def test_overridden_call_is_refused_with_its_reason():
    class Scales(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def __call__(self, x):
            return super().__call__(x * 2)

        def forward(self, x):
            return self.lin(x)

    model = Scales().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8), verify=False)
    assert opt is model and len(messages) == 1 and "overrides __call__" in messages[0]


def test_a_graph_module_is_still_optimized():
    """torch.fx.GraphModule has a __call__ of its own that only wraps nn.Module's."""
    model = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval())
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


def test_unmaterialized_lazy_module_says_to_call_the_model_first():
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU()).eval()
    opt, messages = optimize_warned(model, torch.randn(4, 5))
    assert opt is model and len(messages) == 1 and "call the model once" in messages[0]
    model(torch.randn(4, 5))   # materialized: optimized like any Linear
    opt = fxfuse.optimize(copy.deepcopy(model), torch.randn(4, 5), strict=True)
    assert isinstance(opt, OptimizedModule)


# --- review of the above (helper): items replaced in containers, uncomparable tensors, __call__ aliases


class ReplacesItem(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.lin, self.where = nn.Linear(8, 8), where
        self.hist = [torch.zeros(8)] if where == "list" else {"n": torch.zeros(())}

    def forward(self, x):
        y = self.lin(x)
        if self.where == "list":
            out = y + self.hist[0]
            self.hist[0] = y.mean(0)       # the item replaced, not written in place
            return out
        self.hist["n"] = self.hist["n"] + 1
        return y * self.hist["n"]


@pytest.mark.parametrize("where", ["list", "dict"])
def test_item_replaced_in_a_container_is_refused_and_put_back(where):
    model = ReplacesItem(where).eval()
    before = list(model.hist) if where == "list" else dict(model.hist)
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert opt is model and len(messages) == 1 and "changes the module's state" in messages[0]
    after = list(model.hist) if where == "list" else dict(model.hist)
    assert all(a is b for a, b in zip(after, before)) if where == "list" else after == before
    with torch.no_grad():
        assert isinstance(model(torch.randn(4, 8)), torch.Tensor)   # no torch.fx Proxy left behind


def test_uncomparable_tensors_in_containers_do_not_refuse_the_model():
    class HoldsSparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.extras = [torch.eye(4).to_sparse(), torch.empty(3, device="meta")]

        def forward(self, x):
            return torch.relu(self.lin(x))

    model = HoldsSparse().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages


class Typed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:   # for type checkers only
        return super().__call__(x)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Alias(Typed):
    __call__ = nn.Module.__call__


@pytest.mark.parametrize("make", [Typed, Alias])
def test_a_call_that_only_forwards_is_optimized(make):
    model = make().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] >= 1


def test_snapshot_copies_a_shared_global_once():
    from fxfuse.snapshot import _Snapshot

    class ReadsGlobal(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) + COUNTER

    snapshot = _Snapshot(nn.Sequential(*[ReadsGlobal() for _ in range(6)]))
    assert sum(len(entry[6]) for entry in snapshot.modules) == 1


class Memo(nn.Module):
    """A cache filled once (rotary tables, masks): plain values added under new keys."""

    def __init__(self):
        super().__init__()
        self.lin, self.cache = nn.Linear(8, 8), {}

    def forward(self, x):
        if "ramp" not in self.cache:
            self.cache["ramp"] = torch.arange(8, dtype=torch.float32)
        return torch.relu(self.lin(x)) + self.cache["ramp"]


class Counts(nn.Module):
    """State in disguise: a list or dict that grows per call, read by the output."""

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(8, 8), kind
        self.seen = [] if kind == "list" else {}

    def forward(self, x):
        if self.kind == "list":
            self.seen.append(1)
        else:
            self.seen[len(self.seen)] = 1
        return self.lin(x) * len(self.seen)


def test_a_memo_cache_filled_at_trace_time_is_optimized_and_left_as_eager_filled_it():
    """Since stop 40 the memo keeps what verify's eager run on the example filled it with."""
    model = Memo().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and list(model.cache) == ["ramp"]
    assert type(model.cache["ramp"]) is torch.Tensor
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_growing_container_read_by_the_output_is_refused(kind):
    model = Counts(kind).eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert opt is model and len(messages) == 1 and len(model.seen) == 0


def test_mode_function_imported_by_name_is_watched_too():
    """`from torch import is_inference_mode_enabled` binds a name the tracing-time watch cannot
    replace: counted as read from forward()'s own names."""
    from torch import is_inference_mode_enabled

    class ImportedName(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if is_inference_mode_enabled() else y

    model = ImportedName().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        opt = fxfuse.optimize(model, x)
    for mode in (False, True):
        with _inference(mode), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(opt(x), model(x))


# --- third round (helper): decorated forwards, dataclass state, class-level memos, shape-keyed caches


@dataclasses.dataclass
class DecodeState:
    step: torch.Tensor


class DataclassState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.state = nn.Linear(8, 8), DecodeState(torch.zeros(()))

    def forward(self, x):
        self.state.step.add_(1)
        return self.lin(x) * self.state.step


STEP = torch.zeros(())


class DecoratedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @torch.no_grad()
    def forward(self, x):
        STEP.add_(1)                    # the bytecode scan must read the function under the decorator
        return self.lin(x) * STEP


@pytest.mark.parametrize("make,state", [(DataclassState, lambda m: m.state.step), (DecoratedForward, lambda m: STEP)])
def test_state_behind_a_dataclass_or_a_decorator_is_refused_and_restored(make, state):
    STEP.zero_()
    model = make().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert opt is model and len(messages) == 1 and "changes the module's state" in messages[0]
    assert state(model).item() == 0


class RotaryCache(nn.Module):
    """Keyed by the sequence length, built on the input's device: under tracing both are
    Proxies, and the trace adds an entry even when the cache is warm."""

    def __init__(self, dim=16):
        super().__init__()
        self.lin, self._cache = nn.Linear(dim, dim), {}
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x):
        t = x.shape[-2]
        if t not in self._cache:
            f = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), self.inv_freq)
            self._cache[t] = torch.cat((f, f), -1).cos()
        return self.lin(x) * self._cache[t]


class ClassMemo(nn.Module):
    _masks = {}                         # shared by every instance

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if "causal" not in self._masks:
            self._masks["causal"] = torch.ones(6, 6, device=x.device).tril()
        return (self.lin(x) @ x.transpose(-1, -2)) * self._masks["causal"]


@pytest.mark.parametrize("make,shape,warm", [(RotaryCache, (2, 8, 16), False), (RotaryCache, (2, 8, 16), True),
                                             (ClassMemo, (2, 6, 8), False)])
def test_caches_filled_by_the_trace_are_optimized_and_left_clean(make, shape, warm):
    ClassMemo._masks.clear()
    model = make().eval()
    x = torch.randn(*shape)
    if warm:
        with torch.no_grad():
            model(x)
    before = dict(model._cache if make is RotaryCache else ClassMemo._masks)
    opt, messages = optimize_warned(model, x)
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] >= 1
    after = model._cache if make is RotaryCache else ClassMemo._masks
    assert before.keys() <= after.keys() and all(type(v) is torch.Tensor for v in after.values())
    assert len(after) == 1   # the example's entry, filled by verify's eager run (stop 40) or before
    x2 = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(opt(x2), model(x2))
        assert isinstance(make().eval()(x2), torch.Tensor)   # no Proxy left on the class


def test_an_equal_value_assigned_to_a_config_entry_is_no_state_change():
    class Configured(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.cfg = nn.Linear(8, 8), {"scale": 0.25}

        def forward(self, x):
            self.cfg["scale"] = float("0.25")     # an equal float, another object
            return self.lin(x) * self.cfg["scale"]

    opt, messages = optimize_warned(Configured().eval(), torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] >= 1
