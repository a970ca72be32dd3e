"""Calls whose arguments torch fills in when the call runs, written out in the graph."""
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.node_meta import single_tensor_meta


IMPLICIT_DIM_SOFTMAX = {F.softmax: F.softmax, F.log_softmax: F.log_softmax, F.softmin: F.softmin,
                        nn.Softmax: F.softmax, nn.LogSoftmax: F.log_softmax, nn.Softmin: F.softmin}


def explicit_softmax_dim(gm, node) -> None:
    """F.softmax(x) or nn.Softmax() without dim: torch picks the dim by x's rank and warns on
    every call. The build showed that warning once, in the user's code; the graph then asked
    torch again on its first call and showed it a second time, from fxfuse's generated code
    (review37). The dim torch picks (torch.nn.functional._get_softmax_dim's rule) is written into
    the call; a module becomes the function it calls."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        function = IMPLICIT_DIM_SOFTMAX.get(type(module))
        if function is None or module.dim is not None or len(node.args) != 1 or node.kwargs \
                or single_tensor_meta(node.args[0]) is None:
            return
        node.op, node.target, node.kwargs = "call_function", function, {"dim": _softmax_dim(node.args[0])}
    elif node.op == "call_function" and node.target in IMPLICIT_DIM_SOFTMAX and node.args \
            and single_tensor_meta(node.args[0]) is not None:
        if len(node.args) > 1:
            if node.args[1] is None:
                node.args = (node.args[0], _softmax_dim(node.args[0]), *node.args[2:])
        elif node.kwargs.get("dim", None) is None:
            node.kwargs = {**node.kwargs, "dim": _softmax_dim(node.args[0])}


def _softmax_dim(x) -> int:
    return 0 if len(single_tensor_meta(x).shape) in (0, 1, 3) else 1
