"""Asymmetric fused Strassen: large Linear layers as prefix -> ONE batched GEMM -> suffix.

After normalize a Linear is `F.linear(x, W)` (W a get_attr [N, K]) followed by canonical
pointwise ops. With x flattened to [B, K] and L levels (s = 2^L blocks per side, r = 7^L
products, tables from fxfuse/strassen_tables.py), this pass rewrites

    y = F.linear(x, W)    into    A = prefix(x)          [r, B/s, K/s]   FusedKernel
                                  P = torch.bmm(A, R)    [r, B/s, N/s]   one library GEMM
                                  y = suffix(P)          [B, N]          FusedKernel

where R [r, K/s, N/s] is combined ONCE here from W.T (float64, rounded once) and registered
as a buffer. It is asymmetric because only the left operand is combined per call.

Fusion across layers: the suffix of layer i, the pointwise ops that follow it (its epilogue:
bias, activation, residual adds, ... up to the next Linear) and the prefix of layer i+1 all
iterate over the same [B/s, N/s] space, so they are ONE kernel built here with IRBuilder: it
loads the r products at (i, j), rebuilds y's s*s blocks in registers, applies the epilogue
per block, and stores the r next-layer combinations. A value (y or an epilogue result) is
stored only when something outside the kernel reads it. A chain of n rewritten layers is n+1
kernels and n bmm calls. FusedKernel call_module nodes are not pointwise, so fuse_pointwise
leaves them alone.

Sizes that do not divide by s are padded, not peeled (correctness first; the cost is small
for the large layers this pass is for): x gets an explicit F.pad node (zeros) before a
standalone prefix, W.T and constant epilogue operands are zero-padded at optimize time,
stored outputs live in padded [Bp, Np] buffers and are narrowed back to [B, N] by view
nodes, and a fused kernel zeroes the padded rows/columns of the next layer's input with two
small bool masks, because garbage there would not cancel exactly in floating point (Strassen
mixes padded and real blocks in its sums).

Numerics: each candidate layer is measured on the example input (gm.meta
["fxfuse_example_args"], set by run_pipeline; random data if absent) against a float64
product; a layer whose Strassen error exceeds the tolerance is retried with fewer levels and
otherwise stays classical. Everything lands in node.meta["fxfuse"] (explain() shows
"decision"). Created nodes get tensor_meta here (from meta tensors), so the pipeline needs no
shape re-propagation after this pass. fp32 stays IEEE: the bmm is torch's, so
torch.backends.cuda.matmul.allow_tf32 decides, and the kernels add in fp32; with option tf32x3
the product call is fxfuse.tf32x3.bmm_tf32x3 where the plan marked the layer (x3_products), and
the guard measures that. Inherent to the
algorithm: the prefix adds row blocks (A11 + A22, ...), so a NaN or inf in one row of x
reaches other rows of y, where the classical product keeps it in its own row (the decision
says so; strassen="off" where such rows must stay isolated).

This file decides which layers to rewrite; passes/strassen_rewrite.py builds the kernels.
"""
import math

import torch
import torch.fx

from fxfuse.ops import FLOAT_DTYPES
from fxfuse.precision import matmul_allows_tf32
from fxfuse.strassen_tables import measure_levels
from fxfuse.tf32x3 import tf32x3_bmm
from fxfuse.tracing import fetch_attr as _fetch, fxfuse_meta, tensor_meta as _tmeta

from .fuse_pointwise import _mutated_values
from .plan_linears import LINEAR_TARGETS, is_bias_free_linear, planned_choice
from .strassen_rewrite import Layer, _Rewriter

AUTO_MIN_SIZE = 2048          # "auto" without a cost-model plan for the layer: min(B, K, N) at least this
TOLERANCE_FACTOR = 3.0        # default tolerance: 3x the classical product's measured error ...
ERROR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}   # ... at least this


def why_not_strassen(node: torch.fx.Node, mutated: set) -> str | None:
    """None if `node` is a Linear this pass can rewrite, else the reason."""
    if not is_bias_free_linear(node):
        return "not a bias-free F.linear"
    x, w = node.args[:2]
    xm, wm, ym = _tmeta(x), _tmeta(w), _tmeta(node)
    if not (isinstance(w, torch.fx.Node) and w.op == "get_attr" and hasattr(wm, "shape") and len(wm.shape) == 2):
        return "weight is not a constant matrix"
    if not hasattr(xm, "shape") or not hasattr(ym, "shape") or len(xm.shape) < 2:
        return "input is not a tensor of at least 2 dims"
    if xm.dtype not in FLOAT_DTYPES or wm.dtype != xm.dtype:
        return f"dtype {xm.dtype} (weight {wm.dtype}): kernels compute fp16/bf16/fp32 only"
    if xm.shape.numel() == 0 or wm.shape.numel() == 0:
        return "empty tensor"
    if x in mutated:
        return "input is mutated in place elsewhere in the graph"
    if not node.users:
        return "output is unused"
    return None


def _measure(layer: Layer, x: torch.Tensor, weight: torch.Tensor, max_levels: int, tolerance) -> None:
    """Choose layer.levels (0 = classical) by the numerics guard; fill layer.record."""
    found = measure_levels(x.reshape(layer.B, layer.K), weight, max_levels, tolerance,
                           TOLERANCE_FACTOR, ERROR_FLOOR[layer.dtype], bmm=tf32x3_bmm if layer.tf32x3 else torch.bmm)
    layer.levels, layer.right = found.pop("levels"), found.pop("right")
    layer.record.update(found)


class _LayerProbe(torch.fx.Interpreter):
    """Runs the (not yet rewritten) graph and measures each candidate Linear on its real input."""

    def __init__(self, gm, layers: dict, measure):
        super().__init__(gm)
        self.layers, self.measure = layers, measure

    def run_node(self, n):
        out = super().run_node(n)
        if n in self.layers:
            args, _ = self.fetch_args_kwargs_from_env(n)
            self.measure(self.layers[n], args[0], args[1])
        return out


def _choose(gm, layers: list, options) -> None:
    max_levels = options.strassen_levels
    measure = lambda layer, x, w: _measure(layer, x, w, layer.max_levels or max_levels, options.tolerance)  # noqa: E731
    example = gm.meta.get("fxfuse_example_args")
    with torch.no_grad():
        if example is not None:
            _LayerProbe(gm, {l.node: l for l in layers}, measure).run(*example)
            for layer in layers:
                layer.record["measured_on"] = "the example input"
        else:
            for layer in layers:
                dev = fxfuse_meta(layer.node).get("device", torch.device("cpu"))
                x = torch.randn(_tmeta(layer.x).shape, dtype=layer.dtype, device=dev)
                measure(layer, x, _fetch(gm, layer.node.args[1].target))
                layer.record["measured_on"] = "random data (no example input recorded)"


def _decide_mode(layer: Layer, mode: str) -> str | None:
    """None if the mode asks for Strassen on this layer, else the reason it does not.

    "auto" follows the cost model's plan (passes/plan_linears.py) where one was made, which
    also caps the levels; the size threshold remains for Linears outside any plan."""
    if mode == "force":
        return None
    choice = planned_choice(layer.node)
    if choice is not None:
        if choice.startswith("strassen"):
            layer.max_levels = int(choice[len("strassen"):])
            return None
        return f"classical: the cost model chose {choice} (explain's plan table has the estimates)"
    smallest = min(layer.B, layer.K, layer.N)
    if smallest >= AUTO_MIN_SIZE:
        return None
    return (f"classical: min(B, K, N) = {smallest} < {AUTO_MIN_SIZE} "
            "(size threshold until the cost model lands)")


def strassen(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    mode = "off" if options is None or not options.fuse else options.strassen
    if mode == "off":
        gm.meta["fxfuse_skipped"] = True
        return gm
    use_kernels = True if options.use_kernels is None else options.use_kernels
    mutated = _mutated_values(gm)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    candidates = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        reason = why_not_strassen(node, mutated)
        if reason is not None:
            fxfuse_meta(node).update({"strassen": False, "decision": f"classical: {reason}"})
            continue
        xm, wm = _tmeta(node.args[0]), _tmeta(node.args[1])
        N, K = wm.shape
        layer = Layer(node, tuple(_tmeta(node).shape),
                      xm.shape.numel() // K, K, N, xm.dtype)
        reason = _decide_mode(layer, mode)
        if reason is not None:
            fxfuse_meta(node).update({"strassen": False, "decision": reason})
            continue
        plan = fxfuse_meta(node).get("plan")
        layer.tf32x3 = use_kernels and (plan["layer"].x3_products if plan is not None else   # a Triton kernel too
                                        options.tf32x3 == "force" and xm.dtype == torch.float32
                                        and not matmul_allows_tf32())
        candidates.append(layer)
    if not candidates:
        return gm
    _choose(gm, candidates, options)
    accepted = []
    for layer in candidates:
        rec = layer.record
        if not layer.levels:
            worst = min(rec["errors_by_levels"].values())
            if not math.isfinite(rec["classical_error"]):   # NaN/inf in the input: no measure of rounding
                decision = (f"classical: the error cannot be measured on {rec['measured_on']} (it holds NaN "
                            "or inf, which Strassen would spread to other rows, or its product is all zeros)")
            else:
                decision = (f"classical: Strassen error {worst:.1e} on {rec['measured_on']} exceeds tolerance "
                            f"{rec['tolerance']:.1e} (classical {rec['classical_error']:.1e})")
            fxfuse_meta(layer.node).update({"strassen": False, **rec, "decision": decision})
            continue
        extra = layer.right.numel() * layer.right.element_size() * (2 if layer.tf32x3 else 1)   # R, or its two parts
        padding = ("no padding" if (layer.Bp, layer.Kp, layer.Np) == (layer.B, layer.K, layer.N) else
                   f"padded {layer.B}x{layer.K}x{layer.N} -> {layer.Bp}x{layer.Kp}x{layer.Np}")
        why = ("forced" if mode == "force" else "auto: the cost model's choice" if layer.max_levels
               else f"auto: min(B, K, N) >= {AUTO_MIN_SIZE} (size threshold: no cost-model plan)")
        rec.update({"strassen": True, "levels": layer.levels, "padded": (layer.Bp, layer.Kp, layer.Np),
                    "extra_weight_bytes": extra})
        rec["decision"] = (f"Strassen {layer.levels} level(s), {7 ** layer.levels} products of "
                           f"[{layer.Bp >> layer.levels}x{layer.Kp >> layer.levels}]x"
                           f"[{layer.Kp >> layer.levels}x{layer.Np >> layer.levels}] in one "
                           f"{'3xTF32 batched GEMM' if layer.tf32x3 else 'bmm'} ({why}); "
                           f"{padding}; "
                           f"error {rec['error']:.1e} vs tolerance {rec['tolerance']:.1e} "
                           f"(classical {rec['classical_error']:.1e}) on {rec['measured_on']}; "
                           f"+{extra / 2 ** 20:.1f} MiB combined weights; mixes rows and columns: a "
                           "NaN/inf in one input row reaches other output rows, and the error of every "
                           "row scales with the largest row's (and column's) magnitude")
        accepted.append(layer)
    if accepted:
        _Rewriter(gm, accepted, order, mutated, use_kernels).run()
        gm.graph.lint()
        gm.recompile()
    return gm
