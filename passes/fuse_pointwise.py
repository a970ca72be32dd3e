"""Pointwise fusion: maximal convex groups of pointwise nodes become one generated kernel each.

Groups grow along producer -> consumer edges and then across siblings that share an input,
as long as the group stays convex (no path leaves it and comes back, checked by a search on
the quotient graph) and every member whose value is read outside the group has the group's
full iteration shape (it is stored from the kernel). Smaller members, such as `bias * 2`
feeding `x + bias * 2`, are recomputed per point, which is what broadcasting means.
Library calls (matmul, conv, pooling, reductions, views) stay as they are.
"""
import heapq
import numbers
import operator

import torch
import torch.fx

from fxfuse.ir import IndexMap, IRBuilder
from fxfuse.kernel import FusedKernel
from fxfuse.ops import FLOAT_DTYPES, POINTWISE, TRITON_DTYPE, PointwiseOp, as_layout, is_pointwise_target
from fxfuse.tracing import fxfuse_meta

from .eager_rounding import HALF_COMPOSITES, comparison_dtype, number_literal, round_operands
from .join_outputs import join_of, kernel_joins, piece_index
from .write_aliases import _mutated_values, write_aliases, write_order_edges  # noqa: F401 (re-exported)

SCALAR_TYPES = (int, float, bool)
MAX_GROUP_OPS = 128   # per kernel: a RetNet recurrence unrolled over 160 steps made one kernel of 481 operands,
#                       which took the GPU's compiler 100 s per build (fuzz34b); split, a kernel ends a chain
UNSUPPORTED_INPUT_DTYPES = (torch.float64, torch.complex64, torch.complex128)


def _meta(node):
    return node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None


# as_layout (eager's strides restored after a rewrite that writes others) joins a group as the
# identity: the kernel stores each output in its node's strides, so a group ending in it writes
# eager's layout itself, where the copy used to be a kernel of its own. Only here: its stride
# argument belongs to its shape, so the passes that move ops across views must not see it.
LAYOUT = PointwiseOp("as_layout", as_layout, 1, lambda a, stride: a, ("stride",), False, {})


def _op_of(target):
    return LAYOUT if target is as_layout else POINTWISE.get(target) if is_pointwise_target(target) else None


def broadcast_shapes(*shapes) -> tuple:
    """torch.broadcast_shapes in plain Python (RuntimeError where shapes do not broadcast):
    torch's goes through torch._refs, which imports sympy the first time in a process."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for i, size in enumerate(shape, start=ndim - len(shape)):
            if size != 1:
                if out[i] not in (1, size):
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                out[i] = size
    return tuple(out)


def _fp32_reads_it(node, op, operand_meta) -> bool:
    """A 0-dim float64 operand (`torch.from_numpy(np.array(0.125))`, a numpy-made scale) of an op that
    computes in fp32: it does not promote, and eager reads it as one fp32 value, as the kernel's load
    does (fuzz44b: it split the kernel). Beside fp16 it stays out: fp64 -> fp32 -> fp16 rounds twice."""
    if operand_meta.dtype != torch.float64 or len(operand_meta.shape) != 0 or op is LAYOUT or op.name == "cast":
        return False
    return (comparison_dtype(node) if op.returns_bool else _meta(node).dtype) == torch.float32


def why_not_fusible(node: torch.fx.Node, mutated: set) -> str | None:
    """None if node can join a fused kernel, else the reason (shown by explain)."""
    op = _op_of(node.target) if node.op == "call_function" else None
    if op is None:
        return "not a pointwise op"
    meta = _meta(node)
    if not hasattr(meta, "shape"):
        return "output is not a single tensor"
    if meta.dtype not in FLOAT_DTYPES and not (meta.dtype == torch.bool and (op.returns_bool or op.name == "cast")):
        return f"output dtype {meta.dtype} is computed by the library"
    if meta.shape.numel() == 0:
        return "empty tensor"
    if op is LAYOUT and not _is_dense(meta.shape, meta.stride):
        return "eager's layout there is not dense (the kernel stores dense layouts only)"
    operands, params = node.args[:op.nargs], list(node.args[op.nargs:]) + list(node.kwargs.values())
    if set(node.kwargs) - set(op.params) or len(node.args) > op.nargs + len(op.params):   # torch.round(x, decimals=1)
        return "a parameter the kernel does not implement"   # keeps the canonical target: not normalized
    if any(isinstance(p, torch.fx.Node) for p in params):
        return "a parameter of the op is a tensor"
    for a in operands:
        if isinstance(a, torch.fx.Node):
            m = _meta(a)
            if not hasattr(m, "shape"):
                return f"operand {a.name} is not a tensor"
            if (m.dtype in UNSUPPORTED_INPUT_DTYPES and not _fp32_reads_it(node, op, m)) or m.dtype not in TRITON_DTYPE:
                return f"operand {a.name} has dtype {m.dtype}"
            if a in mutated:
                return (f"operand {a.name} may alias a value an in-place op writes (kept unfused so the write "
                        "stays in order)")
        elif not isinstance(a, SCALAR_TYPES):
            return f"operand {a!r} is neither a tensor nor a number"
    if node.target is torch.where and _meta(node.args[0]) is not None and _meta(node.args[0]).dtype != torch.bool:
        return "where() condition is not bool"
    if op.returns_bool and op.name not in ZERO_OR_CLASS_TESTS and _compares_wide_integers(node):
        return "compares int32/int64 values, which fp32 (the kernel's compute type) cannot hold exactly"
    if op.returns_bool:
        return _outside_integer_range(node)
    return None


# integer dtypes whose every value is exact in fp32, the type kernels load them as
EXACT_IN_FP32 = (torch.bool, torch.uint8, torch.int8, torch.int16)


# ops that only ask whether a value is zero, NaN or infinite, or its sign: an int32/int64 value
# loaded as fp32 keeps all of those exactly (fuzz43d: logical_and of int64 masks stayed unfused)
ZERO_OR_CLASS_TESTS = {"logical_and", "logical_or", "logical_xor", "logical_not", "isnan", "isinf", "isfinite",
                       "isposinf", "isneginf", "signbit"}


def _compares_wide_integers(node) -> bool:
    """Whether an int32/int64 tensor meets a value fp32 may not tell it apart from. Not against an
    integer number under 2**24 in size (`attention_mask == 0`, `ids > 2`): fp32 conversion keeps
    the order of integers against such a number (fuzz46h: HF's `masked_fill(mask == 0, ..)`
    was a library call)."""
    if comparison_dtype(node).is_floating_point:
        return False
    tensors = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    numbers_ = [a for a in node.args[:2] if not isinstance(a, torch.fx.Node)]
    if len(tensors) == 1 and len(numbers_) == 1 and isinstance(numbers_[0], int) and abs(numbers_[0]) < 2 ** 24:
        return False
    return any(_meta(a).dtype not in EXACT_IN_FP32 for a in tensors)


def _outside_integer_range(node) -> str | None:
    """Eager converts what an integer tensor is compared with to the comparison's dtype first,
    wrapping it: a Python number (uint8 == 300 compares with 44; int8 > 200 with -56), and a 0-dim
    integer tensor of another dtype, which does not promote (uint8_x > int8_t: -5 is 251;
    fuzz37c). The kernel compares in fp32, unwrapped: such a comparison stays in the library
    unless every value of the operand fits the comparison dtype."""
    dtype = comparison_dtype(node)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return None
    info = torch.iinfo(dtype)
    for a in node.args[:2]:
        if isinstance(a, numbers.Real) and not isinstance(a, torch.fx.Node) and not info.min <= a <= info.max:
            return (f"compares {dtype} values with {a!r}, outside the {dtype} range: eager converts the number "
                    f"to {dtype} first (wrapping it), the kernel would compare it unwrapped")
        m = _meta(a) if isinstance(a, torch.fx.Node) else None
        if m is not None and m.dtype not in (dtype, torch.bool) and not (
                not m.dtype.is_floating_point and info.min <= torch.iinfo(m.dtype).min
                and torch.iinfo(m.dtype).max <= info.max):
            return (f"compares {dtype} values with {a.name}, a {m.dtype} tensor: eager converts it to {dtype} "
                    "first (wrapping it), the kernel would compare it unwrapped")
    return None


class Grouping:
    """Union of nodes into groups over a quotient DAG that is kept acyclic (convexity).

    The DAG is two dicts of sets (`succ`, `pred`) keyed by each group's head node: a depth-first
    search is all the convexity check needs, and networkx, which did this before, costs ~0.2 s of
    imports (~1 s where Python compiles it from source) in the first optimize of a process.
    """

    def __init__(self, graph: torch.fx.Graph, fusible: set):
        self.group = {}
        self.members = {}
        self.succ, self.pred = {}, {}
        for node in graph.nodes:
            self.group[node] = node
            self.members[node] = [node]
            self.succ[node], self.pred[node] = set(), set()
        for node in graph.nodes:
            for src in node.all_input_nodes:
                self.succ[src].add(node)
                self.pred[node].add(src)
        self.fusible = fusible
        self.mutated = frozenset()   # set by fuse_pointwise

    def _reaches(self, a, b) -> bool:
        """A path a -> ... -> b other than the direct edge."""
        seen, stack = {a}, [v for v in self.succ[a] if v is not b]
        while stack:
            v = stack.pop()
            if v is b:
                return True
            if v not in seen:
                seen.add(v)
                stack.extend(self.succ[v])
        return False

    def _creates_cycle(self, a, b) -> bool:
        return self._reaches(a, b) or self._reaches(b, a)

    @staticmethod
    def iteration_shape(members) -> tuple:
        return broadcast_shapes(*[tuple(_meta(m).shape) for m in members])

    def _shapes_ok(self, members) -> bool:
        try:
            shape = self.iteration_shape(members)
        except RuntimeError:
            return False
        inside = set(members)
        devices = {fxfuse_meta(m).get("device") for m in members}
        if len(devices) > 1:
            return False
        for m in members:
            read_outside = any(u not in inside for u in m.users)
            if read_outside and tuple(_meta(m).shape) != shape:
                return False
        return True

    def topological_order(self, order: dict) -> list:
        """Group heads in dependency order, ties broken by graph position (Kahn's algorithm)."""
        waiting = {n: len(p) for n, p in self.pred.items()}
        ready = [(order[n], n.name, n) for n, k in waiting.items() if k == 0]
        heapq.heapify(ready)
        out = []
        while ready:
            _, _, n = heapq.heappop(ready)
            out.append(n)
            for v in self.succ[n]:
                waiting[v] -= 1
                if waiting[v] == 0:
                    heapq.heappush(ready, (order[v], v.name, v))
        if len(out) != len(waiting):
            raise RuntimeError("fxfuse: the fused graph has a cycle (a bug in fxfuse's convexity check)")
        return out

    def try_merge(self, x, y) -> bool:
        a, b = self.group[x], self.group[y]
        if a is b or a not in self.fusible or b not in self.fusible:
            return False
        merged = self.members[a] + self.members[b]
        if len(merged) > MAX_GROUP_OPS or not self._shapes_ok(merged) or self._creates_cycle(a, b):
            return False
        for u in self.pred.pop(b):
            self.succ[u].discard(b)
            if u is not a:
                self.succ[u].add(a)
                self.pred[a].add(u)
        for v in self.succ.pop(b):
            self.pred[v].discard(b)
            if v is not a:
                self.pred[v].add(a)
                self.succ[a].add(v)
        for m in self.members.pop(b):
            self.group[m] = a
        self.members[a] = merged
        return True


def fuse_pointwise(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    if options is not None and not options.fuse:
        gm.meta["fxfuse_skipped"] = True
        for node in gm.graph.nodes:   # explain() said "not one of the pointwise ops fxfuse fuses" (fuzz36e)
            if node.op == "call_function" and is_pointwise_target(node.target) and "decision" not in fxfuse_meta(node):
                fxfuse_meta(node)["decision"] = "not fused: fuse=False"
        return gm
    use_kernels = True if options is None or options.use_kernels is None else options.use_kernels
    g = gm.graph
    writes = write_aliases(gm)
    mutated = _mutated_values(gm, writes)
    fusible = set()
    for node in g.nodes:
        reason = why_not_fusible(node, mutated)
        if reason is None:
            fusible.add(node)
        elif node.op == "call_function" and _op_of(node.target) is not None:
            fxfuse_meta(node)["decision"] = f"not fused: {reason}"
    grouping = Grouping(g, fusible)
    grouping.mutated = mutated
    for before, after in write_order_edges(gm, writes):
        grouping.succ[before].add(after)
        grouping.pred[after].add(before)
    order = {n: k for k, n in enumerate(g.nodes)}
    for node in g.nodes:                      # producer -> consumer
        if node in fusible:
            for src in node.all_input_nodes:
                grouping.try_merge(src, node)
    for node in g.nodes:                      # siblings reading the same value, or views of it (fuzz39c:
        readers = sorted((u for v in (node, *_views_of(node, fusible)) for u in v.users if u in fusible),
                         key=order.get)       # YOLO's p[..., 0], p[..., 1], ... were a kernel each)
        readers = list(dict.fromkeys(readers))
        anchor = readers[0] if readers else None
        for u in readers[1:]:                 # past a full group (MAX_GROUP_OPS), the next ones join
            if not grouping.try_merge(anchor, u) and len(grouping.members[grouping.group[anchor]]) + len(
                    grouping.members[grouping.group[u]]) > MAX_GROUP_OPS:
                anchor = u                    # each other, not one kernel each (fuzz34i: 73 kernels, not 2)
    return _rebuild(gm, grouping, order, use_kernels)


SLICING = {operator.getitem, torch.select, torch.narrow, torch.split, torch.chunk, torch.unbind, torch.tensor_split,
           torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default,
           torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.unbind.int}


def _views_of(node, fusible, depth: int = 2) -> list:
    """The slices of node (`p[..., 0]`, p.select, a split's or chunk's pieces), two levels down: a
    kernel's loads read them where they lie, so the chains reading them are siblings too."""
    found = []
    for u in node.users:
        if u not in fusible and (u.op == "call_function" and u.target in SLICING
                                 or u.op == "call_method" and u.target in ("select", "narrow", "split", "chunk",
                                                                           "unbind", "tensor_split")):
            found.append(u)
            if depth > 1:
                found += _views_of(u, fusible, depth - 1)
    return found


def _rebuild(gm, grouping: Grouping, order: dict, use_kernels: bool) -> torch.fx.GraphModule:
    """Emit the quotient DAG in topological order; each multi-op group becomes a FusedKernel."""
    new = torch.fx.Graph()
    new.set_codegen(gm.graph._codegen)  # keeps torch.export's pytree inputs/outputs
    env = {}
    units = grouping.topological_order(order)
    count = 0
    for head in units:
        members = sorted(grouping.members[head], key=order.get)
        if head not in grouping.fusible:
            if head not in env:   # a stack / cat a kernel wrote is in env already
                env[head] = new.node_copy(head, lambda n: env[n])
            continue
        if all(m.target is as_layout for m in members):   # only layouts: the library op copies only where
            for m in members:                              # the strides differ at run time
                env[m] = new.node_copy(m, lambda n: env[n])
            continue
        name = f"fused_{count}"
        while hasattr(gm, name):   # the model's own submodule may be called fused_0
            count += 1
            name = f"fused_{count}"
        count += 1
        inputs, outputs, module = build_fused_kernel(gm, members, use_kernels, grouping.mutated)
        gm.add_submodule(name, module)
        call = new.call_module(name, tuple(env[i] for i in inputs))
        call.meta["fxfuse"] = {"kind": "fused kernel", "members": [m.name for m in members]}
        if len(outputs) == 1:
            call.meta["tensor_meta"] = outputs[0].meta["tensor_meta"]
            env[outputs[0]] = call
        else:
            for k, out in enumerate(outputs):
                item = new.call_function(operator.getitem, (call, k))
                item.meta["tensor_meta"] = out.meta["tensor_meta"]
                item.meta["fxfuse"] = {"kind": "output of " + name}
                env[out] = item
    gm.graph = new
    for node in new.nodes:
        node.meta.setdefault("fxfuse", {})
    new.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def build_fused_kernel(gm, members, use_kernels: bool, mutated=frozenset()):
    """Lower a group of canonical pointwise nodes to the IR; return (inputs, outputs, module)."""
    inside = set(members)
    shape = Grouping.iteration_shape(members)
    inputs = []
    for m in members:
        for a in m.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    joins = kernel_joins(members, inputs, shape, UNSUPPORTED_INPUT_DTYPES, mutated)
    outputs = [m for m in members if any(u not in inside and u not in joins for u in m.users)]
    b = IRBuilder(shape)
    for a in inputs:
        b.add_input(_meta(a).dtype)
    value = {}
    for m in members:
        op = _op_of(m.target)
        args = []
        for a in m.args[:op.nargs]:
            if isinstance(a, torch.fx.Node) and a in inside:
                args.append(value[a])
            elif isinstance(a, torch.fx.Node):
                meta = _meta(a)
                args.append(b.load(inputs.index(a), IndexMap.broadcast(meta.shape, meta.stride, shape)))
            else:
                args.append(b.const(number_literal(a, m)))
        if op is LAYOUT:
            value[m] = args[0]
            continue
        args = round_operands(b, m, args)
        params = dict(zip(op.params, m.args[op.nargs:]))
        params.update(m.kwargs)
        half = _meta(m).dtype in (torch.float16, torch.bfloat16)
        value[m] = HALF_COMPOSITES[op.name](b, *args, _meta(m).dtype) if half and op.name in HALF_COMPOSITES \
            else b.op(op.name, args, **params)
        if half and op.name != "cast":
            # eager rounds every fp16 result before the next op reads it; so does the kernel
            value[m] = b.op("cast", [value[m]], dtype=_meta(m).dtype)
    for out in outputs:  # in eager's layout: a channels_last result stays channels_last
        meta = _meta(out)
        b.store(value[out], meta.dtype, strides=meta.stride if _is_dense(meta.shape, meta.stride) else None)
    for join in joins:   # pieces stored where they lie in the stacked / concatenated tensor
        out = b.joined_output(_meta(join).shape, _meta(join).dtype)
        for k, piece in enumerate(join_of(join)[1]):
            v = value[piece] if piece in inside else b.load(
                inputs.index(piece), IndexMap.broadcast(_meta(piece).shape, _meta(piece).stride, shape))
            b.store_into(out, v, piece_index(join, k, shape))
    outputs += joins
    members = list(members) + joins
    reference = _reference_module(members, inputs, outputs)
    input_meta = tuple((tuple(_meta(a).shape), tuple(_meta(a).stride), _meta(a).dtype) for a in inputs)
    described = tuple(f"{m.name}={join_of(m)[0] if m in joins else _op_of(m.target).name}" for m in members)
    return inputs, outputs, FusedKernel(b.build(), reference, input_meta, described, use_kernels)


def _is_dense(shape, strides) -> bool:
    """True if strides lay out every element of shape exactly once (contiguous up to a
    permutation of dims, as eager's pointwise results are): a layout a kernel can store into."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(shape, strides) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _reference_module(members, inputs, outputs) -> torch.fx.GraphModule:
    """The group's own torch ops as a small GraphModule: the kernel's reference and fallback."""
    g = torch.fx.Graph()
    env = {a: g.placeholder(a.name) for a in inputs}
    for m in members:
        env[m] = g.node_copy(m, lambda n: env[n])
    g.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), g)
