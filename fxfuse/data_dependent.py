"""Values whose shape depends on the input's values (h[h > 0], nonzero(x)): every graph is
specialized on shapes, so they are marked after shape propagation (tracing.propagate_shapes)."""
import operator

import torch
import torch.fx

from .errors import UnsupportedError
from .node_meta import fxfuse_meta


# ops whose result's shape depends on the input's values: every graph is specialized on shapes,
# so a size read from such a result (`pos.shape[0]` after `pos = h[h > 0]`) would be frozen
DATA_DEPENDENT_FUNCTIONS = {torch.nonzero, torch.argwhere, torch.masked_select, torch.unique,
                            torch.unique_consecutive, torch.bincount, torch.repeat_interleave}
DATA_DEPENDENT_FUNCTIONS |= {getattr(torch.ops.aten, name).default for name in (
    "nonzero", "argwhere", "masked_select", "_unique2", "unique_consecutive", "unique_dim", "bincount")
    if hasattr(torch.ops.aten, name)}
DATA_DEPENDENT_METHODS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                          "repeat_interleave"}
INDEXING = {operator.getitem, torch.ops.aten.index.Tensor}


def _is_bool_tensor(a) -> bool:
    meta = a.meta.get("tensor_meta") if isinstance(a, torch.fx.Node) else None
    return getattr(meta, "dtype", None) == torch.bool


def _makes_data_dependent_shape(n) -> bool:
    """Whether n's output shape depends on its input's values (nonzero, unique, masked_select,
    boolean-mask indexing, torch.where(cond) with one argument, tensor repeats)."""
    if n.op == "call_function" and n.target in INDEXING:
        return any(_is_bool_tensor(a) for a in torch.utils._pytree.tree_leaves(list(n.args[1:])))
    if n.op == "call_function" and n.target is torch.where:
        return len(n.args) + len(n.kwargs) == 1
    dynamic = (n.op == "call_function" and n.target in DATA_DEPENDENT_FUNCTIONS) or \
        (n.op == "call_method" and n.target in DATA_DEPENDENT_METHODS)
    if dynamic and n.target in (torch.repeat_interleave, "repeat_interleave"):   # tensor repeats only
        dynamic = any(isinstance(a, torch.fx.Node) for a in list(n.args[1:]) + list(n.kwargs.values()))
    return dynamic


def _reads_size(n) -> bool:
    return (n.op == "call_method" and n.target in ("size", "numel", "nelement")) or \
        (n.op == "call_function" and (n.target is len or n.target in SIZE_OPS
                                     or (n.target is getattr and n.args[1:] == ("shape",))))


SIZE_OPS = {getattr(torch.ops.aten, name).int if name == "sym_size" else getattr(torch.ops.aten, name).default
            for name in ("sym_size", "sym_numel") if hasattr(torch.ops.aten, name)}


def mark_data_dependent_shapes(gm: torch.fx.GraphModule) -> None:
    """Every graph is specialized on shapes; a value whose shape depends on the input's values
    (h[h > 0], nonzero(x)) and everything computed from it may change shape between calls.
    Their shape metadata is dropped, so no pass builds a kernel for the example's shape (the
    library ops run them); a size read from one (`pos.shape[0]`) would be frozen at the
    example's value, so that is refused with the node named."""
    dynamic = set()
    for n in gm.graph.nodes:
        if _makes_data_dependent_shape(n) or any(a in dynamic for a in n.all_input_nodes):
            if _reads_size(n) and any(a in dynamic for a in n.all_input_nodes):
                source = next(a for a in n.all_input_nodes if a in dynamic)
                raise UnsupportedError(
                    f"node {n.name} reads the size of {source.name}, whose shape depends on the input's values; "
                    "fxfuse specializes every graph on shapes, so the size would be frozen at the example "
                    "input's. Run that part of the model outside fxfuse")
            dynamic.add(n)
            n.meta.pop("tensor_meta", None)
            fxfuse_meta(n)["kept"] = "shape depends on the input's values"
