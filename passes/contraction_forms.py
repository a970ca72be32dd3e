"""Contractions of an activation with a 2-D weight that are a Linear in another spelling
(`torch.einsum("bi,oi->bo", x, W)`, `torch.inner(x, W)`, `torch.tensordot(x, W, ([-1], [1]))`):
normalize_layers.matmul_as_linear reads each as F.linear, so the Linear passes plan it."""
import torch

from fxfuse.node_meta import tensor_meta

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


def einsum_operands(node):
    """(x, weight node for F.linear) where node is an einsum that is a Linear: one operand a 2-D
    constant W, the other x, the equation contracting x's last index with one of W's and
    keeping x's other indices in order followed by W's other one (`bi,oi->bo`, `...i,io->...o`,
    `bsi,oi->bso`, either operand first); else None. W's index order says which way it is
    stored."""
    if node.op != "call_function" or node.target not in EINSUMS or node.kwargs or len(node.args) < 2:
        return None
    equation, operands = node.args[0], list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != 2:
        return None
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
