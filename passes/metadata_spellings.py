"""The two spellings the normalize pass decides from a node's metadata (passes/spellings.py holds
the tables): `x.masked_fill(mask, v)` as torch.where where both give x's dtype, and the pure
dtype conversions (x.float(), x.to(torch.half), y.type_as(x), torch.export's aten.to.dtype)."""
import torch
import torch.fx

from fxfuse.node_meta import fxfuse_meta, single_tensor_meta

aten = torch.ops.aten
CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                "double": torch.float64}


def masked_fill_is_where(x, value) -> bool:
    """x.masked_fill(mask, value) is torch.where(mask, value, x) where both give x's dtype: a
    floating x with a number, or with a 0-d tensor of its own dtype (masked_fill never promotes;
    where would make an int x float for 1.5)."""
    meta = single_tensor_meta(x)
    if meta is None or not meta.dtype.is_floating_point:
        return False
    if isinstance(value, (bool, int, float)):
        return True
    vmeta = single_tensor_meta(value)
    return vmeta is not None and not vmeta.shape and vmeta.dtype == meta.dtype


def cast_target(node):
    """dtype of a pure dtype conversion (x.float(), x.to(torch.half), x.type(dtype), y.type_as(x)
    on one device, and torch.export's aten.to.dtype and aten.type_as), else None."""
    if node.op == "call_function" and node.target is aten.to.dtype:
        # to.dtype(self, dtype, non_blocking=False, copy=False, memory_format=None)
        extra = dict(zip(("non_blocking", "copy", "memory_format"), node.args[2:]), **node.kwargs)
        if isinstance(node.args[1], torch.dtype) and not any(extra.values()):
            return node.args[1]
        return None
    type_as = node.target == "type_as" if node.op == "call_method" else node.target is aten.type_as.default
    if type_as and len(node.args) == 2 and not node.kwargs:   # LLaMA's RMSNorm: y.type_as(x)
        src, other = node.args
        meta = single_tensor_meta(other)
        devices = {fxfuse_meta(n).get("device") for n in (src, other) if isinstance(n, torch.fx.Node)}
        if meta is not None and len(devices) == 1 and None not in devices:
            return meta.dtype   # x.to(other's dtype and device): a cast where both are on one device
    if node.op != "call_method":
        return None
    if node.target in CAST_METHODS and len(node.args) == 1 and not node.kwargs:
        return CAST_METHODS[node.target]
    if node.target in ("to", "type") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) \
            and not node.kwargs:
        return node.args[1]
    if node.target == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None
