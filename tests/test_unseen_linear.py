"""The opt-in Linear rewrites (strassen, gemm, fused_mlp, the cost-model planner) on models
their tests did not grow up with: odd sizes, bias-free and functional spellings, torch.export
graphs, 1-D/3-D/4-D and strided inputs, epilogues reading other tensors, in-place ops,
re-specialization. Every test compares with eager on fresh random inputs and asserts that the
rewrite happened (bmm nodes, EpilogueGemm / FusedMLP modules, no reference fallback)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.gemm_kernel import EpilogueGemm  # noqa: E402
from fxfuse.kernel import interpreting  # noqa: E402
from fxfuse.mlp_kernel import FusedMLP  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU kernels need TRITON_INTERPRET=1")

H100 = "fxfuse/calibration/nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json"
MODES = {"strassen": dict(strassen="force", gemm="off", fused_mlp="off"),
         "gemm": dict(gemm="force", fused_mlp="off"),
         "mlp": dict(fused_mlp="force", gemm="off")}


class Fn(nn.Module):
    """forward = fn(self, *inputs), with the given submodules, parameters and buffers."""

    def __init__(self, fn, buffers=None, **parts):
        super().__init__()
        self.fn = fn
        for name, part in parts.items():
            setattr(self, name, part)
        for name, t in (buffers or {}).items():
            self.register_buffer(name, t)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def _graph(opt):
    return next(iter(opt._specializations.values())).gm


def rewrites(opt, kind) -> int:
    if kind == "strassen":
        return sum(n.op == "call_function" and n.target is torch.bmm for n in _graph(opt).graph.nodes)
    return sum(isinstance(m, EpilogueGemm if kind == "gemm" else FusedMLP)
               for spec in opt._specializations.values() for m in spec.gm.modules())


def _fresh(t):
    return torch.randn(t.shape, dtype=t.dtype) if t.is_floating_point() else t


def _rel(got, ref64):
    return ((got.double() - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def check(model, inputs, kind, tol=1e-5, calls=None, **options):
    """Optimize with `kind` forced, compare with eager on fresh inputs (Strassen: relative error
    vs float64 within 3x the classical fp32 error + slack), assert the rewrite and no fallback."""
    model = model.eval()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    opt = fxfuse.optimize(model, inputs if len(inputs) > 1 else inputs[0], strict=True,
                          **{**MODES[kind], **options})
    with torch.no_grad():
        for call in calls or [inputs]:
            xs = tuple(_fresh(a) for a in call)
            want, got = model(*[a.clone() for a in xs]), opt(*[a.clone() for a in xs])
            if kind == "strassen" and not isinstance(want, tuple) and want.dtype == torch.float32:
                ref = model.double()(*[a.double() if a.is_floating_point() else a for a in xs])
                model.float()
                assert got.shape == want.shape and got.dtype == want.dtype
                assert _rel(got, ref) <= 3 * _rel(want, ref) + 1e-6, (_rel(got, ref), _rel(want, ref))
            else:
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert rewrites(opt, kind) >= 1, _graph(opt).graph
    assert fxfuse.stats(opt)["reference_fallbacks"] == 0, fxfuse.stats(opt)
    return opt


def _data_dependent(s, x):        # symbolic_trace fails on it: torch.export traces it
    h = s.a(x)
    if x.shape[0] > 2:
        h = torch.relu(h)
    return s.b(h)


def _in_place(s, x):
    y = s.l(x)
    z = torch.relu(y)
    y.mul_(2)
    y += 1
    return z + y


MODELS = {
    # regressions: a bias-free Linear as the root module is F.linear(x, W, None) after
    # tracing, and a bias-free one in a torch.export graph stays aten.linear: strassen and the
    # planner did not recognise either (they are not the F.linear(x, W) that normalize makes)
    "root_linear_no_bias": lambda: (nn.Linear(6, 9, bias=False), torch.randn(3, 6)),
    "export_no_bias": lambda: (Fn(_data_dependent, a=nn.Linear(6, 6, bias=False), b=nn.Linear(6, 5, bias=False)),
                               torch.randn(3, 6)),
    "bias_none_keyword": lambda: (Fn(lambda s, x: F.linear(x, s.w, bias=None).relu(),
                                     w=nn.Parameter(torch.randn(5, 7))), torch.randn(7, 7)),
    "prime_sizes_4d": lambda: (nn.Sequential(nn.Linear(5, 17), nn.GELU(), nn.Linear(17, 2)), torch.randn(2, 3, 5, 5)),
    "transposed_input": lambda: (Fn(lambda s, x: torch.tanh(s.l(x.t())), l=nn.Linear(5, 33)), torch.randn(5, 3)),
    "sliced_input": lambda: (Fn(lambda s, x: s.l(x[:, ::2]) * 0.5, l=nn.Linear(5, 7)), torch.randn(7, 10)),
    "returned_and_used": lambda: (Fn(lambda s, x: (lambda y: (y, torch.relu(y) + 1))(s.l(x)), l=nn.Linear(5, 5)),
                                  torch.randn(3, 5)),
    "same_linear_twice": lambda: (Fn(lambda s, x: s.l(torch.relu(s.l(x))), l=nn.Linear(6, 6)), torch.randn(1, 6)),
    "epilogue_reads_input_and_constants": lambda: (
        Fn(lambda s, x, o: (s.l(x) * s.c + s.row) * torch.sigmoid(o.t()) - s.vec, l=nn.Linear(6, 5),
           c=nn.Parameter(torch.tensor(1.5)), buffers={"row": torch.randn(1, 5), "vec": torch.randn(5)}),
        (torch.randn(3, 6), torch.randn(5, 3))),
    "in_place_after": lambda: (Fn(_in_place, l=nn.Linear(6, 5)), torch.randn(3, 6)),
}
OUT_OF_EPILOGUE = {   # the product leaves the epilogue through ops it must not take
    "softmax": lambda s, x: torch.softmax(s.l(x) * 2, -1),
    "view_then_relu": lambda s, x: torch.relu(s.l(x).view(3, 2, 5)) + 1,
    "sum": lambda s, x: (s.l(x) + 1).sum(-1),
    "where_mask": lambda s, x: torch.where(s.l(x) > 0, s.l(x), 0.5),
    "half": lambda s, x: (s.l(x) + 1).half() * 2,
}


@pytest.mark.parametrize("kind", ["strassen", "gemm", "mlp"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_forced_rewrite_matches_eager(kind, name):
    model, x = MODELS[name]()
    check(model, x, kind)


@pytest.mark.parametrize("kind", ["strassen", "gemm", "mlp"])
@pytest.mark.parametrize("name", sorted(OUT_OF_EPILOGUE))
def test_ops_after_the_epilogue(kind, name):
    check(Fn(OUT_OF_EPILOGUE[name], l=nn.Linear(6, 10)), torch.randn(3, 6), kind, tol=1e-2 if name == "half" else 1e-5)


@pytest.mark.parametrize("levels", [2, 3])
def test_strassen_deeper_levels_on_odd_sizes(levels):
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 17, bias=False), nn.Tanh(), nn.Linear(17, 3))
    opt = check(model, torch.randn(2, 3, 7), "strassen", strassen_levels=levels)
    assert rewrites(opt, "strassen") == 3
    assert all(n.meta["fxfuse"]["levels"] == levels for n in _graph(opt).graph.nodes if n.target is torch.bmm)


@pytest.mark.parametrize("kind", ["strassen", "gemm", "mlp"])
def test_fp16_and_new_batches(kind):
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).half()
    calls = [(torch.randn(3, 6).half(),), (torch.randn(5, 6).half(),), (torch.randn(1, 6).half(),)]
    opt = check(model, calls[0][0], kind, tol=2e-2, calls=calls)
    assert len(opt._specializations) == 3


def test_split_k_gemm_with_odd_k_and_new_batch():
    check(nn.Sequential(nn.Linear(531, 33), nn.SiLU()), torch.randn(7, 531), "gemm",
          calls=[(torch.randn(7, 531),), (torch.randn(40, 531),)])


def test_weight_computed_at_runtime_is_not_a_constant():
    model = Fn(lambda s, x: torch.relu(F.linear(x, s.w * 2, s.b)), w=nn.Parameter(torch.randn(5, 6)),
               b=nn.Parameter(torch.randn(5)))
    for kind in MODES:
        opt = fxfuse.optimize(model.eval(), torch.randn(3, 6), strict=True, **MODES[kind])
        assert rewrites(opt, kind) == 0
        x = torch.randn(3, 6)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 5), (4, 0)], ids=["no_in_features", "no_out_features"])
def test_empty_weight_stays_library(shape):
    """A Linear with 0 in or out features: the kernels refuse it (the GEMM's reshape(-1, 0)
    failed at optimize time) and every mode still runs it."""
    model = nn.Sequential(nn.Linear(*shape), nn.ReLU()).eval()
    x = torch.randn(3, shape[0])
    for options in [*MODES.values(), dict(strassen="auto", gemm="auto", fused_mlp="auto", calibration=H100)]:
        opt = fxfuse.optimize(model, x, strict=True, **options)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


@pytest.mark.parametrize("calibration", [None, H100], ids=["roofline", "h100"])
def test_auto_on_small_models_stays_classical(calibration):
    model = Fn(_data_dependent, a=nn.Linear(6, 6, bias=False), b=nn.Linear(6, 5)).eval()
    x = torch.randn(3, 6)
    opt = fxfuse.optimize(model, x, strict=True, strassen="auto", strassen_levels=2, calibration=calibration)
    assert rewrites(opt, "strassen") == 0
    plans = _graph(opt).meta["fxfuse_plans"]
    assert len(plans) == 2 and all(not p["choice"].startswith("strassen") for p in plans)   # both planned
    assert [p["layer"].bias for p in plans] == [False, True]
    with torch.no_grad():
        x = torch.randn(3, 6)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


def test_auto_plans_strassen_for_a_large_bias_free_linear():
    """With the H100 calibration the planner picks Strassen for a large root nn.Linear without
    bias (kernels off: the interpreter is too slow at this size; the plan is what is tested)."""
    model = nn.Linear(2048, 2048, bias=False).eval()
    x = torch.randn(1024, 2048)
    opt = fxfuse.optimize(model, x, strict=True, strassen="auto", strassen_levels=2, calibration=H100,
                          use_kernels=False)
    (plan,) = _graph(opt).meta["fxfuse_plans"]
    assert plan["choice"].startswith("strassen") and rewrites(opt, "strassen") == 1
    with torch.no_grad():
        x = torch.randn(1024, 2048)
        ref = model.double()(x.double())
        model.float()
        assert _rel(opt(x), ref) <= 3 * _rel(model(x), ref) + 1e-6


def test_fp32_linear_cast_to_double():
    """verify judges a float64 output of fp32 work by fp32's tolerance (api._loosest_tolerance)."""
    check(Fn(lambda s, x: (s.l(x) + 1).double() * 3, l=nn.Linear(6, 5)), torch.randn(3, 6), "gemm")
