"""Tensors forward() builds from Python numbers become constants of the graph.

`scores / torch.sqrt(torch.tensor(d_k, dtype=torch.float32, device=x.device))`,
`h * torch.tensor(0.5, device=h.device)`, `x.new_tensor(1.0)`: each call copied a number from
the host to the device, a copy no CUDA graph can capture (the capture failed and the whole model
ran without its graph: fuzz34b), and the pointwise kernel reading it waited for a library call.
Shape propagation has folded sizes and devices to constants by now, so such a node's value is
known at optimize time: it becomes a buffer of the graph (made once; eager makes it anew each
call, so only where nothing can see the difference: no reader writes it or keeps a view of it,
and forward() does not return it).
"""
import math

import torch
import torch.fx

from fxfuse.node_meta import fxfuse_meta, single_tensor_meta
from fxfuse.state_writes import _writes_in_place

from .normalize_layers import register_constant

FACTORIES = {torch.tensor, torch.as_tensor, torch.scalar_tensor}
MAX_ELEMENTS = 256
LITERAL_STEM = "literal"
LITERAL_PREFIX = "fxfuse_" + LITERAL_STEM   # register_constant's names: api.tensors_read knows them for no model copy


def _numbers(data) -> bool:
    if isinstance(data, (list, tuple)):
        return all(map(_numbers, data))
    return isinstance(data, (bool, int, float))


def fold_literal_tensor(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    from .normalize import _reads_without_alias   # normalize calls this: import late
    if node.op == "call_function" and node.target in FACTORIES and len(node.args) == 1:
        data = node.args[0]
    elif node.op == "call_method" and node.target == "new_tensor" and len(node.args) == 2:
        data = node.args[1]
    else:
        return False
    meta, device = single_tensor_meta(node), fxfuse_meta(node).get("device")
    if not _numbers(data) or set(node.kwargs) - {"dtype", "device", "requires_grad"} or node.kwargs.get(
            "requires_grad") or meta is None or device is None or math.prod(meta.shape) > MAX_ELEMENTS:
        return False
    if not node.users or any(u.op == "output" or _writes_in_place(u) is not None or not _reads_without_alias(gm, u)
                             for u in node.users):
        return False
    value = torch.tensor(data, dtype=meta.dtype, device=device)
    if tuple(value.shape) != tuple(meta.shape):
        return False
    name = register_constant(gm, LITERAL_STEM, value)
    with gm.graph.inserting_before(node):
        constant = gm.graph.get_attr(name)
    constant.meta = dict(node.meta)
    node.replace_all_uses_with(constant)
    gm.graph.erase_node(node)
    return True
