"""3xTF32: fp32 matrix products on tensor cores, and the numerics guard that admits them.

Why (option tf32x3): with TF32 off, fp32 GEMMs run on the CUDA cores: cuBLAS at 51.6 TFLOP/s
on the H100 and Triton's "ieee" tl.dot at about a third of that. Triton's
`tl.dot(..., input_precision="tf32x3")` splits each fp32 operand a into a TF32 high part
hi = rna(a) (round to 10 stored mantissa bits) and a low part lo = a - hi, and sums three
tensor-core products, lo*hi + hi*lo + hi*hi, accumulating in fp32 (the lo*lo term is below
fp32's rounding). About 21 of fp32's 24 mantissa bits survive the split, so the product's
error stays at fp32's level: on the H100 (benchmarks/tf32x3_probe.py, relu(x @ W.T + b),
random normal data) 1.5-3.2e-7 relative to a float64 product where cuBLAS fp32 measured
1.1e-7 to 1.6e-6, at 78 TFLOP/s against cuBLAS's 51.6. It is still not IEEE fp32
(a different rounding, like any other summation order, and Strassen), so it is opt-in, and
each layer is checked on the example input like a Strassen layer: its error against float64
must stay within `tolerance` (default: 3x the classical product's, at least 1e-5).

The guard emulates the kernel with torch: the same split (hi rounded to nearest, ties away
from zero, as cvt.rna.tf32.f32; lo truncated to TF32 as the tensor core reads it) and three
fp32 products of the parts, whose elementwise products are exact in fp32 (11 x 11 bits). Only
the order of the fp32 additions differs from the tensor core's.
"""
import torch

from .strassen_tables import relative_error

TF32_DROPPED_BITS = 13        # fp32 has 23 stored mantissa bits, TF32 10


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value (ties away from zero), still stored as fp32; inf and nan
    stay as they are (a finite value next to the largest fp32 may round to inf, as on the GPU)."""
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + (1 << (TF32_DROPPED_BITS - 1))) & ~((1 << TF32_DROPPED_BITS) - 1)
    return torch.where(torch.isfinite(t), rounded.view(torch.float32), t)


def truncate_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """What a TF32 tensor-core input keeps of an fp32 value: the top 10 stored mantissa bits."""
    return (t.contiguous().view(torch.int32) & ~((1 << TF32_DROPPED_BITS) - 1)).view(torch.float32)


def split_tf32(t: torch.Tensor) -> tuple:
    """(hi, lo): hi = round_to_tf32(t), lo = t - hi as the tensor core reads it (0 where t is
    not finite: Triton masks the NaN the low products would give there)."""
    hi = round_to_tf32(t)
    lo = torch.where(torch.isfinite(t), truncate_to_tf32(t - hi), torch.zeros_like(t))
    return hi, lo


def tf32x3_linear(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2d @ weight.T as the tf32x3 kernel computes it (fp32 in, fp32 out), emulated in IEEE fp32."""
    xh, xl = split_tf32(x2d.float())
    wh, wl = split_tf32(weight.float())
    mm = torch.nn.functional.linear
    return (mm(xl, wh) + mm(xh, wl)) + mm(xh, wh)


def measure_tf32x3(x2d: torch.Tensor, weight: torch.Tensor, tolerance=None, factor: float = 3.0,
                   floor: float = 1e-5) -> dict:
    """The numerics guard of one fp32 Linear on one input: {ok, error, classical_error, tolerance}
    with errors relative to a float64 product (Frobenius), the tolerance as for Strassen."""
    ref64 = x2d.double() @ weight.double().t()
    classical = relative_error(torch.nn.functional.linear(x2d, weight), ref64)
    tol = tolerance if tolerance is not None else max(factor * classical, floor)
    err = relative_error(tf32x3_linear(x2d, weight), ref64)
    return {"ok": err <= tol, "error": err, "classical_error": classical, "tolerance": tol}
