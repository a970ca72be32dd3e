"""Library Linears read a weight stored [in, out] through a view, not a copy.

normalize_layers turns `x @ W` (W stored [in, out], as GPT-2's Conv1D keeps it) into
F.linear(x, W.T) reading a contiguous transposed copy of W, because the generated kernels
(fused GEMM, fused MLP, Strassen) read weights [out, in]. A layer that stays a library call
needs no copy: cuBLAS reads W.T as a transposed operand at no cost, as eager does. Keeping the
copy there would double the memory of every such weight (all of GPT-2's MLP and attention
projections, which stay library GEMMs at their width). This pass runs last: the layers the
generated kernels took no longer read the copy through the graph, the others get `W.t()`,
and a copy nobody reads is dropped from the module.
"""
import torch
import torch.nn.functional as F

from fxfuse.node_meta import fetch_attr, fxfuse_meta
from fxfuse.tracing import tensor_metadata

from .linear_epilogue import linear_relu, split_k_partials
from .normalize_layers import register_constant

# Library calls taking (x, weight, ...) that accept any strided weight view: F.linear and
# linear_relu pass weight.t() to cuBLAS, split_k_partials reshapes weight.t() (W itself here).
LIBRARY_LINEARS = (F.linear, linear_relu, split_k_partials)


def _reads_weight_only(user, node) -> bool:
    return (user.op == "call_function" and user.target in LIBRARY_LINEARS and len(user.args) >= 2
            and user.args[1] is node and node not in user.args[2:] and node not in user.kwargs.values()
            and user.args[0] is not node)


def _readable(gm, target: str, weight) -> str:
    """A get_attr target for W: its own, or (where the passes dropped the module that held it,
    once nothing else read it) W registered again, the same tensor, not a copy."""
    try:
        if fetch_attr(gm, target) is weight:
            return target
    except AttributeError:
        pass
    return register_constant(gm, target, weight)


def weight_views(gm, options):
    """Each library Linear reading a transposed copy reads `W.t()` instead; unread copies go."""
    copies = gm.meta.get("fxfuse_transposed_weights")
    if not copies:
        return gm
    stored = {copy: (target, weight) for target, (copy, weight) in copies.items()}
    graph = gm.graph
    readable = {}
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in stored:
            continue
        target, weight = stored[node.target]
        for user in [u for u in node.users if _reads_weight_only(u, node)]:
            if target not in readable:
                readable[target] = _readable(gm, target, weight)
            with graph.inserting_before(user):
                # not graph.get_attr: its check warns about a plain attribute, as torch.export keeps a global
                w = graph.create_node("get_attr", readable[target])   # tensor (lifted_tensor_0), which reads fine
                view = graph.call_method("t", (w,))
            w.meta["tensor_meta"] = tensor_metadata(weight)
            view.meta["tensor_meta"] = tensor_metadata(weight.t())
            fxfuse_meta(view)["note"] = "weight stored [in, out]: the library GEMM reads it transposed (a view, no copy)"
            user.replace_input_with(node, view)
        if not node.users:
            graph.erase_node(node)
    still_read = {n.target for n in graph.nodes if n.op == "get_attr"}
    for copy in stored:
        if copy not in still_read and copy in gm._buffers:
            del gm._buffers[copy]   # the generated kernels that read it hold their own reference
    graph.lint()
    gm.recompile()
    return gm
