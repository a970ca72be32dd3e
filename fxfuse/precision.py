"""What torch's fp32 precision settings allow, read so that neither of torch's two APIs breaks it.

Why: torch 2.9 added `torch.backends.{cuda.matmul,cudnn.conv}.fp32_precision` ("ieee" / "tf32",
"none" meaning inherited) beside the legacy `allow_tf32` switches, and once a program sets the
new one, reading a legacy getter raises RuntimeError ("mix of the legacy and new APIs"). The new
getter reflects the legacy setters and `torch.set_float32_matmul_precision` too, so it is read
first; the legacy one only where the new one does not exist.
"""
import torch

_NEW_GETTER = getattr(torch._C, "_get_fp32_precision_getter", None)


def _setting(backend: str, op: str, legacy) -> object:
    if _NEW_GETTER is not None:
        try:
            return _NEW_GETTER(backend, op)
        except RuntimeError:   # a backend this torch does not know (checked once per call: keep it rare)
            return None
    try:
        return legacy()
    except (AttributeError, RuntimeError):
        return None


def _matmul() -> object:
    return _setting("cuda", "matmul", lambda: torch._C._get_cublas_allow_tf32())


def matmul_allows_tf32() -> bool:
    """Whether fp32 matmuls may run in TF32 (the generated GEMMs and fused MLPs follow it)."""
    return _matmul() in ("tf32", True)


def _unknown() -> None:
    return None


# cuBLAS's reduced-precision reductions of fp16 / bf16 matmuls: the library kernels a CUDA graph
# captured follow them as they were (review38). Not cuDNN on/off: code that runs parts of a model
# under torch.backends.cudnn.flags(enabled=False) rebuilt every specialization on every call (review38b)
_HALF_REDUCTION = getattr(torch._C, "_get_cublas_allow_fp16_reduced_precision_reduction", _unknown)
_BF16_REDUCTION = getattr(torch._C, "_get_cublas_allow_bf16_reduced_precision_reduction", _unknown)
_HALF_ACCUMULATION = getattr(torch._C, "_get_cublas_allow_fp16_accumulation", _unknown)   # fp16 sums (review39b)


def baked_settings() -> tuple:
    """The process-wide settings a build bakes in (runtime: a change rebuilds): the default
    dtype (`torch.ones(3)`, `int * 0.1`), the fp32 precision of matmuls and convolutions
    (kernel precision; cuBLAS's and cuDNN's choice captured in a CUDA graph), and the library
    switches after them."""
    return (torch.get_default_dtype(), _matmul(),
            _setting("cuda", "conv", lambda: torch._C._get_cudnn_allow_tf32()),   # cuDNN's: torch.backends.cudnn.conv
            _HALF_REDUCTION(), _BF16_REDUCTION(), _HALF_ACCUMULATION(), _default_device() if _FUNCTION_MODES() else None)


_FUNCTION_MODES = getattr(torch._C, "_len_torch_function_stack", lambda: 0)


def _default_device():
    """The device of `with torch.device(...)` / torch.set_default_device (a TorchFunctionMode that
    places factories without device=, which a build folds: fuzz41c), or None."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    device = next((m.device for m in reversed(_get_current_function_mode_stack()) if isinstance(m, DeviceContext)),
                  None)   # None: as without a context; the CPU's context is no change either (review41)
    return None if device is None or torch.device(device).type == "cpu" else str(torch.device(device))


if _NEW_GETTER is not None:   # the per-call check without a frame and a tuple per setting
    def settings_changed(saved: tuple) -> bool:
        """Whether baked_settings() differs from `saved` (runtime: every call)."""
        return (torch.get_default_dtype() is not saved[0] or _NEW_GETTER("cuda", "matmul") != saved[1]
                or _NEW_GETTER("cuda", "conv") != saved[2] or _HALF_REDUCTION() != saved[3]
                or _BF16_REDUCTION() != saved[4] or _HALF_ACCUMULATION() != saved[5]
                or (_default_device() if _FUNCTION_MODES() else None) != saved[6])
else:
    def settings_changed(saved: tuple) -> bool:
        return baked_settings() != saved
