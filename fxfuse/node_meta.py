"""fxfuse's facts about graph nodes: its own meta key, torch.fx's tensor meta, get_attr targets.

Tracing, the passes and the state-write check read these; they import nothing of fxfuse.
"""
import warnings

import torch
import torch.fx
import torch.fx.passes.shape_prop


def fxfuse_meta(node: torch.fx.Node) -> dict:
    """fxfuse's own facts about a node live under one key, never as node attributes."""
    return node.meta.setdefault("fxfuse", {})


def tensor_meta(node):
    """ShapeProp's TensorMetadata of a node (None for non-nodes and nodes without it)."""
    return node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None


def single_tensor_meta(node):
    """The node's TensorMetadata where it is one tensor (not a tuple of them, not a number), else None."""
    meta = tensor_meta(node)
    return meta if isinstance(meta, torch.fx.passes.shape_prop.TensorMetadata) else None


def meta_tensor(meta) -> torch.Tensor:
    """A tensor on the meta device with a TensorMetadata's shape, strides and dtype: what an op
    would return for it (its strides included) is computed without data."""
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")


def fetch_attr(gm: torch.nn.Module, target: str):
    """The object a get_attr target ("layer.0.weight") names in gm."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def get_attr_quietly(graph: torch.fx.Graph, target: str) -> torch.fx.Node:
    """graph.get_attr(target) without torch.fx's warning for an attribute that is a plain tensor
    (no registered parameter or buffer: `del lin.weight; lin.weight = t`, torch.export's
    constants): the node reads it at run time all the same (fuzz35d: the warning reached users)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node with no underlying")
        return graph.get_attr(target)


def ancestors(nodes, stop=lambda n: False):
    """Each node of `nodes` and of their inputs, once, depth first; the inputs of a node where
    stop(node) holds are not followed (a metadata read, a tensor)."""
    stack, seen = list(nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        if not stop(n):
            stack += n.all_input_nodes
