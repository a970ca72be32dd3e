"""Which ops return new memory: an in-place op on their result writes nothing else, so normalize
makes it functional (`w /= w.sum(-1, keepdim=True)` fuses), and the alias walk stops there.
Kept apart from normalize so that adding an op is an edit to a table."""
import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.kernel import FusedKernel
from fxfuse.node_meta import single_tensor_meta

from .identity_ops import torch_contiguous

aten = torch.ops.aten


CREATED = ("zeros", "ones", "full", "empty")
FRESH_FUNCTIONS = {torch.clone, F.linear, F.conv1d, F.conv2d, F.conv3d, torch.matmul, operator.matmul,
                   torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.softmax, F.softmax,
                   torch.log_softmax, F.log_softmax, F.layer_norm, F.group_norm, torch.cat, torch.stack,
                   F.scaled_dot_product_attention,
                   # their aten forms, as torch.export graphs spell them (a bias-free Linear there
                   # is aten.linear.default, and `relu_` after it was kept unfused)
                   aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
                   aten.matmul.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                   aten.convolution.default, aten.softmax.int, aten._softmax.default,
                   aten.log_softmax.int, aten._log_softmax.default, aten.layer_norm.default,
                   aten.group_norm.default, aten.cat.default, aten.stack.default, aten.clone.default,
                   # new tensors (an accumulator `acc = torch.zeros_like(x); acc.add_(y)`), torch's and aten's
                   torch.zeros, torch.ones, torch.full, torch.empty, aten.zeros.default, aten.ones.default,
                   aten.full.default, aten.empty.memory_format, *(getattr(torch, k + "_like") for k in CREATED),
                   *(getattr(aten, k + "_like").default for k in CREATED),
                   *(getattr(aten, "new_" + k).default for k in CREATED)}
FRESH_FUNCTIONS |= {F.embedding, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, torch.roll, F.interpolate,
                    F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                    aten.embedding.default, aten.roll.default}   # (fuzz34b: `e = tok(ids); e += typ(tt)` fused nothing)
FRESH_FUNCTIONS |= {torch.concat, torch.concatenate, torch.hstack, torch.vstack, torch.dstack, torch.row_stack,
                    torch.column_stack, aten.concat.default,   # cat's other names (fuzz42g)
                    *(getattr(aten, n).default for n in ("hstack", "vstack", "dstack", "row_stack", "column_stack")
                      if hasattr(getattr(aten, n, None), "default"))}
FRESH_FUNCTIONS |= {getattr(packet, overload) for name in (   # export's spellings of them (review34)
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d",
    "adaptive_avg_pool1d", "_adaptive_avg_pool2d", "adaptive_avg_pool2d", "convolution", "conv_transpose1d",
    "conv_transpose2d") if (packet := getattr(aten, name, None)) is not None for overload in packet.overloads()}
FRESH_MODULES = (nn.Embedding, nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.LayerNorm,
                 nn.GroupNorm, nn.Upsample, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                 nn.modules.pooling._AdaptiveAvgPoolNd, nn.Softmax, nn.LogSoftmax,
                 FusedKernel)   # modules whose output is new memory (fxfuse's kernels: fused, GEMM, MLP)
FRESH_METHODS = {"matmul", "mm", "bmm", "softmax", "log_softmax", "clone", "new_zeros", "new_ones", "new_full",
                 "new_empty", "roll"}
# reductions, scans, gathers and copies (fuzz35b: an MoE router's `w /= w.sum(-1, keepdim=True)` after topk, BitNet's
# `x.abs().max(-1).values.clamp_(...)`: the write was kept as if into an input, the chain split, the CUDA graph off)
FRESH_REDUCTIONS = ("sum", "mean", "norm", "amax", "amin", "cumsum", "cumprod", "gather", "index_select", "std", "var",
                    "logsumexp", "prod", "repeat_interleave", "flip", "tril", "triu", "diff", "outer")
FRESH_TUPLES = ("topk", "sort", "max", "min", "median", "kthvalue", "cummax", "cummin", "mode")   # (values, indices)
FRESH_FUNCTIONS |= {f for name in FRESH_REDUCTIONS + FRESH_TUPLES if (f := getattr(torch, name, None)) is not None}
FRESH_FUNCTIONS |= {F.normalize, torch.linalg.vector_norm} | ({F.rms_norm} if hasattr(F, "rms_norm") else set())
FRESH_METHODS |= set(FRESH_REDUCTIONS + FRESH_TUPLES) | {"repeat"}
FRESH_FUNCTIONS |= {getattr(packet, overload) for name in FRESH_REDUCTIONS + FRESH_TUPLES + ("linalg_vector_norm", "index")
                    if (packet := getattr(aten, name, None)) is not None
                    for overload in packet.overloads()
                    if not getattr(packet, overload)._schema.is_mutable}   # export's; no out= forms (fuzz35e)

# fuzz38d: after a write into a fresh buffer (an FNO's `out_ft[..., :m] = ...`, a GCN's `index_add_`), the results of
# these were counted as possible aliases of it, and the pointwise ops reading them stayed unfused
NEW_RESULTS = ("where", "masked_fill", "nan_to_num", "atan2", "remainder", "fmod", "cdist", "index_add", "scatter_add",
               "scatter", "index_copy", "index_fill", "tensordot", "glu", "one_hot", "im2col", "col2im",
               "constant_pad_nd", "embedding_bag", "batch_norm")
FFT = ("fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2", "fftn", "ifftn", "rfftn", "irfftn", "hfft",
       "ihfft")
FRESH_FUNCTIONS |= {f for name in NEW_RESULTS if (f := getattr(torch, name, None)) is not None}
FRESH_FUNCTIONS |= {F.pad, F.one_hot, F.glu, F.unfold, F.fold, F.embedding_bag, F.batch_norm}
FRESH_FUNCTIONS |= {getattr(torch.fft, name) for name in FFT}
FRESH_METHODS |= {name for name in NEW_RESULTS if hasattr(torch.Tensor, name)}
FRESH_FUNCTIONS |= {getattr(packet, overload) for name in NEW_RESULTS + tuple(f"fft_{n}" for n in FFT) + (
                        "_fft_r2c", "_fft_c2r", "_fft_c2c", "_cdist_forward")
                    if (packet := getattr(aten, name, None)) is not None
                    for overload in packet.overloads()
                    if not getattr(packet, overload)._schema.is_mutable}


def copying_contiguous(node) -> bool:
    """`h.contiguous()` of an h that is not contiguous (in the eager program's layouts, which the guards
    pin): a copy, new memory (fuzz49b: TCN's Chomp1d `x[:, :, :-pad].contiguous()` then ReLU(inplace=True)
    fused nothing). Of a contiguous h it is h itself."""
    if node.op != "call_method" or node.target != "contiguous" or len(node.args) != 1 \
            or any(k != "memory_format" or v is not torch.contiguous_format for k, v in node.kwargs.items()):
        return False
    src = single_tensor_meta(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
    return src is not None and not torch_contiguous(src.shape, src.stride)


def part_of_fresh_tuple(node) -> bool:
    """`x.topk(k)[0]`, `x.max(-1).values`: a part of what a (values, indices) op returned."""
    if node.op != "call_function" or node.target not in (operator.getitem, getattr) or len(node.args) < 2:
        return False
    src = node.args[0]
    meta = src.meta.get("tensor_meta") if isinstance(src, torch.fx.Node) else None
    if not isinstance(meta, (tuple, list)) or hasattr(meta, "shape") \
            or src.kwargs.get("out") is not None:   # (a TensorMetadata is a namedtuple: one tensor)   # torch.max(a, b)[0] is row 0 of a tensor: a view (review35b)
        return False
    packet = getattr(getattr(src, "target", None), "overloadpacket", None)   # export's aten.topk.default
    return (src.target in FRESH_TUPLES + tuple(
        getattr(torch, t) for t in FRESH_TUPLES) or getattr(packet, "__name__", None) in FRESH_TUPLES) and (
        node.target is operator.getitem or node.args[1] in ("values", "indices")) and not any(
        u is not node and _tuple_part(u) == _tuple_part(node) for u in src.users)   # (review46i: `r[0]` read
    #                                                                         twice is one tensor, written through either)


def _tuple_part(node):
    """0 or 1 for a read of a (values, indices) result's part (`r[0]`, `r.values`), else None."""
    if node.op != "call_function" or node.target not in (operator.getitem, getattr) or len(node.args) < 2:
        return None
    return {0: 0, 1: 1, -2: 0, -1: 1, "values": 0, "indices": 1}.get(node.args[1]) \
        if isinstance(node.args[1], (int, str)) else None


def advanced_index(node) -> bool:
    """`r[idx]` with a tensor (or list) index: a gather, always a copy (fuzz35b: PyG's gcn_norm)."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) < 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return any(isinstance(i, list) and all(type(v) in (int, bool) for v in i)   # [0, slice(None)]: a view
               or isinstance(i, torch.fx.Node) and len(getattr(i.meta.get("tensor_meta"), "shape", ())) > 0
               for i in index)   # a 0-d integer tensor indexes as a number does: a view (review35c)


WHOLE_VIEWS = {"view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "unsqueeze", "squeeze",
               "flatten", "unflatten", "movedim", "moveaxis", "swapaxes", "swapdims", "T", "mT"}


def whole_view_of_fresh(node, produces_fresh_tensor) -> bool:
    """node views all of a fresh tensor nothing else reads (ConvNeXt's layer scale `y = fc(h).permute(0, 3,
    1, 2); y.mul_(gamma); y += x`: fuzz46a, no kernel at all): a write into it reaches no other reader, so
    it reads as a fresh tensor in the view's layout. `produces_fresh_tensor`: normalize's test of fresh memory."""
    src = node.args[0] if (_view_name(node) in WHOLE_VIEWS or _unit_index(node)) and node.args \
        and isinstance(node.args[0], torch.fx.Node) else None
    src_meta, meta = single_tensor_meta(src), single_tensor_meta(node)
    return src_meta is not None and meta is not None and set(src.users) == {node} \
        and (produces_fresh_tensor(src) or whole_view_of_fresh(src, produces_fresh_tensor)) \
        and src_meta.dtype == meta.dtype and src_meta.shape.numel() == meta.shape.numel()   # (a view of a whole
    #                                                                                   view too: fuzz46j)


PART_NAMES = {"chunk", "split", "unbind", "split_with_sizes"}   # parts that never overlap (tensor_split's indices
#                                                                    may go back: `[5, 2]`, review49r1)


def disjoint_part_of_fresh(node, produces_fresh_tensor) -> bool:
    """node is one part (`a` of `a, b = fc(x).chunk(2, -1)`) of a fresh tensor read only by the split, whose
    parts are read by one getitem each: their memory does not overlap, so a write into this part reaches
    no other reader (fuzz49k: SwiGLU's `nn.SiLU(inplace=True)(a) * b` fused nothing)."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2 \
            or type(node.args[1]) is not int or not isinstance(node.args[0], torch.fx.Node):
        return False
    parts = node.args[0]
    count = len(parts.meta.get("tensor_meta") or ()) if isinstance(parts.meta.get("tensor_meta"), (tuple, list)) else 0
    src = parts.args[0] if parts.args else None
    if _view_name(parts) not in PART_NAMES or not count or not isinstance(src, torch.fx.Node) \
            or set(src.users) != {parts} or not (produces_fresh_tensor(src) or whole_view_of_fresh(src, produces_fresh_tensor)):
        return False
    readers = list(parts.users)
    indices = [u.args[1] % count for u in readers if u.op == "call_function" and u.target is operator.getitem
               and len(u.args) == 2 and type(u.args[1]) is int]
    return len(indices) == len(readers) and len(set(indices)) == len(indices) \
        and not _returned_as_view(node)   # written, then returned: eager's view's strides (review49r1, review49r3)


def _returned_as_view(node, depth: int = 0) -> bool:
    """Whether the graph returns node, or a view of it or of a write into it (`a.relu_()[None]`, `a.T.T`)."""
    from fxfuse.state_writes import VIEW_FUNCTIONS, VIEW_METHODS, _writes_in_place
    for u in node.users:
        if u.op == "output":
            return True
        alias = _writes_in_place(u) is node or u.op == "call_module" and u.args and u.args[0] is node and getattr(
            u.graph.owning_module.get_submodule(u.target), "inplace", False) is True \
            or u.args and u.args[0] is node and (u.op == "call_method" and u.target in VIEW_METHODS | WHOLE_VIEWS
                                                 or u.op == "call_function" and u.target in VIEW_FUNCTIONS
                                                 or u.target is getattr)
        if alias and (depth >= 16 or _returned_as_view(u, depth + 1)):
            return True
    return False


def _view_name(node):
    """The name of the view node takes: `y.permute(..)`, `torch.permute(y, ..)`, `y.T` (review46i); else None."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    if node.target is getattr and len(node.args) == 2:
        return node.args[1]
    if isinstance(node.target, torch._ops.OpOverload):   # torch.export's aten.view.default (fuzz48g)
        return node.target.overloadpacket.__name__
    name = getattr(node.target, "__name__", "")
    return name if getattr(torch, name, None) is node.target else None


def _unit_index(node) -> bool:
    """`y[None]`, `y[:, None]`, `t[0]` of a size-1 dim: an index that adds or drops size-1 dims only."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    meta = single_tensor_meta(node.args[0])
    dims = [i for i in index if i is not None]
    if meta is None or Ellipsis in dims or len(dims) > len(meta.shape):
        return False
    return all(i == slice(None) or type(i) is int and i in (0, -1) and meta.shape[k] == 1 for k, i in enumerate(dims))
