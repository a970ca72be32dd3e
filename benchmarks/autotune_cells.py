"""Autotune's measurements: one Cell per (section, dtype, shape), timed the way fxfuse runs.

The cells (what each calibration table measures and how its kernel is checked against torch
before it is timed) live here; benchmarks/autotune.py plans them, runs them with time limits
(some in a child process), and writes the calibration file.
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.cost_model import DTYPE_NAMES
from fxfuse.library_choice import graph_of_calls

from . import common

MLP_LAYERS = 8
GRAPH_TARGET_US = 300.0     # calls per graph: enough for ~300 us of work, at most 64
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class Cell:
    """One measurement: `run()` returns {table: us} for the tables listed, at `point`."""
    section: str
    dtype: torch.dtype
    point: dict                 # axis name -> value, e.g. {"m": 64, "h": 1024}
    tables: tuple
    run: Callable
    isolated: bool = False      # compiles may run for minutes: measure in a child the parent can kill
    kernel: tuple | None = None  # cells with the same key compile the same kernel

    @property
    def label(self):
        return f"{self.section} {DTYPE_NAMES[self.dtype]} " + " ".join(f"{k}={v}" for k, v in self.point.items())


# ---------------------------------------------------------------------------- timing

def per_call_us(fn, device, args) -> float:
    """Per-call time of fn(): replayed from a CUDA graph of back-to-back calls (CPU: eager)."""
    probe = [torch.empty(1, device=device)]
    if device.type != "cuda":
        return common.time_per_call(lambda _: fn(), probe, reps=args.reps, min_rep_s=args.min_rep_ms / 1e3).us
    graph, calls = graph_of_calls(fn, GRAPH_TARGET_US, 64)
    t = common.time_per_call(lambda _: graph.replay(), probe, reps=args.reps, min_rep_s=args.min_rep_ms / 1e3)
    return t.us / calls


def randn(*shape, dtype, device):
    return torch.randn(*shape, device=device).to(dtype)


def check_close(got, want, dtype, what):
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if not err <= TOLERANCE[dtype]:
        raise RuntimeError(f"{what} is wrong: relative error {err:.1e} > {TOLERANCE[dtype]:.0e}")


def fused_modules(opt, cls):
    gm = next(iter(opt._specializations.values())).gm
    return gm, [m for m in gm.modules() if isinstance(m, cls)]


def assert_fast_path(modules):
    if not modules or any(m.launches == 0 or m.fallbacks for m in modules):
        raise RuntimeError("the generated kernel did not run (torch-reference fallback)")


# ---------------------------------------------------------------------------- cells

def linear_cells(dtype, grid, device, args):
    def run(m, h):
        x, w, b = (randn(*s, dtype=dtype, device=device) for s in ((m, h), (h, h), (h,)))
        return {"linear": per_call_us(lambda: F.linear(x, w), device, args),
                "linear_bias": per_call_us(lambda: F.linear(x, w, b), device, args)}
    return [Cell("linear", dtype, {"m": m, "h": h}, ("linear", "linear_bias"), lambda m=m, h=h: run(m, h))
            for h in grid["h"] for m in grid["m"]]


def bmm_cells(dtype, grid, device, args, tf32x3=False):
    """Strassen's product call: torch.bmm, or (tf32x3) fxfuse.tf32x3.bmm_tf32x3 over the
    Strassen rows, checked against torch.bmm first."""
    from fxfuse.tf32x3 import bmm_tf32x3, stored_parts
    suffix = "_tf32x3" if tf32x3 else ""

    def run(level, m, h):
        s, r = 1 << level, 7 ** level
        a = randn(r, -(-m // s), h // s, dtype=dtype, device=device)
        b = randn(r, h // s, h // s, dtype=dtype, device=device)
        if not tf32x3:
            return {f"bmm{r}": per_call_us(lambda: torch.bmm(a, b), device, args)}
        # as the Strassen pass stores it for this kernel: TF32 parts, K-major (strassen_rewrite._k_major)
        b = b.transpose(1, 2)
        hi, lo = (p.transpose(1, 2).contiguous().transpose(1, 2) for p in stored_parts(b))
        check_close(bmm_tf32x3(a, hi, lo), torch.bmm(a, b), dtype, "the 3xTF32 batched GEMM")
        return {f"bmm{r}{suffix}": per_call_us(lambda: bmm_tf32x3(a, hi, lo), device, args)}
    rows = grid["strassen_m"] if tf32x3 else grid["m"]
    return [Cell(f"bmm{7 ** lv}{suffix}", dtype, {"m": m, "h": h}, (f"bmm{7 ** lv}{suffix}",),
                 lambda lv=lv, m=m, h=h: run(lv, m, h))
            for lv in (1, 2) for h in grid["h"] if h >= grid["bmm_min_h"] for m in rows]


def bmm_x3_cells(dtype, grid, device, args):
    return bmm_cells(dtype, grid, device, args, tf32x3=True)


class AddRelu(nn.Module):
    def __init__(self, b):
        super().__init__()
        self.b = nn.Parameter(b, requires_grad=False)

    def forward(self, x):
        return torch.relu(x + self.b)


def pointwise_cells(dtype, grid, device, args):
    """relu(x + b) on [rows, 1024] as fxfuse generates it; point = bytes moved."""
    import fxfuse
    from fxfuse.kernel import FusedKernel

    def run(rows):
        x = randn(rows, 1024, dtype=dtype, device=device)
        model = AddRelu(randn(1024, dtype=dtype, device=device)).eval()
        opt = fxfuse.optimize(model, x, strict=True, cuda_graphs=False)
        gm, kernels = fused_modules(opt, FusedKernel)
        check_close(gm(x), model(x), dtype, "the pointwise kernel")
        us = per_call_us(lambda: gm(x), device, args)
        assert_fast_path(kernels)
        return {"pointwise": us}
    elt = torch.empty((), dtype=dtype).element_size()
    return [Cell("pointwise", dtype, {"bytes": elt * (2 * rows * 1024 + 1024)}, ("pointwise",),
                 lambda rows=rows: run(rows)) for rows in grid["rows"]]


def gemm_cells(dtype, grid, device, args, tf32x3=False):
    """fxfuse's epilogue GEMM, relu(x @ W.T + b), in the config fxfuse would choose for m
    (tf32x3: the fp32 GEMM in 3xTF32, table gemm_tf32x3, over its own rows and up to the
    grid's widest layer: it competes with Strassen there)."""
    from fxfuse.gemm_kernel import EpilogueGemm, GemmSpec, Pointwise, choose_gemm_config
    table = "gemm_tf32x3" if tf32x3 else "gemm_epilogue"

    def run(m, h):
        model = nn.Sequential(nn.Linear(h, h), nn.ReLU()).eval().to(device=device, dtype=dtype)
        spec = GemmSpec(h, h, dtype, (Pointwise(1, "add", (("value", 0), ("vector", 0))),
                                      Pointwise(2, "relu", (("value", 1),))), 2)
        mod = EpilogueGemm(spec, model[0].weight, [model[0].bias], torch.fx.symbolic_trace(model), (),
                           config=choose_gemm_config(m, spec, allow_tf32=False, tf32x3=tf32x3))
        if tf32x3 and mod.config.precision != "tf32x3":
            raise RuntimeError(f"{m} rows do not run in 3xTF32 ({mod.config}): not a gemm_tf32x3 point")
        x = randn(m, h, dtype=dtype, device=device)
        check_close(mod(x), model(x), dtype, f"the epilogue GEMM ({mod.config.precision})")
        us = per_call_us(lambda: mod(x), device, args)
        assert_fast_path([mod])
        return {table: us}
    rows = grid["x3_m"] if tf32x3 else grid["m"]
    return [Cell("gemm_x3" if tf32x3 else "gemm", dtype, {"m": m, "h": h}, (table,), lambda m=m, h=h: run(m, h))
            for h in grid["h"] if tf32x3 or h <= grid["gemm_max_h"] for m in rows]


def gemm_x3_cells(dtype, grid, device, args):
    return gemm_cells(dtype, grid, device, args, tf32x3=True)


def strassen_cells(dtype, grid, device, args):
    """Two Strassen layers in a row, built by fxfuse: its three pointwise kernels (prefix of
    layer 1, suffix 1 + ReLU + prefix 2 fused, suffix 2) each timed alone on its real inputs."""
    import fxfuse
    from fxfuse.kernel import FusedKernel

    def run(level, m, h):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU()).eval().to(device, dtype)
        x = randn(m, h, dtype=dtype, device=device)
        opt = fxfuse.optimize(model, x, strict=True, cuda_graphs=False, fused_mlp="off", strassen="force",
                              strassen_levels=level, tolerance=1.0)
        gm, _ = fused_modules(opt, FusedKernel)
        nodes = [n for n in gm.graph.nodes if n.op == "call_module" and n.meta.get("fxfuse", {}).get("strassen_kernel")]
        if len(nodes) != 3:
            raise RuntimeError(f"expected prefix, fused boundary and suffix kernels, found {len(nodes)}")
        grabbed = {}

        class Grab(torch.fx.Interpreter):
            def call_module(self, target, a, kw):
                grabbed[target] = a
                return super().call_module(target, a, kw)
        Grab(gm).run(x)
        out = {}
        for part, node in zip(("prefix", "fused", "suffix"), nodes):
            mod, inputs = gm.get_submodule(node.target), grabbed[node.target]
            out[f"strassen{level}_{part}"] = per_call_us(lambda: mod(*inputs), device, args)
            assert_fast_path([mod])
        return out
    parts = ("prefix", "fused", "suffix")
    return [Cell(f"strassen{lv}", dtype, {"m": m, "h": h}, tuple(f"strassen{lv}_{p}" for p in parts),
                 lambda lv=lv, m=m, h=h: run(lv, m, h))
            for lv in (1, 2) for h in grid["strassen_h"] for m in grid["strassen_m"]]


def mlp_cells(dtype, grid, device, args):
    """8 x (Linear(w, w), ReLU) as fxfuse's fused MLP (fused_mlp="force"), the kernel alone.
    Widths ascend: the widest chains compile longest and come last."""
    import fxfuse
    from fxfuse.mlp_kernel import ROWWISE_MAX_BATCH, FusedMLP

    def run(m, w):
        torch.manual_seed(0)
        layers = [mod for _ in range(MLP_LAYERS) for mod in (nn.Linear(w, w), nn.ReLU(inplace=True))]
        model = nn.Sequential(*layers).eval().to(device, dtype)
        x = randn(m, w, dtype=dtype, device=device)
        opt = fxfuse.optimize(model, x, strict=True, cuda_graphs=False, fused_mlp="force")
        _, mods = fused_modules(opt, FusedMLP)
        if len(mods) != 1 or len(mods[0].spec.linears) != MLP_LAYERS:
            raise RuntimeError(f"expected one fused MLP of {MLP_LAYERS} layers, got {len(mods)} module(s)")
        us = per_call_us(lambda: mods[0](x), device, args)
        assert_fast_path(mods)
        return {"mlp": us}
    return [Cell("mlp", dtype, {"m": m, "width": w}, ("mlp",), lambda m=m, w=w: run(m, w), isolated=True,
                 kernel=(w, m <= ROWWISE_MAX_BATCH))
            for w in grid["widths"] for m in grid["m"]]


SECTIONS = {"linear": linear_cells, "bmm": bmm_cells, "pointwise": pointwise_cells, "gemm": gemm_cells,
            "gemm_x3": gemm_x3_cells, "bmm_x3": bmm_x3_cells, "strassen": strassen_cells, "mlp": mlp_cells}
NEEDS_KERNELS = {"pointwise", "gemm", "gemm_x3", "bmm_x3", "strassen", "mlp"}
