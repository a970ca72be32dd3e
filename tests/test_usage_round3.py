"""Usage fuzzing, third round (CPU): constant outputs, optimizer steps, non-plain arguments,
autocast, inputs the model itself rejects, TorchScript tracing, quiet errors."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 29), nn.ReLU(), nn.Linear(29, 7)).eval()


class ConstantOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.register_buffer("scale", torch.rand(3) + 1)

    def forward(self, x):
        return self.lin(x).relu(), torch.zeros(3), self.scale * 2


def test_a_constant_output_is_fresh_every_call():
    """Fuzz: `return torch.zeros(3)` came back as the same tensor each call (a graph constant),
    so a caller's write into it changed the next call's answer."""
    model = ConstantOutput().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 5), strict=True)
    with torch.no_grad():
        first = opt(torch.randn(4, 5))
        first[1].add_(100)
        first[2].add_(100)
        again = opt(torch.randn(4, 5))
    assert torch.equal(again[1], torch.zeros(3)) and torch.equal(again[2], model.scale * 2)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


class ReturnsItsState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.register_buffer("state", torch.rand(3))

    def forward(self, x):
        return self.lin(x).relu(), self.state, self.lin.bias[:2]


def test_the_models_own_buffers_and_parameters_are_returned_as_eager_returns_them():
    """Review: the constant-output copy first copied the model's own buffer too."""
    model = ReturnsItsState().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 5), strict=True)
    with torch.no_grad():
        _, state, bias = opt(torch.randn(4, 5))
    assert state is model.state and bias.untyped_storage().data_ptr() == model.lin.bias.untyped_storage().data_ptr()


@pytest.mark.parametrize("plan", [{}, {"gemm": "force"}, {"fused_mlp": "force"}, {"strassen": "force"}])
def test_an_optimizer_step_rebuilds(plan):
    """Fuzz: packed, folded and Strassen copies went stale after an in-place parameter update;
    an optimizer step is seen (runtime: the version counters of tensors the graph holds copies of)."""
    model = mlp()
    x = torch.randn(5, 13)
    opt = fxfuse.optimize(model, x, strict=True, **plan)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(5, 13)).square().sum().backward()
    sgd.step()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
        sgd.step()      # a step of the same gradients moves the weights again
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.stats(opt)["specializations"] == 1 and fxfuse.stats(opt)["fused_kernels"] >= 1


def test_an_unrelated_optimizer_step_keeps_the_build():
    model = mlp()
    x = torch.randn(5, 13)
    opt = fxfuse.optimize(model, x, strict=True)
    spec = next(iter(opt._specializations.values()))
    other = nn.Linear(3, 3)
    other(torch.randn(2, 3)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    with torch.no_grad():
        opt(x)
    assert next(iter(opt._specializations.values())) is spec


def test_reloading_the_state_rebuilds_after_a_manual_edit():
    """The documented way after an edit the version check does not see (README)."""
    model = mlp()
    x = torch.randn(5, 13)
    opt = fxfuse.optimize(model, x, strict=True, fused_mlp="force")
    with torch.no_grad():
        model[2].bias.add_(1.0)
        opt.load_state_dict(opt.state_dict())
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


class ArrayArgument(nn.Module):
    def forward(self, x, table):
        return x * float(table.sum())


class Config:
    scale = 2.0


class ObjectArgument(nn.Module):
    def forward(self, x, cfg):
        return x * cfg.scale


def test_array_and_object_arguments_run_the_original():
    """Fuzz: non-tensor arguments were guarded by repr(): a numpy array differing inside its
    repr's '...', or an object whose attribute changed, gave the old answer."""
    x = torch.randn(3, 4)
    for model, extra in ((ArrayArgument().eval(), np.ones((40, 40))), (ObjectArgument().eval(), Config())):
        with pytest.warns(fxfuse.FxfuseWarning, match="plain values"):
            opt = fxfuse.optimize(model, (x, extra))
        assert opt is model
    with pytest.raises(fxfuse.FxfuseError, match="ndarray"):
        fxfuse.optimize(ArrayArgument().eval(), (x, np.ones(3)), strict=True)
    opt = fxfuse.optimize(Affine().eval(), (x, (1.5, 2.5)), strict=True)   # plain values still specialize
    with torch.no_grad():
        torch.testing.assert_close(opt(x, (1.5, 2.5)), x * 1.5 + 2.5)
        torch.testing.assert_close(opt(x, (3.0, 2.5)), x * 3.0 + 2.5)     # another value: another build
    assert fxfuse.stats(opt)["specializations"] == 2


class Affine(nn.Module):
    def forward(self, x, factors):
        return x * factors[0] + factors[1]


def test_autocast_runs_the_original():
    """Fuzz: under torch.autocast the graph's fp32 result came back where eager gives fp16."""
    model = mlp()
    x = torch.randn(5, 13)
    opt = fxfuse.optimize(model, x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(fxfuse.FxfuseWarning, match="autocast"):
            got = opt(x)
        assert got.dtype == model(x).dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        opt = fxfuse.optimize(model, x)           # built without autocast: its own dtypes
    with torch.no_grad():
        got = opt(x)
    assert got.dtype == torch.float32 and fxfuse.stats(opt)["fused_kernels"] >= 1
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)


def test_an_input_the_model_rejects_gets_the_models_error_and_does_not_poison_its_shape():
    """Fuzz: an index out of range at a new shape was reported as a tracing failure, and the
    signature was then never built for valid inputs."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randint(0, 10, (2, 3)))
    with torch.no_grad(), pytest.raises(IndexError):
        opt(torch.tensor([[1, 2, 10]]))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        good = torch.tensor([[1, 2, 9]])
        torch.testing.assert_close(opt(good), model(good))
    assert fxfuse.stats(opt)["specializations"] == 2 and not opt._original_calls


def test_errors_inside_a_built_graph_print_nothing(capsys):
    """Fuzz: torch.fx's call wrapper printed a traceback of the generated code to stderr."""
    class Gather(nn.Module):
        def forward(self, x, index):
            return x.index_select(0, index).relu()
    opt = fxfuse.optimize(Gather().eval(), (torch.randn(4, 3), torch.tensor([0, 2])), strict=True)
    with torch.no_grad(), pytest.raises(IndexError):
        opt(torch.randn(4, 3), torch.tensor([0, 7]))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_jit_trace_records_the_original_with_one_warning():
    model = mlp()
    x = torch.randn(5, 13)
    opt = fxfuse.optimize(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(opt, x)
    ours = [w for w in caught if issubclass(w.category, fxfuse.FxfuseWarning)]
    assert len(ours) == 1 and "jit.trace" in str(ours[0].message)
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    torch.testing.assert_close(traced(x), model(x))


def test_an_example_input_that_overflows_eager_is_named_as_such():
    """Fuzz: the documented fp16 difference (a fused chain keeps intermediates in fp32, eager
    overflows) was reported as 'a bug in fxfuse, please report it'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 13), nn.Linear(13, 13)).eval().half()
    with torch.no_grad():
        model[0].weight.mul_(1000)
    x = (torch.randn(5, 13) * 100).half()
    with pytest.raises(fxfuse.FxfuseError, match="eager overflows"):
        fxfuse.optimize(model, x, fused_mlp="force", strict=True)
    with pytest.warns(fxfuse.FxfuseWarning, match="eager overflows"):
        assert fxfuse.optimize(model, x, fused_mlp="force") is model


class PositiveMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        pos = h[h > 0]                       # a length that depends on the values
        return pos.sum() / pos.shape[0]


class CountNonzero(nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0).size(0) * torch.ones(1)


class MaskedMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask):
        return (torch.relu(self.lin(x))[mask] * 2).mean(0) + torch.where(x > 0)[1].sum()


def test_value_dependent_shapes_without_size_reads_are_optimized_and_stay_unfused():
    """Review: refusing every mask index lost models that never read the size; what follows
    such a value runs in the library (no kernel built for the example's count)."""
    model = MaskedMean().eval()
    mask = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    opt = fxfuse.optimize(model, (torch.randn(6, 4), mask), strict=True)
    gm = next(iter(opt._specializations.values())).gm
    assert fxfuse.stats(opt)["fused_kernels"] >= 1                     # bias + relu, before the mask
    assert all(n.meta.get("fxfuse", {}).get("kept") == "shape depends on the input's values"
               for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.mul)
    with torch.no_grad():
        x, other = torch.randn(6, 4), torch.tensor([1, 1, 1, 1, 0, 1], dtype=torch.bool)
        torch.testing.assert_close(opt(x, other), model(x, other))


@pytest.mark.parametrize("model", [PositiveMean(), CountNonzero()], ids=["mask_index", "nonzero"])
def test_data_dependent_sizes_are_refused(model):
    """Fuzz: a size read from h[h > 0] or nonzero() was frozen at the example input's value."""
    with pytest.raises(fxfuse.FxfuseError, match="depends on the input's values"):
        fxfuse.optimize(model.eval(), torch.randn(5, 8), strict=True)
    with pytest.warns(fxfuse.FxfuseWarning, match="depends on the input's values"):
        assert fxfuse.optimize(model.eval(), torch.randn(5, 8)) is model


class AutocastInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(x).relu()


def test_autocast_inside_forward_is_refused():
    """Fuzz: torch.fx drops the context manager, and verification excused the fp32 result as
    'accurate enough' where eager returns bf16."""
    with pytest.raises(fxfuse.FxfuseError, match="enters torch.autocast"):
        fxfuse.optimize(AutocastInside().eval(), torch.randn(3, 8), strict=True)


class DunderInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 8) / 3)
        self.b = nn.Parameter(torch.randn(12))
        self.w2 = nn.Parameter(torch.randn(5, 12) / 3)

    def forward(self, x):
        h = torch.nn.functional.linear(x, self.w)
        h.__iadd__(self.b)                   # torch.fx records the dunder as a method call
        return torch.nn.functional.linear(torch.relu(h), self.w2)


@pytest.mark.parametrize("plan", [{}, {"strassen": "force"}])
def test_an_in_place_dunder_is_a_write(plan):
    model = DunderInPlace().eval()
    x = torch.randn(5, 8)
    opt = fxfuse.optimize(model, x, strict=True, **plan)
    with torch.no_grad():
        x = torch.randn(5, 8)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)


class FloatMathOnBool(nn.Module):
    def forward(self, x):
        keep = x > 0
        return torch.sigmoid(keep) * x + torch.exp(keep) - torch.sqrt(keep.float() + 1)


def test_float_math_on_a_bool_value_is_fused():
    """Fuzz: sigmoid(x > 0) crashed code generation (Triton's math rejects int1)."""
    model = FloatMathOnBool().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(opt(x), model(x))


def test_an_example_input_the_model_rejects_names_the_models_error():
    with pytest.raises(fxfuse.TraceError, match="cannot be multiplied.*Check the example input"):
        fxfuse.optimize(nn.Sequential(nn.Linear(8, 16)).eval(), torch.randn(4, 9), strict=True)


def test_optimize_from_several_threads_at_once():
    """Review: torch.fx's patcher and the quiet-trace stdout redirect are process-wide; two
    threads tracing at once broke both traces and could leave sys.stdout redirected."""
    import sys
    import threading
    results, stdout = [], sys.stdout

    def work(seed):
        torch.manual_seed(seed)
        layers = [m for _ in range(20) for m in (nn.Linear(6, 6), nn.GELU())]   # long traces overlap
        model = nn.Sequential(*layers).eval()
        for _ in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                # use_kernels=False: the Triton interpreter itself is not thread-safe (compiled kernels are)
                opt = fxfuse.optimize(model, torch.randn(3, 6), use_kernels=False)
            results.append(isinstance(opt, fxfuse.runtime.OptimizedModule))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 18 and sys.stdout is stdout
