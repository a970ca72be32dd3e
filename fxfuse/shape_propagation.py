"""Shape propagation: each node of a traced graph run once on copies of the example input, its
result's TensorMetadata (or plain value: a size, a dim) recorded in the node's meta. The passes
read shapes, strides and dtypes from there; tracing.py re-exports these names."""

import torch
import torch.fx
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import TensorMetadata

from .data_dependent import mark_data_dependent_shapes
from .log import quiet_this_thread
from .node_meta import fxfuse_meta


_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def tensor_metadata(t: torch.Tensor) -> TensorMetadata:
    """ShapeProp's TensorMetadata of a tensor (real or meta). Its own _extract_tensor_metadata checks
    memory formats through torch._check, which imports symbolic_shapes and sympy."""
    memory_format, strided = None, t.layout == torch.strided   # sparse COO/CSR/...: no strides
    if strided:
        memory_format = next((f for f in _MEMORY_FORMATS
                              if (f != torch.channels_last or t.dim() == 4)
                              and (f != torch.channels_last_3d or t.dim() == 5)
                              and t.is_contiguous(memory_format=f)), None)
    qparams = {}
    if t.is_quantized and t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        qparams = {"qscheme": t.qscheme(), "scale": t.q_scale(), "zero_point": t.q_zero_point()}
    elif t.is_quantized:
        qparams = {"qscheme": t.qscheme(), "scale": t.q_per_channel_scales().tolist(),
                   "zero_point": t.q_per_channel_zero_points().tolist(), "axis": t.q_per_channel_axis()}
    return TensorMetadata(t.shape, t.dtype, t.requires_grad, t.stride() if strided else (),
                          memory_format, t.is_quantized, qparams)


class ShapePropagation(torch.fx.Interpreter):
    """torch.fx's ShapeProp on real example tensors (node.meta["tensor_meta"] and ["type"]),
    plus non-tensor results (sizes, dims) under meta['fxfuse']['value'].

    Not ShapeProp itself: its run_node imports torch.fx.experimental.symbolic_shapes and so
    sympy (for fake-tensor modes fxfuse never uses), 0.3 s here and 2 s on the H100 host the
    first time in a process; and it prints the failing node's traceback to stderr."""

    def run_node(self, n):
        try:
            result = super().run_node(n)
        except Exception as e:
            raise ShapePropagationError(f"running node {n.name} ({n.format_node()}) on the example input "
                                        f"failed") from e
        found_tensor = False

        def extract(obj):
            nonlocal found_tensor
            if isinstance(obj, torch.Tensor):
                found_tensor = True
                return tensor_metadata(obj)
            return obj

        meta = map_aggregate(result, extract)
        if found_tensor:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = type(result)
        if isinstance(result, torch.Tensor):
            fxfuse_meta(n)["device"] = result.device
        elif _is_plain_value(result):
            fxfuse_meta(n)["value"] = result
        return result

    def propagate(self, *args):
        return self.run(*args)


def _is_plain_value(v) -> bool:
    if isinstance(v, (bool, int, float, torch.dtype, torch.device, torch.Size)):
        return True
    if isinstance(v, (tuple, list)):
        return all(_is_plain_value(x) for x in v)
    return False


def like_the_callers(copy: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A copy of input `a` as forward() sees `a`: an nn.Parameter if it is one (`isinstance(x, nn.Parameter)`),
    with the Python attributes set on it (`x.scale`). fuzz49j: the trace and verify's runs saw copies without
    them and agreed on a wrong answer."""
    if type(a) is torch.nn.Parameter:
        copy = torch.nn.Parameter(copy, requires_grad=a.requires_grad)
    copy.__dict__.update({k: v.detach().clone() if isinstance(v, torch.Tensor) else v   # (written by forward():
                          for k, v in a.__dict__.items()})   # the build's runs must leave the caller's alone)
    return copy


def clone_args(args) -> tuple:
    """Copies of the tensor arguments with the same strides and storage offset (other values as
    they are). Running a graph executes the model's in-place ops (`x.add_(1)` on an input), so
    fxfuse runs graphs on copies: optimize() must not change the user's example input."""
    copies = {}   # one copy per tensor object: `f(a, a)` stays the same tensor twice (`key is query`)

    def clone(a):
        if not isinstance(a, torch.Tensor):
            return a
        if id(a) not in copies:
            storage = a.untyped_storage().clone()
            copies[id(a)] = like_the_callers(torch.empty(0, dtype=a.dtype, device=a.device).set_(
                storage, a.storage_offset(), a.shape, a.stride()), a)
        return copies[id(a)]
    return tuple(clone(a) for a in args)


def propagate_shapes(gm: torch.fx.GraphModule, example_args: tuple) -> None:
    # the model's own code may print while it runs; the error fxfuse raises (or warns with)
    # carries the reason, so nothing is printed
    with torch.no_grad(), quiet_this_thread(stdout=False):
        ShapePropagation(gm).propagate(*clone_args(example_args))
    mark_data_dependent_shapes(gm)


class ShapePropagationError(RuntimeError):
    """The traced graph failed on the example input (the model's own error is its cause)."""
