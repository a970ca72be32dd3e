"""The generated GEMM's configuration: which form (row-wise GEMV, tl.dot, 3xTF32), tile sizes,
stages and split-K for a batch of m rows (choose_gemm_config, one place), apart from the
kernel's source (gemm_kernel.py) and correctness (gemm_kernel.why_not_gemm). The measurements
behind each rule are in the docstrings; benchmarks/rowwise_probe.py and x3_small_probe.py
patch this module's functions to try others.
"""
from dataclasses import dataclass

import torch

from .kernel import triton_cdiv
from .mlp_spec import SMS
from .tf32x3 import gemm_tiles

GEMM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemmSpec:
    k: int                   # in features
    n: int                   # out features
    dtype: torch.dtype
    epilogue: tuple = ()     # Pointwise steps; value 0 is x @ W.T, step j defines value j + 1; operand
    #                          ("input", 0) is x at the output tile (a residual; needs k == n),
    #                          ("skip", j) the j-th other tensor the call passes (gemm_kernel.skip_view)
    output: int = 0          # the value stored


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    precision: str = "ieee"
    rowwise: bool = False    # broadcast-multiply-reduce product (small batch), else tl.dot
    pipelined: bool = False  # row-wise K loop as tl.range(num_stages=num_stages): loads staged through shared memory (_rowwise_stages)
    split_weights: bool = False  # tf32x3 with W's TF32 parts made once (fxfuse/tf32x3.py): three plain TF32 dots
    keep_x: bool = False     # row-wise x loads with eviction_policy="evict_last" (_rowwise_config: X_KEPT_FROM_K)


ROWWISE_MAX_BATCH = 16       # rows up to which the row-wise form is chosen
ROWWISE_FP32_MAX_BATCH = 256  # fp32 without TF32: tl.dot is FMA code as well, and the row-wise form wins up to here
ROWWISE_TILE_ELEMENTS = 8192  # BLOCK_M * BLOCK_N * BLOCK_K of the accumulator per 4 warps (64 registers)
ROWWISE_MAX_COLUMNS = 4       # columns per program at batch 1, twice that up to 16 rows (_rowwise_config)
X_KEPT_FROM_K = 2048          # 2-16 fp32 rows and K from here: x's loads ask L2 to keep x (evict_last)


def _pow2_at_least(x: int) -> int:
    return 1 << (max(x, 1) - 1).bit_length()


def _rowwise_config(m: int, spec: GemmSpec, allow_tf32: bool) -> dict:
    """Row-wise tiles. Columns per program: as few as still give every SM work (N / 132, at
    least 4 once there are several rows), so W is read by many SMs at once; K in steps of
    <= 256 (batch 1: 512) filling the accumulator budget; split-K where the columns leave SMs
    idle. Set from benchmarks/gemm_probe.py on the H100: at batch 16, width 1024, 4 columns x
    128 K per step took 6.9 us, 16 x 32 took 13.4 us (cuBLAS with bias 7.9 us). Batch 1 from
    benchmarks/rowwise_probe.py (8 layers with PDL, GPU time): K steps of 512 instead of 256
    took 17.0 vs 20.2 us at width 1024 and 62.9 vs 65.1 at 2048, the same at 128 and 512;
    at batch 16 they lose (20.5 vs 17.1 us at 512, 33.7 vs 29.1 at 1024). Up to 16 rows, at
    most ROWWISE_MAX_COLUMNS columns at batch 1 and twice that with K steps of at least 128 at
    batch 9-16 (rowwise_probe, 8 layers, GPU us): at width 2048 the N / 132 rule with the
    register budget gave 8 x 64 at batch 16 (177; 8 x 128: 117, 4 x 128: 150) and 8 x 512 at
    batch 1 (62.7; 4 x 512: 57.7); at 4096, batch 16: 8 x 128 423, 4 x 128 610.

    Past 16 rows (fp32 IEEE only, up to ROWWISE_FP32_MAX_BATCH) programs take 16 rows below
    64; at 64 rows and K < 1024, 32 rows with 8 warps, and 8 columns where that still leaves
    SMS / 2 programs (rowwise_probe_20261124.txt, 8 layers 64 x 512: 27.3 us vs 34.9 with 4
    columns; fewer rows per program 28.4, K steps of 128 29.3); else 64 rows with 4 warps (W
    read once per 64 rows), 4 columns x 32 K. benchmarks/gemm_sweep.py, one layer with bias and ReLU
    (tl.dot form as chosen before / row-wise / cuBLAS): batch 32, width 1024: 13.7 / 6.8 /
    15.7 us; batch 64, width 128: 5.8 / 2.3 / 14.4; width 512: 11.0 / 4.4 / 10.2; width
    1024: 17.4 / 9.0 (32 rows, 8 warps: 10.6; 16 rows: 11.9) / 24.8; batch 128, width 512:
    10.9 / 5.6 / 20.0; width 1024: 26.4 / 16.3 / 31.2; batch 256, width 128: 6.2 / 2.8 / 5.3;
    width 512: 16.1 / 10.2 / 11.7. Where cuBLAS wins (batch 64, width 2048: 36.9 us against
    row-wise 52.5 and tl.dot 48.1; batch 256, width 1024: 29.6 against 37.7 and 35.3) the
    cost model's measured table sends the layer to the library.

    x is read again by every column block (N / BLOCK_N times per layer) while W streams through
    L2 once; from X_KEPT_FROM_K with 2-16 fp32 rows (where it was measured), x's loads carry
    evict_last so W's stream does not push x out. rowwise_probe --set loads (H100, 8 layers,
    GPU us of the graph, plain / evict_last): 16 x 2048 81.7 / 79.9, 16 x 4096 262.3 / 256.2,
    16 x 1024 29.2 / 29.4, 16 x 512 16.7 / 17.6, 1 x 2048 53.5 / 54.0 (rowwise_probe_loads_20261126.txt)."""
    block_m = (_pow2_at_least(m) if m <= ROWWISE_MAX_BATCH else 16 if m < 64
               else 32 if m == 64 and spec.k < 1024 else 64)
    warps = 8 if block_m == 32 else 4
    budget = ROWWISE_TILE_ELEMENTS * warps // 4
    block_n = max(min(4, block_m), 1 << max(0, (spec.n // SMS).bit_length() - 1))
    if m <= ROWWISE_MAX_BATCH:
        block_n = min(block_n, ROWWISE_MAX_COLUMNS if block_m == 1 else 2 * ROWWISE_MAX_COLUMNS)
    elif block_m == 32 and triton_cdiv(m, 32) * triton_cdiv(spec.n, 2 * block_n) >= SMS // 2:
        block_n *= 2   # each program reads x's rows once per column block: fewer x reads (64 x 512)
    block_n = min(block_n, _pow2_at_least(spec.n), budget // (block_m * 16))
    block_k = min(512 if block_m == 1 else 256 if block_m <= 16 else 64, _pow2_at_least(spec.k),
                  max(16, budget // (block_m * block_n)))
    if m <= ROWWISE_MAX_BATCH and block_m == 16:
        block_k = max(block_k, min(128, _pow2_at_least(spec.k)))   # 8 x 128 at width >= 2048 (probe)
    _, split = _split_k(m, spec.n, spec.k, block_m, block_n, block_k)
    stages = _rowwise_stages(block_m, block_n, block_k, spec.dtype)
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, num_warps=warps,
                num_stages=max(stages, 1), pipelined=stages > 1,
                precision="tf32" if allow_tf32 and spec.dtype == torch.float32 else "ieee", rowwise=True,
                keep_x=1 < m <= ROWWISE_MAX_BATCH and spec.k >= X_KEPT_FROM_K and spec.dtype == torch.float32)


ROWWISE_STAGES = 4                  # K steps in flight through shared memory (tl.range num_stages)
ROWWISE_STAGE_BYTES = 64 * 1024     # shared memory the staged x and W tiles of one program may take


def _rowwise_stages(block_m: int, block_n: int, block_k: int, dtype: torch.dtype) -> int:
    """Software pipelining of the row-wise K loop: Triton stages a loop's loads through shared
    memory (cp.async) when the loop has no tl.dot only if the loop itself carries num_stages,
    so the generated loop is tl.range(..., num_stages=). Without it each K step waited for its
    own loads: at batch 16, width 2048, a layer read W at 39% of HBM bandwidth. H100, 8 layers,
    GPU us of the graph, plain loop / 3 / 4 stages (pipelined_probe_20261125.txt): 16 x 2048
    116.0 / 84.6 / 81.4, 1 x 2048 57.7 / 55.3 / 53.7, 1 x 1024 18.0 / 15.8 / 15.7; 16 x 1024,
    16 x 512, 1 x 512, 64 x 512, 64 x 1024 and 256 x 512 within 1% either way. Fewer stages
    where the tiles would take more than ROWWISE_STAGE_BYTES (smaller GPUs have ~100 KB per SM)."""
    per_stage = (block_m + block_n) * block_k * torch.finfo(dtype).bits // 8
    return min(ROWWISE_STAGES, ROWWISE_STAGE_BYTES // per_stage)


def choose_gemm_config(m: int, spec: GemmSpec, allow_tf32: bool = False, tf32x3: bool = False,
                       **override) -> GemmConfig:
    """Tile sizes and split-K for a batch of m rows: one place, apart from correctness.

    Up to ROWWISE_MAX_BATCH rows (fp32 IEEE: ROWWISE_FP32_MAX_BATCH) the row-wise form
    (_rowwise_config). Else rows per tile follow
    the batch (32..64, or 128 for tensor-core dtypes at large batch), 32 x 32 tiles for fp32
    layers too narrow to fill a quarter of the SMs with 64 x 64 (gemm_probe: batch 64, width
    128: 5.7 us vs 14.0 us), split-K by _split_k. fp32 with tf32x3 (and TF32 not allowed):
    tensor-core tiles of tf32x3.gemm_tiles past ROWWISE_MAX_BATCH rows. `override` sets fields
    (tests, the probe).
    """
    tf32x3 = tf32x3 and spec.dtype == torch.float32 and not allow_tf32
    tensor_cores = spec.dtype != torch.float32 or allow_tf32 or tf32x3
    if m <= (ROWWISE_MAX_BATCH if tensor_cores else ROWWISE_FP32_MAX_BATCH) and override.get("rowwise", True):
        cfg = _rowwise_config(m, spec, allow_tf32)
        cfg.update(override)
        return GemmConfig(**cfg)
    if tf32x3:
        block_m, block_n, block_k, warps, stages, split_weights, per_sm = gemm_tiles(m, spec.n, spec.k)
        _, split = _split_k(m, spec.n, spec.k, block_m, block_n, block_k, per_sm)
        cfg = dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, num_warps=warps,
                   num_stages=stages, precision="tf32x3", split_weights=split_weights)
        cfg.update(override)
        return GemmConfig(**cfg)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if (m <= 64 or not tensor_cores) else 128
    block_n = 64 if spec.n <= 64 or not tensor_cores else 128
    block_k = 64 if tensor_cores else 32
    tiles, split = _split_k(m, spec.n, spec.k, block_m, block_n, block_k)
    if not tensor_cores and block_m == 64 and tiles * split < SMS // 4:   # narrow layer: smaller tiles
        block_m = block_n = 32
        tiles, split = _split_k(m, spec.n, spec.k, block_m, block_n, block_k)
    cfg = dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split,
               num_warps=4 if block_m * block_n <= 64 * 64 else 8, num_stages=3,
               precision="tf32" if allow_tf32 and spec.dtype == torch.float32 else "ieee")
    cfg.update(override)
    return GemmConfig(**cfg)


def _split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, per_sm: int = 1) -> tuple:
    """(output tiles, split): split-K doubles while the grid has fewer than ~per_sm programs per
    SM and every split keeps at least two K steps. Splits take whole steps (generate_gemm:
    cdiv(steps, split) each), so the count is in steps: at odd K the last split could otherwise
    get none (K = 1100 in steps of 128, split 4: 3 + 3 + 3 + 0; review27)."""
    tiles = triton_cdiv(m, block_m) * triton_cdiv(n, block_n)
    steps, split = triton_cdiv(k, block_k), 1
    while split < MAX_SPLIT_K and tiles * split * 2 <= SMS * per_sm:
        per = triton_cdiv(steps, split * 2)
        if per < 2 or (split * 2 - 1) * per >= steps:
            break
        split *= 2
    return tiles, split
