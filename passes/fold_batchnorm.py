"""Eval-mode BatchNorm: folded into (copies of) the preceding Linear/Conv weights, or else
turned into a per-channel multiply-add that pointwise fusion can absorb.

In eval mode BatchNorm is y = x * scale + shift with scale = gamma / sqrt(var + eps) and
shift = beta - mean * scale, constants per channel (dim 1); computed as (x - mean) * scale + beta
where it is not folded. After a Conv (channels = dim 1)
or a Linear on 2-d input (features = dim 1) whose only reader is the BatchNorm, it is
absorbed into a new weight and bias; the user's model is never modified, the copies live on
the GraphModule. Training-mode BatchNorm, or one without running statistics, is left alone.

Half-precision layers are not folded, and their multiply-add keeps fp32 constants and computes
in fp32 (one rounding, as eager's BatchNorm kernels): fp16 constants lost to cancellation where
the running mean is large against the spread (fuzz31a: 3 to 10 times eager's error).

A functional `F.batch_norm(x, self.rm, self.rv, ...)` reads its buffers live instead of folding
them: a training-mode call updates running statistics in place without bumping their version
counters, so constants taken from them would go stale unseen (nn.BatchNorm also bumps
num_batches_tracked, which the runtime watches; a hand-written one has no such counter).
"""
import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.ops import HALF_DTYPES as HALF, keep_eager_layout
from fxfuse.state_writes import written_attributes
from fxfuse.tracing import fetch_attr, fxfuse_meta

from .normalize_layers import keywords_to_positions

CONV_FUNCTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


def _scale_shift(bn: nn.modules.batchnorm._BatchNorm):
    with torch.no_grad():
        var, mean = bn.running_var.double(), bn.running_mean.double()
        scale = torch.rsqrt(var + bn.eps)
        if bn.weight is not None:
            scale = scale * bn.weight.double()
        shift = -mean * scale
        if bn.bias is not None:
            shift = shift + bn.bias.double()
    return scale, shift


def _is_eval_batchnorm(mod) -> bool:
    """An eval-mode BatchNorm whose forward is torch's own (a subclass may override it)."""
    return (isinstance(mod, nn.modules.batchnorm._BatchNorm) and not mod.training
            and type(mod).forward in (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)
            and mod.track_running_stats and mod.running_mean is not None)


def _register(gm, stem: str, tensor: torch.Tensor) -> str:
    name = "fxfuse_" + stem.replace(".", "_")
    k = 0
    while hasattr(gm, f"{name}_{k}"):
        k += 1
    gm.register_buffer(f"{name}_{k}", tensor.detach(), persistent=False)
    return f"{name}_{k}"


def _foldable_producer(gm, bn_node):
    """The Linear/Conv call_module node the BatchNorm can be folded into, or None."""
    src = bn_node.args[0]
    if not isinstance(src, torch.fx.Node) or src.op != "call_module" or len(src.users) != 1:
        return None
    mod = gm.get_submodule(src.target)
    meta = src.meta.get("tensor_meta")
    if type(mod) in CONV_FUNCTIONS and mod.padding_mode == "zeros":   # batched: channels are dim 1
        return src if meta is not None and len(meta.shape) == mod.weight.dim() else None
    if type(mod) is nn.Linear and meta is not None and len(meta.shape) == 2:
        return src
    return None


BATCH_NORM_FUNCTIONS = {  # eval-mode functional spellings (torch.export gives the aten one)
    torch.ops.aten.batch_norm.default: ("input", "weight", "bias", "running_mean", "running_var",
                                        "training", "momentum", "eps", "cudnn_enabled"),
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
}


def _constant(gm, node):
    """The tensor a get_attr node names (None stays None); anything else is not a constant."""
    if node is None:
        return None
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        return fetch_attr(gm, node.target)
    raise LookupError


def _functional_batchnorm(gm, node):
    """The arguments (a dict) of an eval-mode functional batch_norm whose statistics are module
    tensors, or None."""
    names = BATCH_NORM_FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if names is None or len(node.args) > len(names):
        return None
    args = dict(zip(names, node.args), **node.kwargs)
    if args.get("training", False) is not False or not isinstance(args.get("input"), torch.fx.Node):
        return None
    try:
        tensors = [_constant(gm, args.get(k)) for k in ("running_mean", "running_var", "weight", "bias")]
    except (LookupError, AttributeError):
        return None
    meta = node.meta.get("tensor_meta")
    if tensors[0] is None or tensors[1] is None or len(getattr(meta, "shape", ())) < 2:
        return None
    return args


def fold_batchnorm(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    g = gm.graph
    for node in g.nodes:   # self.bn(input=h), self.conv(input=x): as positional calls
        if node.op == "call_module" and node.kwargs:
            keywords_to_positions(gm, node)
    written = written_attributes(gm)
    for node in list(g.nodes):
        args = _functional_batchnorm(gm, node)
        if args is not None:
            _live_normalize(gm, node, args)
            continue
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        bn = gm.get_submodule(node.target)
        if not _is_eval_batchnorm(bn) or any(t.startswith(f"{node.target}.") for t in written):
            continue   # statistics forward() sets itself: folded at optimize time, they would go stale
        src = _foldable_producer(gm, node)
        if src is not None and any(t.startswith(f"{src.target}.") for t in written):
            _as_multiply_add(gm, node, bn, node.args[0], node.target)
            continue
        scale, shift = _scale_shift(bn)
        if src is not None and gm.get_submodule(src.target).weight.dtype not in HALF:
            layer = gm.get_submodule(src.target)
            dtype = layer.weight.dtype
            shape = (-1,) + (1,) * (layer.weight.dim() - 1)
            weight = (layer.weight.double() * scale.view(shape)).to(dtype)
            bias = shift if layer.bias is None else layer.bias.double() * scale + shift
            with g.inserting_before(node):
                w = g.get_attr(_register(gm, f"{src.target}.weight_bn", weight))
                b = g.get_attr(_register(gm, f"{src.target}.bias_bn", bias.to(dtype)))
                if type(layer) is nn.Linear:
                    new = g.call_function(F.linear, (src.args[0], w, b))
                else:
                    new = g.call_function(CONV_FUNCTIONS[type(layer)], (
                        src.args[0], w, b, layer.stride, layer.padding, layer.dilation, layer.groups))
            fxfuse_meta(new)["note"] = (f"{type(gm.get_submodule(node.target)).__name__} `{node.target}` folded into "
                                        f"{type(layer).__name__} `{src.target}`")
            new.meta["tensor_meta"] = node.meta.get("tensor_meta")
            node.replace_all_uses_with(new)
            g.erase_node(node)
            g.erase_node(src)
            continue
        _as_multiply_add(gm, node, bn, node.args[0], node.target)
    # Only the constants this pass orphaned are dead: the default purity test would also drop
    # in-place calls whose result is unused (`v.relu_()` as a statement), changing the model.
    g.eliminate_dead_code(is_impure_node=lambda n: n.op != "get_attr")
    g.lint()
    gm.recompile()
    return gm


def _as_multiply_add(gm, node, bn, x, stem: str) -> None:
    """Replace an eval BatchNorm node by (x - mean) * scale + beta with per-channel constants (fp32
    ones and fp32 arithmetic for a half-precision x). The mean is subtracted first, as CUDA's
    kernel does: x * scale + shift cancels two large rounded terms where the mean is large against
    the spread (fuzz47f: raw features around 1000 with std 0.1 lost three digits)."""
    g = gm.graph
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape") or len(meta.shape) < 2:
        return
    scale, _ = _scale_shift(bn)
    dtype = meta.dtype
    constants = torch.float32 if dtype in HALF else dtype
    view = (-1,) + (1,) * (len(meta.shape) - 2)

    def constant(name, value):
        return g.get_attr(_register(gm, f"{stem}.{name}", value.detach().double().to(constants).view(view)))
    with g.inserting_before(node):
        x_up = g.call_method("to", (x, constants)) if constants != dtype else x
        new = g.call_function(operator.mul, (g.call_function(operator.sub, (x_up, constant("mean", bn.running_mean))),
                                             constant("scale", scale)))
        if bn.bias is not None:
            new = g.call_function(operator.add, (new, constant("shift", bn.bias)))
        if constants != dtype:
            new = g.call_method("to", (new, dtype))
    _replaced(gm, node, new, x, f"eval-mode {stem} as a per-channel multiply-add")


def _live_normalize(gm, node, args: dict) -> None:
    """An eval-mode functional batch_norm as pointwise ops over its live statistics:
    (x - mean) * rsqrt(var + eps) [* weight] [+ bias], in fp32 for a half-precision x, each
    vector viewed along dim 1 (module docstring: why not constants)."""
    g = gm.graph
    meta = node.meta["tensor_meta"]
    dtype = meta.dtype
    work = torch.float32 if dtype in HALF else dtype
    view = (-1,) + (1,) * (len(meta.shape) - 2)

    def channel(key):   # a view registered once: it shares the buffer's storage, so it stays live
        tensor = _constant(gm, args[key])
        live = g.get_attr(_register(gm, f"{node.name}.{key}", tensor.view(view)))
        return live if tensor.dtype == work else g.call_method("to", (live, work))
    with g.inserting_before(node):
        x = args["input"]
        y = g.call_function(operator.sub, (g.call_method("to", (x, work)) if work != dtype else x,
                                           channel("running_mean")))
        var = g.call_function(operator.add, (channel("running_var"), float(args.get("eps", 1e-5))))
        y = g.call_function(operator.mul, (y, g.call_function(torch.rsqrt, (var,))))
        if args.get("weight") is not None:
            y = g.call_function(operator.mul, (y, channel("weight")))
        if args.get("bias") is not None:
            y = g.call_function(operator.add, (y, channel("bias")))
        if work != dtype:
            y = g.call_method("to", (y, dtype))
    _replaced(gm, node, y, x, f"eval-mode {node.name} over its live running statistics")


def _replaced(gm, node, new, x, note: str) -> None:
    """node's users read `new` (eager's strides kept: the pointwise form follows x's layout,
    batch_norm writes its own; as_layout copies only where they differ)."""
    meta = node.meta.get("tensor_meta")
    fxfuse_meta(new)["note"] = note
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    x_meta = x.meta.get("tensor_meta") if isinstance(x, torch.fx.Node) else None
    if x_meta is not None and tuple(x_meta.stride) != tuple(meta.stride):
        keep_eager_layout(gm, new, meta, None)
