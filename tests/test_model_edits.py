"""A model edited after optimize(): what the next call must see (fuzzing round 7 and review).

Each of these kept computing with the old model: an attribute forward() reads assigned (on
the instance or the class), a parameter, buffer or submodule replaced, deleted or inserted, a
weight the graph holds a copy of changed in place (an EMA update), torch's default dtype or
TF32 setting changed. Bookkeeping forward() never reads must not rebuild anything.
"""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402
from conftest import optimize_warned  # noqa: E402
from fxfuse.runtime import OptimizedModule  # noqa: E402


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale, self.k = torch.tensor(2.0), 3.0
        self.register_buffer("shift", torch.ones(8))

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale * self.k + self.shift


EDITS = {
    "tensor attribute replaced": lambda m: setattr(m, "scale", torch.tensor(5.0)),
    "tensor attribute in place": lambda m: m.scale.fill_(9.0),
    "number attribute": lambda m: setattr(m, "k", 7.0),
    "buffer replaced": lambda m: setattr(m, "shift", torch.randn(8)),
    "submodule replaced": lambda m: setattr(m, "lin", nn.Linear(8, 8)),
    "parameter replaced": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.randn(8, 8))),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_editing_the_model_after_optimize_rebuilds(edit):
    """Each of these was baked into the graph and silently ignored by later calls."""
    model = Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        opt(x)
        built = next(iter(opt._specializations.values()))
        EDITS[edit](model)
        torch.testing.assert_close(opt(x), model(x))
    assert next(iter(opt._specializations.values())) is not built and fxfuse.stats(opt)["fused_kernels"] >= 1
    assert not opt._original_calls


def test_modules_built_elsewhere_do_not_rebuild():
    """Any module's construction moves the registration counter; only this model's own
    parameters, buffers and children count."""
    model = Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        built = next(iter(opt._specializations.values()))
        other = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        other.extra = nn.Linear(2, 2)
        torch.testing.assert_close(opt(x), model(x))
        model.k = 3.0            # an equal value: nothing to rebuild
        torch.testing.assert_close(opt(x), model(x))
    assert next(iter(opt._specializations.values())) is built


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU()).eval()


@pytest.mark.parametrize("plan", [{"fused_mlp": "force"}, {"gemm": "force"}, {"strassen": "force"}])
def test_an_in_place_weight_edit_reaches_the_copies(plan):
    """An EMA-style update (`p.mul_(0.9).add_(...)` under no_grad, no optimizer) left the packed
    MLP weights, the GEMM's packed bias and Strassen's operands stale: those copies' sources
    are watched now (api.tensors_read)."""
    model = _chain()
    x = torch.randn(40, 16)
    opt = fxfuse.optimize(model, x, strict=True, **plan)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        opt(x)
        for step in range(2):
            for p in model.parameters():
                p.mul_(0.9).add_(0.01 * (step + 1))
            torch.testing.assert_close(opt(x), model(x))
        model[2].bias.add_(1.0)           # one tensor alone
        torch.testing.assert_close(opt(x), model(x))


def test_weights_read_live_are_not_watched():
    """The library GEMMs read the live weights: nothing to rebuild after an in-place edit."""
    model = _chain()
    x = torch.randn(40, 16)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        built = next(iter(opt._specializations.values()))
        assert not built.gm.meta["fxfuse_copied"]
        model[0].weight.mul_(2.0)
        torch.testing.assert_close(opt(x), model(x))
    assert next(iter(opt._specializations.values())) is built



class PromotesWithTheDefault(nn.Module):
    def forward(self, n):
        return n * 0.1 + torch.ones(3)


def test_a_new_default_dtype_rebuilds():
    model = PromotesWithTheDefault().eval()
    n = torch.arange(6).reshape(2, 3)
    opt = fxfuse.optimize(model, n, strict=True)
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        got, want = opt(n), model(n)
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want)
    finally:
        torch.set_default_dtype(before)
    assert opt(n).dtype == torch.float32


def test_a_changed_tf32_setting_rebuilds():
    """A graph built with TF32 allowed keeps its kernels' precision; turning TF32 off must not
    leave the user with TF32 results."""
    model = _chain()
    x = torch.randn(8, 16)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        opt = fxfuse.optimize(model, x, strict=True, gemm="force")
        built = next(iter(opt._specializations.values()))
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
        assert next(iter(opt._specializations.values())) is not built
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved



class Bookkeeping(nn.Module):
    """forward() reads `scale` through a helper and `shift` through a property; `calls` and
    `last_loss` are the user's bookkeeping, never read by forward()."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale, self._shift, self.calls, self.last_loss = 2.0, 0.5, 0, None

    @property
    def shift(self):
        return self._shift

    def scaled(self, h):
        return h * self.scale

    def forward(self, x):
        return self.scaled(torch.relu(self.lin(x))) + self.shift


def test_attributes_forward_never_reads_do_not_rebuild():
    """Watching every attribute rebuilt on each call of a loop that writes `model.calls = i`
    (about a build per call); the trace now records what forward() reads."""
    model = Bookkeeping().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    built = next(iter(opt._specializations.values()))
    x = torch.randn(4, 8)
    with torch.no_grad():
        for i in range(4):
            model.calls, model.last_loss, model.new_attribute = i, torch.tensor(float(i)), i
            torch.testing.assert_close(opt(x), model(x))
        assert next(iter(opt._specializations.values())) is built
        for name, value in (("scale", 3.0), ("_shift", -1.0)):   # read through a helper and a property
            setattr(model, name, value)
            torch.testing.assert_close(opt(x), model(x))
            assert next(iter(opt._specializations.values())) is not built
            built = next(iter(opt._specializations.values()))


class ReadsItsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.k = nn.Linear(8, 8), 2.0

    def forward(self, x):
        return self.lin(x) * vars(self)["k"]


def test_a_forward_reading_its_dict_watches_every_attribute():
    model = ReadsItsDict().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        model.k = 5.0
        torch.testing.assert_close(opt(x), model(x))



def test_a_change_per_epoch_does_not_warn():
    """Training then evaluating rebuilds once per epoch; only changes between nearly every
    call earn the 'keep changing' warning."""
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(8, 6), strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            model.train()
            model(torch.randn(8, 6))         # moves the BatchNorm statistics
            model.eval()
            with torch.no_grad():
                for _ in range(10):
                    x = torch.randn(8, 6)
                    torch.testing.assert_close(opt(x), model(x))
    assert not [w for w in caught if "keep changing" in str(w.message)]


class TiedLinear(nn.Module):
    """One weight read by a fused-MLP layer (a packed copy) and by a plain matmul (live)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.lin(x)) @ self.lin.weight


def test_a_tied_weight_read_live_elsewhere_still_reaches_its_copy():
    model = TiedLinear().eval()
    x = torch.randn(5, 16)
    opt = fxfuse.optimize(model, x, strict=True, fused_mlp="force")
    with torch.no_grad():
        opt(x)
        model.lin.weight.mul_(2.0)
        torch.testing.assert_close(opt(x), model(x))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))


class ChecksItsChildType(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.lin = Gate(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * self.gate(x) if type(self.gate) is Gate else h


@pytest.mark.parametrize("verify", [True, False])
def test_type_checks_in_forward_see_the_real_class(verify):
    """An attribute recording that ran the trace on subclasses made `type(self.gate) is Gate`
    take the other branch (a false refusal with verify, a wrong answer without); the names
    are now collected without touching the model."""
    model = ChecksItsChildType().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8), verify=verify)
    assert isinstance(opt, OptimizedModule) and not messages
    assert type(model.gate) is Gate
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_an_inner_optimized_module_building_new_shapes_does_not_rebuild_the_outer():
    inner = fxfuse.optimize(_chain(), torch.randn(4, 16), strict=True)
    outer_model = nn.Sequential(inner, nn.Linear(16, 16), nn.ReLU()).eval()
    outer = fxfuse.optimize(outer_model, torch.randn(4, 16), strict=True)
    built = next(iter(outer._specializations.values()))
    with torch.no_grad():
        for rows in (3, 5, 7):
            inner(torch.randn(rows, 16))        # the inner one builds and counts on its own
            x = torch.randn(4, 16)
            torch.testing.assert_close(outer(x), outer_model(x))
    assert next(iter(outer._specializations.values())) is built



@pytest.mark.parametrize("edit", ["del", "pop", "insert", "del attribute"])
def test_removing_or_inserting_a_submodule_rebuilds(edit):
    """torch fires no registration hook for these: the runtime counts each module's children."""
    class WithHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            self.head = nn.Linear(8, 8)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x) if hasattr(self, "head") else x

    model = WithHead().eval()
    spare = nn.Linear(8, 8)   # built before optimize: no registration later
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        opt(x)
        {"del": lambda: model.layers.__delitem__(0), "pop": lambda: model.layers.pop(1),
         "insert": lambda: model.layers.insert(0, spare), "del attribute": lambda: delattr(model, "head")}[edit]()
        torch.testing.assert_close(opt(x), model(x))


class Registered(nn.Module):
    REGISTRY: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        Registered.REGISTRY[cls.__name__] = cls


class Net(Registered):
    temperature = 1.0   # a class default

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) / self.temperature + getattr(self, "bias_shift", 0.0)


def test_the_recording_leaves_the_model_and_its_classes_alone():
    """Names are collected by a profile hook: no subclass reaches a registry, and class-level
    attributes the model reads are watched on the class and on the instance."""
    model = Net().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    assert Registered.REGISTRY == {"Net": Net} and type(model) is Net and Net.__subclasses__() == []
    x = torch.randn(4, 8)
    with torch.no_grad():
        for edit in (lambda: setattr(Net, "temperature", 0.5), lambda: setattr(model, "temperature", 0.25)):
            edit()
            torch.testing.assert_close(opt(x), model(x))
    Net.temperature = 1.0


def test_a_cached_property_filled_by_the_trace_is_a_memo():
    """functools.cached_property stores its value in the instance dict on first use: the trace
    filled it, and the model was refused as writing state."""
    import functools

    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @functools.cached_property
        def table(self):
            return torch.linspace(0.5, 1.5, 8)

        def forward(self, x):
            return torch.relu(self.lin(x)) * self.table

    model = WithTable().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and "table" not in model.__dict__
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        torch.testing.assert_close(opt(x), model(x))   # eager cached it meanwhile: one rebuild, same answer


class MyLeaky(nn.LeakyReLU):
    """A user subclass that keeps torch's forward: torch's code reads negative_slope."""


class NamesInATuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.a, self.b = nn.Linear(8, 8), 1.0, 2.0

    def forward(self, x):
        h = self.lin(x)
        for name in ("a", "b"):
            h = h * getattr(self, name)
        return h


@pytest.mark.parametrize("make,edit", [
    (lambda: nn.Sequential(nn.Linear(8, 8), MyLeaky(0.1)), lambda m: setattr(m[1], "negative_slope", 0.5)),
    (NamesInATuple, lambda m: setattr(m, "b", 5.0)),
], ids=["torch-forward-subclass", "names-in-a-tuple"])
def test_attributes_read_where_no_name_shows_are_still_watched(make, edit):
    model = make().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        opt(x)
        edit(model)
        torch.testing.assert_close(opt(x), model(x))


def test_a_profiler_around_optimize_keeps_the_recording_precise():
    import cProfile
    model = Bookkeeping().eval()
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    finally:
        profiler.disable()
    built = next(iter(opt._specializations.values()))
    x = torch.randn(4, 8)
    with torch.no_grad():
        for i in range(3):
            model.calls = i
            torch.testing.assert_close(opt(x), model(x))
    assert next(iter(opt._specializations.values())) is built


def test_a_cached_property_that_draws_anew_is_not_a_memo():
    import functools

    class RandomProjection(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @functools.cached_property
        def proj(self):
            return torch.randn(8, 8)

        def forward(self, x):
            return self.lin(x) @ self.proj

    model = RandomProjection().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with torch.no_grad():
        first, again = opt(x), opt(x)
        torch.testing.assert_close(first, again)
        torch.testing.assert_close(first, model(x))


def test_model_code_compiled_from_a_string_is_watched():
    """A script run with exec (or `python -`, `python -c`): its code's file is '<string>'."""
    namespace = {"nn": nn, "torch": torch}
    exec(
        "def scaled(m, h):\n"
        "    return h * m.scale\n"
        "class FromString(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin, self.scale = nn.Linear(8, 8), 2.0\n"
        "    def forward(self, x):\n"
        "        return scaled(self, torch.relu(self.lin(x)))\n", namespace)
    model = namespace["FromString"]().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        opt(x)
        model.scale = 3.0
        torch.testing.assert_close(opt(x), model(x))

