"""Fixes from fuzzing round 30 (CPU, Triton interpreter), each a case that failed before.

Wrong values: `torch.add(x, int_tensor, alpha=a)` scaled the integer operand in its own dtype
(wrapping); `x ** inf` / `x ** nan` went through exp2(e * log2(x)). A refused model: an old
OptimizedModule finalized by the garbage collector during another build of the same model.
Accuracy: fp16 Linears rounded the product before adding the bias. Lost fusion: aten alias
overloads (aten.multiply, aten.special_expit, ...) that torch.export records."""
import gc
import os
import warnings
import weakref

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.kernel import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU kernels need TRITON_INTERPRET=1")


def _optimize(model, args, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, args, **options)
    return opt, [str(w.message) for w in caught]


class AlphaInt(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, img, ids):
        return self.lin(torch.add(x, img, alpha=3)) + torch.sub(x, ids, alpha=4) * 2


def test_alpha_scales_an_integer_operand_in_the_result_dtype():
    """uint8 200 * 3 wraps to 88 in uint8; eager computes x + 3 * img in float."""
    torch.manual_seed(0)
    model = AlphaInt().eval()
    small = (torch.randn(4, 8), torch.ones(4, 8, dtype=torch.uint8), torch.ones(4, 8, dtype=torch.int32))
    opt, warned = _optimize(model, small, strict=True)
    assert not warned and fxfuse.stats(opt)["fused_kernels"] >= 1
    args = (torch.randn(4, 8), torch.randint(100, 256, (4, 8), dtype=torch.uint8),
            torch.randint(2 ** 29, 2 ** 30, (4, 8), dtype=torch.int32))
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))


class Power(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return (x ** self.p) * 1.0


@pytest.mark.parametrize("p", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_exponents_follow_c_pow(p):
    special = torch.tensor([[1.0, -1.0, -0.5, -2.0, 0.5, 2.0, 0.0, -0.0, float("inf"), float("-inf"), float("nan")]])
    model = Power(p).eval()
    opt, warned = _optimize(model, torch.rand(1, 11) + 0.5, strict=True)
    assert not warned and fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        torch.testing.assert_close(opt(special), model(special), equal_nan=True)


class VarArgs(nn.Module):
    """forward(*xs): traced by export, and its OptimizedModule ends up in a reference cycle. Told to collect
    through the environment: a flag on the class that forward() resets is state (stop 50)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, *xs):
        if os.environ.pop("FXFUSE_TEST_COLLECT", None):
            gc.collect()   # a garbage collection that happens to run during the build
        return self.b(self.act(self.a(xs[0]), *xs[1:]))

    def act(self, h, *rest):
        return torch.relu(h)


def test_an_old_optimized_module_collected_during_a_build_is_no_state_change():
    """Its finalizer removes its load_state_dict hooks from the model's modules; the build's
    state check had counted those hook registries as state forward() changed."""
    model = VarArgs().eval()
    opt, _ = _optimize(model, torch.randn(4, 16))
    alive = weakref.ref(opt)
    holder = [opt]
    holder.append(holder)   # the user's own reference cycle: freed only by a garbage collection
    del opt, holder
    os.environ["FXFUSE_TEST_COLLECT"] = "1"
    again, warned = _optimize(model, torch.randn(4, 16))
    assert alive() is None and not warned and fxfuse.stats(again)["optimized"]
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def test_fp16_linear_rounds_once_as_eager():
    """The bias goes back into the library GEMM in fp16 (eager's addmm adds it before rounding);
    the ReLU after it still fuses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24)).eval().half()
    x = torch.randn(64, 16, dtype=torch.float16)
    opt, warned = _optimize(model, x, strict=True)
    assert not warned and fxfuse.stats(opt)["fused_kernels"] == 1   # the tanh
    with torch.no_grad():
        x = torch.randn(64, 16, dtype=torch.float16)
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


ALIASES = {
    "absolute": lambda h: torch.absolute(h), "negative": lambda h: torch.negative(h),
    "divide": lambda h: h.divide(2), "true_divide": lambda h: h.true_divide(2),
    "subtract": lambda h: torch.subtract(h, 1), "multiply": lambda h: torch.multiply(h, 3),
    "greater": lambda h: torch.greater(h, 0).float(), "less_equal": lambda h: torch.less_equal(h, 0) * h,
    "not_equal": lambda h: torch.not_equal(h, 0) * h, "special.expit": lambda h: torch.special.expit(h),
}


class Exported(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f, self.a, self.b = f, nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, *xs):   # *xs[1:]: symbolic_trace fails, torch.export traces it
        return self.b(self.f(self.a(xs[0]), *xs[1:]) + 1)


@pytest.mark.parametrize("name", list(ALIASES))
def test_aten_alias_spellings_fuse_under_export(name):
    model = Exported(lambda h, *rest, f=ALIASES[name]: f(h)).eval()
    opt, warned = _optimize(model, torch.randn(4, 16), strict=True)
    assert not warned and "torch.export" in fxfuse.explain(opt)
    # one kernel: b's bias, the output, is in its library call (linear_epilogue._lone, stop 35)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and "torch.ops.aten" not in str(
        next(iter(opt._specializations.values())).gm.code).split("def forward")[1].replace("torch.ops.aten.linear", "")
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_model_traced_by_export_is_freed_when_dropped():
    """symbolic_trace's failure (torch.fx's Proxy.__iter__ keeps its own frame in a local) held
    every caller's frame, the OptimizedModule's __init__ among them: `del opt` freed nothing, its
    CUDA graphs and their memory stayed until a garbage collection."""
    gc.disable()
    try:
        opt, _ = _optimize(VarArgs().eval(), torch.randn(4, 16))
        assert "torch.export" in fxfuse.explain(opt)
        alive = weakref.ref(opt)
        del opt
        assert alive() is None
    finally:
        gc.enable()


def test_strassen_output_of_one_row_has_eager_strides():
    """A padded Strassen buffer narrowed to 7 of 8 columns: at one row contiguous() kept stride 8
    (a size-1 dimension's stride does not count), where eager's output is (7, 1) on 7 elements."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 7)).eval()
    opt, warned = _optimize(model, torch.randn(4, 16), strassen="force", strict=True)
    assert not warned and "strassen" in fxfuse.explain(opt).lower()
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(rows, 16)
            got, want = opt(x), model(x)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride() and got.untyped_storage().nbytes() == want.untyped_storage().nbytes()


class PreNormBlock(nn.Module):
    def __init__(self, d=32, f=64):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, h):
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h))))


@pytest.mark.parametrize("strict", [False, True])
def test_a_model_frozen_after_optimize_keeps_its_graph_across_new_shapes(strict):
    """The first build's probe found recording through parameters that required grad then; a
    second build after requires_grad_(False) kept that finding under the new flags, and every
    grad-mode call ran the original (GuardError under strict)."""
    torch.manual_seed(0)
    model = PreNormBlock().eval()
    opt, _ = _optimize(model, torch.randn(2, 5, 32), strict=strict)
    model.requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (2, 3, 2):
            h = torch.randn(batch, 5, 32)
            torch.testing.assert_close(opt(h), model(h))
    assert not caught and not sum(opt._original_calls.values()) and len(opt._specializations) == 2


@pytest.mark.parametrize("strict", [False, True])
def test_arguments_that_do_not_fit_forward_raise_eagers_type_error(strict):
    """Also once every specialization is in use: not a guard miss, and no warning spent on it."""
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).eval()
    x = torch.randn(4, 16)
    opt, _ = _optimize(model, x, strict=strict, max_specializations=1)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for args in [(), (x, x)]:
            with pytest.raises(TypeError, match="positional argument"):
                opt(*args)
    assert not caught and opt._miss_count == 0


def test_a_parameter_set_to_none_rebuilds_where_no_cuda_graph_runs(capsys):
    """register_parameter("bias", None) fires no registration hook; without a CUDA graph the call
    failed on the missing tensor (and torch.fx printed a traceback of the generated code)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    opt, _ = _optimize(model, x, strict=True)
    model[0].register_parameter("bias", None)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert capsys.readouterr().err == "" and fxfuse.stats(opt)["fused_kernels"] >= 1


class HandBias(nn.Module):
    """x @ W.T + b written out: eager rounds the product to fp16, then adds (two roundings)."""
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(32, 16) * 0.3), nn.Parameter(torch.randn(32))

    def forward(self, x):
        return torch.tanh(x @ self.w.T + self.b)


def test_fp16_bias_added_by_hand_rounds_as_eager():
    """Only a Linear's own bias (nn.Linear, F.linear, addmm) goes back into the GEMM in fp16."""
    torch.manual_seed(0)
    model = HandBias().eval().half()
    x = torch.randn(64, 16, dtype=torch.float16)
    opt, warned = _optimize(model, x, strict=True)
    gm = next(iter(opt._specializations.values())).gm
    assert not warned and not [n for n in gm.graph.nodes if n.op == "call_function" and len(n.args) == 3
                               and getattr(n.target, "__name__", "") == "linear"]   # bias not in the GEMM
    with torch.no_grad():
        x = torch.randn(64, 16, dtype=torch.float16)
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


class MethodAliases(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.a(x)
        h = h.absolute().multiply(2).subtract(1).true_divide(3) * h.greater(0).float() + h.not_equal(0) * 0.5
        return self.b(h.negative())


def test_method_alias_spellings_fuse():
    """x.absolute(), x.greater(0), x.multiply_(...): torch's other names of fused ops, as methods."""
    model = MethodAliases().eval()
    opt, warned = _optimize(model, torch.randn(4, 16), strict=True)
    assert not warned and fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 2
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_pow_reads_a_float_exponent_in_the_tensors_dtype():
    """2.0001 is 2.0 in fp16, as eager's pow reads it: (-2) ** e is 4, not NaN; 1e-30 is 0."""
    special = torch.tensor([[-2.0, -0.5, 0.0, 3.0]], dtype=torch.float16)
    for p in (2.0001, 1e-30):
        model = Power(p).eval().half()
        opt, warned = _optimize(model, (torch.rand(1, 4) + 0.5).half(), strict=True)
        assert not warned and fxfuse.stats(opt)["fused_kernels"] == 1
        with torch.no_grad():
            torch.testing.assert_close(opt(special), model(special), equal_nan=True, rtol=0, atol=0)


class BiasForms(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(40, 48) / 4)
        self.b = nn.Parameter(torch.randn(40))

    def forward(self, x, b):
        if self.form == "input":
            return F.linear(x, self.w, b)
        if self.form == "computed":
            return F.linear(x, self.w, self.b * 1)
        return torch.addmm(self.b.view(1, -1), x, self.w.t())


@pytest.mark.parametrize("form", ["input", "computed", "addmm_row"])
def test_fp16_linear_bias_of_any_origin_rounds_once(form):
    torch.manual_seed(0)
    model = BiasForms(form).eval().half()
    args = (torch.randn(6, 48, dtype=torch.float16), torch.randn(40, dtype=torch.float16))
    opt, warned = _optimize(model, args, strict=True)
    assert not warned
    with torch.no_grad():
        args = (torch.randn(6, 48, dtype=torch.float16), torch.randn(40, dtype=torch.float16))
        torch.testing.assert_close(opt(*args), model(*args), rtol=0, atol=0)


def test_plan_prices_the_kernel_after_a_fused_mlp_and_int_constants():
    """A pre-norm block's residual stream is no input of its Linears: a fused MLP ends before the
    add, and the plan prices that kernel; an integer 0-d buffer is no epilogue constant."""
    from fxfuse.cost_model import CALIBRATION_DIR
    h100 = str(CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json")
    opt, _ = _optimize(PreNormBlock(64, 64).eval(), torch.randn(8, 64), calibration=h100, verify=False)
    plans = next(iter(opt._specializations.values())).gm.meta["fxfuse_plans"]
    assert [p["layer"].mlp_reads_outside for p in plans] == [0, 1]

    class IntScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.register_buffer("ib", torch.tensor(3))

        def forward(self, x, u):
            return (self.a(x) + self.ib) + u

    opt, _ = _optimize(IntScale().eval(), (torch.randn(4, 64), torch.randn(4, 64)), calibration=h100, verify=False)
    (plan,) = next(iter(opt._specializations.values())).gm.meta["fxfuse_plans"]
    assert (plan["layer"].epilogue_reads, plan["layer"].epilogue_reads_outside) == (2, 1)


class InPlaceResidual(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        h += self.lin(h)
        return h


def test_plan_leaves_a_linear_whose_input_is_written_later_to_the_library():
    """h += lin(h): the rewriting passes keep the library GEMM there; the plan said gemm."""
    from fxfuse.cost_model import CALIBRATION_DIR
    h100 = str(CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json")
    model = InPlaceResidual().eval()
    x = torch.randn(2, 12, 32)
    opt, warned = _optimize(model, x.clone(), calibration=h100, strict=True)
    (plan,) = next(iter(opt._specializations.values())).gm.meta["fxfuse_plans"]
    assert not warned and plan["choice"] == "library" and "written in place" in str(plan["reasons"])
    with torch.no_grad():
        torch.testing.assert_close(opt(x.clone()), model(x.clone()))


class TwoReadersOfX(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.a(x), torch.tanh(x + self.b(x))


def test_both_linears_reading_x_become_fused_mlps():
    """`a(x)` beside `x + b(x)`: the region started at `a` kept b's branch; `a` was not tried again."""
    from fxfuse.cost_model import CALIBRATION_DIR
    h100 = str(CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json")
    model = TwoReadersOfX().eval()
    x = torch.randn(4, 5, 32)
    opt, warned = _optimize(model, x, calibration=h100, strict=True)
    gm = next(iter(opt._specializations.values())).gm
    assert [p["choice"] for p in gm.meta["fxfuse_plans"]] == ["mlp", "mlp"]
    assert not warned and sum(type(m).__name__ == "FusedMLP" for m in gm.modules()) == 2
    with torch.no_grad():
        x = torch.randn(3, 5, 32)
        for got, want in zip(opt(x), model(x)):
            torch.testing.assert_close(got, want)


def test_plan_rows_name_the_library_call_that_runs():
    """fp16: linear_epilogue puts a planned library Linear's bias back into a new F.linear node;
    the plan's row and the node's decision move to it."""
    from fxfuse.cost_model import CALIBRATION_DIR
    h100 = str(CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json")

    class Gated(nn.Module):
        def __init__(self, d=24):
            super().__init__()
            self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x, g):
            return self.l2(F.silu(self.l1(x)) * g)

    torch.manual_seed(0)
    args = (torch.randn(2, 24, 24).half(), torch.randn(2, 24, 24).half())
    opt, _ = _optimize(Gated().half().eval(), args, calibration=h100, strict=True)
    gm = next(iter(opt._specializations.values())).gm
    names = {n.name: n for n in gm.graph.nodes}
    for plan in gm.meta["fxfuse_plans"]:
        if plan["choice"] == "library":
            node = names[plan["node"]]
            assert node.meta["fxfuse"]["decision"].startswith("cost model: library") and "plan" in node.meta["fxfuse"]


def test_plan_prices_a_half_linear_with_its_bias_in_the_gemm():
    """fp16 nn.Linear: linear_epilogue always puts its bias into the library GEMM, so the plan's
    library estimate is that spelling, not the cheaper of the two."""
    from fxfuse.cost_model import CALIBRATION_DIR, CostModel
    h100 = str(CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json")
    model = nn.Sequential(nn.Linear(48, 40), nn.Tanh()).half().eval()
    opt, _ = _optimize(model, torch.randn(6, 48).half(), calibration=h100, verify=False)
    (plan,) = next(iter(opt._specializations.values())).gm.meta["fxfuse_plans"]
    assert plan["layer"].bias_in_gemm
    cost = CostModel.load(h100, device_name="NVIDIA H100 80GB HBM3")
    from dataclasses import replace
    free = replace(plan["layer"], bias_in_gemm=False)
    assert cost.estimate("library", plan["layer"]).us >= cost.estimate("library", free).us
