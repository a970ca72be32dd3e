"""Stop 50: helper findings (fuzz50d, fuzz50g, fuzz50i, fuzz50l and their reviews) in what a trace reads and
freezes: class attributes, dtype identity tests, held iterators, counters, value-sized ops, messages (each test
fails on the code before its fix)."""
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse

from conftest import optimize_strict


class Block(nn.Module):
    scale = 1.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale


class SubBlock(Block):
    pass


class Blocks(nn.Module):
    def __init__(self, *classes):
        super().__init__()
        self.blocks = nn.ModuleList([c() for c in classes])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_class_attribute_shadowed_on_any_instance_rebuilds(k):
    """fuzz50d: only the first module of a class was watched for an instance value shadowing the class's."""
    model, x = Blocks(Block, Block, Block).eval(), torch.randn(3, 8)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        opt(x)
        model.blocks[k].scale = 3.0
        torch.testing.assert_close(opt(x), model(x))


def test_a_subclass_shadowing_its_base_after_a_base_module_rebuilds():
    model, x = Blocks(Block, SubBlock).eval(), torch.randn(3, 8)
    opt = optimize_strict(model, x)
    try:
        with torch.no_grad():
            opt(x)
            SubBlock.scale = 3.0
            torch.testing.assert_close(opt(x), model(x))
    finally:
        del SubBlock.scale


class ScaledChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lin.scale = 2.0

    def forward(self, x):
        return torch.relu(self.lin(x)) * getattr(self.lin, "scale")


def test_attributes_of_torch_layers_are_watched_where_the_code_reads_by_computed_names():
    """fuzz50d: with getattr in forward() every attribute was to be watched, but a Linear's or a ReLU's were not."""
    model, x = ScaledChild().eval(), torch.randn(3, 8)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        opt(x)
        model.lin.scale = 5.0
        torch.testing.assert_close(opt(x), model(x))


class UpcastHalf(nn.Module):
    def forward(self, x):
        if x.dtype is torch.float16:
            x = x.float()
        return torch.sigmoid(x * 3.0) * 2


@pytest.mark.parametrize("verify", [False, True])
def test_a_dtype_tested_by_identity_takes_eagers_branch(verify):
    """fuzz50d: `x.dtype is torch.float16` is False for a Proxy: the graph returned fp16 where eager gives
    fp32 (verify=False), or the model was refused (verify=True). Traced by torch.export now."""
    model, x = UpcastHalf().eval(), torch.randn(3, 8).half()
    opt = fxfuse.optimize(model, x, verify=verify, strict=True)
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)


class Scheduled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = itertools.cycle([1.0, 0.5, 0.25])

    def forward(self, x):
        return torch.relu(x) * next(self.scale)


def test_an_iterator_forward_takes_from_is_refused():
    """fuzz50d: with verify=False the first value was frozen into the graph. (The trace takes one value.)"""
    model, x = Scheduled().eval(), torch.randn(3, 8)
    with pytest.warns(fxfuse.FxfuseWarning, match="iterator"):
        opt = fxfuse.optimize(model, x, verify=False)
    assert not fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        assert sorted(opt(torch.ones(1))[0].item() for _ in range(3)) == [0.25, 0.5, 1.0]


class ClassCounter(nn.Module):
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return x * type(self).calls


def _make_step():
    c = 0

    def step():
        nonlocal c
        c += 1
        return c
    return step


class ClosureCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.step = _make_step()

    def forward(self, x):
        return x * self.step()


@pytest.mark.parametrize("model_class", [ClassCounter, ClosureCounter])
@pytest.mark.parametrize("verify", [False, True])
def test_a_count_kept_on_the_class_or_in_a_closure_is_state(model_class, verify):
    """fuzz50d: `type(self).calls += 1` and a closure's `nonlocal c` moved during the trace, and the graph
    held the trace's count (verify=False), or verify refused the model as random."""
    ClassCounter.calls = 0
    model, x = model_class().eval(), torch.ones(2, 4)
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's state"):
        opt = fxfuse.optimize(model, x, verify=verify)
    assert not fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        assert [opt(x)[0, 0].item() for _ in range(3)] == [1.0, 2.0, 3.0]   # optimize left the count as it was


def test_the_grad_probe_shows_no_warning_eager_does_not():
    """fuzz50g: the grad probe's inputs require grad, so `math.sqrt(t)` of a 0-d input warned "Converting a
    tensor with requires_grad=True to a scalar" from optimize, which eager never does."""
    import math

    class Sqrt(nn.Module):
        def forward(self, x, t):
            return x.relu() * math.sqrt(t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxfuse.optimize(Sqrt().eval(), (torch.randn(3, 4), torch.tensor(4.0)))


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.tau = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return torch.softmax(x / float(self.tau), -1)


def test_float_of_a_parameter_names_item_as_the_way():
    """fuzz50d / fuzz50g: the refusal told the user to remove `.item()`, the spelling that works."""
    with pytest.warns(fxfuse.FxfuseWarning, match=r"write `t.item\(\)`"):
        fxfuse.optimize(Tempered().eval(), torch.randn(3, 8))


class LocalDtype(nn.Module):
    def forward(self, x):
        dt = getattr(x, "dtype")
        h = (x * 2 + 1).relu()
        if dt is torch.float16:
            h = h.float()
        return h


def test_a_dtype_tested_by_identity_through_a_local_takes_eagers_branch():
    """review50r2: the first scan looked for the dtype read just before the `is`."""
    model, x = LocalDtype().eval(), torch.randn(3, 8).half()
    opt = fxfuse.optimize(model, x, verify=False, strict=True)
    with torch.no_grad():
        assert opt(x).dtype == model(x).dtype == torch.float32


class NestedIterators(nn.Module):
    def __init__(self, where):
        super().__init__()
        it = itertools.count(1)
        self.where = where
        if where == "dict":
            self.cfg = {"step": it}
        elif where == "namespace":
            import types
            self.state = types.SimpleNamespace(it=it)
        else:
            self.step = lambda: next(it)

    def forward(self, x):
        if self.where == "dict":
            return x * next(self.cfg["step"])
        if self.where == "namespace":
            return x * next(self.state.it)
        return x * self.step()


@pytest.mark.parametrize("where", ["dict", "namespace", "closure"])
def test_an_iterator_held_one_level_down_is_refused(where):
    model = NestedIterators(where).eval()
    with pytest.warns(fxfuse.FxfuseWarning, match="iterator"):
        opt = fxfuse.optimize(model, torch.ones(2), verify=False)
    assert not fxfuse.stats(opt)["optimized"]


class HoldsUnreadIterators(nn.Module):
    _ids = itertools.count()

    def __init__(self):
        super().__init__()
        import io
        self.id = next(HoldsUnreadIterators._ids)
        self.loader = iter([1, 2, 3])
        self.log = io.StringIO()

    def forward(self, x):
        self.log.write("called\n")
        return x.relu() * 2


def test_iterators_forward_does_not_read_and_logs_are_no_refusal():
    """review50r2: an id counter used in __init__, an unread iterator and a StringIO log were refused."""
    model, x = HoldsUnreadIterators().eval(), torch.randn(3, 4)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class CounterKinds(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        import functools
        self.fns = {"s": _make_step()}
        self.partial = functools.partial(_make_step())
        self.cfg = _Cfg()

    def forward(self, x):
        if self.kind == "dict":
            return x * self.fns["s"]()
        if self.kind == "partial":
            return x * self.partial()
        type(self.cfg).calls += 1
        return x * type(self.cfg).calls


class _Cfg:
    calls = 0


@pytest.mark.parametrize("kind", ["dict", "partial", "held_class"])
def test_counters_in_held_closures_and_classes_are_state(kind):
    """review50r2: a closure in a dict, a functools.partial and `type(self.cfg).calls += 1` were frozen."""
    _Cfg.calls = 0
    model, x = CounterKinds(kind).eval(), torch.ones(2)
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's state"):
        opt = fxfuse.optimize(model, x, verify=False)
    assert not fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        assert [opt(x)[0].item() for _ in range(3)] == [1.0, 2.0, 3.0]


class DeadProxies(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


def test_dead_weak_proxies_on_the_module_and_its_class_are_no_internal_error():
    import gc
    import weakref

    class Owner:
        pass
    owner = Owner()
    model = DeadProxies().eval()
    model.owner = weakref.proxy(owner)
    DeadProxies.peer = weakref.proxy(owner)
    try:
        del owner
        gc.collect()
        opt = optimize_strict(model, torch.randn(3, 4))
        assert fxfuse.stats(opt)["fused_kernels"] >= 1
    finally:
        del DeadProxies.peer


class FloatBranch(nn.Module):
    def forward(self, x):
        if float(x.sum()) > 0:
            return x.relu()
        return x


def test_float_in_a_branch_gets_the_branch_advice():
    """review50r2: `if float(x.sum()) > 0:` was told to write `t.item()`, which is refused again."""
    with pytest.warns(fxfuse.FxfuseWarning) as record:
        fxfuse.optimize(FloatBranch().eval(), torch.randn(3, 4))
    assert "torch.where" in str(record[0].message) and "write `t.item()`" not in str(record[0].message)


class LazyFast(nn.Module):
    def __init__(self):
        super().__init__()
        self.core, self.fast = nn.Linear(8, 8), None

    def forward(self, x):
        if self.fast is None:
            self.fast = fxfuse.optimize(self.core, x)
        return self.fast(x) + 1


def test_optimize_inside_a_traced_forward_says_so():
    """fuzz50i: the refusal said "example_input must be a tensor ... got Proxy" about the user's tensor example."""
    model = LazyFast().eval()
    with pytest.warns(fxfuse.FxfuseWarning, match="called inside a forward"):
        opt = fxfuse.optimize(model, torch.randn(4, 8))
    assert model.fast is None and not fxfuse.stats(opt)["optimized"]


class HalfPath(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.half_scale = nn.Linear(8, 8), 2.0

    def half_path(self, h):
        return (h.float() * self.half_scale).relu()

    def forward(self, x):
        h = self.lin(x)
        if x.dtype is torch.float16:
            return self.half_path(h)
        return h.relu()


def test_attributes_read_only_in_the_export_retrys_branch_are_watched():
    """review50r4: the retry ran after the attribute recording: `half_scale`, read only in export's branch,
    was not watched, and assigning it kept the old graph."""
    model, x = HalfPath().eval().half(), torch.randn(2, 8).half()
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        opt(x)
        model.half_scale = 5.0
        torch.testing.assert_close(opt(x), model(x), atol=2e-3, rtol=2e-3)


def _is_half(dtype):
    return dtype is torch.float16


class HelperTest(nn.Module):
    def forward(self, x):
        h = (x * 2).relu()
        return h.float() if _is_half(x.dtype) else h


def test_a_dtype_identity_test_in_a_helper_takes_eagers_branch():
    model, x = HelperTest().eval(), torch.randn(3, 4).half()
    opt = fxfuse.optimize(model, x, verify=False, strict=True)
    with torch.no_grad():
        assert opt(x).dtype == model(x).dtype == torch.float32


class BoundNext(nn.Module):
    def __init__(self):
        super().__init__()
        self.step = itertools.cycle([1.0, 2.0, 3.0]).__next__

    def forward(self, x):
        return x * self.step()


class TrainOnlySchedule(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop_schedule = itertools.cycle([0.1, 0.2])

    def forward(self, x):
        if self.training:
            return F.dropout(x, next(self.drop_schedule))
        return x.relu() * 2


def test_a_bound_next_is_refused_and_a_schedule_eval_never_advances_is_not():
    """review50r4: `it.__next__` held was not looked into; a schedule read only in training was refused."""
    with pytest.warns(fxfuse.FxfuseWarning, match="iterator"):
        opt = fxfuse.optimize(BoundNext().eval(), torch.ones(2), verify=False)
    assert not fxfuse.stats(opt)["optimized"]
    model, x = TrainOnlySchedule().eval(), torch.randn(3, 4)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def _warn_once(fn):
    warned = False

    def wrapper(*args):
        nonlocal warned
        if not warned:
            warnings.warn("deprecated helper", DeprecationWarning)
            warned = True
        return fn(*args)
    return wrapper


class WarnsOnce(nn.Module):
    @staticmethod
    @_warn_once
    def act(h):
        return h.relu()

    def forward(self, x):
        return self.act(x) * 2


def test_a_warn_once_flag_in_a_closure_is_no_state():
    """review50r4: the decorator's `warned` moved once in the build's first run, as it does in eager."""
    model, x = WarnsOnce().eval(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = optimize_strict(model, x)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def _warmed_generator():
    for v in itertools.count(1):
        yield float(v)


class HeldGenerator(nn.Module):
    def __init__(self, kind):
        super().__init__()
        if kind == "generator":
            self.schedule = _warmed_generator()
            next(self.schedule)   # already at its yield, as after an eager warm-up call
        else:
            values = iter([1.0, 2.0, 3.0, 4.0, 5.0])
            self.schedule = iter(lambda: next(values), None)

    def forward(self, x):
        return x * next(self.schedule)


@pytest.mark.parametrize("kind", ["generator", "callable"])
def test_iterators_whose_position_cannot_be_told_are_refused_by_name(kind):
    """review50r5: a started generator sits at the same yield after each next(), and iter(callable, sentinel)
    reduces the same: both were taken for unmoved and frozen into the graph."""
    with pytest.warns(fxfuse.FxfuseWarning, match="iterator"):
        opt = fxfuse.optimize(HeldGenerator(kind).eval(), torch.ones(2), verify=False)
    assert not fxfuse.stats(opt)["optimized"]
