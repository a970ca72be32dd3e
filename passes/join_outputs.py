"""Stacks and concatenations of a fused kernel's results, written by the kernel itself.

`torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)` (rotary embeddings that rotate
every two), `torch.cat([h.sin(), h.cos()], -1)` (positional encodings), `torch.cat([x, gelu(x)], 1)`:
the pieces are a kernel's results, and the library call copied each of them once more into a new
tensor (a second kernel and a second round trip through memory). The kernel stores every piece
at its place in the joined tensor instead: one output, no copy.

Only where every piece has the kernel's full iteration shape and the joined tensor's dtype, at
least one piece is computed by the kernel (the others are its inputs, which it loads and stores
as the copy did), and the joined tensor is laid out contiguously (as torch lays out a stack or
cat of such pieces).
"""
import math
import operator

import torch
import torch.fx

from fxfuse.ir import IndexMap
from fxfuse.node_meta import single_tensor_meta
from fxfuse.ops import TRITON_DTYPE, is_pointwise_target, row_major
from fxfuse.tracing import fxfuse_meta

aten = torch.ops.aten
JOINS = {torch.stack: "stack", torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat",
         aten.stack.default: "stack", aten.cat.default: "cat", aten.concat.default: "cat",
         **{p.default: "cat" for p in (getattr(aten, "concatenate", None),) if p is not None}}   # (export: fuzz47i)
# cat along a fixed dim where every piece has at least that many dims + 1 (lower ones are reshaped first)
FIXED_DIM = {torch.hstack: 1, torch.column_stack: 1, torch.vstack: 0, torch.row_stack: 0, torch.dstack: 2}
FIXED_DIM.update({getattr(aten, f.__name__).default: d for f, d in list(FIXED_DIM.items())
                  if hasattr(getattr(aten, f.__name__, None), "default")})   # torch.export's spellings
DIM_NAMES = {"dim": "dim", "axis": "dim"}   # torch.concatenate(tensors, axis=...)
# the same joins of lower pieces, by each piece's rank: (kind, dim) (fuzz44e: they split a kernel)
LOW_RANK = {"hstack": {1: ("cat", 0)}, "vstack": {1: ("stack", 0)}, "row_stack": {1: ("stack", 0)},
            "column_stack": {1: ("stack", 1)}, "dstack": {2: ("stack", 2)}}


def _meta(node):
    """node's TensorMetadata where it is one tensor (a split's is a tuple of them: fuzz45a, a cat of
    a chunk's items was an internal error), else None."""
    return single_tensor_meta(node) if isinstance(node, torch.fx.Node) else None


def join_of(node):
    """(kind, pieces, dim) of a stack or cat node written plainly, else None."""
    if node.op == "call_function" and node.target in FIXED_DIM and len(node.args) == 1 and not node.kwargs \
            and isinstance(node.args[0], (list, tuple)) and node.args[0]:
        ranks = {len(getattr(_meta(p), "shape", ())) for p in node.args[0]}
        if min(ranks) > max(FIXED_DIM[node.target], 1):
            return "cat", tuple(node.args[0]), FIXED_DIM[node.target]   # (fuzz42g; vstack of 1-D pieces stacks
            #                                                              them: a cat of [N] wrote past its end, review43k)
        name = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", "")
        kind_dim = LOW_RANK.get(name, {}).get(min(ranks)) if len(ranks) == 1 else None
        return (kind_dim[0], tuple(node.args[0]), kind_dim[1]) if kind_dim else None
    if node.op != "call_function" or node.target not in JOINS or len(node.args) > 2:
        return None
    bound = dict(zip(("tensors", "dim"), node.args))
    for name, value in node.kwargs.items():
        key = "tensors" if name == "tensors" else DIM_NAMES.get(name)
        if key is None or key in bound:
            return None   # out=, or a parameter given twice
        bound[key] = value
    pieces, dim = bound.get("tensors"), bound.get("dim", 0)
    if not isinstance(pieces, (list, tuple)) or not pieces or type(dim) is not int \
            or not all(isinstance(p, torch.fx.Node) for p in pieces):
        return None
    return JOINS[node.target], tuple(pieces), dim


def cat_of_unsqueezed_as_stack(node) -> bool:
    """`torch.cat([h[..., None], g[..., None]], -1)` (vstack of `h[None]` pieces, ...) is
    `torch.stack([h, g], -1)`, which a kernel writes; the cat split it (fuzz44e). Rewritten in
    place (normalize), so the unsqueezed views go dead; True if it was."""
    parts = join_of(node)
    sources = _unsqueezed_sources(parts[1], parts[2]) if parts is not None and parts[0] == "cat" else None
    if sources is None:
        return False
    node.target, node.args, node.kwargs = torch.stack, (list(sources), parts[2]), {}
    return True


def _unsqueezed_sources(pieces, dim):
    """The sources of pieces that are each an unsqueeze at the cat's dim, else None."""
    sources = []
    for p in pieces:
        meta, src = _meta(p), p.args[0] if p.args else None
        src_meta = _meta(src)
        if meta is None or src_meta is None or len(meta.shape) != len(src_meta.shape) + 1:
            return None
        d = dim % len(meta.shape)
        if p.op == "call_method" and p.target == "unsqueeze" or p.op == "call_function" and p.target in (
                torch.unsqueeze, aten.unsqueeze.default):
            at = p.args[1] if len(p.args) == 2 and not p.kwargs else p.kwargs.get("dim")
            ok = type(at) is int and at % len(meta.shape) == d
        else:   # h[..., None] at the last dim, h[None] at the first
            index = p.args[1] if p.op == "call_function" and p.target is operator.getitem else False
            ok = index == (Ellipsis, None) and d == len(meta.shape) - 1 or index in (None, (None,)) and d == 0
        if not ok:
            return None
        sources.append(src)
    return tuple(sources)


def kernel_joins(members, inputs, shape, unsupported_dtypes, mutated) -> list:
    """The stack / cat nodes a kernel of `members` over iteration space `shape` can write: each
    piece computed by the kernel or one of its inputs (another kernel's result may come later),
    and none an in-place op may write (`a = x.relu(); a.add_(1); torch.cat([a, b])`: the kernel
    would store a before the write)."""
    inside, found = set(members), []
    numel = 1
    for size in shape:
        numel *= size
    devices = {fxfuse_meta(m).get("device") for m in members}
    for join in dict.fromkeys(u for m in members for u in m.users if u not in inside):
        parts = join_of(join)
        meta = _meta(join)
        if parts is None or meta is None or numel == 0 or not shape and parts[0] == "cat":
            continue
        kind, pieces, dim = parts
        metas = [_meta(p) for p in pieces]
        if not any(p in inside for p in pieces) or not all(p in inside or p in inputs for p in pieces) \
                or any(p in mutated for p in pieces) or any(
                m is None or tuple(m.shape) != tuple(shape) or m.dtype != meta.dtype for m in metas):
            continue
        if meta.dtype in unsupported_dtypes or meta.dtype not in TRITON_DTYPE \
                or tuple(meta.stride) != row_major(meta.shape) \
                or {fxfuse_meta(n).get("device") for n in (join, *pieces)} != devices:
            continue
        ndim = len(shape) + (kind == "stack")
        if not -ndim <= dim < ndim:
            continue
        found.append(join)
    return found


def piece_index(join, k: int, shape) -> IndexMap:
    """Where piece k of join lies in the joined (contiguous) tensor, over the iteration space."""
    kind, pieces, dim = join_of(join)
    strides = row_major(_meta(join).shape)
    if kind == "stack":
        d = dim % (len(shape) + 1)
        return IndexMap(k * strides[d], tuple(s for i, s in enumerate(strides) if i != d))
    d = dim % len(shape)
    return IndexMap(k * shape[d] * strides[d], tuple(strides))


def pointwise_into_joins(gm: torch.fx.GraphModule, written: set) -> bool:
    """`op(torch.cat([a, b], d), s)` as `torch.cat([op(a, s), op(b, s)], d)` where s does not vary
    along d (a number, or size 1 there): the kernel computing the pieces then applies op and
    writes the cat itself; read after the cat, op was a second kernel over the whole joined tensor
    (fuzz43e, fuzz43i: YOLOv8's `cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * strides`). Only where
    op reads the join once and alone reads it, and keeps its shape. Returns whether one moved."""
    g, moved = gm.graph, False
    for op in list(g.nodes):
        if op.op != "call_function" or not is_pointwise_target(op.target) or op in written \
                or any(isinstance(v, torch.fx.Node) for v in op.kwargs.values()):
            continue
        joins = [a for a in op.args if isinstance(a, torch.fx.Node) and join_of(a) is not None]
        if len(joins) != 1 or op.args.count(joins[0]) != 1 or set(joins[0].users) != {op}:
            continue
        join = joins[0]
        kind, pieces, dim = join_of(join)
        out, meta = _meta(op), _meta(join)
        if out is None or meta is None or tuple(out.shape) != tuple(meta.shape) or not _takes_ops(join, written):
            continue
        d = dim % len(meta.shape)
        others = [a for a in op.args if isinstance(a, torch.fx.Node) and a is not join]
        if any(_meta(a) is None for a in others):
            continue
        spanning = [a for a in others if not _constant_along(_meta(a).shape, len(meta.shape), d, kind)]
        if spanning and not _sliceable(spanning, meta, d, out):
            continue
        with g.inserting_before(op):
            new_pieces = []
            for k, p in enumerate(pieces):
                parts = {a: _part(g, a, len(meta.shape), d, kind, k, len(pieces), meta) for a in spanning}
                piece = g.call_function(op.target, tuple(p if a is join else parts.get(a, a) for a in op.args),
                                        dict(op.kwargs))
                shape = tuple(_meta(p).shape)
                piece.meta = {k: v for k, v in op.meta.items() if k != "tensor_meta"}
                piece.meta["tensor_meta"] = out._replace(shape=torch.Size(shape), stride=row_major(shape))
                new_pieces.append(piece)
            new_join = g.call_function(torch.stack if kind == "stack" else torch.cat, (new_pieces, dim))   # as
        new_join.meta = dict(op.meta)   # join_of reads it (hstack's cat, a cat of unsqueezed pieces' stack)
        op.replace_all_uses_with(new_join)
        g.erase_node(op)
        g.erase_node(join)
        moved = True
    return moved


def pointwise_groups_into_joins(gm: torch.fx.GraphModule, written: set) -> bool:
    """pointwise_into_joins for a group of pointwise ops that read the join several times and end in
    one result: `h * torch.sigmoid(h)`, `sigmoid(h) + tanh(h)` after `h = torch.cat([..])` (fuzz46h: a
    second kernel over the joined tensor). Each op of the group is computed per piece, and the group's
    one result read elsewhere is the join of its pieces. Returns whether one moved."""
    g, moved = gm.graph, False
    for join in list(g.nodes):
        meta = _meta(join)
        if join_of(join) is None or meta is None or not join.users or not _takes_ops(join, written):
            continue
        kind, pieces, dim = join_of(join)
        d = dim % len(meta.shape)
        group, spanning = _group_reading(join, meta, d, kind, written)
        if group is None:
            continue
        ends = [n for n in group if any(u not in group for u in n.users)]
        if ends != group[-1:] or not set(join.users) <= set(group):
            continue   # (several results would make several joins; the last op is the one read elsewhere)
        with g.inserting_before(ends[0]):
            new_pieces = []
            for k, p in enumerate(pieces):
                made = {join: p}
                made.update({a: _part(g, a, len(meta.shape), d, kind, k, len(pieces), meta) for a in spanning})
                for n in group:
                    made[n] = g.call_function(n.target, tuple(made.get(a, a) if isinstance(a, torch.fx.Node) else a
                                                              for a in n.args), dict(n.kwargs))
                    shape = tuple(_meta(p).shape)
                    made[n].meta = {key: v for key, v in n.meta.items() if key != "tensor_meta"}
                    made[n].meta["tensor_meta"] = _meta(n)._replace(shape=torch.Size(shape), stride=row_major(shape))
                new_pieces.append(made[ends[0]])
            new_join = g.call_function(torch.stack if kind == "stack" else torch.cat, (new_pieces, dim))
        new_join.meta = dict(ends[0].meta)
        ends[0].replace_all_uses_with(new_join)
        for n in reversed(group):
            g.erase_node(n)
        g.erase_node(join)
        moved = True
    return moved


def _group_reading(join, meta, d: int, kind: str, written: set):
    """(the pointwise ops that read `join` or each other, in graph order; their operands that vary along
    d), or (None, None) where a reader of the join cannot move: another op, another shape, a keyword
    tensor, an operand neither constant along d nor sliceable."""
    group, spanning, node = [], [], join.next
    inside = {join}
    while node.op != "output":
        reads = [a for a in node.all_input_nodes if a in inside]
        if reads:
            out = _meta(node)
            if node.op != "call_function" or not is_pointwise_target(node.target) or node in written \
                    or out is None or tuple(out.shape) != tuple(meta.shape) \
                    or any(isinstance(v, torch.fx.Node) for v in node.kwargs.values()):
                if join in reads:
                    return None, None
                node = node.next   # a reader of the group's result (a Linear after `h * sigmoid(h)`)
                continue
            others = [a for a in node.args if isinstance(a, torch.fx.Node) and a not in inside]
            if any(_meta(a) is None for a in others):
                return None, None
            span = [a for a in others if not _constant_along(_meta(a).shape, len(meta.shape), d, kind)]
            if span and not _sliceable(span, meta, d, out):
                return None, None
            spanning += [a for a in span if a not in spanning]
            group.append(node)
            inside.add(node)
        node = node.next
    return group, spanning


def _same_numbers(p, first, at: int) -> bool:
    """p's arguments besides its operand are first's: numbers equal with the sign of a zero (fuzz49c: `==` took
    `clamp(min=-0.0)` for `clamp(min=0.0)`: +0.0 came back where eager gives -0.0), an int equal to a float
    (`h * 2`, `h * 2.0`: the pieces' dtypes are checked apart), anything else by type and repr."""
    return len(p.kwargs) == len(first.kwargs) and _same_value(
        (p.args[:at], p.args[at + 1:], sorted(p.kwargs.items())),
        (first.args[:at], first.args[at + 1:], sorted(first.kwargs.items())))


def _same_value(a, b) -> bool:
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(map(_same_value, a, b))
    if type(a) in (int, float) and type(b) in (int, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return type(a) is type(b) and repr(a) == repr(b)


def pointwise_out_of_joins(gm: torch.fx.GraphModule, written: set) -> bool:
    """`torch.cat([relu(a), relu(b)], 1)` as `relu(torch.cat([a, b], 1))` where every piece is the same
    one-operand pointwise op (same arguments besides its operand, the operand's dtype kept) of a
    library result read only there: one kernel after the cat, where each piece was a kernel of its
    own (fuzz46a: SqueezeNet's Fire, Inception and DenseNet branches). Not where a piece's operand
    is computed by a pointwise op or a constant, where the pieces read one tensor (`x.sin()` twice) or
    slices of one kernel's result (one kernel writes the join; fuzz47i), or anything is written in place. Returns whether one moved."""
    g, moved = gm.graph, False
    for join in list(g.nodes):
        parts = join_of(join)
        meta = _meta(join)
        if parts is None or meta is None or join in written or len(parts[1]) < 2:
            continue
        kind, pieces, dim = parts
        first = pieces[0]
        at = [i for i, a in enumerate(first.args) if isinstance(a, torch.fx.Node)]   # the one tensor operand
        if len(at) != 1 or not all(    # (`1 - h`, `2 / h` too: review46i)
                p.op == "call_function" and p.target is first.target and is_pointwise_target(p.target)
                and len(p.args) == len(first.args) and _same_numbers(p, first, at[0]) and len(p.users) == 1
                and p not in written and isinstance(p.args[at[0]], torch.fx.Node) and p.args[at[0]] not in written
                and not _computed(p.args[at[0]]) and p.args[at[0]].op != "get_attr"
                and _meta(p.args[at[0]]) is not None and _meta(p.args[at[0]]).dtype == _meta(p).dtype == meta.dtype
                and not any(isinstance(v, torch.fx.Node) for v in p.kwargs.values())
                for p in pieces) or len(set(pieces)) != len(pieces):
            continue
        sources = [p.args[at[0]] for p in pieces]
        wholes = {_whole_of(s) for s in sources}
        if len(set(sources)) == 1 or len(wholes) == 1 and _computed(next(iter(wholes))):
            continue   # `x.sin()` twice, a kernel result's chunks: one kernel computes them and writes the join
        with g.inserting_before(join):
            inner = g.call_function(torch.stack if kind == "stack" else torch.cat, (sources, dim))
            outer = g.call_function(first.target, (*first.args[:at[0]], inner, *first.args[at[0] + 1:]),
                                    dict(first.kwargs))
        inner.meta = {k: dict(v) if isinstance(v, dict) else v for k, v in join.meta.items()}
        outer.meta = dict(join.meta)
        join.replace_all_uses_with(outer)
        g.erase_node(join)
        for p in pieces:
            g.erase_node(p)
        moved = True
    return moved


def _whole_of(node):
    """The tensor node slices or takes an item of (a chunk's: `(x + 1).chunk(2)[0]`), else node."""
    for _ in range(2):
        if isinstance(node, torch.fx.Node) and (_slice_of_one(node) or node.op == "call_function"
                                                and node.target is operator.getitem) and node.args:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") and \
                getattr(node.target, "__name__", node.target) in ("chunk", "split", "unbind", "tensor_split"):
            node = node.args[0]
    return node


def _takes_ops(join, written: set) -> bool:
    """Whether pointwise ops after `join` can run per piece: pieces of one shape and the join's dtype, one
    of them computed by a kernel (so the ops join it: no more launches than before), the others inputs,
    constants or slices, and nothing written in place."""
    kind, pieces, dim = join_of(join)
    meta = _meta(join)
    return not {join, *pieces} & written and all(_meta(p) is not None and _meta(p).dtype == meta.dtype for p in pieces) \
        and len({tuple(_meta(p).shape) for p in pieces}) == 1 and any(_computed(p) for p in pieces) \
        and all(_computed(p) or p.op in ("placeholder", "get_attr") or _slice_of_one(p) for p in pieces)


def _computed(node) -> bool:
    return node.op == "call_function" and is_pointwise_target(node.target)


def _slice_of_one(node) -> bool:
    """`x[..., :h]`, `x.narrow(..)`, `x.select(..)`: a view a kernel reads where it lies (rotate_half's x1)."""
    return _meta(node) is not None and isinstance(node.args[0] if node.args else None, torch.fx.Node) and (
        node.op == "call_function" and node.target in (operator.getitem, aten.slice.Tensor, aten.select.int,
                                                       aten.narrow.default)   # (export's: review45i)
        or node.op == "call_method" and node.target in ("narrow", "select"))


def _sliceable(spanning, meta, d: int, out) -> bool:
    """Operands that vary along the joined dim d, each as long there as the join (q * cos +
    cat((-x2, x1), -1) * sin: rotary's rotate_half; fuzz45a), all row-major as the join and op's
    result (the pieces' join is row-major: a transposed operand would have laid eager's result out
    after itself)."""
    from .identity_ops import torch_contiguous
    return tuple(out.stride) == row_major(out.shape) and all(
        torch_contiguous(m.shape, m.stride) and d - (len(meta.shape) - len(m.shape)) >= 0
        and m.shape[d - (len(meta.shape) - len(m.shape))] == meta.shape[d] for m in map(_meta, spanning))


def _part(g, a, ndim: int, d: int, kind: str, k: int, count: int, meta):
    """The part of operand a that piece k of the join meets: a.narrow(..) for a cat, a.select(..) for a stack."""
    m = _meta(a)
    position = d - (ndim - len(m.shape))
    if kind == "stack":
        view = g.call_method("select", (a, position, k))
        shape, stride = m.shape[:position] + m.shape[position + 1:], m.stride[:position] + m.stride[position + 1:]
    else:
        size = meta.shape[d] // count
        view = g.call_method("narrow", (a, position, k * size, size))
        shape, stride = m.shape[:position] + (size,) + m.shape[position + 1:], tuple(m.stride)
    view.meta["tensor_meta"] = m._replace(shape=torch.Size(shape), stride=tuple(stride))
    if "device" in fxfuse_meta(a):
        fxfuse_meta(view)["device"] = fxfuse_meta(a)["device"]
    return view


def _constant_along(shape, ndim: int, d: int, kind: str) -> bool:
    """Whether an operand of `shape`, broadcast against a joined tensor of `ndim` dims, has one
    value along its dim d; for a stack, it must not reach d at all (each piece lacks that dim)."""
    position = d - (ndim - len(shape))   # the operand's own dim lined up with d (right-aligned)
    return position < 0 or kind == "cat" and shape[position] == 1
