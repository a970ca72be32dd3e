"""In-place writes on a fresh tensor read as their out-of-place twins (`scores.masked_fill_(m, v)`,
export's index_add_, `h[mask] = v`): kept in place, a write makes everything that may alias the
tensor unfusible. Used by passes/normalize.py, whose helpers these import late (it imports this)."""
import operator

import torch
import torch.fx

from fxfuse.node_meta import single_tensor_meta
from fxfuse.tracing import fxfuse_meta

from .identity_ops import torch_contiguous

aten = torch.ops.aten


FUNCTIONAL_TWINS = {"masked_fill_", "masked_scatter_", "index_fill_", "index_add_", "index_copy_", "scatter_",
                    "scatter_add_", "scatter_reduce_", "tril_", "triu_", "nan_to_num_"}
# in-place math with no pointwise row of fxfuse's (fuzz46e: `h.fmod_(0.7)` kept the op after it out of
# any kernel): twins only on a floating h whose other operands are numbers or tensors of h's dtype,
# where the out-of-place result has h's dtype as the write does
MATH_TWINS = {"fmod_", "remainder_", "hypot_", "copysign_", "xlogy_", "heaviside_", "div_", "logit_", "sinh_",
              "cosh_", "tan_", "atan_", "asin_", "acos_", "asinh_", "acosh_", "atanh_", "atan2_", "arctan2_",
              "ldexp_", "nextafter_", "i0_", "lgamma_", "digamma_", "erfinv_", "sinc_", "deg2rad_", "rad2deg_"}


def _fresh_and_contiguous(gm, base, node, order) -> bool:
    """Whether the in-place `node` may become its out-of-place twin: base is a fresh tensor whose other
    readers before the write only read it (a view taken after the write reads the result: review35c),
    laid out contiguously (the twin's result is: a buffer with other strides keeps them, fuzz38h)."""
    from .normalize import _produces_fresh_tensor, _reads_without_alias
    meta = single_tensor_meta(base)
    return meta is not None and torch_contiguous(meta.shape, meta.stride) and _produces_fresh_tensor(base) \
        and all(u is node or _reads_without_alias(gm, u) or order.get(u, -1) > order[node] for u in base.users)


def functional_twin(gm, node, order) -> bool:
    """`scores.masked_fill_(mask, v)` on a fresh tensor (a matmul's result) that nothing else
    reads as is: the out-of-place `masked_fill`, and later readers of `scores` read its result.
    Kept in place, the write would make everything that may alias `scores` unfusible. torch.export
    spells it aten.index_add_.default & co. (fuzz38d: a GCN's aggregation into torch.zeros)."""
    from .normalize import _later_readers_read
    if node.op == "call_method" and node.target in MATH_TWINS and _keeps_dtype(node):
        twin = node.target[:-1]
    elif node.op == "call_method" and node.target in FUNCTIONAL_TWINS:
        twin = node.target[:-1]
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target.overloadpacket.__name__ in FUNCTIONAL_TWINS:
        packet = getattr(aten, node.target.overloadpacket.__name__[:-1], None)
        twin = getattr(packet, node.target._overloadname, None) if packet is not None else None
    else:
        return False
    base = node.args[0] if node.args else None
    if twin is None or base in node.args[1:] or base in node.kwargs.values() \
            or not _fresh_and_contiguous(gm, base, node, order):   # sc.masked_scatter_(m, sc): reads what it writes
        return False
    with gm.graph.inserting_after(node):
        new = gm.graph.create_node(node.op, twin, node.args, dict(node.kwargs))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    _later_readers_read(base, new, node, order)
    return True


def _keeps_dtype(node) -> bool:
    """Whether the out-of-place twin of in-place math `node` gives its base's (floating) dtype."""
    meta = single_tensor_meta(node.args[0]) if node.args else None
    if meta is None or not meta.dtype.is_floating_point:
        return False
    for a in (*node.args[1:], *node.kwargs.values()):
        other = single_tensor_meta(a) if isinstance(a, torch.fx.Node) else None
        if isinstance(a, torch.fx.Node) and (other is None or other.dtype != meta.dtype) \
                or not isinstance(a, (torch.fx.Node, bool, int, float, str, type(None))):
            return False
    return True


def mask_assignment_as_where(gm, node, order) -> bool:
    """`h[mask] = v` (torch.export's index_put_(h, [mask], v)) with a bool mask of h's shape and a
    number or one-element value, on a fresh h: `torch.where(mask, v, h)`, as masked_fill_ is read
    (fuzz44e: the write kept everything reading h out of fusion)."""
    from .normalize import _later_readers_read
    if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3 and not node.kwargs:
        base, mask, value = node.args
    elif node.op == "call_function" and node.target is aten.index_put_.default and len(node.args) == 3 \
            and not node.kwargs and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) == 1:
        base, (mask,), value = node.args
    else:
        return False
    meta, mask_meta = single_tensor_meta(base), single_tensor_meta(mask)
    value_meta = single_tensor_meta(value) if isinstance(value, torch.fx.Node) else None
    if meta is None or mask_meta is None or mask_meta.dtype != torch.bool or mask_meta.shape != meta.shape \
            or not (isinstance(value, (int, float)) and not isinstance(value, bool) and meta.dtype.is_floating_point
                    or value_meta is not None and value_meta.shape.numel() == 1 and len(value_meta.shape) == 0
                    and value_meta.dtype == meta.dtype) \
            or base in (mask, value) or not _fresh_and_contiguous(gm, base, node, order):
        return False
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(torch.where, (mask, value, base))
    new.meta = {k: v for k, v in node.meta.items() if k != "fxfuse"}
    new.meta["tensor_meta"] = meta
    fxfuse_meta(new).update({k: v for k, v in fxfuse_meta(base).items() if k == "device"})
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    _later_readers_read(base, new, node, order)
    return True


WHOLE = (slice(None), Ellipsis)


def _everything(index) -> bool:
    """`:`, `...`, `:, :` (no more dims than the tensor has: eager's error, left to eager)."""
    if isinstance(index, tuple):
        return index.count(Ellipsis) <= 1 and all(i in WHOLE for i in index)
    return index in WHOLE


def _whole_write(node):
    """(dst, value) of a write of all of dst: `dst.copy_(src)` (torch.export's aten.copy_),
    `dst[:] = v`, `dst[...] = v` (operator.setitem, or __setitem__ where forward() wrote it),
    `dst.fill_(v)`, `dst.zero_()`; else None."""
    if (node.op == "call_method" and node.target == "copy_" or node.op == "call_function"
            and node.target is aten.copy_.default) and len(node.args) in (2, 3) and set(node.kwargs) <= {"non_blocking"}:
        return node.args[:2]
    if (node.op == "call_method" and node.target == "fill_" or node.op == "call_function"
            and node.target in (aten.fill_.Scalar, aten.fill_.Tensor)) and len(node.args) == 2 and not node.kwargs:
        return node.args             # h.fill_(v), export's h[:] = v (review45h)
    if (node.op == "call_method" and node.target == "zero_" or node.op == "call_function"
            and node.target is aten.zero_.default) and len(node.args) == 1 and not node.kwargs:
        return node.args[0], 0
    if (node.op == "call_function" and node.target is operator.setitem or node.op == "call_method"
            and node.target == "__setitem__") and len(node.args) == 3 and not node.kwargs and _everything(node.args[1]):
        return node.args[0], node.args[2]
    return None


def _added(gm, node, op, target, args, meta, device):
    with gm.graph.inserting_before(node):
        new = gm.graph.create_node(op, target, args, {})
    new.meta["tensor_meta"] = meta
    fxfuse_meta(new)["device"] = device
    return new


def whole_write_as_value(gm, node, order) -> bool:
    """`h.copy_(src)`, `h[:] = v`, `h[...] = v` on a fresh h that nothing reads before as anything
    but a value: every element is overwritten, so later readers of h read the written value made
    out of place (src cast to h's dtype, broadcast to h's shape, in h's row-major layout; a number
    filled), which fusion can take in. Kept in place, the write made everything that may alias h
    unfusible (stop 44 left `h.copy_(h * 2)`, `torch.empty_like(x).copy_(y)`, `h[:] = v`)."""
    from fxfuse.ops import cast
    from .normalize import _later_readers_read
    pair = _whole_write(node)
    if pair is None:
        return False
    base, value = pair
    meta = single_tensor_meta(base)
    device = fxfuse_meta(base).get("device") if isinstance(base, torch.fx.Node) else None
    index = node.args[1] if len(node.args) == 3 and isinstance(node.args[1], tuple) else ()
    if meta is None or device is None or value is base or not _fresh_and_contiguous(gm, base, node, order) \
            or len(index) - index.count(Ellipsis) > len(meta.shape):
        return False
    from .fold_literals import LITERAL_PREFIX, _lifted_literal, _literal
    literal = None if not isinstance(value, torch.fx.Node) else _lifted_literal(value) if value.op != "get_attr" else \
        _literal(value) if value.target.startswith(LITERAL_PREFIX) else None   # (not a tensor the trace read: its
    #                                                                          value may change in place later)
    if literal is not None and literal.dim() == 0 and not literal.is_complex():   # export's h[:] = 7.0: fill_ of
        value = literal.item()                                                     # a lifted constant
    if isinstance(value, (bool, int, float)):
        filled = torch.empty((), dtype=meta.dtype)
        try:
            filled[...] = value            # eager's conversion of the number (h[:] = 2.7 of an int h: 2)
        except (RuntimeError, OverflowError):
            return False
        new = _added(gm, node, "call_function", torch.full, (tuple(meta.shape), filled.item()), meta, device)
        new.kwargs = {"dtype": meta.dtype, "device": device}
    else:
        src = single_tensor_meta(value)
        if src is None or fxfuse_meta(value).get("device") != device:
            return False
        try:
            if torch.broadcast_shapes(src.shape, meta.shape) != meta.shape:
                return False
        except RuntimeError:
            return False
        new = value
        if tuple(src.shape) != tuple(meta.shape):
            pad = len(meta.shape) - len(src.shape)
            stride = tuple(0 if i < pad or src.shape[i - pad] != meta.shape[i] else src.stride[i - pad]
                           for i in range(len(meta.shape)))
            new = _added(gm, node, "call_method", "expand", (new, tuple(meta.shape)),
                         src._replace(shape=meta.shape, stride=stride), device)
        if src.dtype != meta.dtype:   # a cast's result is row-major where its operand is (or is expanded)
            new = _added(gm, node, "call_function", cast, (new, meta.dtype), meta, device)
        if new.op != "call_function" or new.target is not cast or not torch_contiguous(src.shape, src.stride):
            # a fresh row-major copy, which read_only_clone or copy_as_contiguous may drop
            new = _added(gm, node, "call_function", torch.clone, (new,), meta, device)
            new.kwargs = {"memory_format": torch.contiguous_format}
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    _later_readers_read(base, new, node, order)
    return True
