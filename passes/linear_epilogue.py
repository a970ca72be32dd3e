"""Where a Linear's bias is added: in the library GEMM's epilogue, or in the fused kernel.

normalize splits every Linear into `F.linear(x, W)` plus a pointwise bias add, so fusion can
absorb the bias into the activation's kernel. On the GPU the library's kernel choice for the
two spellings differs a lot with shape (fxfuse/library_choice.py measures it), so for each
such pair this pass measures once per shape and, where the GEMM with bias wins, puts the
bias back into the library call. The decision and its numbers go to explain().
"""
import operator

import torch
import torch.fx
import torch.nn.functional as F

from fxfuse.library_choice import bias_in_library_gemm
from fxfuse.tracing import fxfuse_meta


def _linear_bias_pairs(gm):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.linear and len(node.args) == 2 \
                and not node.kwargs and len(node.users) == 1:
            add = next(iter(node.users))
            if add.op == "call_function" and add.target is operator.add and add.args[0] is node \
                    and isinstance(add.args[1], torch.fx.Node) and add.args[1].op == "get_attr":
                bias_meta = add.args[1].meta.get("tensor_meta")
                out = node.meta.get("tensor_meta")
                if bias_meta is not None and out is not None and len(bias_meta.shape) == 1 \
                        and bias_meta.shape[0] == out.shape[-1] and bias_meta.dtype == out.dtype:
                    yield node, add


def linear_epilogue(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    changed = False
    for linear, add in list(_linear_bias_pairs(gm)):
        meta = linear.meta["tensor_meta"]
        device = fxfuse_meta(linear).get("device", torch.device("cpu"))
        n = meta.shape[-1]
        batch = meta.shape.numel() // max(n, 1)
        k = linear.args[1].meta["tensor_meta"].shape[-1]
        use_library, reason = bias_in_library_gemm(batch, k, n, meta.dtype, device,
                                                   torch.backends.cuda.matmul.allow_tf32)
        if not use_library:   # keep what earlier passes decided about this Linear (fuse_gemm's "no")
            earlier = fxfuse_meta(linear).get("decision")
            fxfuse_meta(linear)["decision"] = f"{earlier}; {reason}" if earlier else reason
            continue
        with gm.graph.inserting_before(add):
            new = gm.graph.call_function(F.linear, (linear.args[0], linear.args[1], add.args[1]))
        new.meta = dict(add.meta)
        new.meta["fxfuse"] = {"decision": reason, "device": device}
        add.replace_all_uses_with(new)
        gm.graph.erase_node(add)
        gm.graph.erase_node(linear)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
