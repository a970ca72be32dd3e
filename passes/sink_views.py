"""Reshapes move below the pointwise ops that read them: `gelu(y.view(b, s, n))` becomes
`gelu(y).view(b, s, n)`, so the pointwise op joins the group of what produced y.

Why: code that runs a Linear on a 2-D view and reshapes back (GPT-2's Conv1D:
`torch.addmm(b, x.view(-1, k), W).view(b, s, n)`, then the activation; `h.flatten(0, 1)` around
an MLP) put a view between the GEMM and its activation and residual add. A view is no
pointwise op, so every epilogue stopped at it: the generated GEMM applied its bias only, and
the activation and the residual add ran as kernels of their own.

An elementwise op commutes with any reshape (same elements, same row-major order). An
operand other than the view moves along when it is a number, a constant of all-ones shape or
a vector along the last dimension (which both shapes share), or a tensor of the view's
shape that is contiguous (read through a reshape of its own, free). A view chain that ends
at the shape it started from, on a contiguous tensor, is that tensor. Views of another
dtype or size, 0-d tensors and ops whose result broadcasts beyond the view stay as written.
"""
import math
import operator

import torch
import torch.fx
import torch.nn.functional as F

from fxfuse.node_meta import fetch_attr, fxfuse_meta, single_tensor_meta as _meta
from fxfuse.ops import is_pointwise_target, row_major
from fxfuse.state_writes import VIEW_FUNCTIONS, VIEW_METHODS

from .fuse_pointwise import _mutated_values
from .identity_ops import repeat_as_expand
from .join_outputs import join_of, pointwise_groups_into_joins, pointwise_into_joins, pointwise_out_of_joins
from .normalize_layers import register_constant

aten = torch.ops.aten

RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "unsqueeze", "squeeze"}
RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze, aten.view.default,
                     aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default}
RESHAPE_FUNCTIONS |= {getattr(packet, overload) for packet, overload in (   # export's spellings (fuzz34a)
    (aten.squeeze, "dim"), (aten.squeeze, "dims"), (aten.squeeze, "default"), (aten.flatten, "using_ints"),
    (aten.unflatten, "int"), (aten.view_as, "default"), (aten.reshape_as, "default")) if hasattr(packet, overload)}


def _contiguous(meta) -> bool:
    return all(s == e or size == 1 for s, e, size in zip(meta.stride, row_major(meta.shape), meta.shape))


def _unsqueezes(node) -> bool:
    """`h[:, None]`, `h[..., None]`: unsqueeze spelled as an index (fuzz43b)."""
    index = node.args[1] if len(node.args) == 2 else ()
    index = index if isinstance(index, tuple) else (index,)
    return None in index and all(i is None or i is Ellipsis or i == slice(None) for i in index)


def reshape_source(node):
    """y where node reshapes y (same dtype and element count, neither 0-d nor empty), else None."""
    is_reshape = (node.op == "call_method" and node.target in RESHAPE_METHODS
                  or node.op == "call_function" and node.target in RESHAPE_FUNCTIONS
                  or node.op == "call_function" and node.target is operator.getitem and _unsqueezes(node)
                  or node.op == "call_module" and type(node.graph.owning_module.get_submodule(node.target))
                  in (torch.nn.Flatten, torch.nn.Unflatten))
    if not is_reshape or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    src, out = _meta(node.args[0]), _meta(node)
    if src is None or out is None or src.dtype != out.dtype or not src.shape or not out.shape:
        return None
    numel = math.prod(src.shape)
    return node.args[0] if numel and numel == math.prod(out.shape) else None


def _operand_plan(operand, view, source, before, written=frozenset()):
    """How `operand` of a pointwise op reading `view` moves once the op reads `source`, decided
    without touching the graph (an op moves only when all of its operands can): ("keep", x)
    where it broadcasts the same way against both shapes, ("flat", x) for a [1, .., 1, n]
    constant read as its [n] view, ("reshape", x) for a contiguous tensor of the view's shape
    (or ("keep", r) where a reshape r of it to source's shape exists already); None where it
    cannot move."""
    if operand is view:
        return "keep", source
    if not isinstance(operand, torch.fx.Node):
        return "keep", operand               # a number, a string, a dtype
    meta = _meta(operand)
    if meta is None:
        return None
    src_shape, view_shape, shape = tuple(_meta(source).shape), tuple(_meta(view).shape), tuple(meta.shape)
    if not shape:
        return "keep", operand               # 0-d: broadcasts against anything
    if all(s == 1 for s in shape[:-1]) and (shape[-1] == 1 or shape[-1] == src_shape[-1] == view_shape[-1]):
        if len(shape) <= len(src_shape):
            return "keep", operand           # a scalar-like constant or a vector along the last dim
        if operand.op == "get_attr":         # [1, 1, n] against [m, n]: its [n] view (same storage)
            return "flat", operand
    if shape == view_shape and _contiguous(meta):
        existing = next((u for u in operand.users if reshape_source(u) is operand
                         and tuple(_meta(u).shape) == src_shape and _precedes(u, before)), None)
        if existing is None and before is not None and _joins_only(operand, before) and (_joins_only(
                source, view) or source.target == "contiguous" and len(source.users) == 1
                or join_of(source) is not None and set(source.users) == {view}) \
                and _hoistable(operand, src_shape, written):   # (a library result's view
            return "hoist", operand          # is read as it is; a stack's pieces take op in) computed at
            #                                  source's shape, its operands reshaped
        return ("keep", existing) if existing is not None else ("reshape", operand)
    regrouped = _regrouped(shape, view_shape, src_shape)
    return ("regroup", (operand, regrouped)) if regrouped is not None else None


def _regrouped(shape, view_shape, src_shape):
    """The shape a broadcast operand takes against the source where the view only merges or
    splits dims along which the operand is constant, or merges into one dim it varies along
    (`(x * 2).flatten(2) + w[:, None]`: w[:, None] is [C, 1] against [B, C, H * W], so
    [C, 1, 1] against [B, C, H, W]: fuzz43j; a bias [H * D] after a head merge is [H, D]); else None."""
    if len(shape) > len(view_shape):
        return None
    padded = (1,) * (len(view_shape) - len(shape)) + tuple(shape)
    new, i, j = [], 0, 0
    while i < len(src_shape) or j < len(view_shape):
        group_src, group_view = [], []
        product_src = product_view = 1
        while True:   # the smallest run of dims on each side with the same element count
            if (not group_src or product_src < product_view) and i < len(src_shape):
                group_src.append(i)
                product_src *= src_shape[i]
                i += 1
            elif (not group_view or product_view < product_src) and j < len(view_shape):
                group_view.append(j)
                product_view *= view_shape[j]
                j += 1
            else:
                break
        if product_src != product_view:
            return None
        varying = [k for k in group_view if padded[k] != 1]
        if not varying:
            new += [1] * len(group_src)
            continue
        if varying != [k for k in group_view if view_shape[k] != 1] or len(varying) != 1 \
                or padded[varying[0]] != view_shape[varying[0]]:
            return None   # (it varies along the group's one dim: split as the source's dims, `bias` [h * d] as [h, d])
        new += [src_shape[k] for k in group_src]
    return tuple(new)


def _hoistable(node, shape, written, depth: int = 0) -> bool:
    """Whether pointwise `node` (read by one op) can be computed at `shape` instead, every tensor
    operand of its own shape and contiguous (reshaped, or hoisted in turn), or 0-d (fuzz43a:
    Mamba-2's `(y + x * D).reshape(B, L, -1) * silu(z)` split in two kernels at the reshape)."""
    if node.op != "call_function" or not is_pointwise_target(node.target) or depth > 8 or node in written \
            or any(isinstance(v, torch.fx.Node) for v in node.kwargs.values()):
        return False
    own = tuple(_meta(node).shape)
    for a in node.args:
        meta = _meta(a) if isinstance(a, torch.fx.Node) else None
        if meta is not None and meta.shape and tuple(meta.shape) != own and a not in written \
                and not is_pointwise_target(a.target) and _regrouped(tuple(meta.shape), own, shape) is not None:
            continue   # a broadcast operand read where it lies (GPT-J's `q * cos` next to rotate_every_two's
            #            flattened stack); a computed one would be a reshape between two kernels
        if isinstance(a, torch.fx.Node) and (meta is None or meta.shape and (
                tuple(meta.shape) != own or not _contiguous(meta) or a in written
                or _joins_only(a, node) and a.op == "call_function" and not _hoistable(a, shape, written, depth + 1))):
            return False
    return True


def _hoisted(g, node, shape, made):
    """node computed at `shape` (_hoistable), its own operands reshaped or hoisted; `made` maps
    what is made already (an operand read twice, `a * a`, is made once: review43f)."""
    if node in made:
        return made[node]
    args = []
    for a in node.args:
        meta = _meta(a) if isinstance(a, torch.fx.Node) else None
        if meta is None or not meta.shape:
            args.append(a)
        elif tuple(meta.shape) != tuple(_meta(node).shape):   # a broadcast operand, regrouped (_hoistable)
            if a not in made:
                made[a] = _moved_operand(g, ("regroup", (a, _regrouped(tuple(meta.shape), tuple(_meta(node).shape),
                                                                        shape))), None)
            args.append(made[a])
        elif _joins_only(a, node) and a.op == "call_function":
            args.append(_hoisted(g, a, shape, made))
        else:
            if a not in made:
                made[a] = _moved_operand(g, ("reshape", a), None, shape)
            args.append(made[a])
    with g.inserting_after(node):
        new = g.call_function(node.target, tuple(args), dict(node.kwargs))
    new.meta = {k: v for k, v in node.meta.items() if k != "tensor_meta"}
    new.meta["tensor_meta"] = _meta(node)._replace(shape=torch.Size(shape), stride=row_major(shape))
    made[node] = new
    return new


def _moved_operand(g, plan, source, shape=None, made=None):
    """The node (or value) an operand becomes, per its _operand_plan (at source's shape, or at
    `shape`)."""
    how, operand = plan
    if how == "keep":
        return operand    # an existing reshape is the same node a Linear reads: a residual it knows
    if how == "regroup":   # (a broadcast operand reshaped to its _regrouped shape)
        return _moved_operand(g, ("reshape", operand[0]), source, operand[1])
    if how == "hoist":
        return _hoisted(g, operand, tuple(_meta(source).shape), {} if made is None else made)
    meta = _meta(operand)
    if how == "flat":
        shape = tuple(meta.shape)
        with g.inserting_after(operand):
            flat = g.get_attr(register_constant(g.owning_module, operand.target + ".flat",
                                                 fetch_attr(g.owning_module, operand.target).view(shape[-1:])))
        flat.meta["tensor_meta"] = meta._replace(shape=torch.Size(shape[-1:]), stride=(1,))
        return flat
    src_shape = shape or tuple(_meta(source).shape)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(placeholders[-1] if operand.op == "placeholder" else operand):
        moved = g.call_method("reshape", (operand, src_shape))
    moved.meta["tensor_meta"] = meta._replace(shape=torch.Size(src_shape), stride=row_major(src_shape))
    return moved


def _precedes(a, b) -> bool:
    node = a
    while node.op != "root":
        if node is b:
            return True
        node = node.next
    return False


def _sink_one(gm, op, written: set) -> bool:
    """Rewrite `op(view(y), ...)` as `view(op(y, ...))` where every operand can move and no
    value involved is written in place: a reshape of a non-contiguous y is a copy, and a write
    to y or to the copy between the reshape and op would otherwise be read (or missed)."""
    g = gm.graph
    if fxfuse_meta(op).get("view_moved"):
        return False    # once: its operands' reshapes would move the view back up
    views = [a for a in op.args if isinstance(a, torch.fx.Node) and reshape_source(a) is not None
             and reshape_source(a).op not in ("placeholder", "get_attr")]   # a view of an input joins nothing
    if not views:
        return False
    view = views[0]
    source = reshape_source(view)
    if not _contiguous(_meta(source)) or source in written:
        return False    # the reshape copies: op(source) would keep source's layout, not the row-major one assumed
    if any(_computed_through_library(a, source) for a in op.args    # (a view of one moves along: review47r3)
           if isinstance(a, torch.fx.Node) and a is not view and reshape_source(a) is None):
        return False    # op runs after that library op: it joins no kernel of source's, and moving it
        #                 would only cut it from its other operand's (fuzz47a: OPT's flattened residual + fc2)
    plans = _plans(op, view, source, written)
    if plans is not None and any(how == "reshape" and _joins_only(x, op) for how, x in plans):
        return False    # `sigmoid(x) * softmax(o).view(b, t, d)`: the reshape of sigmoid's result would cut
                        # it from the product it fuses with now, for a source no pointwise op joins (fuzz40a)
    if plans is None or not all(_plans(u, op, source, written) is not None for u in op.users
                                if u.op == "call_function" and is_pointwise_target(u.target)):
        return False    # a pointwise user that cannot follow op below the view: moving op alone would
                        # put a reshape between them (where(v > 0, v, c) with c [3, 1] against [b, 3, 4])
    made = {}   # (an operand op reads twice, `addcmul(v, a, a)`, is hoisted once: review43f)
    args = [_moved_operand(g, plan, source, made=made) for plan in plans]
    hoisted = list(dict.fromkeys(x for how, x in plans if how == "hoist"))
    with g.inserting_before(op):
        new_op = g.call_function(op.target, tuple(args), dict(op.kwargs))
        out_meta = _meta(op)
        new_op.meta = {k: v for k, v in op.meta.items() if k != "tensor_meta"}
        new_op.meta["tensor_meta"] = out_meta._replace(shape=_meta(source).shape,
                                                       stride=row_major(tuple(_meta(source).shape)))
        new_view = g.call_method("reshape", (new_op, tuple(out_meta.shape)))
        new_view.meta["tensor_meta"] = out_meta
    fxfuse_meta(new_op)["view_moved"] = view.name
    op.replace_all_uses_with(new_view)
    g.erase_node(op)
    if not view.users:
        g.erase_node(view)
    for x in hoisted:   # its hoisted copy reads the operands now (depth-first: the chain it was read through)
        _erase_unread(g, x)
    return True


def _erase_unread(g, node) -> None:
    if node.users or node.op != "call_function" or node._erased:
        return
    inputs = node.all_input_nodes
    g.erase_node(node)
    for a in inputs:
        _erase_unread(g, a) if a.op == "call_function" and is_pointwise_target(a.target) else None


def _plans(op, view, source, written):
    """Each operand's _operand_plan for pointwise op reading `view` (of `source`), or None where
    op cannot move below it: its result is not of the view's shape, a tensor keyword argument,
    or op or an operand written in place."""
    meta = _meta(op)
    if meta is None or tuple(meta.shape) != tuple(_meta(view).shape) or op in written \
            or any(isinstance(v, torch.fx.Node) for v in op.kwargs.values()) \
            or any(a in written for a in op.args if isinstance(a, torch.fx.Node)):
        return None
    plans = [_operand_plan(a, view, source, op, written) for a in op.args]
    return None if None in plans else plans


def _computed_through_library(operand, source, cap: int = 256) -> bool:
    """Whether operand is computed from source through an op that is no pointwise op and no view
    (a LayerNorm, a Linear): `(h.reshape(-1, c) + fc2(ln(h.reshape(-1, c))))`. Looked for among
    operand's nearest `cap` ancestors (beyond them: no)."""
    seen, queue = {operand}, [operand]
    while queue and len(seen) < cap:
        node = queue.pop()
        for a in node.all_input_nodes:
            if a not in seen and a is not source:
                seen.add(a)
                queue.append(a)
    if len(seen) >= cap:
        return False
    reaches = {}

    def reaches_source(node) -> bool:
        if node not in reaches:
            reaches[node] = False   # (a cycle cannot be: the graph is a DAG)
            reaches[node] = any(a is source or a in seen and reaches_source(a) for a in node.all_input_nodes)
        return reaches[node]
    return any(reaches_source(n) and not (n.op == "call_function" and is_pointwise_target(n.target))
               and reshape_source(n) is None and n.op not in ("placeholder", "get_attr")
               and not (n.op == "call_method" and n.target in VIEW_METHODS or n.op == "call_function"
                        and n.target in VIEW_FUNCTIONS) for n in seen)


def _joins_only(operand, op) -> bool:
    """Whether a pointwise op's result is read by op alone (so fusion puts them in one kernel)."""
    return operand.op == "call_function" and is_pointwise_target(operand.target) and set(operand.users) == {op}


def _same_shape(node, written: set):
    """z where node reshapes contiguous z to z's own shape (`y.view_as(h)` of a y shaped as h, a
    no-op that split a kernel: fuzz40d), else None. Not where either is written in place: a
    `v.t_()` or `h.unsqueeze_(0)` reshapes one of the two tensors only (review40)."""
    z = reshape_source(node)
    if z is None or tuple(_meta(z).shape) != tuple(_meta(node).shape) or not _contiguous(_meta(z)) \
            or z.op in ("placeholder", "get_attr") or any(u.op == "output" for u in node.users) \
            or node in written or z in written:
        return None
    return z


def _round_trip(node, written: set):
    """z where node reshapes a reshape of contiguous z back to z's shape (a no-op), else None;
    not where one of the three is written in place (review40b: `v.t_()` reshapes v only)."""
    inner = reshape_source(node)
    z = reshape_source(inner) if inner is not None else None
    if z is None or tuple(_meta(z).shape) != tuple(_meta(node).shape) or not _contiguous(_meta(z)) \
            or z.op in ("placeholder", "get_attr") or any(u.op == "output" for u in node.users) \
            or {node, inner, z} & written:
        return None   # eager returns a view (of an input, a parameter, or next to its source), not the tensor
    return z


def _copying_reshapes_spelled_out(gm, written) -> None:
    """`y.transpose(1, 2).reshape(b, n, c)` (a multi-head merge) copies, as `.contiguous().view()`
    does: spelled so, the pointwise ops around it fuse as they do for that spelling (fuzz43a: two
    kernels and a library copy)."""
    g = gm.graph
    for node in list(g.nodes):
        source = reshape_source(node)
        if source is None or node in written or source in written or not any(
                u.op == "call_function" and is_pointwise_target(u.target) for u in node.users) \
                or _contiguous(_meta(source)) or not _reshape_copies(_meta(source), _meta(node)):
            continue
        with g.inserting_before(node):
            laid = g.call_method("contiguous", (source,))
        laid.meta = {k: v for k, v in source.meta.items() if k != "tensor_meta"}
        laid.meta["tensor_meta"] = _meta(source)._replace(stride=row_major(tuple(_meta(source).shape)))
        node.args = (laid, *node.args[1:])


def _reshape_copies(src, out) -> bool:
    """Whether eager's reshape of a tensor laid out as `src` to out's shape copies (no view can)."""
    t = torch.empty_strided(tuple(src.shape), tuple(src.stride), dtype=src.dtype, device="meta")
    try:
        return not t.reshape(tuple(out.shape))._is_view()
    except RuntimeError:
        return False


def _linear_past_view(gm, node, written) -> bool:
    """`F.linear(h.flatten(0, 1), W)` as `F.linear(h, W).view(...)`: a Linear reads only the last
    dim, which the view keeps, so a chain of Linears and pointwise ops split by such a view (a
    hidden state flattened between layers) is one chain again for the fused MLP and the GEMM
    epilogues (fuzz43b)."""
    if node.op != "call_function" or node.target is not F.linear or len(node.args) != 2 or node.kwargs:
        return False
    view = node.args[0]
    source = reshape_source(view) if isinstance(view, torch.fx.Node) else None
    weight = _meta(node.args[1]) if isinstance(node.args[1], torch.fx.Node) else None
    if source is None or source.op in ("placeholder", "get_attr") or {view, source, node} & written \
            or weight is None or len(weight.shape) != 2 \
            or not _contiguous(_meta(source)) or _meta(source).shape[-1:] != _meta(view).shape[-1:]:
        return False
    out = _meta(node)
    shape = tuple(_meta(source).shape[:-1]) + tuple(out.shape[-1:])
    with gm.graph.inserting_before(node):
        moved = gm.graph.call_function(F.linear, (source, node.args[1]))
        moved.meta = {k: v for k, v in node.meta.items() if k != "tensor_meta"}
        moved.meta["tensor_meta"] = out._replace(shape=torch.Size(shape), stride=row_major(shape))
        back = gm.graph.call_method("reshape", (moved, tuple(out.shape)))
        back.meta["tensor_meta"] = out
    node.replace_all_uses_with(back)
    gm.graph.erase_node(node)
    if not view.users:
        gm.graph.erase_node(view)
    return True


def _reshapes_out_of_join(gm: torch.fx.GraphModule, join, written: set) -> bool:
    """`torch.cat([a.reshape(s), b.reshape(s)], d)` as `torch.cat([a, b], i).reshape(...)` where the
    dims before d hold as many elements as a's dims before i (then both joins lay every element out
    at the same place): the kernel computing a and b writes the join itself, where it wrote a and b
    for a library cat to copy (fuzz46a: NeRF's `(x[:, None] * freqs[:, None]).reshape(B, -1)` before
    `sin(cat([xb, xb + pi / 2], -1))`). Only where each piece reshapes a tensor of one shape, one of
    them computed by a pointwise op, all row-major (a cat keeps channels_last pieces so: review47r1), and
    nothing involved is written in place."""
    parts = join_of(join)
    meta = _meta(join)
    if parts is None or meta is None or join in written or tuple(meta.stride) != row_major(meta.shape):
        return False
    kind, pieces, dim = parts
    sources = [reshape_source(p) for p in pieces]
    if any(s is None or not _contiguous(_meta(s)) for s in sources) or {*pieces, *sources} & written \
            or not any(s.op == "call_function" and is_pointwise_target(s.target) for s in sources):
        return False
    src_shapes = {tuple(_meta(s).shape) for s in sources}
    view_shapes = {tuple(_meta(p).shape) for p in pieces}
    if len(src_shapes) != 1 or len(view_shapes) != 1 or any(_meta(p).dtype != meta.dtype for p in pieces):
        return False
    (src_shape,), (view_shape,) = src_shapes, view_shapes
    ndim = len(view_shape) + (kind == "stack")
    if not -ndim <= dim < ndim:
        return False
    outer = math.prod(view_shape[:dim % ndim])
    at = [i for i in range(len(src_shape) + (kind == "stack")) if math.prod(src_shape[:i]) == outer]
    if not at:
        return False
    joined_shape = list(src_shape)
    if kind == "stack":
        joined_shape.insert(at[0], len(pieces))
    else:
        joined_shape[at[0]] *= len(pieces)
    with gm.graph.inserting_before(join):
        inner = gm.graph.call_function(torch.stack if kind == "stack" else torch.cat, (sources, at[0]))
        view = gm.graph.call_method("reshape", (inner, tuple(meta.shape)))
    inner.meta = {k: dict(v) if isinstance(v, dict) else v for k, v in join.meta.items()}
    inner.meta["tensor_meta"] = meta._replace(shape=torch.Size(joined_shape), stride=row_major(joined_shape))
    view.meta = dict(join.meta)
    join.replace_all_uses_with(view)
    gm.graph.erase_node(join)
    for p in dict.fromkeys(pieces):
        if not p.users:
            gm.graph.erase_node(p)
    return True


def sink_views(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    g = gm.graph
    _copying_reshapes_spelled_out(gm, _mutated_values(gm))
    changed = True
    while changed:
        changed = False
        written = _mutated_values(gm)
        for node in list(g.nodes):
            if node.op == "call_function" and is_pointwise_target(node.target) and _sink_one(gm, node, written):
                changed = True
            elif _linear_past_view(gm, node, written) or _reshapes_out_of_join(gm, node, written):
                changed = True
            elif (z := _round_trip(node, written)) is not None:
                inner = node.args[0]
                node.replace_all_uses_with(z)
                g.erase_node(node)
                if not inner.users:
                    g.erase_node(inner)
                changed = True
            elif (z := _same_shape(node, written)) is not None:
                node.replace_all_uses_with(z)
                g.erase_node(node)
                changed = True
        changed = pointwise_out_of_joins(gm, written) or pointwise_into_joins(gm, written) \
            or pointwise_groups_into_joins(gm, written) or changed
    for node in list(g.nodes):   # constants read as their [n] views ("flat") now
        if node.op == "get_attr" and not node.users:
            g.erase_node(node)
        else:   # a repeat that a reshape stood between it and its pointwise readers (fuzz46j: Squeezeformer's
            repeat_as_expand(node, is_pointwise_target)   # `h[:, :, None].repeat(1, 1, 2, 1).flatten(1, 2) + y`)
    g.lint()
    gm.recompile()
    return gm
