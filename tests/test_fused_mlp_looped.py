"""The fused MLP's looped form (KernelConfig.looped): a chain of identical layers run as a loop
over layers in one kernel (fp32 IEEE, widths 65-128, past the row-wise batches).

CPU tensors under the Triton interpreter (tiny, irregular shapes; widths that are not a whole
tile, so padded lanes are hit) and, marked cuda, the compiled kernel on a GPU. Every test
asserts the form that ran (the config, the kernel's name, launches) and compares a fresh input
against eager and a float64 reference."""
import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
import fxfuse.cost_model  # noqa: E402
from fxfuse.mlp_kernel import (FusedMLP, KernelConfig, Linear, MLPSpec, Pointwise, choose_config,  # noqa: E402
                                layer_period, why_slow)

F32 = torch.float32


pytestmark = pytest.mark.usefixtures("kernel_backend")   # conftest.py: interpreter or GPU


def chain_spec(width, layers, acts=None, dtype=F32):
    """Linear, bias add, activation per layer, as passes/fuse_mlp lowers Sequential(Linear, act)."""
    acts = acts or ["relu"] * layers
    steps, v = [], 0
    for k, act in enumerate(acts):
        steps += [Linear(v + 1, v, k), Pointwise(v + 2, "add", (("value", v + 1), ("vector", k))),
                  Pointwise(v + 3, act, (("value", v + 2),))]
        v += 3
    return MLPSpec((width,) * (v + 1), tuple(steps), v, dtype)


def _moved(step, values, vectors):
    """step with value ids moved by `values` and vector indices by `vectors`."""
    if isinstance(step, Linear):
        return Linear(step.out + values, step.src + values, step.weight)
    return Pointwise(step.out + values, step.op, tuple((k, r + (values if k == "value" else vectors if k == "vector"
                                                                 else 0)) for k, r in step.operands), step.params)


def seq(width, layers, act=nn.ReLU):
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), act())]).eval()


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def test_layer_period_finds_identical_layers_only():
    numels = (100,) * 4
    assert layer_period(chain_spec(100, 4), numels) == (0, 3)
    lead = chain_spec(100, 3)   # the previous layer's bias add and ReLU absorbed in front (fuse_mlp's prefix)
    lead = MLPSpec((100,) * 12, (Pointwise(1, "add", (("value", 0), ("vector", 0))), Pointwise(2, "relu", (("value", 1),)))
                   + tuple(_moved(st, 2, 1) for st in lead.steps), 11, F32)
    assert layer_period(lead, (100,) * 4) == (2, 3)
    assert layer_period(chain_spec(100, 4, ["relu", "relu", "sigmoid", "relu"]), numels) is None
    assert layer_period(chain_spec(100, 4), (100, 100, 1, 100)) is None          # a scalar among biases
    narrowing = MLPSpec((100, 100, 100, 50, 50, 50), chain_spec(100, 2).steps, 6, F32)
    assert layer_period(narrowing, (100, 50)) is None
    skip = chain_spec(100, 2)   # layer 1 adds layer 0's input: reaches outside its layer
    skip = MLPSpec(skip.widths + (100,), skip.steps + (Pointwise(7, "add", (("value", 6), ("value", 0))),), 7, F32)
    assert layer_period(skip, (100, 100)) is None
    assert layer_period(chain_spec(100, 1), (100,)) is None                      # one layer: nothing to loop


def test_choose_config_loops_identical_fp32_layers_past_the_row_wise_batches():
    spec, numels = chain_spec(128, 8), (128,) * 8
    small, mid, big = (choose_config(spec, b, numels=numels) for b in (64, 1024, 4096))
    assert small.rowwise and not small.looped
    assert mid.looped and mid.block_m == 16 and mid.num_warps == 8 and mid.max_tile == 128
    assert big.looped and big.block_m == 32
    assert why_slow(spec, mid) is None
    assert not choose_config(spec, 1024, allow_tf32=True, numels=numels).looped      # tensor cores: tl.dot as before
    assert not choose_config(chain_spec(128, 8, dtype=torch.float16), 1024, numels=numels).looped
    assert not choose_config(chain_spec(64, 8), 1024, numels=(64,) * 8).looped        # one 64-lane tile already
    mixed = chain_spec(128, 8, ["relu"] * 7 + ["sigmoid"])
    unrolled = choose_config(mixed, 1024, numels=numels)
    assert not unrolled.looped and "10x slower" in why_slow(mixed, unrolled)


@pytest.mark.parametrize("width,act,batch", [(72, nn.Sigmoid, 37), (128, nn.ReLU, 20), (100, nn.GELU, 16)])
def test_looped_kernel_matches_eager(width, act, batch):
    """Sigmoid makes padded lanes 0.5: they must be masked before the next product."""
    torch.manual_seed(0)
    model = seq(width, 3, act)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    name = {nn.Sigmoid: "sigmoid", nn.ReLU: "relu", nn.GELU: "gelu"}[act]
    spec = chain_spec(width, 3, [name] * 3)
    config = KernelConfig(block_m=16, num_warps=8, max_tile=128, looped=True)
    mod = FusedMLP(spec, [l.weight for l in layers], [l.bias for l in layers], torch.fx.symbolic_trace(model), (),
                   config=config)
    assert "_loop_" in mod.kernel_name and "for g in range(3)" in mod.source
    x = torch.randn(batch, width)
    with torch.no_grad():
        got, want, ref = mod(x), model(x), copy.deepcopy(model).double()(x.double())
    assert mod.launches == 1 and mod.fallbacks == 0
    assert rel_err(got, ref) < 1e-5 + 2 * rel_err(want, ref)


def test_optimize_builds_the_looped_form_at_large_batch():
    """Through the pass: 600 rows (past the row-wise batches) of 3 x Linear(100) + ReLU."""
    torch.manual_seed(0)
    model = seq(100, 3)
    x = torch.randn(600, 100)
    opt = fxfuse.optimize(model, x, fused_mlp="force", strict=True)
    spec = next(iter(opt._specializations.values()))
    (mod,) = [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]
    assert mod.config.looped and mod.config.block_m == 16
    x = torch.randn(600, 100)
    with torch.no_grad():
        got, want, ref = opt(x), model(x), copy.deepcopy(model).double()(x.double())
    assert rel_err(got, ref) < 1e-5 + 2 * rel_err(want, ref)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0


def test_auto_fuses_the_identical_middle_of_an_mlp_with_a_head_and_a_tail():
    """Linear(40, 128), 6 x Linear(128, 128), Linear(128, 10) at 1100 rows, planned with the H100
    calibration: the six identical layers (and the head's bias + ReLU in front) become one looped
    kernel; the head and the tail stay with the library."""
    torch.manual_seed(0)
    mods = [nn.Linear(40, 128), nn.ReLU()] + [m for _ in range(6) for m in (nn.Linear(128, 128), nn.ReLU())]
    model = nn.Sequential(*mods, nn.Linear(128, 10)).eval()
    x = torch.randn(1100, 40)
    calibration = fxfuse.cost_model.CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json"
    opt = fxfuse.optimize(model, x, calibration=str(calibration), strict=True)
    spec = next(iter(opt._specializations.values()))
    (mod,) = [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]
    assert mod.config.looped and len(mod.spec.linears) == 6 and layer_period(mod.spec, (128,) * 7) == (2, 3)
    assert fxfuse.stats(opt)["library_calls"] == 2
    x = torch.randn(1100, 40)
    with torch.no_grad():
        got, want, ref = opt(x), model(x), copy.deepcopy(model).double()(x.double())
    assert rel_err(got, ref) < 1e-5 + 2 * rel_err(want, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("batch,width", [(1024, 128), (4096, 128), (777, 100)])
def test_gpu_looped_seed_mlp(batch, width):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = seq(width, 8).cuda()
        opt = fxfuse.optimize(model, torch.randn(batch, width, device="cuda"), strict=True, fused_mlp="force")
        spec = next(iter(opt._specializations.values()))
        (mod,) = [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]
        assert mod.config.looped
        x = torch.randn(batch, width, device="cuda")
        with torch.no_grad():
            got, want, ref = opt(x), model(x), copy.deepcopy(model).double()(x.double())
        assert rel_err(got, ref) < 1e-5 + 2 * rel_err(want, ref)
        assert mod.launches >= 1 and mod.fallbacks == 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_kernels_differing_only_in_a_vector_size_have_different_names():
    """A per-layer scale of shape [w] and one of shape [] give different sources: different names."""
    spec = MLPSpec((100,) * 7, tuple(st for k in range(3) for st in (
        Linear(2 * k + 1, 2 * k, k), Pointwise(2 * k + 2, "mul", (("value", 2 * k + 1), ("vector", k))))), 6, F32)
    config = KernelConfig(block_m=16, num_warps=8, max_tile=128, looped=True)
    weights = [torch.randn(100, 100) for _ in range(3)]
    ref = torch.fx.symbolic_trace(nn.Identity())
    vector = FusedMLP(spec, weights, [torch.randn(100) for _ in range(3)], ref, (), config=config)
    scalar = FusedMLP(spec, weights, [torch.tensor(2.0) for _ in range(3)], ref, (), config=config)
    assert vector.source != scalar.source and vector.kernel_name != scalar.kernel_name


def test_review_findings_stay_fixed():
    """Signed zeros are different literals; a layer whose vectors are read out of index order
    strides by the layer's first vector; a deep chain keeps the looped form (one layer's code)."""
    div = lambda zero: chain_spec(100, 2).steps[:1] + (Pointwise(2, "div", (("value", 1), ("number", zero))),)  # noqa: E731
    signed = MLPSpec((100,) * 5, div(0.0) + (Pointwise(3, "sigmoid", (("value", 2),)),
                                            Linear(4, 3, 1), Pointwise(5, "div", (("value", 4), ("number", -0.0))),
                                            Pointwise(6, "sigmoid", (("value", 5),))), 6, F32)
    signed = MLPSpec((100,) * 7, signed.steps, 6, F32)
    assert layer_period(signed, ()) is None
    steps = []
    for g in range(3):   # Linear, * vector 2g+1, + vector 2g
        v = 3 * g
        steps += [Linear(v + 1, v, g), Pointwise(v + 2, "mul", (("value", v + 1), ("vector", 2 * g + 1))),
                  Pointwise(v + 3, "add", (("value", v + 2), ("vector", 2 * g)))]
    spec = MLPSpec((72,) * 10, tuple(steps), 9, F32)
    torch.manual_seed(0)
    weights, vectors = [torch.randn(72, 72) / 9 for _ in range(3)], [torch.randn(72) for _ in range(6)]
    ref = torch.fx.symbolic_trace(nn.Identity())
    looped = FusedMLP(spec, weights, vectors, ref, (), config=KernelConfig(block_m=16, num_warps=8, max_tile=128,
                                                                          looped=True))
    unrolled = FusedMLP(spec, weights, vectors, ref, (), config=KernelConfig(block_m=16))
    x = torch.randn(20, 72)
    torch.testing.assert_close(looped(x), unrolled(x), rtol=1e-5, atol=1e-5)
    deep = chain_spec(128, 70)
    assert choose_config(deep, 4096, numels=(128,) * 70).looped


@pytest.mark.parametrize("options", [{}, {"calibration": "h100"}])
def test_a_long_chain_is_lowered_a_bounded_number_of_times(monkeypatch, options):
    """review29: on a 60-layer residual chain the pass lowered each start's region once per
    Linear dropped from its end (O(layers^2) lowerings, 6 s at 60 layers, 735 s of optimize at
    200). Under "auto" a Linear the cost model gave another candidate now cuts the region."""
    import glob

    import fxfuse.passes.fuse_mlp as pass_module

    class Chain(nn.Module):
        def __init__(self, layers=60, d=8):
            super().__init__()
            self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

        def forward(self, x):
            for fc in self.fc:
                x = x + F.gelu(fc(x)) * 0.5
            return x

    if options:
        options = {"calibration": sorted(glob.glob(os.path.join(os.path.dirname(fxfuse.__file__), "calibration",
                                                                 "nvidia-h100*.json")))[0]}
    lowered = []
    original = pass_module._lower
    monkeypatch.setattr(pass_module, "_lower", lambda *a: lowered.append(1) or original(*a))
    model = Chain().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 3, 8), strict=True, **options)
    assert len(lowered) <= 2 * 60, len(lowered)
    assert fxfuse.stats(opt)["fused_kernels"] == (1 if options else 60)   # one fused MLP (H100 plan), or the epilogues
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
