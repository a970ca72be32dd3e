"""3xTF32: fp32 matrix products on tensor cores, and the numerics guard that admits them.

Why (option tf32x3): with TF32 off, fp32 GEMMs run on the CUDA cores: cuBLAS at 51.6 TFLOP/s
on the H100 and Triton's "ieee" tl.dot at about a third of that. Triton's
`tl.dot(..., input_precision="tf32x3")` splits each fp32 operand a into a TF32 high part
hi = rna(a) (round to 10 stored mantissa bits) and a low part lo = a - hi, and sums three
tensor-core products, lo*hi + hi*lo + hi*hi, accumulating in fp32 (the lo*lo term is below
fp32's rounding). About 21 of fp32's 24 mantissa bits survive the split, so the product's
error stays at fp32's level: on the H100 (benchmarks/tf32x3_probe.py, relu(x @ W.T + b),
random normal data) 1.5-3.2e-7 relative to a float64 product where cuBLAS fp32 measured
1.1e-7 to 1.6e-6, at 78 TFLOP/s against cuBLAS's 51.6; from 256 rows fxfuse's own form with
W split once (gemm_tiles, split_dot_step) reached 102 TFLOP/s at 4096^3 at 3.1e-7
(tiles_ab6_20261126.txt; x's high part truncated, see split_dot_step). It is still not IEEE fp32
(a different rounding, like any other summation order, and Strassen), so it is opt-in, and
each layer is checked on the example input like a Strassen layer: its error against float64
must stay within `tolerance` (default: 3x the classical product's, at least 1e-5).

fxfuse's split form (from 256 rows, and Strassen's products) rounds W's parts once and
truncates x's high part in the kernel (split_dot_step says why). The guard emulates it with
torch: W's split (hi rounded to nearest, ties away from zero, as cvt.rna.tf32.f32; lo truncated
to TF32 as the tensor core reads it), x truncated (truncated_parts), and three fp32 products of
the parts, whose elementwise products are exact in fp32 (11 x 11 bits). The order of the
additions differs from the tensor core's, which sums each K step without IEEE rounding: with
the 128-wide steps of 33-255 rows (gemm_tiles) the kernel's error is ~2x the emulation's
(1.9e-7 vs ~8e-8 at 64 x 1024); the default tolerance's floor, 1e-5, is far above both, but a
`tolerance` set near 1e-7 is checked against an estimate that is low there (review27).
"""
import torch

from .strassen_tables import relative_error

TF32_DROPPED_BITS = 13        # fp32 has 23 stored mantissa bits, TF32 10


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value (ties away from zero), still stored as fp32; inf and nan
    stay as they are, and a finite value next to the largest fp32, which would round to inf,
    is truncated instead (so its low part stays finite). Used for the parts made once (W,
    Strassen's R); the kernels truncate x's high part (split_dot_step)."""
    bits = t.contiguous().view(torch.int32)
    rounded = ((bits + (1 << (TF32_DROPPED_BITS - 1))) & ~((1 << TF32_DROPPED_BITS) - 1)).view(torch.float32)
    rounded = torch.where(torch.isinf(rounded), truncate_to_tf32(t), rounded)
    return torch.where(torch.isfinite(t), rounded, t)


def truncate_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """What a TF32 tensor-core input keeps of an fp32 value: the top 10 stored mantissa bits."""
    return (t.contiguous().view(torch.int32) & ~((1 << TF32_DROPPED_BITS) - 1)).view(torch.float32)


def split_tf32(t: torch.Tensor) -> tuple:
    """(hi, lo): hi = round_to_tf32(t), lo = t - hi as the tensor core reads it (0 where t is
    not finite: Triton masks the NaN the low products would give there)."""
    hi, lo = stored_parts(t)
    return hi, torch.where(torch.isfinite(t), lo, torch.zeros_like(t))


def stored_parts(t: torch.Tensor) -> tuple:
    """The TF32 parts the split-weights kernels read (GEMM weights, Strassen's R): as split_tf32,
    but the low part of an inf or NaN is NaN (inf - inf), so the kernels drop that step's low
    products as Triton's builtin does and the high product gives eager's inf; a low part of 0
    there gave a_lo * inf of either sign, and NaN where eager has inf (review26)."""
    hi = round_to_tf32(t.contiguous())
    return hi, truncate_to_tf32(t.contiguous() - hi)


def truncated_parts(t: torch.Tensor) -> tuple:
    """(hi, lo) as split_dot_step splits x: hi truncated to TF32, lo = t - hi as the tensor core
    reads it (0 where t is not finite). One bit less than split_tf32's rounding; the guard
    emulates x this way for every 3xTF32 form (below 256 rows Triton's builtin rounds, so
    there the emulation errs on the safe side)."""
    t = t.contiguous()
    hi = torch.where(torch.isfinite(t), truncate_to_tf32(t), t)
    return hi, torch.where(torch.isfinite(t), truncate_to_tf32(t - hi), torch.zeros_like(t))


def tf32x3_linear(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2d @ weight.T as the tf32x3 kernel computes it (fp32 in, fp32 out), emulated in IEEE fp32
    for finite inputs (the kernels' masking of a non-finite low product is not modelled; the
    guard does not measure on such inputs)."""
    xh, xl = truncated_parts(x2d.float())
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


def tf32x3_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) as bmm_tf32x3 computes it, emulated in IEEE fp32 for finite inputs (Strassen's guard)."""
    ah, al = truncated_parts(a.float())
    bh, bl = split_tf32(b.float())
    return (torch.bmm(al, bh) + torch.bmm(ah, bl)) + torch.bmm(ah, bh)


# ---------------------------------------------------------------------------- kernel choices

def gemm_tiles(m: int, n: int, k: int) -> tuple:
    """(block_m, block_n, block_k, warps, stages, split_weights, splits_per_sm) of the generated
    GEMM in tf32x3 (gemm_config.choose_gemm_config adds split-K: splits_per_sm is the programs
    per SM it may fill, gemm_config._split_k).

    split_weights (from 256 rows): W's TF32 parts are made once, so the kernel splits only x,
    in registers, and issues three plain TF32 dots; the builtin tf32x3 dot splits both tiles
    at every K step and sends the split W tile back through shared memory. H100, one layer in
    a CUDA graph, no split-K (benchmarks/tf32x3_tiles_probe.py): 4096 x 4096 1158 us with
    128 x 256 tiles against 1800 for the builtin's best (119 vs 76 TFLOP/s); 1024 x 8192 1137
    vs 1764; 1024 x 2048 86.7 (128 x 128) vs 115.5; 1024 x 1024 31.2 (64 x 64) vs 36.1;
    256 x 4096 116.9 (64 x 64) vs 156.8. Tiles: the largest whose count still gives every SM
    one (split_tiles: 128 x 128, else 64 x 64; 128 x 256 measured fastest in the probe's
    one-accumulator form but does not fit two [BM, BN] fp32 tiles in registers). K steps of 32.

    Below 256 rows the builtin (W read once, not twice). There the layer is a stream of W, and
    longer K steps over fewer columns won (benchmarks/x3_small_probe.py --set 64, H100, 8
    layers, GPU us of the graph, 64 rows; the tiles before in brackets): width 1024 32 x 128
    steps, split-K 4: 57.1 us (64 x 64 x 32, split 8: 76.5; the IEEE row-wise plan 68.7);
    width 2048 64 x 64 steps, split 4: 129.6 (141.2); width 4096 64 x 64, split 4, i.e. two
    programs per SM: 303.7 (64 x 128 x 32, split 4: 390.5; one program per SM 366.8). Longer
    steps add error (the tensor cores sum each step's products without IEEE rounding): 1.9e-7
    at width 1024 against 8.0e-8 with steps of 32 and eager fp32's 5.8e-8; the numerics guard
    checks every layer. Up to 32 rows, and below width 1024, the tiles of tf32x3_probe.py stay
    (32 x 64 x 32; 64 x 64 x 32, 64 x 128 x 32 from 4096 columns): one layer alone
    (benchmarks.autotune gemm_x3) took longer with 32 x 128 steps there (64 x 128: 7.4 vs 5.1 us,
    64 x 512: 6.9 vs 6.2) and less from width 2048 (64 x 4096: 39.6 vs 52.1; 128 x 4096: 68.0
    vs 89.5)."""
    if m >= 256:
        bm, bn, warps, stages = split_tiles(m, n)
        return bm, bn, 32, warps, stages, True, 1
    if m <= 32:
        return 32, 64, 32, 4, 4, False, 1
    if k < 1024:   # few K steps: the tiles of tf32x3_probe.py (longer steps measured slower, see above)
        return (64, 128, 32, 4, 3, False, 1) if n >= 4096 else (64, 64, 32, 4, 3, False, 1)
    if k < 2048:
        return 64, 32, 128, 4, 3, False, 1
    return 64, 64, 64, 4, 3, False, 2 if k >= 4096 else 1


SPLIT_MIN_TILES = 116   # ~ the H100's 132 SMs less an eighth: 1024 x 2048 has 128 tiles of 128 x 128 and took them


def split_tiles(m: int, n: int, batch: int = 1) -> tuple:
    """(block_m, block_n, warps, stages) of the split-weights form: 128 x 128 where `batch`
    products of [m, n] still have SPLIT_MIN_TILES of them, else 64 x 64 (128 x 256 does not
    fit: the running sum and the step's partial are two [BM, BN] fp32 tiles in registers)."""
    for bm, bn, warps, stages in ((128, 128, 8, 3),):
        if batch * -(-m // bm) * -(-n // bn) >= SPLIT_MIN_TILES:
            return bm, bn, warps, stages
    return 64, 64, 4, 4


# ---------------------------------------------------------------------------- the batched kernel
# Strassen's one product call, P = A @ R over 7^L products (passes/strassen.py), in 3xTF32. A
# fixed kernel, not generated: nothing of it depends on the model but the sizes, which are
# arguments. Defined at import like library_choice's kernel; Triton compiles it on first use.

import triton                    # noqa: E402  (after the torch-only part above, which the guard uses)
import triton.language as tl     # noqa: E402

from .kernel import PRODUCT_FP_FUSION, kernels_available, launch_context, triton_cdiv   # noqa: E402


@triton.jit
def split_dot_step(a, b, b_lo, acc, MASK_NAN: tl.constexpr = False):
    """acc + a @ (b + b_lo) in 3xTF32, b and b_lo being B's TF32 parts made once (stored_parts),
    a split here; one K step of both split-weights kernels (the generated GEMM and
    _bmm_tf32x3_kernel). Each K step's three products start from zero on the tensor cores and are
    added to the running acc in IEEE fp32: accumulated on the tensor cores across K, the sum
    lost precision in proportion to K (H100, 4096 x 4096: 2.9e-5 relative error with one
    accumulator, 9.6e-6 with the low products in a second one, against 2.4e-7 for the builtin
    and 1.1e-6 for cuBLAS; tf32x3_tiles_probe).

    a's high part is truncated, not rounded (truncated_parts): the same 3xTF32 at about one bit
    less (H100, 4096^3: 3.1e-7 vs 2.4e-7) and faster (1500 vs 1644 us; tiles probe modes 13, 6):
    rounding took an add, and a value next to the fp32 maximum, which rounds to inf, needed a
    test and a select of its own. A NaN stays in the high part (truncation must not turn a NaN
    with low payload bits into inf).

    MASK_NAN drops the low products' NaN (0 * inf where x or W holds inf) before the high product
    is added, as Triton's builtin does, so that eager's inf comes out, not NaN. It costs a test
    and a select per output element and K step (12%: 1522 vs 1347 us at 4096^3, tiles probe
    mode 16), so the kernels run the plain steps and compute a tile again with the mask only
    where its sum came out NaN (nan_in): a NaN in any step's products reaches the sum."""
    hi = tl.where(a != a, a, (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True))
    part = tl.dot(a - hi, b, input_precision="tf32")
    part = tl.dot(hi, b_lo, acc=part, input_precision="tf32")
    if MASK_NAN:
        part = tl.where(part == part, part, 0.0)
    return acc + tl.dot(hi, b, acc=part, input_precision="tf32")


@triton.jit
def nan_in(acc):
    """Whether a [BM, BN] tile holds a NaN (the split kernels' cue to compute it again with MASK_NAN)."""
    return tl.max(tl.max(tl.where(acc == acc, 0, 1), axis=1), axis=0) > 0


@triton.jit
def _bmm_k_loop(a_rows, b_cols, bl_cols, offs_m, offs_n, M, N, K, s_ak, s_bk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                MASK_NAN: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of A @ B over all of K in 3xTF32: from B's TF32 parts (SPLIT)
    or tl.dot's own split."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_rows + k[None, :] * s_ak, mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        b_ok = (k[:, None] < K) & (offs_n[None, :] < N)
        b = tl.load(b_cols + k[:, None] * s_bk, mask=b_ok, other=0.0)
        if SPLIT:   # b and b_lo: the TF32 parts of B, made once
            b_lo = tl.load(bl_cols + k[:, None] * s_bk, mask=b_ok, other=0.0)
            acc = split_dot_step(a, b, b_lo, acc, MASK_NAN=MASK_NAN)
        else:
            acc = tl.dot(a, b, acc=acc, input_precision="tf32x3")
    return acc


@triton.jit
def _bmm_tf32x3_kernel(a_ptr, b_ptr, bl_ptr, c_ptr, M, N, K, s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + batch * s_ab + offs_m.to(tl.int64)[:, None] * s_am
    b_cols = b_ptr + batch * s_bb + offs_n.to(tl.int64)[None, :] * s_bn
    bl_cols = bl_ptr + batch * s_bb + offs_n.to(tl.int64)[None, :] * s_bn
    acc = _bmm_k_loop(a_rows, b_cols, bl_cols, offs_m, offs_n, M, N, K, s_ak, s_bk,
                      BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, False)
    if SPLIT:
        if nan_in(acc):   # again with the low products' NaN masked (split_dot_step)
            acc = _bmm_k_loop(a_rows, b_cols, bl_cols, offs_m, offs_n, M, N, K, s_ak, s_bk,
                              BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, True)
    c = c_ptr + batch * s_cb + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def bmm_tf32x3(a: torch.Tensor, b: torch.Tensor, b_lo: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bmm for fp32 [r, m, k] @ [r, k, n] in 3xTF32 on the GPU (or the interpreter); with
    b_lo, b and b_lo are B's TF32 parts (split_tf32, same strides: K-major is fastest), made
    once by the caller. Anything else (another dtype, no kernels on this device) is torch.bmm."""
    if not (a.dtype == b.dtype == torch.float32 and a.dim() == b.dim() == 3 and a.device == b.device
            and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1] and kernels_available(a.device)
            and (b_lo is None or (b_lo.shape == b.shape and b_lo.stride() == b.stride() and b_lo.device == b.device))):
        return torch.bmm(a, b if b_lo is None else b + b_lo)
    r, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((r, m, n), dtype=torch.float32, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    bm, bn, warps, stages = split_tiles(m, n, r)
    with launch_context(a.device):
        _bmm_tf32x3_kernel[(triton_cdiv(m, bm), triton_cdiv(n, bn), r)](
            a, b, b if b_lo is None else b_lo, c, m, n, k, *a.stride(), *b.stride(), *c.stride(),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=32, SPLIT=b_lo is not None, num_warps=warps, num_stages=stages,
            **PRODUCT_FP_FUSION)
    return c
