"""Epilogue-fused GEMM: a Linear and the pointwise ops that follow it become ONE generated
Triton GEMM (fxfuse/gemm_kernel.py) whose epilogue applies them to the output tile.

Runs after fuse_mlp (chains it fused are gone) and before linear_epilogue and
fuse_pointwise, so it sees `F.linear(x, W)` (W a get_attr [N, K]) followed by canonical
pointwise ops. The epilogue grows over the users of the product exactly as a fused MLP's body
does (fuse_mlp._Region: same legality rules, same lowering), with two limits: it stops at the
next Linear, and it reads x only where x is as wide as the product (a residual `x + lin(x)`
of a square layer: the kernel loads x at the output tile's coordinates, operand "input").
Unlike a fused MLP's body it may read up to gemm_kernel.MAX_SKIPS other tensors that
broadcast to the product's shape (operands "skip": the residual stream of a pre-norm block,
`h + fc2(...)`, passed to the kernel with their strides and loaded at the output tile; in
fp16 the sum is then rounded once, where eager rounds the product and the sum). Then it is
cut back to the longest prefix whose only value read outside is its last, since nothing in
between is written to memory.

Profitability lives in `should_fuse_gemm`, the one place the choice is made for
gemm="auto" (until the cost model replaces it); "force" fuses every legal Linear (tests,
benchmarks), "off" skips the pass. The decision goes to node.meta["fxfuse"]["decision"].
"""
import math

import torch
import torch.fx

import fxfuse.gemm_kernel as gemm_kernel

from fxfuse.gemm_kernel import ROWWISE_MAX_BATCH as GEMM_ROWWISE_MAX_BATCH
from fxfuse.gemm_kernel import GEMM_DTYPES, EpilogueGemm, GemmSpec, choose_gemm_config, skip_fits, why_not_gemm
from fxfuse.mlp_kernel import Linear, Pointwise
from fxfuse.precision import matmul_allows_tf32
from fxfuse.tf32x3 import measure_tf32x3
from fxfuse.tracing import fetch_attr as _fetch, fxfuse_meta

from .fuse_mlp import _linear_parts, _lower, _reference, _Region, _tmeta, replace_region
from .fuse_pointwise import _mutated_values
from .plan_linears import planned_choice
from .strassen import _LayerProbe



def should_fuse_gemm(m: int, k: int, n: int, dtype: torch.dtype, allow_tf32: bool) -> tuple:
    """(fuse?, reason) for a legal Linear + epilogue under gemm="auto".

    Provisional rule read off one H100 grid (benchmarks/results/nvidia-h100-80gb-hbm3/
    mlp_20261123-012743.md, 8 x Linear(h) + ReLU, fp32 TF32 off, per call in a CUDA graph):
    the generated split-K GEMM beat cuBLAS + the epilogue kernel only at batch 16, hidden 1024
    (78.7 us vs 108.2 us); at batch 1 it lost (78.9 vs 46.0), at batch >= 64 it lost by up to
    3x (its IEEE fp32 tl.dot runs on FMA units, far below cuBLAS), at hidden 128 and 2048 too.
    The cost model replaces this with calibrated estimates.
    """
    if dtype != torch.float32 or allow_tf32:
        return False, "library GEMM + fused epilogue kernel (the generated GEMM is measured for IEEE fp32 only)"
    lo_rows, hi_rows = GEMM_ROWS
    lo_width, hi_width = GEMM_WIDTHS
    if lo_rows <= m <= hi_rows and lo_width <= min(k, n) and max(k, n) <= hi_width:
        return True, (f"{m} rows, widths {k}->{n}: split-K GEMM with fused epilogue measured faster than "
                      "cuBLAS + epilogue kernel (H100: 78.7 vs 108.2 us at batch 16, hidden 1024)")
    return False, (f"library GEMM + fused epilogue kernel: the generated GEMM measured slower outside "
                   f"{lo_rows}..{hi_rows} rows and widths {lo_width}..{hi_width} (H100, fp32)")


GEMM_ROWS = (9, 32)          # rows where the generated GEMM measured faster (see should_fuse_gemm)
GEMM_WIDTHS = (768, 1536)    # in/out features where it measured faster


class _EpilogueRegion(_Region):
    """A fused-MLP region limited to one Linear at its start; its epilogue may read x (see
    joins) and up to gemm_kernel.MAX_SKIPS other tensors of the product's shape, at the output tile."""

    def __init__(self, gm, start, mutated):
        super().__init__(gm, start, mutated)
        self.start = start

    def joins(self, node) -> bool:
        if node is self.start:
            return super().joins(node)
        if _linear_parts(node) is not None:
            return False
        if any(a is self.x for a in node.args) and _tmeta(self.x).shape[-1] != _tmeta(self.start).shape[-1]:
            return False   # x is read at the output tile's coordinates: only as wide as the product
        if not super().joins(node):
            return False
        skips = set(self.skips) | set(self.outside_operands(node))
        return len(skips) <= gemm_kernel.MAX_SKIPS   # (read here: benchmarks.blocks sets it to 0)

    def _skip_ok(self, a, node) -> bool:
        """A tensor computed elsewhere (the residual stream of a pre-norm block: `h + fc2(...)`,
        a per-row scale [..., 1]), read at the output tile: the product's dtype, a shape that
        broadcasts to the product's (which the op's result keeps), not written in place."""
        product = _tmeta(self.start)
        return a not in self.mutated and tuple(_tmeta(node).shape) == tuple(product.shape) \
            and skip_fits(_tmeta(a), product)


def _gemm_spec(spec, region):
    """GemmSpec from the region's MLPSpec: value 0 there is x, value 1 the product; here the
    product is value 0, so every value id moves down by one, and x becomes operand "input"."""
    first, *rest = spec.steps
    assert isinstance(first, Linear) and first.src == 0
    epilogue = []
    for step in rest:
        assert isinstance(step, Pointwise)
        operands = tuple(("input", 0) if (kind, ref) == ("value", 0) else (kind, ref - 1) if kind == "value"
                         else (kind, ref) for kind, ref in step.operands)
        epilogue.append(Pointwise(step.out - 1, step.op, operands, step.params))
    k = _tmeta(region.x).shape[-1]
    return GemmSpec(k=k, n=spec.widths[1], dtype=spec.dtype, epilogue=tuple(epilogue), output=spec.output - 1)


def fuse_gemm(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    mode = options.gemm if options is not None else "auto"    # (Options checked the value)
    if mode == "off" or (options is not None and not options.fuse):
        gm.meta["fxfuse_skipped"] = True
        return gm
    use_kernels = True if options is None or options.use_kernels is None else options.use_kernels
    allow_tf32 = matmul_allows_tf32()
    g = gm.graph
    mutated = _mutated_values(gm)
    order = {n: k for k, n in enumerate(g.nodes)}
    guard = _tf32x3_guard(gm, options, allow_tf32)
    changed = False
    for start in list(g.nodes):
        if getattr(start, "_erased", False) or _linear_parts(start) is None or not isinstance(start.args[0], torch.fx.Node) \
                or not hasattr(_tmeta(start.args[0]), "shape") or start.args[0] in mutated:
            continue
        if _tmeta(start.args[0]).dtype not in GEMM_DTYPES:
            if mode == "force":   # (fuzz46f: the node said "cost model: library" only)
                _note(start, f"no fused GEMM: {_tmeta(start.args[0]).dtype} (the kernels take fp32, fp16 and bf16)")
            continue
        region = _EpilogueRegion(gm, start, mutated)
        if not region.joins(start):
            continue
        region.grow(start, order)
        region.trim()
        if not region.nodes:
            continue
        spec, weights, vectors, members = _lower(gm, region)
        gspec = _gemm_spec(spec, region)
        choice = planned_choice(start)
        x3 = start in guard and guard[start]["ok"]
        config = choose_gemm_config(region.batch, gspec, allow_tf32, tf32x3=x3)
        problem = why_not_gemm(gspec, config, rows=region.batch)
        if problem:
            _note(start, f"no fused GEMM: {problem}")
            continue
        if choice is None:
            ok, reason = should_fuse_gemm(region.batch, gspec.k, gspec.n, gspec.dtype, allow_tf32)
        else:
            ok, reason = choice in ("gemm", "gemm_x3"), f"the cost model chose {choice}"
        if start in guard:   # (guarded only past the row-wise GEMV's rows: _builds_tf32x3)
            reason += "; " + _guard_text(guard[start])
            if choice == "gemm_x3" and not x3:   # the IEEE GEMM was not what the plan chose: the library runs it
                ok = False
                _note(start, reason)
        if mode == "force":
            ok, reason = True, f"forced by gemm='force'; auto: {'yes' if ok else 'no'}, {reason}"
        if not ok:
            if choice is None:          # a plan's choice is already the node's decision line
                _note(start, reason)
            continue
        module = EpilogueGemm(gspec, weights[0], vectors, _reference(gm, region), members, use_kernels, config)
        if config.split_weights:
            reason += f"; +{2 * module.weight.numel() * 4 / 2 ** 20:.1f} MiB for W's TF32 parts"
        _replace(gm, region, module, reason)
        changed = True
    if changed:
        g.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return gm


def _tf32x3_guard(gm, options, allow_tf32: bool) -> dict:
    """Linear node -> fxfuse.tf32x3.measure_tf32x3 on its input from the example, for the
    Linears that would run in 3xTF32: planned "gemm_x3", or every fp32 one with tf32x3="force"
    (gemm="force" builds a GEMM for the ones the plan left to the library too).
    Numerics are legality, so they are checked here, like Strassen's; random data where no
    example was recorded."""
    if options is None or options.tf32x3 == "off" or allow_tf32:
        return {}
    nodes = {n: n for n in gm.graph.nodes if _linear_parts(n) is not None and _builds_tf32x3(n, options)}
    found = {}

    def measure(node, x, w, on="the example input"):
        if x.numel() == 0 or w.numel() == 0:   # Linear(0, n): no product to measure (fuzz38b); not in 3xTF32
            return
        found[node] = {**measure_tf32x3(x.reshape(-1, x.shape[-1]), w, options.tolerance), "measured_on": on}

    example = gm.meta.get("fxfuse_example_args")
    with torch.no_grad():
        if nodes and example is not None:
            _LayerProbe(gm, nodes, measure).run(*example)
        for node in nodes:
            if node not in found:
                x, w = _linear_parts(node)[:2]
                dev = fxfuse_meta(node).get("device", torch.device("cpu"))
                measure(node, torch.randn(_tmeta(x).shape, device=dev), _fetch(gm, w.target),
                        "random data (no example input recorded)")
    return found


def _builds_tf32x3(node, options) -> bool:
    """Whether fuse_gemm would build this Linear as a 3xTF32 GEMM (if the guard passes): fp32, a
    constant weight, more rows than the row-wise GEMV's, and planned gemm_x3, or forced (with
    gemm="force", or where the plan or the no-plan rule gives it a generated GEMM)."""
    w = _linear_parts(node)[1]
    meta, wmeta = _tmeta(node), _tmeta(w) if isinstance(w, torch.fx.Node) else None
    if not (getattr(meta, "dtype", None) == torch.float32 and hasattr(meta, "shape")
            and hasattr(wmeta, "shape") and len(wmeta.shape) == 2):
        return False
    rows = meta.shape.numel() // max(int(wmeta.shape[0]), 1)
    if rows <= GEMM_ROWWISE_MAX_BATCH:
        return False
    choice = planned_choice(node)
    if choice == "gemm_x3":
        return True
    return options.tf32x3 == "force" and (options.gemm == "force" or choice in ("gemm", None))


def _guard_text(rec: dict) -> str:
    if not math.isfinite(rec["classical_error"]):
        return (f"no 3xTF32: the error cannot be measured on {rec['measured_on']} (it holds NaN or inf, the "
                "product overflows, or it is all zeros)")
    verdict = "3xTF32" if rec["ok"] else "no 3xTF32: its error exceeds the tolerance"
    return (f"{verdict} (error {rec['error']:.1e} vs tolerance {rec['tolerance']:.1e}, classical "
            f"{rec['classical_error']:.1e}, on {rec['measured_on']})")


def _note(node, text: str) -> None:
    """Add this pass's "no" to what earlier passes decided about the node (explain shows both)."""
    earlier = fxfuse_meta(node).get("decision")
    fxfuse_meta(node)["decision"] = f"{earlier}; {text}" if earlier else text


def _replace(gm, region, module: EpilogueGemm, reason: str) -> None:
    c = module.config
    replace_region(gm, region, module, "fused_gemm", "fused gemm",
                   f"fused GEMM: Linear + {len(region.nodes) - 1} pointwise ops in one launch ({reason}; "
                   f"tiles {c.block_m}x{c.block_n}x{c.block_k}, split-K {c.split_k}, {c.precision})")
