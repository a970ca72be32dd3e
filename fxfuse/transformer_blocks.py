"""Transformer blocks inside a model: which ones fxfuse traces through with torch.export.

symbolic_trace keeps every torch.nn module as one call, so an nn.TransformerEncoder inside a
model was one opaque library call, its Linears, bias adds and residual adds unfused, while the
same layer as the root model went through torch.export and fused into 5 kernels
(tracing._trace). Except where a block is given a mask: there eager's inference fast path and
the slow path export records differ (fuzzing round 7: a key-padding mask; fuzz33c: an
attention mask that hides every key of a row, NaN in eager, numbers in the slow path).
"""
import inspect

import torch

from .log import logger

# torch.nn modules that symbolic_trace keeps as one call (every torch.nn class is a leaf) and
# that hold Linears, pointwise ops and residual adds fxfuse would fuse; their forward()'s
# fast-path tests are Python control flow, which symbolic_trace cannot follow but torch.export can
DECOMPOSED_BY_EXPORT = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer,
                        torch.nn.TransformerEncoder, torch.nn.TransformerDecoder, torch.nn.Transformer)


def opaque_blocks(gm) -> list:
    """The targets of the blocks of a symbolic_trace graph to trace through with torch.export;
    none where any block is given a mask. There eager's inference fast path (nested tensors,
    the fused encoder-layer kernel) and the slow path export records differ: zeros against
    values at padded positions, NaN against numbers for a fully padded sequence or a row of an
    attention mask that hides every key. Fuzzing found both as silent differences on calls
    whose masks the example did not have."""
    targets = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(block := gm.get_submodule(node.target), DECOMPOSED_BY_EXPORT):
            if padding_mask_given(block, node.args, node.kwargs):
                return []
            targets.append(node.target)
    return targets


def blocks_given_padding(model, args) -> list:
    """The blocks of model (DECOMPOSED_BY_EXPORT, MultiheadAttention), itself included, that
    receive a mask (attention or key-padding) when model runs on args (which it may change: pass a copy): found by running it once
    with forward pre-hooks, for a model no symbolic_trace graph shows the arguments of."""
    found, handles = [], []
    for name, block in model.named_modules():   # export decomposes MultiheadAttention too (its fast path)
        if isinstance(block, (*DECOMPOSED_BY_EXPORT, torch.nn.MultiheadAttention)):
            def note(module, block_args, kwargs, label=name or type(block).__name__):
                if padding_mask_given(module, block_args, kwargs):
                    found.append(label)
            handles.append(block.register_forward_pre_hook(note, with_kwargs=True))
    if not handles:
        return []
    try:
        with torch.no_grad():
            model(*args)
    except Exception as e:  # noqa: BLE001 -- the model's own error: export meets it too
        logger.info("running the model to find padding masks failed: %s", e)
    finally:
        for handle in handles:
            handle.remove()
    return found


def padding_mask_given(block, args, kwargs) -> bool:
    try:
        bound = inspect.signature(block.forward).bind(*args, **kwargs)
    except TypeError:
        return True   # not understood: keep the block opaque
    return any(name.endswith("mask") and value is not None for name, value in bound.arguments.items())
