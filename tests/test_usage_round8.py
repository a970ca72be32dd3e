"""Findings of the eighth fuzzing round (workflows around an optimized module, CPU), each kept
fixed here.

- Forward-mode AD: a dual input lost its tangent (a plain output, no warning).
- torch.func.vmap / jvp / jacfwd over opt: the guards passed (a BatchedTensor reports the
  per-sample shape) and the kernels failed inside Triton on the wrapped tensor.
- torch.compile of opt, or of a model holding opt: Dynamo traced into the runtime and failed
  inside Triton's launcher (now it traces the original module, as torch.export does).
- `opt.original = other` kept running the graphs of the old model.
- TRITON_INTERPRET=false counted as on; a nested list as example input, and a module of
  torch.export, got errors that did not say what to do.
"""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.autograd.forward_ad as fwAD  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.errors import UnsupportedError  # noqa: E402
from fxfuse.env import env_flag  # noqa: E402


def mlp():
    return nn.Sequential(nn.Linear(13, 33), nn.ReLU(), nn.Linear(33, 13), nn.GELU()).eval()


def optimized(model, x):
    opt = fxfuse.optimize(model, x)
    assert isinstance(opt, fxfuse.OptimizedModule) and fxfuse.stats(opt)["fused_kernels"] >= 1
    return opt


def recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, fxfuse.FxfuseWarning)]


def test_a_dual_input_keeps_its_tangent():
    model, x, t = mlp().requires_grad_(False), torch.randn(5, 13), torch.randn(5, 13)
    opt = optimized(model, x)
    with fwAD.dual_level():
        expected = fwAD.unpack_dual(model(fwAD.make_dual(x, t)))
        got, messages = recorded(lambda: fwAD.unpack_dual(opt(fwAD.make_dual(x, t))))
    assert got.tangent is not None and torch.allclose(got.tangent, expected.tangent)
    assert torch.allclose(got.primal, expected.primal)
    assert len(messages) == 1 and "forward-mode AD" in messages[0]
    with torch.no_grad():     # outside the dual level the graphs run again
        assert torch.allclose(opt(x), model(x), atol=1e-6) and opt._original_calls["transform"] == 1


@pytest.mark.parametrize("transform", ["vmap", "jvp", "jacfwd"])
def test_torch_func_transforms_run_the_original(transform):
    model, x = mlp().requires_grad_(False), torch.randn(5, 13)
    opt = optimized(model, x)
    xs, t = torch.randn(3, 5, 13), torch.randn(5, 13)
    run = {"vmap": lambda f: torch.func.vmap(f)(xs),
           "jvp": lambda f: torch.func.jvp(f, (x,), (t,))[1],
           "jacfwd": lambda f: torch.func.jacfwd(f)(x)}[transform]
    with torch.no_grad():
        got, messages = recorded(lambda: run(opt))
        assert torch.allclose(got, run(model), atol=1e-6)
        assert len(messages) == 1 and "torch.func transform" in messages[0]
        assert opt._misses == []     # a per-sample shape is no new specialization
        assert torch.allclose(opt(x), model(x), atol=1e-6)


def test_torch_compile_and_export_of_opt_or_of_a_model_holding_it_trace_the_original():
    model, x = mlp(), torch.randn(5, 13)
    opt = optimized(model, x)
    parent = nn.Sequential(opt, nn.Tanh()).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        for compiled, eager in ((torch.compile(opt, backend="eager"), model),
                                (torch.compile(parent, backend="eager"), nn.Sequential(model, nn.Tanh()))):
            for _ in range(2):
                x = torch.randn(5, 13)
                got, messages = recorded(lambda: compiled(x))
                assert torch.allclose(got, eager(x), atol=1e-6) and messages == []
        torch._dynamo.reset()
        for strict in (False, True):
            exported = torch.export.export(opt, (x,), strict=strict).module()
            assert torch.allclose(exported(x), model(x), atol=1e-6)
        assert torch.allclose(opt(x), model(x), atol=1e-6) and sum(opt._original_calls.values()) == 0


def test_every_way_into_opt_under_compile_or_export_keeps_eager_semantics():
    """opt.compile(), torch.compile(opt.forward) and a parent calling opt.forward reached the
    runtime inside Dynamo; a forward hook on opt was skipped under compile and export."""
    model, x = mlp(), torch.randn(5, 13)
    opt = optimized(model, x)

    class CallsForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = opt

        def forward(self, x):
            return self.inner.forward(x)
    with torch.no_grad():
        expected = model(x)
        for run in (lambda: torch.compile(opt.forward, backend="eager")(x),
                    lambda: torch.compile(CallsForward().eval(), backend="eager")(x)):
            torch._dynamo.reset()
            torch.testing.assert_close(run(), expected)
        opt.register_forward_hook(lambda mod, args, out: out * 0 + 7.0)
        parent = nn.Sequential(opt, nn.Identity()).eval()
        torch._dynamo.reset()
        for run in (lambda: opt(x), lambda: torch.compile(parent, backend="eager")(x),
                    lambda: torch.export.export(parent, (x,), strict=False).module()(x)):
            assert (run() == 7.0).all()
        opt.compile(backend="eager")
        assert (opt(x) == 7.0).all()
    torch._dynamo.reset()


def test_the_original_module_cannot_be_replaced():
    opt = optimized(mlp(), torch.randn(5, 13))
    for replace in (lambda: setattr(opt, "original", mlp()), lambda: delattr(opt, "original"),
                    lambda: opt.add_module("original", mlp())):
        with pytest.raises(AttributeError, match="fxfuse.optimize"):
            replace()
    opt.some_attribute = 1    # other attributes are set as on any module


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("", False),
                                       ("0", False), ("false", False), ("off", False), ("2", False)])
def test_yes_no_environment_variables_read_as_triton_reads_them(monkeypatch, value, on):
    monkeypatch.setenv("FXFUSE_TEST_FLAG", value)
    assert env_flag("FXFUSE_TEST_FLAG", False) is on


def test_unhelpful_inputs_get_errors_that_say_what_to_do():
    with pytest.raises(UnsupportedError, match="holds no tensor"):
        fxfuse.optimize(mlp(), [[1.0] * 13])
    exported = torch.export.export(mlp(), (torch.randn(5, 13),)).module()
    with pytest.raises(UnsupportedError, match="before exporting"):
        fxfuse.optimize(exported, torch.randn(5, 13))


class Epilogue(nn.Module):
    """Two Linears with an epilogue between them spelled by `expr` (g, b: [33] parameters)."""

    def __init__(self, expr, first=None):
        super().__init__()
        self.expr, self.l1, self.l2 = expr, first or nn.Linear(13, 33), nn.Linear(33, 13)
        self.g, self.b = nn.Parameter(torch.randn(33)), nn.Parameter(torch.randn(33))
        self.w = nn.Parameter(torch.randn(33, 13) / 4)

    def forward(self, x):
        g, b, w = self.g, self.b, self.w   # noqa: F841 (read by expr)
        h = eval(self.expr, {"torch": torch}, {"x": x, "g": g, "b": b, "w": w, "self": self})
        return self.l2(h)


@pytest.mark.parametrize("expr", ["torch.relu(self.l1(x)) * g[None]", "torch.relu(self.l1(x)) * g.unsqueeze(0)",
                                  "torch.relu(self.l1(x)) * g.view(1, -1)", "torch.relu(self.l1(x) + b[None, :])",
                                  "torch.relu(x @ w.t() + b)", "torch.relu(torch.addmm(b, x, w.transpose(0, 1)))"])
def test_constant_views_and_transposes_stay_inside_the_fused_mlp(expr):
    """A view adding leading unit dimensions to a parameter (`g[None]`) in an epilogue split the
    fused MLP into three kernels and a library call; a W.t() whose product became a Linear was
    left in the graph as a library call."""
    model, x = Epilogue(expr).eval(), torch.randn(7, 13)
    opt = fxfuse.optimize(model, x, fused_mlp="force")
    stats = fxfuse.stats(opt)
    assert stats["fused_kernels"] == 1 and stats["library_calls"] == 0, fxfuse.explain(opt)
    with torch.no_grad():
        x = torch.randn(7, 13)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


class Looked(nn.Module):
    """A constant indexed, not only viewed: `pos[None, positions]` has the shape of `pos[None]`
    when len(positions) == len(pos); a 0-dim constant's [1] view promotes dtypes as a tensor."""

    def __init__(self, expr):
        super().__init__()
        self.expr = expr
        self.register_buffer("pos", torch.arange(4.0) * 3)
        self.register_buffer("s", torch.tensor(2.0))

    def forward(self, x, positions):
        return eval(self.expr, {"torch": torch}, {"x": x, "positions": positions, "self": self})


@pytest.mark.parametrize("expr, x", [("x + self.pos[None, positions]", torch.zeros(2, 4)),
                                     ("x * self.s[None] + 1", torch.full((3,), 60000.0, dtype=torch.float16))])
def test_indexed_constants_and_0_dim_constants_keep_their_meaning(expr, x):
    model = Looked(expr).eval()
    opt = fxfuse.optimize(model, (x, torch.arange(4)))
    with torch.no_grad():
        positions = torch.tensor([0, 0, 1, 2])
        got, expected = opt(x, positions), model(x, positions)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (got, expected)


def test_a_parametrized_module_other_than_linear_or_conv_stays_whole():
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    torch.nn.utils.parametrizations.weight_norm(mha.out_proj)   # traced through, it was 26 library calls

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]
    block, x = Block().eval(), torch.randn(2, 5, 16)
    opt = fxfuse.optimize(block, x)
    assert fxfuse.stats(opt)["library_calls"] <= 2
    with torch.no_grad():
        torch.testing.assert_close(opt(x), block(x))


def test_a_unit_view_stays_where_broadcasting_would_not_add_its_dimension():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.g, self.h = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))

        def forward(self, x):
            return x + self.g[None] * self.h      # [1, 5]: the view's dimension is the result's
    model = Outer().eval()
    opt = fxfuse.optimize(model, torch.randn(5))
    with torch.no_grad():
        x = torch.randn(5)
        assert opt(x).shape == model(x).shape == (1, 5)
        torch.testing.assert_close(opt(x), model(x))


@pytest.mark.parametrize("wrap", ["weight_norm", "custom"])
def test_a_parametrized_linear_fuses_its_epilogue_and_reads_its_parameters_live(wrap):
    """A Linear under weight_norm / register_parametrization was one opaque call; traced
    through, its weight is computed in the graph and its bias and ReLU fuse."""
    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w
    first = nn.Linear(13, 33)
    if wrap == "weight_norm":
        first = torch.nn.utils.parametrizations.weight_norm(first)
        source = first.parametrizations.weight.original1
    else:
        torch.nn.utils.parametrize.register_parametrization(first, "weight", Doubled())
        source = first.parametrizations.weight.original
    model, x = Epilogue("torch.relu(self.l1(x))", first).eval(), torch.randn(7, 13)
    opt = optimized(model, x)
    report = fxfuse.explain(opt)
    assert "relu" in report.lower() and fxfuse.stats(opt)["fused_kernels"] == 1   # l2's bias: its library call
    assert "weight is computed in the graph" in report   # why no generated GEMM / fused MLP takes it
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        source.mul_(1.5)                       # an edit of the parametrization's own parameter
        torch.testing.assert_close(opt(x), model(x))


def test_builds_inside_parametrize_cached_trace_the_parametrization():
    """Inside parametrize.cached() the trace read torch's cached weight (a constant no later edit
    reached) or left a tracing Proxy in that cache, which eager calls then returned."""
    from torch.nn.utils import parametrize
    first = torch.nn.utils.parametrizations.weight_norm(nn.Linear(13, 33))
    model, x = Epilogue("torch.relu(self.l1(x))", first).eval(), torch.randn(7, 13)
    with torch.no_grad(), parametrize.cached():
        opt = optimized(model, x)
        assert type(model(torch.randn(3, 13))) is torch.Tensor
        first.parametrizations.weight.original1.mul_(1.5)
        for batch in (7, 3):        # 3: a specialization built inside the context
            x = torch.randn(batch, 13)
            assert type(opt(x)) is torch.Tensor
        first.parametrizations.weight.original1.mul_(2.0)
    with torch.no_grad():
        for batch in (7, 3):
            x = torch.randn(batch, 13)
            torch.testing.assert_close(opt(x), model(x))


class BiasBump(nn.Module):
    def __init__(self, guarded=False):
        super().__init__()
        self.lin, self.guarded = nn.Linear(4, 4), guarded

    def forward(self, x):
        if self.guarded:
            if x.shape[0] > 1:        # Python control flow on a size: symbolic_trace fails, torch.export records it
                self.lin.bias.add_(0.1)
        else:
            self.lin.bias += 0.1      # torch.fx cannot assign its Proxy to the parameter
        return self.lin(x)


@pytest.mark.parametrize("guarded, applied", [(False, 0), (True, 1)])
def test_a_forward_writing_a_parameter_is_refused_before_the_graph_runs(guarded, applied):
    """optimize() ran such a forward six times (export, shape propagation, the checks) and left
    the bias 0.6 higher; now it stops after the trace (export applies the write once)."""
    model = BiasBump(guarded).eval()
    before = model.lin.bias.detach().clone()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fxfuse.optimize(model, torch.randn(2, 4)) is model
    assert [str(w.message) for w in caught if "changes the module's state" in str(w.message)]
    torch.testing.assert_close(model.lin.bias.detach(), before + 0.1 * applied)


def test_strassen_auto_alone_may_choose_two_levels():
    """The default strassen_levels was 1 for "auto" too, so the benchmarks' 2-level plans needed
    an option users had no reason to set."""
    from fxfuse.options import Options
    assert Options.from_kwargs(strassen="auto").strassen_levels == 2
    assert Options.from_kwargs(strassen="force").strassen_levels == 1
    assert Options.from_kwargs().strassen_levels == 1
    assert Options.from_kwargs(strassen="auto", strassen_levels=1).strassen_levels == 1
