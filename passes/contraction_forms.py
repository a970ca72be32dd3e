"""Contractions of an activation with a 2-D weight that are a Linear in another spelling
(`torch.einsum("bi,oi->bo", x, W)`, `torch.inner(x, W)`, `torch.tensordot(x, W, ([-1], [1]))`):
normalize_layers.matmul_as_linear reads each as F.linear, so the Linear passes plan it."""
import operator

import torch

from fxfuse.node_meta import fxfuse_meta, meta_tensor, tensor_meta
from fxfuse.shape_propagation import tensor_metadata

aten = torch.ops.aten

EINSUMS = {torch.einsum, aten.einsum.default}


def stored_weight(node):
    """W where node is itself a 2-D floating constant of the model (a get_attr), else None."""
    meta = tensor_meta(node)
    if meta is None or node.op != "get_attr":
        return None
    return node if len(meta.shape) == 2 and meta.dtype.is_floating_point else None


INNERS = {torch.inner, aten.inner.default}
TENSORDOTS = {torch.tensordot, aten.tensordot.default}


def inner_or_tensordot(node):
    """(x, other, as_linear) where node contracts x's last dim with one dim of a 2-D other:
    `torch.inner(x, W)` and `torch.tensordot(x, W, dims=([-1], [1]))` are F.linear(x, W)
    (as_linear), `tensordot(x, W, dims=([-1], [0]))` is x @ W; else None."""
    if node.op != "call_function" or len(node.args) < 2:
        return None
    if node.target in INNERS and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1], True
    if node.target not in TENSORDOTS:
        return None
    args = dict(zip(("a", "b", "dims"), node.args), **node.kwargs)
    x, other, dims, x_meta = args.get("a"), args.get("b"), args.get("dims"), tensor_meta(args.get("a"))
    if set(args) != {"a", "b", "dims"} or x_meta is None or not isinstance(dims, (list, tuple)) or len(dims) != 2 \
            or not all(isinstance(d, (list, tuple)) and len(d) == 1 and type(d[0]) is int for d in dims) \
            or dims[0][0] % max(len(x_meta.shape), 1) != len(x_meta.shape) - 1 or dims[1][0] not in (0, 1, -1, -2):
        return None
    return x, other, dims[1][0] % 2 == 1


def _equation(node):
    """(input subscripts, output subscript, operands) of an einsum node written plainly, else None."""
    if node.op != "call_function" or node.target not in EINSUMS or node.kwargs or len(node.args) < 2:
        return None
    equation, operands = node.args[0], list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "->" not in equation or not all(isinstance(o, torch.fx.Node) for o in operands):
        return None
    inputs, out = equation.replace(" ", "").split("->")
    subscripts = inputs.split(",")
    return (subscripts, out, operands) if len(subscripts) == len(operands) else None


def einsum_as_product(gm, node) -> bool:
    """`torch.einsum("bld,dn->bldn", delta, A)` (Mamba's discretization: no index summed) as the
    broadcast product of its operands, each permuted and unsqueezed into the output's index order:
    pointwise ops a kernel fuses, where the library einsum split it (fuzz46a). Only where eager's
    result is row-major (the product is laid out so: a contiguous() after it), the operands share
    one dtype and no letter repeats within a subscript. Rewritten in place; True if it was."""
    from fxfuse.ops import row_major   # (ops imports passes' helpers: late)
    parsed = _equation(node)
    if parsed is None:
        return False
    subscripts, out, operands = parsed
    metas, meta = [tensor_meta(o) for o in operands], tensor_meta(node)
    if len(operands) < 2 or "." in out or any("." in sub or len(set(sub)) != len(sub) for sub in subscripts) \
            or len(set(out)) != len(out) or set("".join(subscripts)) != set(out) or meta is None \
            or None in metas or len({m.dtype for m in metas}) != 1 or tuple(meta.stride) != row_major(meta.shape) \
            or any(len(m.shape) != len(sub) for m, sub in zip(metas, subscripts)) \
            or any(m.shape[i] != meta.shape[out.index(c)]
                   for m, sub in zip(metas, subscripts) for i, c in enumerate(sub)):
        return False
    g, product, device = gm.graph, None, fxfuse_meta(node).get("device")

    def made(kind, target, args, value):   # a node with its meta (the value a meta tensor's op gives)
        new = g.create_node(kind, target, args)
        new.meta["tensor_meta"] = tensor_metadata(value)
        if device is not None:
            fxfuse_meta(new)["device"] = device
        return new, value
    with g.inserting_before(node):
        for operand, meta_in, sub in zip(operands, metas, subscripts):
            order = sorted(range(len(sub)), key=lambda i: out.index(sub[i]))
            view, value = operand, meta_tensor(meta_in)
            if order != sorted(order):
                view, value = made("call_method", "permute", (view, *order), value.permute(*order))
            for position, c in enumerate(out):
                if c not in sub:
                    view, value = made("call_method", "unsqueeze", (view, position), value.unsqueeze(position))
            product = (view, value) if product is None else \
                made("call_function", operator.mul, (product[0], view), product[1] * value)
        laid, _ = made("call_method", "contiguous", (product[0],), product[1].contiguous())
    node.replace_all_uses_with(laid)
    g.erase_node(node)
    return True


def einsum_operands(node):
    """(x, weight node for F.linear) where node is an einsum that is a Linear: one operand a 2-D
    constant W, the other x, the equation contracting x's last index with one of W's and
    keeping x's other indices in order followed by W's other one (`bi,oi->bo`, `...i,io->...o`,
    `bsi,oi->bso`, either operand first); else None. W's index order says which way it is
    stored."""
    parsed = _equation(node)
    if parsed is None or len(parsed[2]) != 2:
        return None
    subscripts, out, operands = parsed
    w_at = [i for i, a in enumerate(operands) if stored_weight(a) is not None]
    if len(w_at) != 1 or not isinstance(operands[1 - w_at[0]], torch.fx.Node):
        return None
    sw, sx = subscripts[w_at[0]], subscripts[1 - w_at[0]]
    letters = sx.replace("...", "")
    if len(sw) != 2 or not sx or sx.endswith(".") or len(set(letters)) != len(letters) or len(set(sw)) != 2:
        return None
    c = sx[-1]
    o = sw.replace(c, "", 1)
    if c not in sw or len(o) != 1 or o in sx or out != sx[:-1] + o:
        return None
    return operands[1 - w_at[0]], operands[w_at[0]], sw == o + c
