"""FusedKernel: the module a fused group becomes in the rewritten graph.

It owns the group's KernelIR, its generated Triton source and a reference GraphModule made of
the group's original (canonical) torch ops. forward() launches the kernel when it can and the
inputs are exactly what the kernel was built for; otherwise it runs the reference, so a
kernel never sees shapes, strides or dtypes it was not generated for.
"""
import contextlib
import threading
import types

import torch
import torch.fx

from .codegen import block_size, generate, num_warps, streams
from .env import env_flag
from .ir import KernelIR
from .kernel_cache import default_cache


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: the same reading of TRITON_INTERPRET as
    Triton's (TRITON_INTERPRET=false once counted as on here, and CPU builds failed inside Triton)."""
    return env_flag("TRITON_INTERPRET", False)


BF16_INTERPRETED = ("bf16 products come out wrong in Triton's interpreter (TRITON_INTERPRET=1, "
                    "triton-lang/triton#11584): the library computes this one")   # why_not_gemm, why_not_kernel

GRID_YZ_MAX = 65535   # CUDA's gridDim.y and gridDim.z (x goes to 2**31 - 1): why_not_gemm
INT32_INDEX_MAX = 2 ** 31 - 1   # row indices the GEMM and MLP kernels compute in int32 (pid * BLOCK_M + arange)

PDL_ENABLED = env_flag("FXFUSE_PDL", True)   # escape hatch; the benchmarks' A/B switch
_pdl_devices: dict = {}


def launch_context(device: torch.device):
    """Around a kernel launch: the kernel's device on CUDA. Under the interpreter (CPU), numpy
    quiet: the kernel evaluates its expression on masked-out lanes too (loaded as 0), where
    x ** 5 or 1 / x divide by zero, and numpy would warn on every call although no stored value
    is affected; and one launch at a time: Triton's interpreter is not thread-safe (kernels
    called from two threads fail with "Did you forget to add @triton.jit ?")."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return _interpreted_launch()


_INTERPRETER_LOCK = threading.RLock()


@contextlib.contextmanager
def _interpreted_launch():
    import numpy   # the interpreter's own dependency
    with _INTERPRETER_LOCK, numpy.errstate(all="ignore"):
        yield


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and newer, compiled kernels only): a kernel
    launched with it may start while the previous kernel of the stream finishes; it reads
    its constant weights, then waits (gdc_wait) before touching anything that kernel wrote.
    Saves the ~1 us gap between kernels in a CUDA graph and overlaps the weight reads."""
    if not PDL_ENABLED or device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pdl_devices:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            supported = "launch_pdl" in CUDAOptions.__dataclass_fields__
        except Exception:  # noqa: BLE001 -- another backend or an older Triton: no PDL
            supported = False
        _pdl_devices[index] = supported and torch.cuda.get_device_capability(index)[0] >= 9
    return _pdl_devices[index]


def kernels_available(device: torch.device) -> bool:
    """Generated kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    if device.type == "cuda":
        return not interpreting()
    return device.type == "cpu" and interpreting()


def resolved(inputs) -> tuple:
    """Inputs with a pending negation or conjugation (`torch._neg_view`, `z.conj().imag`: a flag
    over the same bytes) applied: a kernel reads the raw bytes, the flag would be lost."""
    if not any(isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj()) for t in inputs):
        return inputs
    return tuple(t.resolve_neg().resolve_conj() if isinstance(t, torch.Tensor) else t for t in inputs)


def _used_strides(shape, stride) -> tuple:
    return tuple(st for n, st in zip(shape, stride) if n != 1)


PRODUCT_FP_FUSION = types.MappingProxyType({"enable_fp_fusion": True})
"""Launch option of the product kernels (generated GEMM, fused MLP, tf32x3 bmm, the library
probe's sum): multiply-adds contract to FMA, as cuBLAS's do. Passed explicitly because Triton
3.9 warns once when the option is left unset and 3.10 turns the default off, which would make
every K step a separate multiply and add (slower, and rounded twice). Pointwise kernels pass
False instead (FusedKernel.forward says why)."""


class FusedKernel(torch.nn.Module):
    def __init__(self, ir: KernelIR, reference: torch.fx.GraphModule, input_meta: tuple,
                 members: tuple, use_kernel: bool = True, origin: str = "fuse_pointwise"):
        super().__init__()
        self.ir = ir
        self.reference = reference
        self.input_meta = input_meta      # (shape, stride, dtype) the kernel was built for, per input
        self.members = members            # readable description of the fused nodes
        self.origin = origin              # the pass that built this kernel
        self.use_kernel = use_kernel
        self.source, self.kernel_name = generate(ir)
        width = streams(ir)
        self.launch_config = (block_size(ir.numel, width), num_warps(block_size(ir.numel, width), width))
        self._kernel = None
        self.launches = 0                 # kernel launches so far (tests assert the fast path ran)
        self.fallbacks = 0

    def _matches(self, inputs) -> bool:
        """Whether the inputs are what the kernel was built for. A stride of a dimension of size
        1 is never used (its index is 0): a batch-1 row of a padded Strassen output has stride
        (16, 1) where the meta says (15, 1), and ran the torch reference on every call."""
        for t, (shape, stride, dtype) in zip(inputs, self.input_meta):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                return False
            if t.numel() > 1 and _used_strides(shape, t.stride()) != _used_strides(shape, stride):
                return False
        return len(inputs) == len(self.input_meta)

    def compiled(self):
        if self._kernel is None:
            self._kernel = default_cache().load(self.source, self.kernel_name)
        return self._kernel

    def forward(self, *inputs):
        inputs = resolved(inputs)
        device = inputs[0].device if inputs and isinstance(inputs[0], torch.Tensor) else None
        if not (self.use_kernel and device is not None and kernels_available(device)
                and self._matches(inputs)
                and all(t.device == device for t in inputs)):
            self.fallbacks += 1
            return self._in_kernel_layout(self.reference.forward(*inputs))   # (torch.fx's __call__ prints a
            #                                                                   traceback on errors)
        outs = [torch.empty(o.shape, dtype=o.dtype, device=device) if o.strides is None else
                torch.empty_strided(o.shape, o.strides, dtype=o.dtype, device=device) for o in self.ir.outputs]
        numel = self.ir.numel
        block, warps = self.launch_config
        grid = (triton_cdiv(numel, block),)
        # no FMA contraction: eager rounds x * y to fp16 before adding z, and an fma across the
        # kernel's cast would not (1 ulp off on the H100); in fp32 eager does not contract either
        with launch_context(device):
            self.compiled()[grid](*inputs, *outs, BLOCK=block, num_warps=warps, enable_fp_fusion=False)
        self.launches += 1
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _in_kernel_layout(self, result):
        """The reference's outputs with the strides the kernel writes (eager's, from the meta):
        the torch ops lay a result out after their operands, and an operand passes may have made
        non-contiguous (hoist_permutes drops a `.contiguous()` before pointwise readers)."""
        outs = result if isinstance(result, tuple) else (result,)
        if len(outs) != len(self.ir.outputs):
            return result
        laid = tuple(t if o.strides is None or not isinstance(t, torch.Tensor) or t.shape != tuple(o.shape)
                     or _used_strides(o.shape, t.stride()) == _used_strides(o.shape, o.strides)
                     else torch.empty_strided(o.shape, o.strides, dtype=t.dtype, device=t.device).copy_(t)
                     for t, o in zip(outs, self.ir.outputs))
        return laid if isinstance(result, tuple) else laid[0]

    def extra_repr(self) -> str:
        return f"kernel={self.kernel_name}, shape={list(self.ir.shape)}, members={list(self.members)}"


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
