"""Fully fused MLP: a chain of narrow Linear layers and the pointwise ops between them becomes
ONE generated Triton kernel (fxfuse/mlp_kernel.py), activations kept on chip.

Runs after normalize, so a Linear is `F.linear(x, W)` with W a get_attr, followed by canonical
pointwise ops (`operator.add(y, bias)`, `torch.relu(y)`, ...). A region grows from a Linear
over the users of its values, in graph order: a node joins when it is a Linear reading a
region value (or the region's input x) with a get_attr weight, or a pointwise op of
fxfuse.ops whose operands are region values, x, numbers, or constant get_attr vectors ([N],
[1, N]) or scalars, and whose result keeps the region's rows and dtype. Residual adds
(`h + lin(h)`) join like any other pointwise op. Pointwise ops that only feed x join as a
prefix (the bias add and activation of a wide Linear left to the library). The region is then
cut back to its longest prefix with exactly one value read from outside (the chain's output):
every intermediate value must have all its readers inside, because none of them is ever
written to memory. When the answer is no, the chain is retried without its last Linear (a
narrow body before a wide head still fuses), and later Linears start chains of their own.

Legality lives here and in mlp_spec.why_not_kernel; profitability in `should_fuse_mlp`, the
one place the choice is made (options.fused_mlp: "auto" asks it, "force" fuses every legal
chain, "off" skips the pass). The reason lands in node.meta["fxfuse"]["decision"] of the new
call_module node, where explain() shows it; when it says no, in "decision" and "fused_mlp" of
the chain's Linear nodes (a later pass may replace "decision" with its own).
"""
import heapq

import torch
import torch.fx
import torch.nn.functional as F

from fxfuse.mlp_kernel import (FusedMLP, KERNEL_DTYPES, Linear, MLPSpec, Pointwise, choose_config, why_not_kernel,
                               why_slow)
from fxfuse.ops import FLOAT_DTYPES, POINTWISE, cast, is_pointwise_target, keep_eager_layout, row_major
from fxfuse.precision import matmul_allows_tf32
from fxfuse.tracing import fetch_attr as _fetch, fxfuse_meta, tensor_meta as _tmeta

from .eager_rounding import number_literal
from .fuse_pointwise import _mutated_values, why_not_fusible
from .plan_linears import planned_choice

AUTO_MAX_WIDTH = 0       # measured: no width where the kernel beat library GEMMs yet (should_fuse_mlp)
AUTO_MAX_ROWS = 0
EXCLUDED_OPS = {torch.where, cast}   # bool conditions and dtype changes stay outside the chain


def should_fuse_mlp(batch: int, widths, dtype: torch.dtype) -> tuple:
    """(fuse?, reason) for a legal chain under fused_mlp="auto".

    Measured on an H100 (benchmarks/results/nvidia-h100-80gb-hbm3/mlp_20261123-012452.md and
    overhead_probe_20261123.txt, 8 x Linear(128) + ReLU, fp32): the kernel as it stands is
    slower than per-layer library GEMMs with fused epilogues in one CUDA graph at every batch
    tried (batch 1: 50 us of GPU time vs 27 us; batch 64: 409 vs 90 us), so "auto" does not
    choose it until the kernel is faster; "force" still builds it (tests, benchmarks).
    """
    widest = max(widths)
    if dtype not in KERNEL_DTYPES:
        return False, f"dtype {dtype} has no fused MLP kernel"
    if widest > AUTO_MAX_WIDTH or batch > AUTO_MAX_ROWS:
        return False, (f"widths up to {widest}, batch {batch}: outside where the fused MLP kernel "
                       "measured faster than library GEMMs")
    return True, f"widths <= {widest} fit on chip"


def _auto_choice(region, spec) -> tuple:
    """(fuse?, reason) under "auto": the cost model's plan where every Linear of the region has
    one (fuse only if all chose "mlp"), else should_fuse_mlp's measured rule."""
    choices = [planned_choice(n) for n in region.nodes if _linear_parts(n) is not None]
    if choices and all(c is not None for c in choices):
        if all(c == "mlp" for c in choices):
            return True, "the cost model chose one fused MLP kernel for these layers"
        return False, f"the cost model chose {', '.join(sorted(set(choices)))}"
    return should_fuse_mlp(region.batch, spec.widths, spec.dtype)


LINEAR_TARGETS = (F.linear, torch.ops.aten.linear.default)   # aten: torch.export graphs, no bias


def _linear_parts(node):
    """(input, weight, bias or None) of a linear call, or None."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    args = dict(zip(("input", "weight", "bias"), node.args), **node.kwargs)
    if set(args) - {"input", "weight", "bias"} or "weight" not in args:
        return None
    return args["input"], args["weight"], args.get("bias")


def _constant(gm, node, width: int):
    """The tensor of a get_attr usable as a row vector [width] or a scalar, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    m = _tmeta(node)
    if m is None or not hasattr(m, "shape") or m.dtype not in FLOAT_DTYPES:
        return None
    shape = tuple(m.shape)
    if m.shape.numel() == 1 or (shape and shape[-1] == width and m.shape.numel() == width):
        return _fetch(gm, node.target)
    return None


class _Region:
    """A candidate chain: its input x, its nodes in graph order, and their row shape."""

    def __init__(self, gm, start, mutated):
        self.gm, self.mutated = gm, mutated
        self.x = start.args[0]
        xm = _tmeta(self.x)
        self.rows = tuple(xm.shape[:-1])
        self.dtype = xm.dtype
        self.nodes, self.inside = [], set()

    def _value_ok(self, node) -> bool:
        m = _tmeta(node)
        return hasattr(m, "shape") and m.dtype == self.dtype and len(m.shape) >= 1 \
            and tuple(m.shape[:-1]) == self.rows and node not in self.mutated

    def _is_value(self, a) -> bool:
        return isinstance(a, torch.fx.Node) and (a in self.inside or a is self.x)

    @property
    def skips(self) -> list:
        """Tensors the nodes read that are neither region values nor constants, in order of
        first reading: none in a fused MLP (joins refuses them); a generated GEMM's epilogue
        reads them at the output tile (fuse_gemm._EpilogueRegion: the skip of `h + lin(...)`)."""
        found = {}
        for node in self.nodes:
            if _linear_parts(node) is None:
                found.update(dict.fromkeys(self.outside_operands(node)))
        return list(found)

    def outside_operands(self, node) -> list:
        """The operands of pointwise `node` that are tensors but neither region values nor constants."""
        width = _tmeta(node).shape[-1]
        return [a for a in node.args[:POINTWISE[node.target].nargs] if isinstance(a, torch.fx.Node)
                and not self._is_value(a) and _constant(self.gm, a, width) is None]

    def joins(self, node) -> bool:
        if not self._value_ok(node):
            return False
        width = _tmeta(node).shape[-1]
        parts = _linear_parts(node)
        if parts is not None:
            src, w, b = parts
            wm = _tmeta(w)
            return (self._is_value(src) and isinstance(w, torch.fx.Node) and w.op == "get_attr"
                    and w not in self.mutated and b not in self.mutated   # packed now: a written W would go stale
                    and wm is not None and len(wm.shape) == 2 and wm.dtype == self.dtype
                    and wm.shape[1] == _tmeta(src).shape[-1]
                    and (b is None or (_constant(self.gm, b, width) is not None and _tmeta(b).dtype == self.dtype)))
        if node.op != "call_function" or not is_pointwise_target(node.target) or node.target in EXCLUDED_OPS \
                or POINTWISE[node.target].returns_bool or why_not_fusible(node, self.mutated) is not None:
            return False
        operands = node.args[:POINTWISE[node.target].nargs]
        if not any(isinstance(a, torch.fx.Node) and a in self.inside for a in operands):
            return False
        for a in operands:
            if not isinstance(a, torch.fx.Node):
                continue
            if self._is_value(a):
                if tuple(_tmeta(a).shape) != tuple(_tmeta(node).shape):
                    return False
            elif _constant(self.gm, a, width) is None and not self._skip_ok(a, node):
                return False
        return True

    def _skip_ok(self, a, node) -> bool:
        """Whether `node` may read tensor `a` from outside the region (a fused MLP: no)."""
        return False

    def grow(self, start, order: dict) -> None:
        """Visit users of region values in graph order (a heap), so a node is decided after
        every node before it that could have joined. Later readers of x are seeds too: in
        fc3(relu(fc1(x)) + fc2(x)) the second Linear reads x, not a region value. Nodes before
        start (an absorbed prefix) stay; a second call, after absorb_prefix moved x, finds the
        readers of the new x (a residual `+ x` around a prefix op)."""
        self.nodes = [n for n in self.nodes if order[n] < order[start]]
        self.inside = set(self.nodes)
        seeds = [start] + [u for u in self.x.users if u in order and order[u] > order[start]]
        heap, seen = [(order[n], n) for n in seeds], set(seeds)
        heapq.heapify(heap)
        while heap:
            _, node = heapq.heappop(heap)
            if node is not start and not self.joins(node):
                continue
            self.nodes.append(node)
            self.inside.add(node)
            for u in node.users:
                if u not in seen and u in order:   # (nodes made by this pass are not candidates)
                    seen.add(u)
                    heapq.heappush(heap, (order[u], u))

    def absorb_prefix(self) -> bool:
        """Pull in pointwise ops that only feed the chain's input, such as the bias add and
        activation after a Linear left to the library: they run in the kernel's first tiles.
        True if x moved."""
        moved = False
        while True:
            p = self.x
            if p.op != "call_function" or not is_pointwise_target(p.target) or p.target in EXCLUDED_OPS \
                    or POINTWISE[p.target].returns_bool or len(p.users) != 1 or not self._value_ok(p) \
                    or why_not_fusible(p, self.mutated) is not None:
                return moved
            width = _tmeta(p).shape[-1]
            operands = p.args[:POINTWISE[p.target].nargs]
            sources = [a for a in operands if isinstance(a, torch.fx.Node) and _constant(self.gm, a, width) is None]
            if len(sources) != 1 or any(a is sources[0] for a in operands if a is not sources[0]) \
                    or _tmeta(sources[0]) is None or tuple(_tmeta(sources[0]).shape) != tuple(_tmeta(p).shape) \
                    or _tmeta(sources[0]).dtype != self.dtype or sources[0] in self.mutated:
                return moved
            self.nodes.insert(0, p)
            self.inside.add(p)
            self.x = sources[0]
            moved = True

    def drop_last_linear(self) -> bool:
        """Cut the chain before its last Linear (after a "no"); False if one Linear is left."""
        linears = [k for k, n in enumerate(self.nodes) if _linear_parts(n) is not None]
        if len(linears) < 2:
            return False
        self.nodes = self.nodes[:linears[-1]]
        self.inside = set(self.nodes)
        return True

    def cut_before_other_plans(self) -> None:
        """Under "auto", keep the nodes before the first Linear the cost model gave another
        candidate than "mlp": _auto_choice refuses every region holding it, and dropping the
        chain's Linears one by one to get there cost O(layers^2) lowerings per start."""
        for k, n in enumerate(self.nodes):
            if _linear_parts(n) is not None and planned_choice(n) not in (None, "mlp"):
                self.nodes = self.nodes[:k]
                self.inside = set(self.nodes)
                return

    def trim(self) -> None:
        """Keep the largest part that ends in one value, its only one read outside: some node
        o and the region nodes it depends on. A branch that leaves the region elsewhere (a
        second head on x, a value also returned) is dropped, not the chain after it."""
        best = []
        for k in range(len(self.nodes) - 1, -1, -1):
            if len(best) > k:
                break        # o's part holds at most the k + 1 nodes up to it: none larger is left
            o = self.nodes[k]
            keep, todo = {o}, [o]
            while todo:
                for a in todo.pop().all_input_nodes:
                    if a in self.inside and a not in keep:
                        keep.add(a)
                        todo.append(a)
            if len(keep) > len(best) and all(u in keep for n in keep if n is not o for u in n.users):
                best = [n for n in self.nodes if n in keep]
        self.nodes, self.inside = best, set(best)

    @property
    def output(self):
        return self.nodes[-1]

    @property
    def batch(self) -> int:
        n = 1
        for r in self.rows:
            n *= r
        return n


def _lower(gm, region: _Region):
    """(MLPSpec, weights, vectors, members) of a region."""
    values, widths, steps, weights, vectors, members = {region.x: 0}, [_tmeta(region.x).shape[-1]], [], [], [], []
    skips = region.skips
    for node in region.nodes:
        width = _tmeta(node).shape[-1]
        parts = _linear_parts(node)
        if parts is not None:
            src, w, b = parts
            weights.append(_fetch(gm, w.target))
            steps.append(Linear(out=len(widths), src=values[src], weight=len(weights) - 1))
            widths.append(width)
            if b is not None:
                vectors.append(_fetch(gm, b.target))
                steps.append(Pointwise(len(widths), "add", (("value", len(widths) - 1), ("vector", len(vectors) - 1))))
                widths.append(width)
            members.append(f"{node.name}=linear")
        else:
            op = POINTWISE[node.target]
            operands = []
            for a in node.args[:op.nargs]:
                if isinstance(a, torch.fx.Node) and a in values:
                    operands.append(("value", values[a]))
                elif isinstance(a, torch.fx.Node) and a in skips:
                    operands.append(("skip", skips.index(a)))
                elif isinstance(a, torch.fx.Node):
                    vectors.append(_fetch(gm, a.target))
                    operands.append(("vector", len(vectors) - 1))
                else:
                    operands.append(("number", number_literal(a, node)))   # as eager reads it (fuzz48f)
            params = dict(zip(op.params, node.args[op.nargs:]))
            params.update(node.kwargs)
            steps.append(Pointwise(len(widths), op.name, tuple(operands), tuple(sorted(params.items()))))
            widths.append(width)
            members.append(f"{node.name}={op.name}")
        values[node] = len(widths) - 1
    spec = MLPSpec(tuple(widths), tuple(steps), values[region.output], region.dtype)
    return spec, weights, vectors, tuple(members)


def _reference(gm, region: _Region) -> torch.fx.GraphModule:
    """The chain's own nodes (and the constants they read) as a GraphModule: the fallback."""
    g = torch.fx.Graph()
    env, attrs = {region.x: g.placeholder("x")}, {}
    for k, skip in enumerate(region.skips):
        env[skip] = g.placeholder(f"skip{k}")

    def arg(n):
        if n not in env:  # a constant outside the region
            env[n] = g.get_attr(n.target)
            attrs[n.target] = _fetch(gm, n.target)
        return env[n]

    for node in region.nodes:
        env[node] = g.node_copy(node, arg)
    g.output(env[region.output])
    return torch.fx.GraphModule(attrs, g)


def fuse_mlp(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    mode = options.fused_mlp if options is not None else "auto"    # (Options checked the value)
    if mode == "off" or (options is not None and not options.fuse):
        gm.meta["fxfuse_skipped"] = True
        return gm
    use_kernels = True if options is None or options.use_kernels is None else options.use_kernels
    allow_tf32 = matmul_allows_tf32()
    g = gm.graph
    mutated = _mutated_values(gm)
    order = {n: k for k, n in enumerate(g.nodes)}
    taken, changed = set(), False
    pending, retried = list(g.nodes), set()
    while pending:
        start = pending.pop(0)
        x = _linear_parts(start)[0] if _linear_parts(start) is not None else None
        if start in taken or not isinstance(x, torch.fx.Node) or _tmeta(x) is None \
                or not hasattr(_tmeta(x), "shape") or x in mutated:
            continue
        if mode == "auto" and planned_choice(start) not in (None, "mlp"):   # no region holding it fuses
            fxfuse_meta(start)["fused_mlp"] = f"not a fused MLP: the cost model chose {planned_choice(start)}"
            continue
        region = _Region(gm, start, mutated)
        if not region.joins(start):
            continue
        region.grow(start, order)
        if region.absorb_prefix():
            region.grow(start, order)
        if mode == "auto":
            region.cut_before_other_plans()
        while True:          # on a "no", retry without the last Linear (a narrow head may fit)
            region.trim()
            if not region.nodes:
                break
            spec, weights, vectors, members = _lower(gm, region)
            config = choose_config(spec, region.batch, allow_tf32, numels=tuple(v.numel() for v in vectors))
            problem = why_not_kernel(spec, config, rows=region.batch)
            ok, reason = (False, problem) if problem else _auto_choice(region, spec)
            if ok and (slow := why_slow(spec, config)):
                ok, reason = False, slow
            if mode == "force" and not problem:
                ok, reason = True, f"forced by fused_mlp='force'; auto: {'yes' if ok else 'no'}, {reason}"
            if ok:
                break
            for n in region.nodes:
                if _linear_parts(n) is not None:
                    fxfuse_meta(n)["fused_mlp"] = f"not a fused MLP: {reason}"
                    if planned_choice(n) is None:     # else the plan's own decision line says it
                        fxfuse_meta(n)["decision"] = fxfuse_meta(n)["fused_mlp"]
                    elif mode == "force":             # (and why the force did not take it: fuzz46f)
                        fxfuse_meta(n)["decision"] += f"; {fxfuse_meta(n)['fused_mlp']}"
            if not region.drop_last_linear():
                break
        if not region.nodes or not ok:   # a chain starting at a later Linear may still qualify
            taken.add(start)
            continue
        taken.update(region.nodes)
        module = FusedMLP(spec, weights, vectors, _reference(gm, region), members, use_kernels, config)
        _replace(gm, region, module, reason)
        changed = True
        if start not in region.inside and start not in retried:   # the region kept a later reader of x
            retried.add(start)                                     # (`a(x)` beside `x + b(x)`): `a` once more
            pending.insert(0, start)
    if changed:
        g.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return gm


def replace_region(gm, region: _Region, module, prefix: str, kind: str, decision: str):
    """Put `module` (called on region.x and region.skips) in place of the region's nodes;
    return the call node.

    The region's output is its only value read outside it (trim), so its users move to the
    call; the members and the constants only they read are erased. Shared by fuse_gemm."""
    g = gm.graph
    k = 0
    while hasattr(gm, f"{prefix}_{k}"):
        k += 1
    name = f"{prefix}_{k}"
    gm.add_submodule(name, module)
    out = region.output
    with g.inserting_before(out):
        call = g.call_module(name, (region.x, *region.skips))
    eager = out.meta["tensor_meta"]
    written = row_major(eager.shape)    # the kernel writes row-major
    call.meta["tensor_meta"] = eager._replace(stride=written)
    call.meta["fxfuse"] = {"kind": kind, "members": [n.name for n in region.nodes],
                           "device": fxfuse_meta(out).get("device"), "decision": decision}
    out.replace_all_uses_with(call)
    keep_eager_layout(gm, call, eager, written)   # a residual over a transposed x: eager kept x's layout
    consts = set()
    for node in reversed(region.nodes):
        consts.update(a for a in node.all_input_nodes if a.op == "get_attr")
        g.erase_node(node)
    for c in consts:
        if not c.users:
            g.erase_node(c)
    return call


def _replace(gm, region: _Region, module: FusedMLP, reason: str) -> None:
    layers = len(module.spec.linears)
    cfg = module.config
    form = "row-wise, 1 row" if cfg.rowwise else f"tl.dot {cfg.precision}, {cfg.block_m} rows"
    replace_region(gm, region, module, "fused_mlp", "fused mlp",
                   f"fused MLP: {layers} Linear layer(s) + {len(region.nodes) - layers} pointwise ops "
                   f"in one launch ({reason}; {form} per program)")
