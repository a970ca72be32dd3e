"""Permutes (and views that only add or drop size-1 dims: is_unit_view) move above the pointwise ops they read: `x + (gamma * y).permute(0, 3, 1, 2)` becomes
`x + gamma' * y.permute(0, 3, 1, 2)`, so both ops join one kernel (a reshape right before the
permute, as torch.export writes MultiheadAttention's output, moves along with it).

Why (fuzz31b, fuzz31e): ConvNeXt's block (`gamma * pwconv2(h)`, permute back to NCHW, then the
residual add), MLP-Mixer's token mixing (`x + mlp(ln(x).transpose(1, 2)).transpose(1, 2)`) and
similar code put a permute between a Linear's bias or layer scale and the residual add. A
permute is no pointwise op, so fusion stopped at it: the residual add ran as a kernel of its
own, one more pass over the activation per block.

An elementwise op commutes with any permutation of its (broadcast) operands: op(a, b).permute(p)
is op(a'.permute(p), b'.permute(p)) with a', b' expanded to op's shape, views both (stride 0
where a operand broadcasts), and the values are the same bits. The op moves when:
  - the permute is its only reader, and every reader of the permute is a pointwise op (the
    permute's own strides are then seen by nobody but the fused kernel);
  - the moved op's result has the permute's strides (computed on meta tensors), so the readers'
    results keep eager's layout;
  - nothing involved is written in place, and the op is not a Linear's bias add
    (normalize_layers.LINEAR_BIAS): that one stays next to its GEMM, which in fp16/bf16 rounds
    the sum once, and on the GPU takes it into cuBLAS where linear_epilogue measured that faster.
    Moved past the permute, the bias cost MLP-Mixer's token mixing (4 x 196 x 512, fp32, H100)
    0.7 and 1.7 us in two runs (`blocks_20261126-155737`, `-151232`: 51.2 against 50.5 without
    this pass), where the add in the residual kernel replaced a bias cuBLAS adds for free.
    Nor after linear_epilogue (tried in stop 32 for a bias cuBLAS did not take): on ConvNeXt-T's
    block it moved the sum of 4 split-K partials past the permute, each then read transposed by
    the residual kernel: 71.1 us against 66.0 before and 65.3 for eager in a CUDA graph
    (`blocks_20261126-163025`).
"""
import operator

import torch
import torch.fx
from torch.fx.node import map_aggregate

from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fxfuse.data_dependent import op_name
from fxfuse.node_meta import fetch_attr, meta_tensor, single_tensor_meta as _meta
from fxfuse.ops import is_pointwise_target

from .fuse_pointwise import _mutated_values, why_not_fusible
from .identity_ops import reshaped_in_place
from .normalize_layers import LINEAR_BIAS, only_unit_indices, register_constant
from .sink_views import reshape_source

aten = torch.ops.aten

PERMUTE_METHODS = {"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t"}
PERMUTE_FUNCTIONS = {torch.permute, torch.transpose, torch.swapaxes, torch.swapdims, torch.movedim,
                     torch.moveaxis, torch.t, aten.permute.default, aten.transpose.int, aten.t.default,
                     aten.numpy_T.default, aten.mT.default, aten.swapaxes.default, aten.swapdims.default,
                     aten.movedim.int, aten.movedim.intlist, aten.moveaxis.int, aten.moveaxis.intlist}   # export's
# `y.T` and `y.mT` are attribute reads (getattr nodes): the same permutes (fuzz35, left open then).
# `.H`/`.mH` conjugate complex values, which a pointwise op need not commute with: not taken.
PERMUTE_ATTRIBUTES = {"T", "mT"}


def _is_permute(node) -> bool:
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.op == "call_function" and node.target is getattr:
        source = _meta(node.args[0])   # `.T` of other than 2 dims is deprecated (it warns): left alone
        return len(node.args) == 2 and node.args[1] in PERMUTE_ATTRIBUTES and source is not None and (
            node.args[1] == "mT" or len(source.shape) == 2)
    return node.op == "call_method" and node.target in PERMUTE_METHODS \
        or node.op == "call_function" and node.target in PERMUTE_FUNCTIONS


def is_unit_view(node) -> bool:
    """A view that only adds or drops size-1 dims (`y.unsqueeze(1)`, `y[:, :, None, None]`,
    `y.view(b, n, 1)`): sink_views leaves it where its reader broadcasts it (DiT's
    `x * (1 + scale.unsqueeze(1))`, a UNet's `h + emb[:, :, None, None]`, Mamba's
    `dt.unsqueeze(-1)`), and fusion stopped at it (fuzz34j). Moved above the op, the op is
    computed at each point it broadcasts to, as fusion does for a broadcast without a view."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if not all(i is None or i is Ellipsis or i == slice(None) for i in index):
            return False
    elif reshape_source(node) is None or node.op == "call_module":
        return False
    src, out = _meta(node.args[0]), _meta(node)
    return src is not None and out is not None and src.dtype == out.dtype and \
        [d for d in src.shape if d != 1] == [d for d in out.shape if d != 1] and tuple(src.shape) != tuple(out.shape)


def _same_strides(a, b, shape) -> bool:
    """Equal strides, where a size-1 dim's stride counts for nothing (no address uses it)."""
    return all(x == y or n == 1 for x, y, n in zip(a, b, shape))


def _chain(permute) -> tuple:
    """(op, [layout nodes from op's result to the permute]) where the permute reads a pointwise
    op directly or through reshapes and permutes that nothing else reads (torch.export's
    MultiheadAttention output: view, then transpose; `.transpose(0, 1).permute(2, 1, 0)`,
    review36), else (None, [])."""
    chain, src = [permute], permute.args[0]
    while len(chain) < 4 and len(src.users) == 1 and src.op != "call_module" and bool(src.args) and (
            _is_permute(src) or reshape_source(src) is not None):
        chain, src = [src, *chain], src.args[0]
    if src.op == "call_function" and is_pointwise_target(src.target):
        return src, chain
    return None, []


def _laid_out(chain, shape, value):
    """`value` (a tensor, or a number) expanded to the op's shape and read through the chain."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value   # a 0-dim tensor promotes as a number does: expanded, it would not (fuzz33h)
    out = value.expand(shape)
    for node in chain:
        out = _step(node, out)
    return out


def _step(node, value: torch.Tensor) -> torch.Tensor:
    """What a layout node (a reshape or permute) makes of `value`."""
    fn = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
    return fn(value, *node.args[1:], **node.kwargs)


def meta_operands(op) -> list | None:
    """op's operands as meta tensors (numbers as they are); None where one has no tensor meta or
    more dims than op's result (it would not broadcast to it)."""
    meta, args = _meta(op), []
    for a in op.args:
        if isinstance(a, torch.fx.Node):
            m = _meta(a)
            if m is None or len(m.shape) > len(meta.shape):
                return None
            args.append(meta_tensor(m))
        else:
            args.append(a)
    return args


def _movable(op, chain, written) -> bool:
    meta, out, last = _meta(op), _meta(chain[-1]), chain[-1]
    if meta is None or out is None or op in written or any(n in written for n in chain) or len(op.users) != 1 \
            or any(isinstance(v, torch.fx.Node) for v in op.kwargs.values()) \
            or any(a in written for a in op.args if isinstance(a, torch.fx.Node)) \
            or op.meta.get(LINEAR_BIAS, False) \
            or not last.users or not all(u.op == "call_function" and is_pointwise_target(u.target)
                                         for u in last.users):
        return False
    args = meta_operands(op)
    if args is None:
        return False
    try:
        laid = [_laid_out(chain, tuple(meta.shape), a) for a in args]
        result = op.target(*laid, **op.kwargs)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    views = all(t._base is not None for t in laid if isinstance(t, torch.Tensor) and t.dim())   # no reshape copied
    # other strides than the permute's (two broadcast operands: fuzz37e) do when no reader's result changes
    return views and tuple(result.shape) == tuple(out.shape) and (
        _same_strides(result.stride(), out.stride, out.shape) or readers_keep_strides(last, result))


def readers_keep_strides(leaf, result) -> bool:
    """Each pointwise reader of `leaf` (a slice, a permute) gives eager's strides when it reads
    `result` (a meta tensor) instead."""
    for reader in leaf.users:
        def fake(a):
            if a is leaf:
                return result
            meta = _meta(a) if isinstance(a, torch.fx.Node) else None
            if isinstance(a, torch.fx.Node) and meta is None:
                raise TypeError("an operand without tensor meta")
            return meta_tensor(meta) if meta is not None else a
        expected = _meta(reader)
        try:
            out = reader.target(*map_aggregate(reader.args, fake), **map_aggregate(reader.kwargs, fake))
        except (RuntimeError, TypeError, ValueError, NotImplementedError, IndexError):
            return False
        if expected is None or not isinstance(out, torch.Tensor) or tuple(out.stride()) != tuple(expected.stride):
            return False
    return True


def _hoist(gm, op, chain) -> None:
    """Replace `chain(op(a, b))` by `op(chain(a.expand), chain(b.expand))`."""
    g = gm.graph
    shape, last = tuple(_meta(op).shape), chain[-1]
    permutes_only = all(_is_permute(node) for node in chain)   # a reshape needs the whole shape
    with g.inserting_before(last):
        args = []
        for a in op.args:
            if isinstance(a, torch.fx.Node) and _meta(a).shape == ():   # 0-dim: stays as it is (_laid_out)
                pass
            elif isinstance(a, torch.fx.Node) and a.op == "get_attr":   # a parameter or buffer: its view
                view = _laid_out(chain, shape, fetch_attr(gm, a.target))   # registered once (the same
                a = g.get_attr(register_constant(gm, f"{a.target}.permuted", view))   # storage: stays live)
                a.meta["tensor_meta"] = _extract_tensor_metadata(view)
            elif isinstance(a, torch.fx.Node):   # each new node's meta from a meta tensor: no graph run
                fake = meta_tensor(_meta(a))
                if tuple(fake.shape) != shape and permutes_only and fake.dim() < len(shape):
                    ranked = (1,) * (len(shape) - fake.dim()) + tuple(fake.shape)   # permuted with size-1 dims,
                    a, fake = g.call_method("reshape", (a, ranked)), fake.reshape(ranked)   # it broadcasts as the
                    a.meta["tensor_meta"] = _extract_tensor_metadata(fake)   # expand would, which split chains
                elif tuple(fake.shape) != shape and not permutes_only:
                    a, fake = g.call_method("expand", (a, shape)), fake.expand(shape)
                    a.meta["tensor_meta"] = _extract_tensor_metadata(fake)
                for node in chain:
                    make = g.call_method if node.op == "call_method" else g.call_function
                    a, fake = make(node.target, (a, *node.args[1:]), dict(node.kwargs)), _step(node, fake)
                    a.meta["tensor_meta"] = _extract_tensor_metadata(fake)
            args.append(a)
        moved = g.call_function(op.target, tuple(args), dict(op.kwargs))
    moved.meta = {k: v for k, v in op.meta.items() if k != "tensor_meta"}
    moved.meta["tensor_meta"] = last.meta.get("tensor_meta")
    last.replace_all_uses_with(moved)
    for node in reversed(chain):
        g.erase_node(node)
    g.erase_node(op)


def _drop_contiguous_before_pointwise(gm, written, options) -> None:
    """`y.permute(0, 2, 1).contiguous() + 1`: the copy only lays y out row-major, and a pointwise
    reader writes its result in eager's layout whatever its operand's (the kernel's output strides
    are the node's), so the readers read y itself and the permute can move (fuzz35b: Swin's
    window partition, channel_shuffle, `x.transpose(1, 2).contiguous()` split a chain)."""
    for node in list(gm.graph.nodes):
        contiguous = node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1 and (
            node.kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format) or (
            node.op == "call_function" and node.target is aten.clone.default and len(node.args) == 1
            and node.kwargs.get("memory_format") is torch.contiguous_format) or (
            node.op == "call_function" and node.target is aten.contiguous.default and len(node.args) == 1   # export's
            and node.kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format)   # (fuzz40h)
        if contiguous and node.users and node not in written and node.args[0] not in written and not reshaped_in_place(
                node.args[0]) and all(   # (h.t_(): fuzz43h)
                u.op == "call_function" and why_not_fusible(u, written) is None or _unit_view_into_kernels(u, written)
                for u in node.users) and (options is None or options.fuse):   # each reader in a kernel, which
            #                                                                   writes eager's strides
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _unit_view_into_kernels(view, written) -> bool:
    """`y.unsqueeze(0)`, `y[None]` read only by fusible pointwise ops: a view of any layout, which the kernels
    read as they read y (fuzz49a: BEiT's `attn + rpb.permute(2, 0, 1).contiguous().unsqueeze(0)` kept the copy)."""
    unit = op_name(view) == "unsqueeze" or view.op == "call_function" and view.target is operator.getitem \
        and len(view.args) == 2 and only_unit_indices(view.args[1])
    return unit and view not in written and bool(view.users) and all(
        u.op == "call_function" and why_not_fusible(u, written) is None for u in view.users)


EXPAND_METHODS = {"expand", "expand_as", "broadcast_to"}
EXPAND_FUNCTIONS = {torch.broadcast_to, aten.expand.default, aten.expand_as.default, aten.broadcast_to.default}


def _broadcast_alone(expand, reader) -> bool:
    """Whether `reader` computes the same shape and dtype with the expand's source in place of the
    expand (worked out on meta tensors): it then broadcasts the source itself."""
    def operand(a):
        if a is expand:
            a = expand.args[0]
        return meta_tensor(_meta(a)) if isinstance(a, torch.fx.Node) else a
    meta = _meta(reader)
    if any(isinstance(v, torch.fx.Node) for v in reader.kwargs.values()) or any(
            isinstance(a, torch.fx.Node) and _meta(a) is None for a in reader.args):
        return False
    try:
        result = reader.target(*[operand(a) for a in reader.args], **reader.kwargs)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return isinstance(result, torch.Tensor) and tuple(result.shape) == tuple(meta.shape) and result.dtype == meta.dtype


def _drop_expand_before_pointwise(gm, written, options) -> None:
    """`y.expand(b, n, d) + z`: the reader broadcasts y as the expand does, and a fused kernel
    writes its result in the node's (eager's) strides, so the reader reads y itself; the expand
    had split the chain that made y from the chain that reads it (fuzz35, left open then). Not
    where the source has no dims (a 0-dim tensor promotes as a number: the dtype check sees it)."""
    for node in list(gm.graph.nodes):
        expand = (node.op == "call_method" and node.target in EXPAND_METHODS
                  or node.op == "call_function" and node.target in EXPAND_FUNCTIONS) \
            and bool(node.args) and isinstance(node.args[0], torch.fx.Node)
        if not expand or not node.users or node in written or node.args[0] in written \
                or (options is not None and not options.fuse):
            continue
        source = _meta(node.args[0])
        if source is None or not len(source.shape) or _meta(node) is None:
            continue
        readers = list(node.users)
        if all(u.op == "call_function" and why_not_fusible(u, written) is None and _broadcast_alone(node, u)
               for u in readers):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _one_view_per_source(gm, written) -> None:
    """Identical permutes and unit views of one tensor read by pointwise ops only, as one node: each
    hoist made its own (`c = e.cos().unsqueeze(1); s = e.sin().unsqueeze(1)` read by q and k, GQA's
    rotary), and kernels reading two nodes were not taken as siblings of one input (fuzz47a: cos and sin
    in two kernels). Not where a view is returned or written: eager's are distinct tensor objects."""
    kept = {}
    for node in list(gm.graph.nodes):
        if not (_is_permute(node) or is_unit_view(node)) or node in written or node.args[0] in written:
            continue
        key = (node.op, node.target, repr(node.args), repr(node.kwargs))
        first = kept.setdefault(key, node)
        if first is not node and all(u.op == "call_function" and is_pointwise_target(u.target) for u in node.users):
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)


def hoist_permutes(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    g = gm.graph
    _drop_contiguous_before_pointwise(gm, _mutated_values(gm), options)
    _drop_expand_before_pointwise(gm, _mutated_values(gm), options)
    changed = True
    while changed:
        changed = False
        written = _mutated_values(gm)
        for node in list(g.nodes):
            op, chain = _chain(node) if _is_permute(node) or is_unit_view(node) else (None, [])
            if op is not None and _movable(op, chain, written):
                _hoist(gm, op, chain)   # the new permutes carry their meta: the op before may move next
                changed = True
                break   # the graph changed under the loop: look again
    _one_view_per_source(gm, _mutated_values(gm))
    g.lint()
    gm.recompile()
    return gm
