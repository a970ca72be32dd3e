"""The fully fused MLP (passes/fuse_mlp.py, fxfuse/mlp_kernel.py): CPU tensors under the Triton
interpreter, and (marked cuda) compiled kernels on a GPU.

Every test asserts the fast path was taken (how many fused-MLP modules the graph holds, how
many launches they made, no reference fallbacks) and compares a fresh input against eager
and a float64 reference. Shapes are tiny and irregular so every mask and padded lane is hit.
"""
import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.mlp_kernel import (FusedMLP, KernelConfig, Linear, MLPSpec, Pointwise, choose_config,  # noqa: E402
                                tile_of, why_not_kernel)
from fxfuse.passes.fuse_mlp import should_fuse_mlp  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


pytestmark = pytest.mark.usefixtures("kernel_backend")   # conftest.py: interpreter or GPU


def mlp(widths, act=nn.ReLU, inplace=True):
    mods = []
    for k, n in zip(widths[:-1], widths[1:]):
        mods += [nn.Linear(k, n), act(inplace=True) if inplace else act()]
    return nn.Sequential(*mods).eval()


def fused_modules(opt):
    spec = next(iter(opt._specializations.values()))
    return [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def check(model, x_shape, dtype=torch.float32, expect_modules=1, **options):
    """Optimize on one input, run a fresh one; returns the optimized module."""
    torch.manual_seed(0)
    model = model.to(dtype)
    opt = fxfuse.optimize(model, torch.randn(x_shape, dtype=dtype), fused_mlp="force", strict=True, **options)
    mods = fused_modules(opt)
    assert len(mods) == expect_modules
    x = torch.randn(x_shape, dtype=dtype)
    with torch.no_grad():
        got, want = opt(x), model(x)
        ref = copy.deepcopy(model).double()(x.double())
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, ref) < TOL[dtype] + 2 * rel_err(want, ref), (rel_err(got, ref), rel_err(want, ref))
    assert all(m.launches >= 1 and m.fallbacks == 0 for m in mods)
    return opt


def test_eight_layer_mlp_is_one_launch():
    model = mlp([13] + [24] * 8)
    opt = check(model, (5, 13))
    (mod,) = fused_modules(opt)
    assert mod.launches == 2                 # verify call + the fresh input: one launch each
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] == 1 and s["library_calls"] == 0 and s["reference_fallbacks"] == 0
    assert len(mod.spec.linears) == 8
    assert "fused MLP: 8 Linear layer(s)" in fxfuse.explain(opt)


@pytest.fixture
def narrow_auto(monkeypatch):
    """The "auto" rule as it was before the H100 measurement said no everywhere (widths <= 256):
    these tests check which regions auto picks and how it cuts them, not the thresholds."""
    import fxfuse.passes.fuse_mlp as pass_module
    monkeypatch.setattr(pass_module, "AUTO_MAX_WIDTH", 256)
    monkeypatch.setattr(pass_module, "AUTO_MAX_ROWS", 16384)
    monkeypatch.setattr(pass_module, "planned_choice", lambda node: None)   # no cost-model plan: the rule


def test_auto_default_declines_and_says_why():
    from fxfuse.demo import seed_network
    opt = fxfuse.optimize(seed_network(128, 8), torch.randn(1, 128), strict=True)
    assert not fused_modules(opt)
    gm = next(iter(opt._specializations.values())).gm
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 8 and all("the cost model chose library" in n.meta["fxfuse"]["fused_mlp"]
                                     for n in linears)
    assert all(n.meta["fxfuse"]["plan"]["choice"] == "library" for n in linears)
    assert "no 'mlp' table" in linears[0].meta["fxfuse"]["plan"]["reasons"]["mlp"]
    assert "cost model: library" in fxfuse.explain(opt)


def test_seed_network_auto_fused(narrow_auto):
    from fxfuse.demo import seed_network
    model = seed_network(128, 8)
    opt = fxfuse.optimize(model, torch.randn(1, 128), strict=True)       # default: fused_mlp="auto"
    (mod,) = fused_modules(opt)
    assert mod.config.rowwise and fxfuse.stats(opt)["library_calls"] == 0
    x = torch.randn(1, 128)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch", [1, 5, 37])
@pytest.mark.parametrize("widths", [[7, 13, 24, 7], [24, 7, 13], [13, 13]])
def test_irregular_sizes(batch, widths, dtype):
    check(mlp(widths), (batch, widths[0]), dtype)


def test_wide_tiles_and_leading_dims():
    # 100 -> 130 -> 40: row-wise, 1 x 2 and 2 x 1 GEMV tiles of 128 lanes (the second Linear
    # reads transposed tiles); x is 3-D (rows flattened)
    opt = check(mlp([100, 130, 40]), (2, 3, 100))
    assert fused_modules(opt)[0].config.rowwise
    opt = check(mlp([100, 130, 40]), (2, 300, 100))   # 600 rows: the tl.dot form, 64-lane tiles
    assert not fused_modules(opt)[0].config.rowwise


def test_row_wise_residual_across_tiles():
    # width 150: two 128-lane tiles per value; the residual adds values that come out of sums
    # over different axes (module docstring of mlp_kernel), and x is read again at the end
    opt = check(ResidualChain(150).eval(), (3, 150))
    (mod,) = fused_modules(opt)
    assert mod.config.rowwise and len(mod.spec.linears) == 3


@pytest.mark.parametrize("act", [nn.Sigmoid, nn.GELU, nn.Tanh, nn.SiLU, nn.LeakyReLU, nn.ELU,
                                 nn.Softplus, nn.Hardswish, nn.Mish, nn.ReLU6])
def test_activations(act):
    # sigmoid, softplus and friends have f(0) != 0: padded lanes (13 of 16) must not leak
    mods = []
    for k, n in [(13, 24), (24, 13), (13, 7)]:
        mods += [nn.Linear(k, n), act()]
    check(nn.Sequential(*mods).eval(), (37, 13))


@pytest.mark.parametrize("batch", [1, 37])
def test_single_linear_is_an_epilogue_fused_gemm(batch):
    # one Linear + bias + GELU: a legal "chain" of one layer, one launch, no library call left
    opt = check(nn.Sequential(nn.Linear(13, 7), nn.GELU()).eval(), (batch, 13))
    (mod,) = fused_modules(opt)
    assert len(mod.spec.linears) == 1 and fxfuse.stats(opt)["library_calls"] == 0


class ResidualChain(nn.Module):
    def __init__(self, n=13):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(n, n), nn.Linear(n, n), nn.Linear(n, 7)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = h + torch.relu(self.fc2(h))      # residual inside the chain
        return self.fc3(x + h) * 0.5         # the chain's input read again


def test_residual_inside_chain():
    opt = check(ResidualChain().eval(), (5, 13))
    (mod,) = fused_modules(opt)
    assert len(mod.spec.linears) == 3



class BranchOnInput(nn.Module):
    """A second Linear reads the chain's input x again (fuzz: three launches, not one)."""

    def __init__(self, n=13):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(n, 20), nn.Linear(n, 20), nn.Linear(20, 6)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc1(x)) + self.fc2(x))


class PrefixThenResidual(nn.Module):
    """A pointwise op before the first Linear and the original x added back at the end (fuzz:
    the prefix moved the chain's input after the residual had been refused)."""

    def __init__(self, n=13):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(n, 24), nn.Linear(24, n)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x * 0.5 + 1.0))) + x


class SecondHeadOnInput(nn.Module):
    """A Linear on x whose result leaves the model on its own: the chain is still one region."""

    def __init__(self, n=13):
        super().__init__()
        self.head = nn.Linear(n, 3)
        self.chain = mlp([n, 24, 24, 5])

    def forward(self, x):
        return self.head(x), self.chain(x)


@pytest.mark.parametrize("rows", [1, 19])      # row-wise form, tl.dot form
def test_branches_reading_the_input_join_the_chain(rows):
    opt = check(BranchOnInput().eval(), (rows, 13))
    (mod,) = fused_modules(opt)
    assert len(mod.spec.linears) == 3 and fxfuse.stats(opt)["library_calls"] == 0
    opt = check(PrefixThenResidual().eval(), (rows, 13))
    (mod,) = fused_modules(opt)
    first, last = mod.spec.steps[0], mod.spec.steps[-1]          # x * 0.5 ... + x, both on x itself
    assert len(mod.spec.linears) == 2 and first.op == "mul" and last.op == "add" and ("value", 0) in last.operands


def test_a_second_head_on_the_input_does_not_cut_the_chain():
    model = SecondHeadOnInput().eval()
    opt = fxfuse.optimize(model, torch.randn(5, 13), fused_mlp="force", strict=True)
    assert sorted(len(m.spec.linears) for m in fused_modules(opt)) == [1, 3]   # the chain whole; the head
    # (tried again after the chain's region took x's other reader) is a kernel of its own under "force"
    x = torch.randn(5, 13)
    with torch.no_grad():
        for g, w in zip(opt(x), model(x)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)

class ScaledChain(nn.Module):
    """Division by a constant vector: padded lanes compute 0 / 0 = nan, which must stay out."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 13), nn.Linear(13, 5)
        self.register_buffer("scale", torch.rand(13) + 0.5)
        self.register_buffer("shift", torch.tensor(0.25))

    def forward(self, x):
        return self.fc2(torch.sigmoid(self.fc1(x) / self.scale - self.shift))


@pytest.mark.filterwarnings("ignore:invalid value encountered")   # numpy, on the padded lanes
def test_constant_vectors_and_nan_in_padded_lanes():
    opt = check(ScaledChain().eval(), (37, 7))
    with torch.no_grad():
        assert not torch.isnan(opt(torch.randn(37, 7))).any()


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = mlp([13, 24, 24])
        self.b = mlp([24, 7])

    def forward(self, x):
        h = self.a(x)
        return h, self.b(h)


def test_value_read_outside_splits_the_chain():
    model = TwoOutputs().eval()
    opt = fxfuse.optimize(model, torch.randn(5, 13), fused_mlp="force", strict=True)
    mods = fused_modules(opt)
    assert len(mods) == 2 and [len(m.spec.linears) for m in mods] == [2, 1]
    x = torch.randn(5, 13)
    with torch.no_grad():
        for g, w in zip(opt(x), model(x)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_auto_leaves_wide_chains_alone_and_says_why(narrow_auto):
    model = mlp([300, 300])
    opt = fxfuse.optimize(model, torch.randn(2, 300), strict=True, gemm="off")  # (auto would take it)
    assert not fused_modules(opt)
    gm = next(iter(opt._specializations.values())).gm
    (linear,) = [n for n in gm.graph.nodes if n.target is F.linear]
    assert "widths up to 300" in linear.meta["fxfuse"]["fused_mlp"]
    assert should_fuse_mlp(4, [128, 128], torch.float32)[0]
    assert not should_fuse_mlp(4, [512, 128], torch.float32)[0]


def test_auto_fuses_the_narrow_middle_of_a_wide_model(narrow_auto):
    # 300 -> 24 stays a library GEMM, its bias add + ReLU join the kernel as a prefix; the
    # 300-wide head is cut off the chain (the longest narrow prefix is kept)
    model = nn.Sequential(nn.Linear(300, 24), nn.ReLU(), nn.Linear(24, 13), nn.Tanh(), nn.Linear(13, 24),
                          nn.ReLU(), nn.Linear(24, 300)).eval()
    opt = fxfuse.optimize(model, torch.randn(5, 300), strict=True)
    (mod,) = fused_modules(opt)
    assert len(mod.spec.linears) == 2 and mod.spec.widths[0] == 24
    assert [m.split("=")[1] for m in mod.members[:2]] == ["add", "relu"]
    x = torch.randn(5, 300)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert mod.launches == 2 and mod.fallbacks == 0


def test_auto_fuses_narrow_and_off_disables(narrow_auto):
    model = mlp([13, 24, 24])
    assert len(fused_modules(fxfuse.optimize(model, torch.randn(3, 13), strict=True))) == 1
    opt = fxfuse.optimize(model, torch.randn(3, 13), fused_mlp="off", strict=True)
    assert not fused_modules(opt) and fxfuse.stats(opt)["fused_kernels"] == 2   # bias+relu per layer
    assert not fused_modules(fxfuse.optimize(model, torch.randn(3, 13), fuse=False, strict=True))
    with pytest.raises(fxfuse.FxfuseError, match="fused_mlp"):
        fxfuse.optimize(model, torch.randn(3, 13), fused_mlp="sometimes", strict=True)


def test_reference_fallback_without_kernels():
    model = mlp([13, 24, 7])
    opt = fxfuse.optimize(model, torch.randn(4, 13), fused_mlp="force", use_kernels=False, strict=True)
    (mod,) = fused_modules(opt)
    x = torch.randn(4, 13)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert mod.launches == 0 and mod.fallbacks >= 1


def test_kernel_serves_other_batches_and_strides():
    model = mlp([13, 24, 7])
    opt = fxfuse.optimize(model, torch.randn(4, 13), fused_mlp="force", strict=True)
    (mod,) = fused_modules(opt)
    with torch.no_grad():
        for x in (torch.randn(19, 13), torch.randn(13, 3).t(), torch.randn(0, 13)):
            torch.testing.assert_close(mod(x), model(x), rtol=1e-5, atol=1e-5)
    assert mod.fallbacks == 0


def test_precision_follows_tf32_flag():
    spec = MLPSpec((13, 7), (Linear(1, 0, 0),), 1, torch.float32)
    assert choose_config(spec, 64, allow_tf32=False).precision == "ieee"
    assert choose_config(spec, 64, allow_tf32=True).precision == "tf32"
    assert choose_config(spec.__class__((13, 7), spec.steps, 1, torch.float16), 64, True).precision == "ieee"
    ref = torch.fx.symbolic_trace(nn.Identity())
    for cfg, want in ((KernelConfig(precision="tf32"), 'input_precision="tf32"'),
                      (KernelConfig(), 'input_precision="ieee"')):
        assert want in FusedMLP(spec, [torch.randn(7, 13)], [], ref, (), config=cfg).source
    half = MLPSpec((13, 7), (Linear(1, 0, 0),), 1, torch.float16)
    assert "input_precision" not in FusedMLP(half, [torch.randn(7, 13).half()], [], ref, ()).source


def relu_mlp_spec(layers, dtype):
    """The spec the pass builds for Sequential(Linear, ReLU, ...): linear, bias add, relu."""
    widths, steps = [layers[0].in_features], []
    for k, lin in enumerate(layers):
        n = lin.out_features
        steps += [Linear(len(widths), len(widths) - 1, k),
                  Pointwise(len(widths) + 1, "add", (("value", len(widths)), ("vector", k))),
                  Pointwise(len(widths) + 2, "relu", (("value", len(widths) + 1),))]
        widths += [n, n, n]
    return MLPSpec(tuple(widths), tuple(steps), len(widths) - 1, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [KernelConfig(block_m=1, rowwise=True), KernelConfig(block_m=1, rowwise=True, num_warps=1),
                                    KernelConfig(block_m=16), KernelConfig(block_m=32, max_tile=16)],
                         ids=["rows", "rows_w1", "dot16", "dot32_tile16"])
def test_every_kernel_form(config, dtype):
    torch.manual_seed(0)
    model = mlp([24, 40, 13, 7], inplace=False).to(dtype)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    mod = FusedMLP(relu_mlp_spec(layers, dtype), [l.weight for l in layers], [l.bias for l in layers],
                   torch.fx.symbolic_trace(model), (), config=config)
    x = torch.randn(37, 24, dtype=dtype)
    with torch.no_grad():
        got, ref = mod(x), copy.deepcopy(model).double()(x.double())
        want = model(x)
    assert mod.launches == 1
    assert rel_err(got, ref) < TOL[dtype] + 2 * rel_err(want, ref)


def test_tiles_and_limits():
    assert tile_of(7) == (16, 1) and tile_of(24) == (32, 1) and tile_of(130) == (64, 3)
    assert tile_of(1024) == (128, 8)
    wide = MLPSpec((2048, 2048), (Linear(1, 0, 0),), 1, torch.float32)
    assert "2048" in why_not_kernel(wide)
    assert "dtype" in why_not_kernel(MLPSpec((8, 8), (Linear(1, 0, 0),), 1, torch.float64))
    relu_only = MLPSpec((8, 8), (Pointwise(1, "relu", (("value", 0),)),), 1, torch.float32)
    assert "no Linear" in why_not_kernel(relu_only)


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.cuda   # each case compiles its own kernel: kept few
@pytest.mark.parametrize("batch,hidden,dtype", [(1, 128, F32), (37, 24, F32), (64, 128, F32), (16, 256, F32),
                                                (5000, 64, F32), (1, 128, F16), (64, 128, F16), (37, 24, BF16)])
def test_gpu_seed_mlp_is_one_launch(batch, hidden, dtype):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = mlp([hidden] * 9).to(device="cuda", dtype=dtype)
        opt = fxfuse.optimize(model, torch.randn(batch, hidden, device="cuda", dtype=dtype), strict=True,
                              fused_mlp="force")   # "auto" asks the calibrated cost model, which may say no
        (mod,) = fused_modules(opt)
        assert next(iter(opt._specializations.values())).cuda_graph_note.startswith("captured")
        x = torch.randn(batch, hidden, device="cuda", dtype=dtype)
        with torch.no_grad():
            got, want = opt(x), model(x)
            ref = copy.deepcopy(model).double()(x.double())
        assert rel_err(got, ref) < TOL[dtype] + 2 * rel_err(want, ref)
        assert mod.launches >= 1 and mod.fallbacks == 0
        assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.cuda
@pytest.mark.parametrize("rows,dtype", [(1, F32), (19, F32), (300, F32), (1, F16), (40, BF16)])
def test_gpu_branches_and_residuals_in_one_launch(rows, dtype):
    """Chains whose values mix the row-wise form's two layouts (x + h with h out of an odd
    number of Linears) and read x twice: Triton converts the layouts; the answer must not move."""
    for model in (ResidualChain(), BranchOnInput(), PrefixThenResidual()):
        torch.manual_seed(0)
        model = model.eval().to(device="cuda", dtype=dtype)
        x = torch.randn(rows, 13, device="cuda", dtype=dtype)
        opt = fxfuse.optimize(model, x, strict=True, fused_mlp="force")
        assert len(fused_modules(opt)) == 1 and fxfuse.stats(opt)["library_calls"] == 0, type(model).__name__
        x = torch.randn(rows, 13, device="cuda", dtype=dtype)
        with torch.no_grad():
            got, want = opt(x), model(x)
            ref = copy.deepcopy(model).double()(x.double())
        assert rel_err(got, ref) < TOL[dtype] + 2 * rel_err(want, ref), type(model).__name__
