"""The fused MLP's description and the choices made for it: what a chain is (MLPSpec), how its
kernel is configured (KernelConfig, choose_config) and whether it can be built (why_not_kernel).

The pass (passes/fuse_mlp.py) describes the chain as an `MLPSpec`, a straight-line program over
*values* (value 0 is the input; every value is [rows, width]):
  Linear(out, src, weight)                -> out = src @ W.T        (fp32 accumulate)
  Pointwise(out, op, operands, params)    -> out = op(operands)     (fxfuse.ops expressions)
Operands of a pointwise step are earlier values (residuals included), numbers, or constant
vectors (a bias [N], or a scalar tensor). Triton cannot slice a register tensor, so a value
of width w is held as ceil(w / T) column tiles of T lanes (`tile_of`). mlp_codegen.py turns a
spec into Triton source; mlp_kernel.py packs the weights and launches it.
"""
from dataclasses import dataclass

import torch

from .kernel import BF16_INTERPRETED, INT32_INDEX_MAX, interpreting, triton_cdiv

MAX_WIDTH = 1024             # widest value a kernel may hold
MAX_TILE = 64                # lanes per column tile (128 past 512 lanes: at most 8 x 8 products)
MAX_DOTS = 1024              # unrolled tile products per kernel (tensor-core forms)
MAX_FMA_PER_THREAD = 1 << 17  # unrolled FMAs per thread (FMA forms): bounds code size
ROWWISE_MAX_BATCH = 512      # batch up to which one program per row wins (choose_config), fp32 IEEE
ROWWISE_TC_MAX_BATCH = 16    # the same where tl.dot runs on tensor cores (fp16, bf16, fp32 with TF32)
ROWWISE_MAX_TILE = 128       # lanes per column tile of the row-wise form: fewer, larger GEMV tiles
FMA_ONE_TILE = 128           # fp32 IEEE tl.dot (FMAs): values of 65-128 lanes as ONE tile, 8 warps (choose_config)
PREFETCH_ELEMENTS = 64       # weight elements per thread of two Linears' tiles held at once (row-wise)
SMS = 132                    # H100 SXM; only used to judge when larger row tiles still fill the GPU
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Linear:
    out: int                 # value id it defines
    src: int                 # value id it reads ([rows, K])
    weight: int              # index into the weights list ([N, K], as nn.Linear stores it)


@dataclass(frozen=True)
class Pointwise:
    out: int
    op: str                  # key of fxfuse.ops.BY_NAME
    operands: tuple          # ("value", id) | ("number", x) | ("vector", index into vectors)
    params: tuple = ()       # sorted (name, value) pairs of the op's constant parameters


@dataclass(frozen=True)
class MLPSpec:
    widths: tuple            # width of every value; value 0 is the chain's input
    steps: tuple             # Linear / Pointwise in execution order; step k defines value k + 1
    output: int              # the value stored
    dtype: torch.dtype       # input, weight and output dtype

    @property
    def linears(self) -> list:
        return [s for s in self.steps if isinstance(s, Linear)]


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = 16        # rows per program
    rowwise: bool = False    # broadcast-multiply-reduce products, BLOCK_M 1 (else tl.dot)
    num_warps: int = 4
    max_tile: int = MAX_TILE
    precision: str = "ieee"  # fp32 tl.dot: "ieee" or "tf32"
    looped: bool = False     # identical layers as a runtime loop (tl.dot form; layer_period)


def tile_of(width: int, max_tile: int = MAX_TILE) -> tuple:
    """(T, n): a value of this width is held as n column tiles of T lanes.

    T is the next power of two >= 16 (tl.dot's minimum), capped at max_tile (at 128 past
    512 lanes); n * T covers the width with less padding than one power-of-two tile would
    (130 lanes: 3 x 64, not 256).
    """
    p = max(16, 1 << (max(width, 1) - 1).bit_length())
    t = min(p, max_tile if p <= 512 else max(max_tile, 128))
    return t, triton_cdiv(width, t)


def layer_period(spec: MLPSpec, numels: tuple) -> tuple | None:
    """(prefix, period) if the chain is `prefix` pointwise steps and then the same layer of
    `period` steps repeated, else None.

    The prefix is what passes/fuse_mlp absorbs before the first Linear (the previous layer's
    bias and activation). Same layer: every value has one width; layer g's steps are layer 0's
    with value ids moved by g * period, weight g, and constant vectors moved by g * (vectors per
    layer), of the same sizes (so the packed buffers are strided by layer); operands only refer
    to the layer's own input and values. Such a chain runs as a loop over layers
    (KernelConfig.looped): small code, and the compiler cannot hoist every layer's weight loads
    to the top as it does in the unrolled chain (8 x 128 fp32 at 1024 rows: 396 us unrolled,
    24.5 looped)."""
    layers = len(spec.linears)
    prefix = next((k for k, st in enumerate(spec.steps) if isinstance(st, Linear)), 0)
    body = len(spec.steps) - prefix
    if layers < 2 or body % layers or len(set(spec.widths)) != 1 or spec.output != len(spec.steps):
        return None
    period = body // layers
    prefix_vectors = vectors_before(spec, prefix)
    per_layer_vectors, remainder = divmod(len(numels) - prefix_vectors, layers)
    if remainder:
        return None

    def shifted(step, g):
        """layer g's step as layer 0's would read, or None if it reaches outside its layer."""
        base, vbase = prefix + g * period, prefix_vectors + g * per_layer_vectors
        if isinstance(step, Linear):
            return Linear(step.out - base, step.src - base, step.weight - g) if step.src == base else None
        operands = []
        for kind, ref in step.operands:
            if kind == "value":
                if not base <= ref <= step.out - 1:
                    return None
                ref -= base
            elif kind == "vector":
                if not vbase <= ref < vbase + per_layer_vectors or numels[ref] != numels[ref - vbase + prefix_vectors]:
                    return None
                ref -= vbase
            elif kind == "number":
                ref = repr(ref)        # by spelling: 0.0 and -0.0 (or 1 and True) are different literals
            operands.append((kind, ref))
        return Pointwise(step.out - base, step.op, tuple(operands), tuple((k, repr(v)) for k, v in step.params))

    first = tuple(shifted(st, 0) for st in spec.steps[prefix:prefix + period])
    if None in first or any(isinstance(st, Linear) for st in first[1:]):
        return None
    for g in range(1, layers):
        if tuple(shifted(st, g) for st in spec.steps[prefix + g * period:prefix + (g + 1) * period]) != first:
            return None
    return prefix, period


def vectors_before(spec: MLPSpec, step: int) -> int:
    """How many constant vectors the steps before `step` read: _lower numbers vectors in the
    order the steps use them, so layer_period's layers read theirs from this index on."""
    return len({ref for st in spec.steps[:step] for kind, ref in st.operands if kind == "vector"})


def _padded_kn(spec: MLPSpec, max_tile: int) -> list:
    out = []
    for s in spec.linears:
        (tk, nk), (tn, nn) = tile_of(spec.widths[s.src], max_tile), tile_of(spec.widths[s.out], max_tile)
        out.append((tk * nk, tn * nn, nk * nn))
    return out


def choose_config(spec: MLPSpec, batch: int, allow_tf32: bool = False, numels: tuple | None = None,
                  **override) -> KernelConfig:
    """The kernel configuration for a batch: one place, kept apart from correctness.

    Row-wise up to ROWWISE_MAX_BATCH rows (ROWWISE_TC_MAX_BATCH where tl.dot has tensor cores),
    with tiles of up to ROWWISE_MAX_TILE lanes; else
    tl.dot with 16 rows per program, or 32/64 where the batch still gives every SM two programs
    and a value stays ~32 registers per thread (BLOCK_M * width <= 1024 * num_warps); row-wise
    also where tl.dot's unrolled code would exceed the budget (why_not_kernel). `override`
    sets fields (for the probe).

    Measured (H100, 8 x (Linear(w, w), ReLU) fp32, GPU us of the kernel in a CUDA graph against
    the per-layer plan's graph; mlp_probe sweeps, mlp_probe_20261124.txt): width 64, row-wise
    5.1 us at batch 1-64, 6.2 at 256 and 9.0 at 512 (plan 11-15, 32), tl.dot 11.1 at 256, 11.3
    at 512 and 11.6 at 1024 (row-wise 16.4, plan 41); width 128, row-wise in 128-lane tiles
    10.1-10.7 us at batch 1-64 and 15.3 at 256 (plan 11.2-13.3, 17.2; in 64-lane tiles 19.5 at
    batch 1), tl.dot 429 us at 64 and 256 rows (fp32 FMA code: the cost model's table keeps it
    from being chosen). On tensor cores (bf16, autotune mlp section) tl.dot is as fast at 1024
    rows as row-wise at 64 (width 128: 12.1 vs 11.4 us; 256: 36.5 vs 35.8) and 1.2-1.6x faster
    at 256 rows, so there row-wise serves up to ROWWISE_TC_MAX_BATCH rows only.
    fp32 IEEE past the row-wise batches at widths 65-128 (narrow_mlp_probe_20261125-1925.txt, 8 x 128):
    one 128-lane tile per value and 8 warps, 24.5 us at 1024 rows (16-row programs) and 35.8 at
    4096 (32 rows), against 41.7 and 72.8 for the per-layer plan (64-lane tiles: 429-475 us).
    """
    widest = max(spec.widths)
    warps = 4 if widest <= 128 else 8
    precision = "tf32" if allow_tf32 and spec.dtype == torch.float32 else "ieee"
    forced, override = bool(override), dict(override)
    tensor_cores = spec.dtype != torch.float32 or precision == "tf32"
    rowwise = override.pop("rowwise", batch <= (ROWWISE_TC_MAX_BATCH if tensor_cores else ROWWISE_MAX_BATCH))
    block_m, max_tile = 1 if rowwise else 16, ROWWISE_MAX_TILE if rowwise else MAX_TILE
    looped = (not rowwise and not tensor_cores and MAX_TILE < widest <= FMA_ONE_TILE and numels is not None
              and layer_period(spec, numels) is not None)
    if looped:
        # one [BLOCK_M, w] x [w, w] product per layer; 32 rows once that still gives every SM a program
        max_tile, warps, block_m = FMA_ONE_TILE, 8, 32 if batch >= 0.9 * SMS * 32 else 16
    elif not rowwise:
        for bm in (64, 32):
            if batch >= 2 * SMS * bm and bm * widest <= 1024 * warps:
                block_m = bm
                break
    cfg = dict(block_m=block_m, rowwise=rowwise, num_warps=warps, precision=precision, max_tile=max_tile,
               looped=looped)
    cfg.update(override)
    config = KernelConfig(**cfg)
    if not forced and why_not_kernel(spec, config) and not why_not_kernel(spec, rows := KernelConfig(
            block_m=1, rowwise=True, num_warps=warps, precision=precision, max_tile=ROWWISE_MAX_TILE)):
        return rows   # 16x fewer unrolled FMAs than tl.dot's 16 rows: fits where tl.dot does not
    return config


def why_slow(spec: MLPSpec, config: KernelConfig) -> str | None:
    """Why this kernel would lose to the per-layer plan although it can be built (None: no known
    reason). fp32 IEEE tl.dot unrolled over values wider than one 64-lane tile measured 10x
    slower than the plan (8 x 128: 429-475 us at 64-1024 rows, the plan 12-42); only the
    looped form (identical layers) is fast there."""
    fma_dot = not config.rowwise and spec.dtype == torch.float32 and config.precision == "ieee"
    if fma_dot and not config.looped and max(spec.widths) > MAX_TILE:
        return ("fp32 IEEE tl.dot over several column tiles per value measured ~10x slower than the per-layer "
                "plan; only a chain of identical layers runs fused there (as a loop)")
    return None


def fma_per_thread(spec: MLPSpec, config: KernelConfig) -> int:
    """Unrolled FMAs per thread: the code size of the FMA forms (the looped form unrolls one layer)."""
    kn = _padded_kn(spec, config.max_tile)[:1 if config.looped else None]
    return config.block_m * sum(k * n for k, n, _ in kn) // (32 * config.num_warps)


def why_not_kernel(spec: MLPSpec, config: KernelConfig = KernelConfig(), rows: int = 0) -> str | None:
    """None if the kernel can be generated for spec and config over `rows` rows, else why not (legality)."""
    if spec.dtype not in KERNEL_DTYPES:
        return f"dtype {spec.dtype} has no fused MLP kernel"
    if spec.dtype == torch.bfloat16 and interpreting():
        return BF16_INTERPRETED
    if not spec.linears:
        return "no Linear layer"
    if min(spec.widths) < 1:
        return "a width is 0 (empty weight)"
    if max(spec.widths) > MAX_WIDTH:
        return f"width {max(spec.widths)} > {MAX_WIDTH} does not fit on chip"
    if config.looped and (config.rowwise or spec.dtype != torch.float32):
        return "the looped form is an fp32 tl.dot form"
    if config.rowwise and config.block_m != 1:
        return "the row-wise form takes 1 row per program"
    if not config.rowwise and config.block_m < 16:
        return "tl.dot takes at least 16 rows per program"
    if not config.rowwise and rows + config.block_m > INT32_INDEX_MAX:
        return f"{rows} rows: the tl.dot form's row indices are int32"
    fma_form = config.rowwise or (spec.dtype == torch.float32 and config.precision == "ieee")
    if fma_form and fma_per_thread(spec, config) > MAX_FMA_PER_THREAD:
        return (f"{fma_per_thread(spec, config)} unrolled FMAs per thread > {MAX_FMA_PER_THREAD} "
                "(code size; fewer or narrower layers fit)")
    dots = sum(d for _, _, d in _padded_kn(spec, config.max_tile)[:1 if config.looped else None])
    if dots > MAX_DOTS:
        return f"{dots} unrolled tile products > {MAX_DOTS}"
    return None
