"""Plan every Linear with the cost model, for the whole chain at once.

Legality lives in the passes that rewrite (strassen, fuse_mlp, fuse_gemm); profitability
lives here, in one call to fxfuse.chain_plan.plan_chain per chain of Linear layers. This pass
only describes the graph as plain data (fxfuse.cost_model.LinearLayer), asks the model, and
writes each Linear's plan to node.meta["fxfuse"]["plan"]; the rewriting passes, in their
"auto" modes, follow it. Nothing here rewrites the graph.

Why whole chains: a choice at layer i changes what fuses at the boundary with layer i+1 (two
Strassen layers in a row share one suffix+prefix kernel and never write the activation), so
the model chooses by dynamic programming over the chain, not layer by layer.

A chain is a run of Linears where each one's input is the previous one's output after
pointwise ops only (bias, activation, scaling), read by nothing else, or after a residual add
of the previous Linear's own input (`h + act(lin(h))`, a ResMLP block: h is then read by the
Linear and the add, nothing else). A reduction or another reader ends the chain: the model
then sees the layer as writing its output (`output_read_elsewhere`); a residual link writes
it as well, except inside a fused MLP, which keeps it on chip.
"""
import operator
from dataclasses import replace

import torch
import torch.fx
import torch.nn.functional as F

from fxfuse.chain_plan import plan_chain
from fxfuse.cost_model import CostModel, LinearLayer
import fxfuse.gemm_kernel as gemm_kernel
from fxfuse.gemm_kernel import ROWWISE_MAX_BATCH as GEMM_ROWWISE_MAX_BATCH, skip_fits
from fxfuse.mlp_spec import (FMA_ONE_TILE, KERNEL_DTYPES, MAX_TILE as MLP_MAX_TILE,
                             ROWWISE_MAX_BATCH as MLP_ROWWISE_MAX_BATCH)
from fxfuse.ops import FLOAT_DTYPES, POINTWISE, is_pointwise_target
from fxfuse.precision import matmul_allows_tf32
from fxfuse.tracing import fxfuse_meta, tensor_meta as _tmeta

from .fuse_pointwise import _mutated_values
from .normalize_layers import LINEAR_BIAS

# Where Strassen's prefix/suffix kernels were calibrated (benchmarks/autotune.py: 256, 1024 and
# 4096 rows, widths 2048-8192) and where the H100 measured it faster or even. Below, the model
# extrapolates them from the plain pointwise kernel and underestimates them: batch 64, hidden
# 1024, Strassen 1 level measured 207 us against 125 us classical (the model said 113); batch 64,
# hidden 8192: 2075 (1 level) and 4373 us (2 levels) against 1655 (strassen_probe_20261125-1910.txt).
# At 256 rows 2 levels won: hidden 2048 391 vs 442 us, 4096 1388 vs 1434, 8192 5317 vs 5496.
# Where the calibration has no Strassen kernels for the dtype (fp16/bf16 on the H100, any GPU
# without a calibration) the model extrapolates them, and Strassen keeps the older, measured-safe
# 1024 rows (bf16 at 256 x 2048 it would choose 1 level on extrapolated kernels alone).
STRASSEN_MIN_ROWS = 256
STRASSEN_MIN_ROWS_UNMEASURED = 1024
STRASSEN_MIN_WIDTH = 2048
LINEAR_TARGETS = (F.linear, torch.ops.aten.linear.default)
MLP_MAX_WIDTH = 1024       # the fused MLP kernel's limit (mlp_spec.why_not_kernel refuses wider)


def is_bias_free_linear(node: torch.fx.Node) -> bool:
    """F.linear(x, W) as normalize leaves it, or spelled with bias None (`F.linear(x, W, None)`:
    a bias-free nn.Linear traced as the root module, or `bias=None` by keyword), or aten.linear
    (torch.export graphs: normalize leaves a bias-free one as it is)."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS or not 2 <= len(node.args) <= 3 \
            or set(node.kwargs) - {"bias"}:
        return False
    return (node.args[2] if len(node.args) == 3 else node.kwargs.get("bias")) is None


def is_planned_linear(node: torch.fx.Node) -> bool:
    """A bias-free F.linear (normalize split the bias) with a constant 2-D weight and shapes."""
    if not is_bias_free_linear(node):
        return False
    x, w = node.args[:2]
    return (isinstance(w, torch.fx.Node) and w.op == "get_attr" and hasattr(_tmeta(w), "shape")
            and len(_tmeta(w).shape) == 2 and hasattr(_tmeta(x), "shape") and hasattr(_tmeta(node), "shape"))


def _single_source(node):
    """The one non-constant tensor operand of a pointwise node, or None."""
    if node.op != "call_function" or not is_pointwise_target(node.target):
        return None
    operands = [a for a in node.args[:POINTWISE[node.target].nargs]
                if isinstance(a, torch.fx.Node) and a.op != "get_attr"]
    return operands[0] if len(operands) == 1 else None


def _residual_add_of(linear: torch.fx.Node):
    """The add that closes `h + f(lin(h))` for this Linear (f: single-reader pointwise ops), or None."""
    h, x = linear.args[0], linear
    while len(x.users) == 1:
        user = next(iter(x.users))
        if _single_source(user) is x:
            x = user
            continue
        parts = _residual_parts(user)
        return user if parts is not None and parts == (x, h) else None
    return None


def _residual_parts(node):
    """(branch, skip) of a residual add `skip + branch` (either order; no alpha), else None."""
    if node.op != "call_function" or node.target not in (operator.add, torch.add) or node.kwargs \
            or len(node.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    a, b = node.args
    shapes = {tuple(getattr(_tmeta(n), "shape", (None,))) for n in (node, a, b)}
    if len(shapes) != 1:   # a broadcasting add is no residual of the layer's own width
        return None
    for branch, skip in ((a, b), (b, a)):
        if branch is not skip and len(branch.users) == 1 and len(skip.users) == 2:
            return branch, skip
    return None


def _input_readers_ok(linear) -> bool:
    """A chain may enter `linear` where its input is read by it alone, or by it and its residual add."""
    h = linear.args[0]
    if not isinstance(h, torch.fx.Node):
        return False
    return set(h.users) in ({linear}, {linear, _residual_add_of(linear)})


def previous_linear(node: torch.fx.Node):
    """(the Linear feeding `node` through single-reader pointwise ops, and at most one residual
    add of that Linear's own input, ops on the way, whether the way had a residual add)."""
    x, ops, skip, add = node.args[0], 0, None, None
    if not _input_readers_ok(node):
        return None, 0, False
    while isinstance(x, torch.fx.Node) and (len(x.users) == 1 or x is node.args[0]):
        if is_planned_linear(x):
            if add is not None and (x.args[0] is not skip or _residual_add_of(x) is not add):
                return None, 0, False
            return x, ops, add is not None
        src = _single_source(x)
        if src is None and add is None and _residual_parts(x) is not None:
            (src, skip), add = _residual_parts(x), x
        if src is None:
            return None, 0, False
        x, ops = src, ops + 1
    return None, 0, False


def _has_bias(node) -> bool:
    """Whether the Linear's first epilogue op is normalize's bias add (`y + b`, b a get_attr)."""
    if len(node.users) != 1:
        return False
    user = next(iter(node.users))
    return (user.op == "call_function" and user.target is operator.add and len(user.args) == 2
            and user.args[0] is node and isinstance(user.args[1], torch.fx.Node) and user.args[1].op == "get_attr")


def _describe(node, epilogue_ops: int, read_elsewhere: bool, mutated=frozenset(), chain_inputs=()) -> LinearLayer:
    w = _tmeta(node.args[1])
    n, k = w.shape
    m = _tmeta(node.args[0]).shape.numel() // max(k, 1)
    reads, outside, read = _epilogue_reads(node, epilogue_ops, mutated)
    bias = epilogue_ops > 0 and _has_bias(node)
    return LinearLayer(m=m, k=k, n=n, dtype=w.dtype, epilogue_ops=epilogue_ops,
                       output_read_elsewhere=read_elsewhere, bias=bias,
                       bias_in_gemm=bias and w.dtype in (torch.float16, torch.bfloat16)
                       and next(iter(node.users)).meta.get(LINEAR_BIAS, False),
                       epilogue=_epilogue_key(node, epilogue_ops), epilogue_reads=reads,
                       epilogue_reads_outside=outside,
                       mlp_reads_outside=len([a for a in read if all(a is not x for x in chain_inputs)]))


def _epilogue_reads(node, ops: int, mutated) -> tuple:
    """(other [m, n] tensors the `ops` pointwise ops after a Linear read, how many of them the
    generated GEMM's epilogue cannot read at its tile, the tensors), as fuse_gemm decides: x where
    it is as wide as the product, up to gemm_kernel.MAX_SKIPS distinct tensors of the product's dtype
    that broadcast to its shape and that nothing writes in place; row vectors and scalars of a
    floating dtype held by the model are constants (fuse_mlp._constant). The ops from the first
    other read on run as a kernel after the GEMM. A fused MLP reads only the inputs of its own
    Linears (its x, a residual's skip): the plan prices the others (mlp_reads_outside)."""
    out = _tmeta(node)
    shape, values, inside, outside = tuple(getattr(out, "shape", ())), {node}, [], []
    x = node
    for _ in range(ops):
        if len(x.users) != 1:
            break
        x = next(iter(x.users))
        for a in x.args:
            if not isinstance(a, torch.fx.Node) or a in values or a in inside or a in outside:
                continue
            m = _tmeta(a)
            a_shape = tuple(getattr(m, "shape", ()))
            numel = m.shape.numel() if hasattr(m, "shape") else 0
            if a.op == "get_attr" and shape and getattr(m, "dtype", None) in FLOAT_DTYPES and (
                    numel == 1 or (a_shape and a_shape[-1] == shape[-1] and numel == shape[-1])):
                continue
            own_input = a is node.args[0]
            fits = skip_fits(m, out) and a not in mutated and (
                a_shape == shape if own_input else sum(b is not node.args[0] for b in inside) < gemm_kernel.MAX_SKIPS)
            (inside if fits else outside).append(a)
        values.add(x)
    return len(inside) + len(outside), len(outside), inside + outside


def unmeasured(table: str, dtype: torch.dtype) -> str:
    if dtype not in KERNEL_DTYPES:   # not a table to measure (fuzz39b: an fp64 model was sent to autotune)
        return f"{dtype}: generated GEMM/MLP kernels take fp32, fp16 and bf16 only"
    return (f"the calibration has no '{table}' table for this dtype: generated GEMM/MLP kernels are chosen "
            "only on measured evidence (python -m benchmarks.autotune, then option calibration=...)")


WRITTEN_INPUT = ("its input is written in place in forward(), before or after it (`h[:, :8] = a`, `h += lin(h)`): "
                 "fuse_gemm, fuse_mlp and Strassen leave such a Linear to the library GEMM")


def _legal(layer: LinearLayer, options, model) -> dict:
    """Candidate -> None (the options allow it) or why not. The rewriting passes check the rest
    (numerics, exact graph shapes) and fall back to the library GEMM when they refuse.

    Without a calibration the roofline would rank a generated kernel by its ideal time, and
    on the H100 those kernels measured far from ideal at the sizes where the roofline prefers
    them; so they need a measurement to be chosen. cuBLAS and its bmm sit near the roofline."""
    legal = {"library": None}
    legal["gemm"] = ("gemm='off' or fuse=False" if not options.fuse or options.gemm == "off" else None
                     if model.measured("gemm_epilogue", layer.dtype) else unmeasured("gemm_epilogue", layer.dtype))
    legal["gemm_x3"] = _tf32x3_legal(layer, options, model)
    if legal["gemm_x3"] is None and options.tf32x3 == "force":
        legal["gemm"] = "tf32x3='force': the generated fp32 GEMM runs as gemm_x3"
    for levels in (1, 2):
        name = f"strassen{levels}"
        min_rows = (STRASSEN_MIN_ROWS if _strassen_kernels_timed_from(model, name, layer.dtype, STRASSEN_MIN_ROWS)
                    else STRASSEN_MIN_ROWS_UNMEASURED)
        if options.strassen == "off":
            legal[name] = "strassen='off' (the default: Strassen changes rounding; opt in with 'auto')"
        elif not options.fuse:
            legal[name] = "fuse=False"
        elif levels > options.strassen_levels:
            legal[name] = f"strassen_levels={options.strassen_levels}"
        elif layer.m < min_rows or min(layer.k, layer.n) < STRASSEN_MIN_WIDTH:
            legal[name] = (f"{layer.m} rows x {min(layer.k, layer.n)} features is below {min_rows} x "
                           f"{STRASSEN_MIN_WIDTH}, where Strassen's kernels were timed (smaller: measured slower)")
        else:
            legal[name] = None
    return legal


def _tf32x3_legal(layer: LinearLayer, options, model, table: str = "gemm_tf32x3") -> str | None:
    """None where the generated GEMM (table gemm_tf32x3) or Strassen's product call (bmm7_tf32x3,
    bmm49_tf32x3) may run in 3xTF32 (fxfuse/tf32x3.py), else why not. The numerics guard on
    the example input is the rewriting pass's (legality that needs the data)."""
    if options.tf32x3 == "off":
        return "tf32x3='off' (the default: 3xTF32 is not IEEE fp32; opt in with 'auto')"
    if table == "gemm_tf32x3" and (not options.fuse or options.gemm == "off"):
        return "gemm='off' or fuse=False"
    if layer.dtype in (torch.float16, torch.bfloat16):
        return f"{layer.dtype} runs on tensor cores already"
    if layer.dtype != torch.float32:
        return f"{layer.dtype}: 3xTF32 stands in for fp32 products only"
    if matmul_allows_tf32():
        return "TF32 is allowed: the generated GEMM runs plain TF32"
    if table == "gemm_tf32x3" and layer.m <= GEMM_ROWWISE_MAX_BATCH:
        return f"{layer.m} rows: the generated GEMM is the row-wise GEMV form there, IEEE fp32 (no tl.dot to split)"
    if options.tf32x3 == "auto" and not model.measured(table, layer.dtype):
        return unmeasured(table, layer.dtype)
    return None


def _with_tf32x3_products(layer: LinearLayer, options, model) -> LinearLayer:
    """The layer marked for Strassen products in 3xTF32 where the tables of the levels it may
    get allow it (the model then prices strassenL's product call from bmm{7^L}_tf32x3)."""
    tables = ("bmm7_tf32x3", "bmm49_tf32x3")[:max(1, min(2, options.strassen_levels))]
    ok = options.strassen != "off" and all(_tf32x3_legal(layer, options, model, t) is None for t in tables)
    return replace(layer, x3_products=True) if ok else layer


def _strassen_kernels_timed_from(model, name: str, dtype, rows: int) -> bool:
    """Whether all three of the candidate's kernels were calibrated at `rows` rows or fewer."""
    smallest = [model.smallest_measured(f"{name}_{part}", dtype) for part in ("prefix", "fused", "suffix")]
    return all(s is not None and s <= rows * 1.001 for s in smallest)


def _epilogue_key(node, ops: int) -> tuple:
    """What the `ops` pointwise ops after a Linear compute (targets and constant arguments), so
    the plan can tell identical layers from layers that only have as many ops."""
    key, x = [], node

    def operand(a, prev):
        if not isinstance(a, torch.fx.Node):
            return repr(a)
        if a.op == "get_attr":   # its size too: a [w] vector and a scalar are different kernels
            return f"constant{tuple(getattr(_tmeta(a), 'shape', ()))}"
        return "value" if a is prev else "input" if a is node.args[0] else "skip"

    for _ in range(ops):
        if len(x.users) != 1:
            break
        prev, x = x, next(iter(x.users))
        consts = tuple(operand(a, prev) for a in x.args)
        kwargs = tuple(sorted((k, operand(v, prev)) for k, v in x.kwargs.items()))
        key.append((getattr(x.target, "__name__", str(x.target)), consts, kwargs))
    return tuple(key)


def _mlp_legal(run: list, options, model) -> str | None:
    """None if layers `run` may be planned as one fused MLP kernel, else why not."""
    if not options.fuse:
        return "fuse=False"
    if options.fused_mlp == "off":
        return "fused_mlp='off'"
    if not model.measured("mlp", run[0].dtype):
        return unmeasured("mlp", run[0].dtype)
    widest = max(max(l.k, l.n) for l in run)
    if widest > MLP_MAX_WIDTH:
        return f"width {widest} > {MLP_MAX_WIDTH} does not fit on chip"
    fma = run[0].dtype == torch.float32 and not matmul_allows_tf32()
    if fma and run[0].m > MLP_ROWWISE_MAX_BATCH and widest > MLP_MAX_TILE and (
            widest > FMA_ONE_TILE or len(run) < 2 or len({(l.k, l.n, l.epilogue, l.bias) for l in run}) > 1):
        return (f"fp32 IEEE past the row-wise batches: only a run of identical layers up to {FMA_ONE_TILE} "
                "wide is fused, as a loop (mlp_spec.why_slow)")
    return None


def _chains(gm) -> list:
    """Lists of (linear node, epilogue op count or None at the chain's end, whether the Linear's
    output is read besides the next Linear's path) in chain order."""
    nodes = [n for n in gm.graph.nodes if is_planned_linear(n)]
    after = {}
    for node in nodes:
        prev, ops, residual = previous_linear(node)
        if prev is not None and prev not in after:
            after[prev] = (node, ops, residual or len(node.args[0].users) > 1)
    starts = [n for n in nodes if n not in {v[0] for v in after.values()}]
    chains = []
    for start in starts:
        chain, node = [], start
        while node is not None:
            nxt = after.get(node)
            chain.append((node, nxt[1] if nxt else None, nxt[2] if nxt else True))
            node = nxt[0] if nxt else None
        chains.append(chain)
    return chains


def _output_ops(node) -> int:
    """Pointwise ops after the chain's last Linear that its epilogue would take (bias, act, and
    the residual add of its own input)."""
    ops, x = 0, node
    while len(x.users) == 1:
        user = next(iter(x.users))
        if _single_source(user) is not x and user is not _residual_add_of(node) and not _joins_epilogue(user, x):
            break
        ops, x = ops + 1, user
    return ops


def _joins_epilogue(user, x) -> bool:
    """A pointwise op taking the last layer's value and another tensor of its shape (the skip of
    `x + mlp(x)`): the fused MLP takes it into its last layer, so that layer differs from the
    others (the plan must not count it as one more identical layer of a loop)."""
    if user.op != "call_function" or not is_pointwise_target(user.target) or x not in user.args:
        return False
    shape = getattr(_tmeta(x), "shape", None)
    return shape is not None and getattr(_tmeta(user), "shape", None) == shape


def plan_linears(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:   # explain() says why no candidate but the library applies, forced or not
        w = node.args[1] if is_bias_free_linear(node) and len(node.args) > 1 else None
        if isinstance(w, torch.fx.Node) and w.op != "get_attr":
            fxfuse_meta(node)["decision"] = (
                "library GEMM: its weight is computed in the graph (a parametrization such as weight_norm, or "
                "other values); the generated GEMM, fused MLP and Strassen take a weight the model holds")
    if options is None or all(mode != "auto" for mode in (options.strassen, options.gemm, options.fused_mlp, options.tf32x3)):
        gm.meta["fxfuse_skipped"] = True
        return gm
    device = next((fxfuse_meta(n).get("device") for n in gm.graph.nodes if fxfuse_meta(n).get("device")), None)
    name = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else "cpu"
    model = CostModel.load(options.calibration, device_name=name)
    gm.meta["fxfuse_cost_model"] = model.description
    plans_meta = gm.meta.setdefault("fxfuse_plans", [])
    mutated = _mutated_values(gm)
    for chain in _chains(gm):
        layers, inputs = [], tuple(node.args[0] for node, _, _ in chain)
        for node, ops_after, read_elsewhere in chain:
            ops = ops_after if ops_after is not None else _output_ops(node)
            layers.append(_with_tf32x3_products(_describe(node, ops, read_elsewhere, mutated, inputs), options, model))
        legal = [_legal(layer, options, model) for layer in layers]
        written = [node.args[0] in mutated for node, _, _ in chain]
        for layer_legal, w in zip(legal, written):
            if w:   # the rewriting passes keep the library GEMM for it (fuse_gemm, fuse_mlp, strassen)
                layer_legal.update({c: WRITTEN_INPUT for c in layer_legal if c != "library"})

        def mlp_legal(i, j, layers=layers, written=written):
            return WRITTEN_INPUT if any(written[i:j + 1]) else _mlp_legal(layers[i:j + 1], options, model)

        plans = plan_chain(model, layers, legal, mlp_legal)
        for (node, _, _), layer, plan in zip(chain, layers, plans):
            record = {
                "node": node.name, "chain": chain[0][0].name,
                "choice": plan.choice, "segment": plan.segment, "layer": layer,
                "estimates": {c: e.us for c, e in plan.estimates.items()},
                "source": {c: e.source for c, e in plan.estimates.items()},
                "reasons": dict(plan.reasons),
            }
            fxfuse_meta(node)["plan"] = record
            fxfuse_meta(node)["decision"] = f"cost model: {plan.choice} (plan table below)"
            plans_meta.append(record)      # explain() reads it here: rewrites erase the Linear nodes
    return gm


def planned_choice(node) -> str | None:
    """The cost model's choice for a Linear node, or None where no plan was made."""
    plan = fxfuse_meta(node).get("plan")
    return plan["choice"] if plan else None
