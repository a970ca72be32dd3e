"""Residual MLP chains in the cost model's plan (passes/plan_linears.py).

A ResMLP block `h + act(lin(h))` reads h twice. The plan used to end a chain at every residual
add, so under "auto" each such layer was planned alone and the fused MLP (which keeps h on
chip) was never offered. These tests check that a residual link continues the chain, that
only a true residual of the Linear's own input does, that the plan and the fused-MLP pass agree
on what they fuse, and that results match eager and float64 on fresh random inputs (CPU tensors
under the Triton interpreter)."""
import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402
import fxfuse.cost_model  # noqa: E402
from fxfuse.mlp_kernel import FusedMLP  # noqa: E402

H100 = str(fxfuse.cost_model.CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json")

pytestmark = pytest.mark.usefixtures("kernel_backend")   # conftest.py: interpreter or GPU


class ResMLP(nn.Module):
    """layers x (h = h + act(lin(h))), in one of several spellings."""

    def __init__(self, width, layers, spelling="x+f", post=None):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.spelling, self.post = spelling, post

    def forward(self, h):
        for lin in self.lins:
            y = torch.relu(lin(h))
            if self.spelling == "x+f":
                h = h + y
            elif self.spelling == "f+x":
                h = y + h
            elif self.spelling == "torch.add":
                h = torch.add(h, y)
            elif self.spelling == "alpha":
                h = torch.add(h, y, alpha=0.5)
            if self.post is not None:
                h = self.post(h)
        return h


def _build(model, x, **options):
    opt = fxfuse.optimize(model, x, calibration=H100, strict=True, **options)
    spec = next(iter(opt._specializations.values()))
    plans = spec.gm.meta.get("fxfuse_plans", [])
    mlps = [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]
    return opt, plans, mlps


def _check(opt, model, x):
    with torch.no_grad():
        got, want, ref = opt(x), model(x), copy.deepcopy(model).double()(x.double())

    def err(a):
        return ((a.double() - ref).norm() / ref.norm()).item()
    assert err(got) < 1e-5 + 2 * err(want), (err(got), err(want))


def test_residual_chain_is_one_looped_kernel_under_auto():
    """6 x (h + relu(lin(h))) at 1100 rows, width 100 (padded lanes): before, 6 library GEMMs and
    6 pointwise kernels; now one looped kernel, the plan's chain spanning all six layers."""
    torch.manual_seed(0)
    model = ResMLP(100, 6).eval()
    opt, plans, mlps = _build(model, torch.randn(1100, 100))
    assert [p["choice"] for p in plans] == ["mlp"] * 6
    assert len({p["chain"] for p in plans}) == 1
    (mod,) = mlps
    assert mod.config.looped and len(mod.spec.linears) == 6
    assert fxfuse.stats(opt)["kernel_launches"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    _check(opt, model, torch.randn(1100, 100))


@pytest.mark.parametrize("spelling,post,rows", [("f+x", None, 16), ("torch.add", None, 600), ("x+f", torch.tanh, 600),
                                                ("f+x", torch.sigmoid, 5)])
def test_plan_and_pass_agree_on_residual_spellings(spelling, post, rows):
    torch.manual_seed(1)
    model = ResMLP(48, 3, spelling, post).eval()
    opt, plans, mlps = _build(model, torch.randn(rows, 48))
    assert len({p["chain"] for p in plans}) == 1, "a residual link ended the chain"
    planned = sum(p["choice"] == "mlp" for p in plans)
    assert planned == 3 and sum(len(m.spec.linears) for m in mlps) == planned
    _check(opt, model, torch.randn(rows, 48))


def test_add_with_alpha_is_planned_and_correct():
    """torch.add(h, f(h), alpha=0.5): eager computes h + 0.5 * f(h) as one fused multiply-add,
    which normalize keeps (fxfuse.ops.add_scaled; as `h + f(h) * 0.5`, rounded twice, it lost
    every bit where the terms cancel: fuzz34e). It is no plain residual add, so each layer is a
    chain of its own; all three are planned, and the result is eager's."""
    torch.manual_seed(2)
    model = ResMLP(48, 3, "alpha").eval()
    opt, plans, mlps = _build(model, torch.randn(16, 48))
    assert len(plans) == 3 and all(p["choice"] in ("mlp", "gemm", "library") for p in plans)
    _check(opt, model, torch.randn(16, 48))


class SkipFromElsewhere(nn.Module):
    """The add's other operand is not the Linear's input, or the skip has a third reader."""

    def __init__(self, width, third_reader):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.third_reader = third_reader

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.third_reader:
            h2 = h + torch.relu(self.b(h))
            return h2 * h.sum(-1, keepdim=True)
        return x + torch.relu(self.b(h))     # x is not b's input


@pytest.mark.parametrize("third_reader", [False, True])
def test_only_a_residual_of_the_linears_own_input_links(third_reader):
    torch.manual_seed(3)
    model = SkipFromElsewhere(40, third_reader).eval()
    opt, plans, mlps = _build(model, torch.randn(12, 40))
    chains = {p["chain"] for p in plans}
    if third_reader:
        assert len(chains) == 2, "a skip read a third time kept the chain"
    else:    # a's output feeds b through a single reader: one chain; x + ... is b's epilogue only
        assert len(chains) == 1
    planned = sum(p["choice"] == "mlp" for p in plans)
    assert sum(len(m.spec.linears) for m in mlps) == planned
    _check(opt, model, torch.randn(12, 40))


@pytest.mark.cuda
@pytest.mark.parametrize("rows,width", [(1, 128), (1024, 128), (777, 100)])
def test_gpu_residual_chain_under_auto(rows, width):
    """On the GPU with the shipped calibration: a residual chain is planned and run as fused
    MLP kernel(s) and matches eager and float64."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = ResMLP(width, 8).cuda().eval()
        opt = fxfuse.optimize(model, torch.randn(rows, width, device="cuda"), strict=True)
        spec = next(iter(opt._specializations.values()))
        plans = spec.gm.meta.get("fxfuse_plans", [])
        mlps = [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]
        assert len({p["chain"] for p in plans}) == 1
        assert sum(len(m.spec.linears) for m in mlps) == sum(p["choice"] == "mlp" for p in plans)
        for _ in range(2):
            _check(opt, model, torch.randn(rows, width, device="cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class Gated(nn.Module):
    """h + g_i * relu(lin_i(h)), g a [w] vector in even layers and a scalar in odd ones."""

    def __init__(self, width, layers=4):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.gates = nn.ParameterList(nn.Parameter(torch.rand(width if i % 2 == 0 else 1)) for i in range(layers))

    def forward(self, h):
        for lin, g in zip(self.lins, self.gates):
            h = h + g * torch.relu(lin(h))
        return h


class Broadcast(nn.Module):
    """A residual add that broadcasts (lin: w -> 1) is no residual of the layer's width."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, 1), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h):
        h = h + torch.relu(self.a(h))
        h = h + torch.relu(self.b(h))
        return self.c(h)


class OuterSkip(nn.Module):
    """x + mlp(x): the last layer's epilogue takes the skip, so it differs from the others."""

    def __init__(self, width, layers=4):
        super().__init__()
        self.mlp = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x):
        return x + self.mlp(x)


@pytest.mark.parametrize("make,rows,width", [(Gated, 1100, 100), (Broadcast, 16, 48), (OuterSkip, 1100, 100)])
def test_review_findings_plan_and_pass_agree(make, rows, width):
    """The plan chooses "mlp" for exactly the Linears the fused-MLP pass fuses (review of the
    residual planning: constants of other sizes counted as identical, a broadcasting add linked
    as a residual, a trailing skip add not counted in the last layer)."""
    torch.manual_seed(4)
    model = make(width).eval()
    opt, plans, mlps = _build(model, torch.randn(rows, width))
    runs = {}
    for p in plans:
        if p["choice"] == "mlp":
            runs.setdefault((p["chain"], p["segment"]), []).append(p["node"])
    fused = [[member.split("=")[0] for member in m.members if member.endswith("=linear")] for m in mlps]
    assert sorted(runs.values()) == sorted(fused)
    _check(opt, model, torch.randn(rows, width))


def test_gemm_estimate_counts_where_the_skip_is_read():
    """fuse_gemm reads a skip inside the kernel (bytes at the output tile), the layer's own input
    or another tensor alike: no kernel after it."""
    from fxfuse.cost_model import CostModel, LinearLayer
    model = CostModel.load(H100, device_name="NVIDIA H100 80GB HBM3")
    base = dict(m=16, k=1024, n=1024, dtype=torch.float32, epilogue_ops=3)
    one = model.estimate("gemm", LinearLayer(**base, epilogue_reads=1)).us
    two = model.estimate("gemm", LinearLayer(**base, epilogue_reads=2)).us
    plain = model.estimate("gemm", LinearLayer(**base)).us
    assert plain <= one <= two < plain + 1.0   # 64 KB more per skip, not a kernel launch


class ThreeSkips(nn.Module):
    def __init__(self, width, dtype_c=torch.float32):
        super().__init__()
        self.fc, self.dtype_c = nn.Linear(width, width), dtype_c

    def forward(self, x, a, b, c):
        return (self.fc(x) + a) * b + c.to(self.dtype_c)


def test_plan_counts_the_skips_the_gemm_reads_and_prices_the_rest_as_a_kernel():
    """(fc(x) + a) * b + c: the GEMM's epilogue reads two skips (MAX_SKIPS); the plan's layer
    says so and its gemm estimate includes the kernel that adds c after it."""
    from fxfuse.cost_model import CostModel, LinearLayer
    width, rows = 768, 16   # where the H100 calibration plans the generated GEMM
    args = tuple(torch.randn(rows, width) for _ in range(4))
    opt = fxfuse.optimize(ThreeSkips(width).eval(), args, calibration=H100, fused_mlp="off", verify=False,
                          strict=True)
    gm = next(iter(opt._specializations.values())).gm
    (plan,) = gm.meta["fxfuse_plans"]
    assert (plan["layer"].epilogue_reads, plan["layer"].epilogue_reads_outside) == (3, 1)
    (g,) = [m for m in gm.modules() if type(m).__name__ == "EpilogueGemm"]
    assert len({ref for step in g.spec.epilogue for kind, ref in step.operands if kind == "skip"}) == 2
    model = CostModel.load(H100, device_name="NVIDIA H100 80GB HBM3")
    base = dict(m=rows, k=width, n=width, dtype=torch.float32, epilogue_ops=4, epilogue_reads=3)
    assert model.estimate("gemm", LinearLayer(**base, epilogue_reads_outside=1)).us > \
        model.estimate("gemm", LinearLayer(**base)).us + 1.0   # a launch more
    with torch.no_grad():
        args = tuple(torch.randn(rows, width) for _ in range(4))
        torch.testing.assert_close(opt(*args), opt.original(*args))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [7, 300])
def test_gpu_residual_in_the_gemm_epilogue(rows):
    """Compiled: the generated GEMM reads the layer's input at the output tile, one launch per
    residual layer (row-wise at 7 rows, tl.dot at 300)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = ResMLP(96, 3).cuda().eval()
        opt = fxfuse.optimize(model, torch.randn(rows, 96, device="cuda"), strict=True, gemm="force", fused_mlp="off")
        assert fxfuse.stats(opt)["fused_kernels"] == 3 and fxfuse.stats(opt)["library_calls"] == 0
        for _ in range(2):
            _check(opt, model, torch.randn(rows, 96, device="cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class PreNormBlock(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, h):
        return h + self.fc2(torch.relu(self.fc1(self.ln(h))))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [7, 300])
def test_gpu_skip_in_the_gemm_epilogue(rows):
    """Compiled, in the CUDA graph with PDL: fc2's epilogue reads the residual stream h (no input
    of fc2) at its output tile, so the add is no kernel of its own."""
    from fxfuse.gemm_kernel import EpilogueGemm
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = nn.Sequential(PreNormBlock(96, 160), PreNormBlock(96, 160)).cuda().eval()
        opt = fxfuse.optimize(model, torch.randn(2, rows, 96, device="cuda"), strict=True, gemm="force", fused_mlp="off")
        spec = next(iter(opt._specializations.values()))
        gemms = [m for m in spec.gm.modules() if isinstance(m, EpilogueGemm)]
        assert spec.graph is not None and len(gemms) == 4
        assert sum(("skip", 0) in s.operands for g in gemms for s in g.spec.epilogue) == 2
        assert fxfuse.stats(opt)["fused_kernels"] == 4 and fxfuse.stats(opt)["library_calls"] == 2   # LayerNorms
        for _ in range(2):
            _check(opt, model, torch.randn(2, rows, 96, device="cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
