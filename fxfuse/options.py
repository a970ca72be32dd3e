"""Options of fxfuse.optimize, one frozen dataclass so a specialization can record what built it."""
import math
import numbers
import os
from dataclasses import dataclass, fields, replace

from .errors import OptionError


MODES = ("off", "auto", "force")   # strassen, gemm, fused_mlp, tf32x3: never, where the cost model says, always
MAX_STRASSEN_LEVELS = 3


@dataclass(frozen=True)
class Options:
    strict: bool = False
    """Raise FxfuseError subclasses instead of falling back to the original module with a warning."""
    fuse: bool = True
    """Fuse pointwise ops into generated Triton kernels (off: only normalize and the runtime; no
    generated GEMM, fused MLP or Strassen kernels either, so a "force" of those is refused)."""
    cuda_graphs: bool = True
    """On CUDA, capture each specialization once in a CUDA graph and replay it."""
    max_specializations: int = 8
    """How many input signatures (shape, dtype, device, strides, grad mode) get their own build."""
    verify: bool = True
    """Check each new specialization against the original module on the input it was built from."""
    use_kernels: bool | None = None
    """Run the generated Triton kernels (None: when CUDA or TRITON_INTERPRET=1 is available)."""
    fused_mlp: str = "auto"
    """Chains of narrow Linear layers as one kernel: "auto" (where it pays), "force" (every legal chain), "off"."""
    gemm: str = "auto"
    """A Linear and the pointwise ops after it as one generated Triton GEMM: "auto" (where it pays), "force", "off"."""
    strassen: str = "off"
    """Asymmetric fused Strassen for large Linear layers: "off", "auto" (where it pays), "force" (every legal layer)."""
    strassen_levels: int | None = None
    """Strassen recursion levels per rewritten Linear (7^L products of (1/2^L)-size blocks): with
    strassen="auto" the most the cost model may choose per layer, with "force" the levels used.
    None: 2 with "auto" (every layer gets 0, 1 or 2, each checked against `tolerance`), else 1.
    The default was 1 for both, so `strassen="auto"` alone never took the 2-level plans that
    won the large cells (8 x 8192 at batch 4096, H100: 67.3 ms against 76.3 with one level)."""
    tf32x3: str = "off"
    """fp32 GEMMs on tensor cores as three TF32 products (3xTF32, fxfuse/tf32x3.py): "off", "auto"
    (where the cost model measured it faster), "force" (every generated fp32 GEMM past 16 rows
    and every Strassen product call; fused MLPs, the row-wise GEMV at <= 16 rows and layers left
    to cuBLAS stay IEEE). From 256 rows a GEMM keeps W's two TF32 parts: twice W's memory. Not IEEE
    fp32, but as close: H100, random data, 1.5-3.2e-7 relative error against float64 where
    cuBLAS fp32 gave 1.1e-7 to 1.6e-6, at 78 TFLOP/s against 51.6. Each layer is checked on
    the example input against `tolerance`, like Strassen. Ignored where TF32 is allowed (the
    generated GEMMs then run plain TF32) and for fp16/bf16."""
    calibration: str | None = None
    """Cost-model calibration file (from `python -m benchmarks.autotune`); None: $FXFUSE_CALIBRATION,
    else the shipped file for this GPU, else the roofline."""
    tolerance: float | None = None
    """Relative error (Frobenius, vs float64) a Strassen or tf32x3 layer may have on the example input
    (None: 3x the classical product's, at least 1e-5 fp32 / 1e-2 fp16, bf16)."""

    def __post_init__(self):
        if self.strassen_levels is None:   # (a str test first: a numpy array's == is no bool; fuzz45g)
            object.__setattr__(self, "strassen_levels", 2 if isinstance(self.strassen, str) and self.strassen == "auto"
                               else 1)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "Options":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise OptionError(f"unknown option(s) {unknown}; known options: {sorted(known)}")
        opts = cls(**_as_plain_values(kwargs))
        for name in ("strict", "fuse", "cuda_graphs", "verify"):
            if not isinstance(getattr(opts, name), bool):
                raise OptionError(f"option {name}={getattr(opts, name)!r}: expected True or False")
        if opts.use_kernels is not None and not isinstance(opts.use_kernels, bool):
            raise OptionError(f"option use_kernels={opts.use_kernels!r}: expected True, False or None")
        for name in ("max_specializations", "strassen_levels"):
            if type(getattr(opts, name)) is not int:
                raise OptionError(f"option {name}={getattr(opts, name)!r}: expected an integer")
        if opts.calibration is not None and not isinstance(opts.calibration, str):
            raise OptionError(f"option calibration={opts.calibration!r}: expected a file path or None")
        if opts.calibration is not None and not opts.calibration.strip():
            raise OptionError("option calibration='': expected a file path, or None for the default")
        if opts.max_specializations < 1:
            raise OptionError(f"option max_specializations={opts.max_specializations}: must be at least 1")
        for name in ("strassen", "gemm", "fused_mlp", "tf32x3"):
            if not isinstance(getattr(opts, name), str) or getattr(opts, name) not in MODES:
                raise OptionError(f"option {name}={getattr(opts, name)!r}; expected one of {MODES}")
        forced = [name for name in ("strassen", "gemm", "fused_mlp", "tf32x3") if getattr(opts, name) == "force"]
        if not opts.fuse and forced:   # (fuzz36e: gemm and fused_mlp were dropped in silence, Strassen was not)
            raise OptionError(f"fuse=False turns off every generated kernel and {forced[0]}='force' asks for "
                              "them: pass one or the other")
        if not 1 <= opts.strassen_levels <= MAX_STRASSEN_LEVELS:
            raise OptionError(f"strassen_levels must be 1..{MAX_STRASSEN_LEVELS}, got {opts.strassen_levels}")
        tol = opts.tolerance   # a negative or nan tolerance would silently reject (or accept) every layer
        if tol is not None and (type(tol) is not float or not math.isfinite(tol) or tol < 0):
            raise OptionError(f"option tolerance={kwargs['tolerance']!r}: expected a finite number >= 0 (a relative "
                              "error), or None")
        return opts

    def with_(self, **kwargs) -> "Options":
        return replace(self, **kwargs)


def _as_plain_values(kwargs: dict) -> dict:
    """numpy's and other numbers as Python's (`max_specializations=np.int64(2)`, `tolerance=np.float32(1e-3)`:
    refused, where np.float64 passed as a float subclass; fuzz45g), a path-like calibration as its str
    (`os.fspath`, not `str()`, which is the path only for pathlib's). Values of other kinds stay, for
    from_kwargs to name in its error."""
    plain = dict(kwargs)
    for name in ("max_specializations", "strassen_levels"):
        value = plain.get(name)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            plain[name] = int(value)
    tol = plain.get("tolerance")
    if isinstance(tol, numbers.Real) and not isinstance(tol, bool):
        try:
            plain["tolerance"] = float(tol)
        except OverflowError:   # tolerance=10**400: refused as not finite
            plain["tolerance"] = math.inf
    if isinstance(plain.get("calibration"), os.PathLike):
        try:
            plain["calibration"] = os.fsdecode(plain["calibration"])
        except TypeError:   # an __fspath__ that returns no path: refused as no path
            pass
    return plain

