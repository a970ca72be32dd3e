"""A forward() whose result depends on grad or inference mode, however it asks.

Tracing watches torch.is_grad_enabled / torch.is_inference_mode_enabled by name; a helper
that imported the function, a function stored on the module, or `h.is_inference()` escaped
that watch, and the graph traced in one mode ran in the other: silently wrong. The build's
verification now also runs the model in the other modes (mode_watch.probe_mode_dependence).
"""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch import is_inference_mode_enabled as imported_inference_mode  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.runtime import OptimizedModule  # noqa: E402


def doubled_in_inference_mode(h):
    """A helper outside forward(): its name binding escapes the tracing-time watch."""
    return h * 2.0 if imported_inference_mode() else h


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.grad_on = torch.is_grad_enabled   # bound before tracing replaces torch's

    def hidden(self, x):
        return torch.relu(self.lin(x)) + 0.5


class HelperAsks(Block):
    def forward(self, x):
        return doubled_in_inference_mode(self.hidden(x))


class TensorAsks(Block):
    def forward(self, x):
        h = self.hidden(x)
        return h * 3.0 if h.is_inference() else h


class StoredFunctionAsks(Block):
    def forward(self, x):
        h = self.hidden(x)
        return h * 3.0 if self.grad_on() else h


class NeverAsks(Block):
    def forward(self, x):
        return self.hidden(x)


MODES = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}


def _calls(opt, model, x, modes):
    """Each call's (mode, warnings) after checking it against eager in that mode."""
    seen = []
    for mode in modes:
        with MODES[mode](), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, want = opt(x), model(x)
        torch.testing.assert_close(got.detach(), want.detach())
        seen.append((mode, [str(w.message) for w in caught]))
    return seen


@pytest.mark.parametrize("make", [HelperAsks, TensorAsks, StoredFunctionAsks])
@pytest.mark.parametrize("built_in", ["inference", "no_grad"])
def test_a_mode_read_the_watch_misses_runs_the_original_in_the_other_mode(make, built_in):
    model = make().eval().requires_grad_(False)   # frozen: grad-mode calls may use the graph
    x = torch.randn(5, 8)
    with MODES[built_in]():
        opt = fxfuse.optimize(model, x)
    assert isinstance(opt, OptimizedModule)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    _calls(opt, model, x, ["inference", "no_grad", "grad", built_in])
    assert sum(opt._original_calls.values()) >= 1   # some mode ran the original


def test_a_model_that_never_asks_uses_the_graph_in_every_mode():
    model = NeverAsks().eval().requires_grad_(False)
    x = torch.randn(5, 8)
    with torch.no_grad():
        opt = fxfuse.optimize(model, x)
    trace = next(iter(opt._specializations.values())).gm.meta["fxfuse_trace"]
    assert not trace["reads_grad_mode"] and trace["reads_inference_mode"] is None
    seen = _calls(opt, model, x, ["inference", "no_grad", "grad"])
    assert all(not caught for _, caught in seen)
    assert not opt._original_calls


def test_the_warning_names_the_mode_dependence():
    model = HelperAsks().eval().requires_grad_(False)
    x = torch.randn(5, 8)
    with torch.inference_mode():
        opt = fxfuse.optimize(model, x)
    seen = dict(_calls(opt, model, x, ["no_grad"]))
    assert any("depends on inference mode" in m for m in seen["no_grad"])


class GradAndNotInference(Block):
    def forward(self, x):
        h = self.hidden(x)
        return h * 3.0 if torch.is_grad_enabled() and not imported_inference_mode() else h


def test_the_default_mode_is_probed_after_an_inference_mode_build():
    """Built under inference_mode, the probe runs (grad on, inference off) too: the mode a plain
    call without any context has."""
    model = GradAndNotInference().eval().requires_grad_(False)
    x = torch.randn(5, 8)
    with torch.inference_mode():
        opt = fxfuse.optimize(model, x)
    _calls(opt, model, x, ["grad", "no_grad", "inference"])
    assert sum(opt._original_calls.values()) >= 1


def test_a_model_made_under_inference_mode_serves_no_grad_calls():
    """fuzz28: a model constructed inside inference_mode, optimized there and called under
    no_grad ran the original with a false "depends on inference mode" warning: the probe that
    flips grad and inference together fails (inference parameters cannot be saved for
    backward) and was booked as an inference-mode dependence."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(17, 33), nn.ReLU(), nn.Linear(33, 7)).eval()
        opt = fxfuse.optimize(model, torch.randn(5, 17), strict=True)
    x = torch.randn(5, 17)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        launches = fxfuse.stats(opt)["kernel_launches"]
        torch.testing.assert_close(opt(x), model(x))
        assert fxfuse.stats(opt)["kernel_launches"] > launches and sum(opt._original_calls.values()) == 0


class NoGradForward(nn.Module):
    """An inference wrapper: forward() turns autograd off itself, in whole or in part."""
    def __init__(self, how):
        super().__init__()
        self.how, self.l1, self.l2 = how, nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        if self.how == "part":   # the second layer records autograd
            with torch.no_grad():
                h = torch.nn.functional.silu(self.l1(x))
            return self.l2(h)
        with torch.no_grad() if self.how == "no_grad" else torch.inference_mode():
            return self.l2(torch.nn.functional.silu(self.l1(x)))


class DecoratedForward(NoGradForward):
    def __init__(self):
        super().__init__("decorated")

    @torch.no_grad()
    def forward(self, x):
        return self.l2(torch.nn.functional.silu(self.l1(x)))


@pytest.mark.parametrize("make", [DecoratedForward, lambda: NoGradForward("no_grad"),
                                  lambda: NoGradForward("inference_mode")])
def test_a_forward_that_turns_grad_off_itself_uses_the_graph_in_grad_mode(make):
    """fuzz29: `@torch.no_grad() def forward` called plainly (grad on, parameters requiring
    grad) ran the original on every call, with a warning to call under no_grad. The build's
    grad-mode probe sees that forward() records nothing, so such calls run the graph."""
    model = make().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 8))
        for batch in (4, 3):
            x = torch.randn(batch, 8)
            got, want = opt(x), model(x)
            torch.testing.assert_close(got, want)
            assert not got.requires_grad and not want.requires_grad
    assert not opt._original_calls and fxfuse.stats(opt)["fused_kernels"] >= 1


def test_a_forward_that_records_autograd_in_part_still_runs_the_original():
    model = NoGradForward("part").eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with pytest.warns(fxfuse.FxfuseWarning, match="would record autograd"):
        got = opt(x)
    assert got.requires_grad and opt._original_calls["grad"] == 1
    torch.testing.assert_close(got, model(x))


def test_a_parameter_unfrozen_after_the_build_records_again():
    """fuzz29c: forward() turns grad off for its body only, and the head was frozen at the build,
    so the probe saw nothing requiring grad; after the head is unfrozen eager records autograd."""
    model = NoGradForward("part").eval()
    model.l2.requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not opt(x).requires_grad
    model.l2.requires_grad_(True)
    with pytest.warns(fxfuse.FxfuseWarning, match="would record autograd"):
        got = opt(x)
    assert got.requires_grad
    got.sum().backward()
    assert model.l2.weight.grad is not None


def test_an_attribute_that_turns_grad_on_rebuilds_and_records():
    """fuzz29c: `with torch.set_grad_enabled(self.finetune)` with finetune False at the build;
    set True afterwards, the first grad-mode call (which rebuilds) must record as eager does."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.finetune = nn.Linear(8, 8), False

        def forward(self, x):
            with torch.set_grad_enabled(self.finetune):
                return torch.relu(self.lin(x))

    model = M().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    assert not opt(x).requires_grad and not opt._original_calls
    model.finetune = True
    with pytest.warns(fxfuse.FxfuseWarning, match="would record autograd"):
        assert opt(x).requires_grad


def test_a_forward_that_turns_grad_on_itself_runs_the_original_under_no_grad():
    """fuzz29c: `with torch.enable_grad():` around a head records autograd even under no_grad;
    the graph (run under no_grad) returned outputs without grad. An input passed through is no
    such case: it requires grad because the input does."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x, through=False):
            h = torch.relu(self.body(x))
            with torch.enable_grad():
                return (self.head(h), x) if through else self.head(h)

    model = M().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="would record autograd"):
        got = opt(x)
    assert got.requires_grad and opt._original_calls["grad"] == 1

    class Through(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x)), x

    model = Through().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 8))
        with torch.no_grad():
            y, x_out = opt(torch.randn(4, 8, requires_grad=True))
    assert not y.requires_grad and x_out.requires_grad and not opt._original_calls


def test_tensors_of_the_model_that_require_grad_are_seen():
    """fuzz29c: a plain tensor attribute requiring grad (parameters frozen), and a buffer made
    to require grad after the build behind a no_grad body: eager records, so the original runs.
    A model frozen after the build uses the graph in grad mode."""
    class Temperature(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8).requires_grad_(False)
            self.temp = torch.ones(8, requires_grad=True)

        def forward(self, x):
            return torch.relu(self.lin(x)) * self.temp

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x):
            with torch.no_grad():
                h = torch.relu(self.lin(x))
            return h * self.scale

    x = torch.randn(4, 8)
    model = Temperature().eval()
    opt = fxfuse.optimize(model, x)
    with pytest.warns(fxfuse.FxfuseWarning, match="would record autograd"):
        assert opt(x).requires_grad
    model = Scaled().eval()
    opt = fxfuse.optimize(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = opt(x)
    assert not y.requires_grad and not opt._original_calls
    model.scale.requires_grad_(True)
    with pytest.warns(fxfuse.FxfuseWarning, match="would record autograd"):
        assert opt(x).requires_grad
    plain = fxfuse.optimize(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), x)
    plain.original.requires_grad_(False)   # frozen after the build: grad-mode calls record nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not plain(x).requires_grad and not plain._original_calls


def test_a_parameter_returned_under_no_grad_is_no_recording():
    """fuzz29c: a parameter (or a view of one made under no_grad) returned by forward() requires
    grad without autograd computing it: no_grad calls still use the graph."""
    class Query(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.lin = nn.Parameter(torch.randn(1, 8)), nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x)), self.query.expand(x.shape[0], 8)

    model = Query().eval()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, x)
        with torch.no_grad():
            y, q = opt(x)
    assert not opt._original_calls and fxfuse.stats(opt)["fused_kernels"] >= 1


def test_a_grad_mode_call_that_builds_looks_at_the_new_build():
    """fuzz29c: forward() records autograd only for some values of a non-tensor argument. Built
    with detach=True, grad-mode calls run the graph; a call with detach=False is a new
    signature, and its build's probe says it records: that call must run the original too."""
    class Detaching(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, detach: bool = True):
            y = torch.relu(self.lin(x))
            return y.detach() if detach else y

    model = Detaching().eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, (x, True))
    assert not opt(x, True).requires_grad and not opt._original_calls
    with pytest.warns(fxfuse.FxfuseWarning, match="would record autograd"):
        got = opt(x, False)
    assert got.requires_grad and opt._original_calls["grad"] == 1
