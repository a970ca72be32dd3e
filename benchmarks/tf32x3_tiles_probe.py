"""Probe: tiles for the 3xTF32 GEMM, and a form with the weight split once, ahead of time.

    python -m benchmarks.tf32x3_tiles_probe

Why: tl.dot(input_precision="tf32x3") splits both operand tiles at every K step, and the
split B tile must go back through shared memory for the tensor cores. The weights of a Linear
are constants, so their TF32 high and low parts can be made once at optimize time; the kernel
then splits only x (in registers) and issues three plain TF32 dots. This times, for C = A @ W.T
(W [N, K], K contiguous), the builtin tf32x3 dot over a set of tiles and the pre-split form,
next to cuBLAS fp32, in a CUDA graph of back-to-back calls, with errors against float64.
"""
import types

import torch
import triton
import triton.language as tl

from benchmarks.autotune_cells import per_call_us
from fxfuse.tf32x3 import split_dot_step, split_tf32


@triton.jit
def _mm(a_ptr, al_ptr, w_ptr, wl_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        MODE: tl.constexpr, GROUP: tl.constexpr):
    """MODE 0: builtin tf32x3; 1: W split once, x split here, one accumulator; 2: the same with
    the low products in their own accumulator; 3: x split by torch too (al_ptr), two
    accumulators; 4: the high product alone (plain TF32 of rounded operands); 5: W split once, x
    split here, each K step's three products from zero, added to the running sum in IEEE fp32;
    6: fxfuse's split_dot_step with MASK_NAN (5 with the NaN of the low products masked; until
    commit "x's high part truncated", also rounding with values next to the fp32 maximum truncated); 7: 5 with the NaN mask only (stop 26's commit 1aac53c); 8: 6
    with x's tile masked instead of the step's product (valid for a finite W): no low part
    where x is inf or NaN, and no inf in the high part that multiplies W's low part; 9: x split
    ahead too (a_ptr, al_ptr: its TF32 parts), the step's low products NaN-masked as in 6;
    10: 9 without the mask; 11: 6's split, the high product fresh per step and added in IEEE
    fp32, the low products accumulated on the tensor cores in a second accumulator whose NaN is
    dropped once, after the loop; 12: 11 with x's high part truncated (no rounding, so nothing
    next to the fp32 maximum can round to inf); 13: 7 with x's high part truncated (a NaN kept);
    14: 13 without keeping a NaN (a NaN whose payload lies in the dropped bits becomes inf);
    15: 8 with x's high part truncated (x's tile masked, no product mask: valid for a finite W);
    16: 13 without the mask, and a tile whose sum came out NaN is computed again with it."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    per_group = GROUP * grid_n
    group = pid // per_group
    first_m = group * GROUP
    size = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.full([BM, BN], 0.0, tl.float32)
    acc_lo = tl.full([BM, BN], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + offs_k
        amask = (offs_m[:, None] < M) & (k[None, :] < K)
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * K + k[None, :], mask=amask, other=0.0)
        wmask = (k[:, None] < K) & (offs_n[None, :] < N)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
        if MODE == 0:
            acc = tl.dot(a, w, acc=acc, input_precision="tf32x3")
        elif MODE == 6:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            acc = split_dot_step(a, w, wl, acc, MASK_NAN=True)
        elif MODE == 11 or MODE == 12:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            bits = a.to(tl.int32, bitcast=True)
            if MODE == 11:
                a_hi = ((bits + 4096) & -8192).to(tl.float32, bitcast=True)
                a_hi = tl.where(a != a, a, tl.where(a_hi == a_hi * 2.0, (bits & -8192).to(tl.float32, bitcast=True), a_hi))
            else:
                a_hi = tl.where(a != a, a, (bits & -8192).to(tl.float32, bitcast=True))
            acc += tl.dot(a_hi, w, input_precision="tf32")
            acc_lo = tl.dot(a - a_hi, w, acc=acc_lo, input_precision="tf32")
            acc_lo = tl.dot(a_hi, wl, acc=acc_lo, input_precision="tf32")
        elif MODE == 16:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            a_hi = tl.where(a != a, a, (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True))
            part = tl.dot(a - a_hi, w, input_precision="tf32")
            part = tl.dot(a_hi, wl, acc=part, input_precision="tf32")
            acc += tl.dot(a_hi, w, acc=part, input_precision="tf32")
        elif MODE == 13 or MODE == 14 or MODE == 15:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            a_hi = (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            if MODE == 13:
                a_hi = tl.where(a != a, a, a_hi)
            a_lo = a - a_hi
            if MODE == 15:
                fin = a_lo == a_lo
                a_lo = tl.where(fin, a_lo, 0.0)
                part = tl.dot(a_lo, w, input_precision="tf32")
                part = tl.dot(tl.where(fin, a_hi, 0.0), wl, acc=part, input_precision="tf32")
            else:
                part = tl.dot(a_lo, w, input_precision="tf32")
                part = tl.dot(a_hi, wl, acc=part, input_precision="tf32")
                part = tl.where(part == part, part, 0.0)
            acc += tl.dot(a_hi, w, acc=part, input_precision="tf32")
        elif MODE == 9 or MODE == 10:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            a_lo = tl.load(al_ptr + offs_m[:, None].to(tl.int64) * K + k[None, :], mask=amask, other=0.0)
            part = tl.dot(a_lo, w, input_precision="tf32")
            part = tl.dot(a, wl, acc=part, input_precision="tf32")
            if MODE == 9:
                part = tl.where(part == part, part, 0.0)
            acc += tl.dot(a, w, acc=part, input_precision="tf32")
        elif MODE == 8:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            bits = a.to(tl.int32, bitcast=True)
            a_hi = ((bits + 4096) & -8192).to(tl.float32, bitcast=True)
            big = a_hi == a_hi * 2.0                      # 0, inf (rounded up from near the maximum too)
            a_hi = tl.where(a != a, a, tl.where(big, (bits & -8192).to(tl.float32, bitcast=True), a_hi))
            a_lo = a - a_hi
            fin = a_lo == a_lo                            # False where a is inf or NaN
            a_lo = tl.where(fin, a_lo, 0.0)
            a_hf = tl.where(fin, a_hi, 0.0)
            part = tl.dot(a_lo, w, input_precision="tf32")
            part = tl.dot(a_hf, wl, acc=part, input_precision="tf32")
            acc += tl.dot(a_hi, w, acc=part, input_precision="tf32")
        else:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            if MODE == 3:
                a_hi = a
                a_lo = tl.load(al_ptr + offs_m[:, None].to(tl.int64) * K + k[None, :], mask=amask, other=0.0)
            else:
                a_hi = ((a.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)
                a_lo = a - a_hi
            if MODE == 5 or MODE == 7:   # a fresh partial per K step on the tensor cores, added in IEEE fp32
                part = tl.dot(a_lo, w, input_precision="tf32")
                part = tl.dot(a_hi, wl, acc=part, input_precision="tf32")
                if MODE == 7:
                    part = tl.where(part == part, part, 0.0)
                part = tl.dot(a_hi, w, acc=part, input_precision="tf32")
                acc += part
            elif MODE == 1:
                acc = tl.dot(a_lo, w, acc=acc, input_precision="tf32")
                acc = tl.dot(a_hi, wl, acc=acc, input_precision="tf32")
                acc = tl.dot(a_hi, w, acc=acc, input_precision="tf32")
            elif MODE == 4:
                acc = tl.dot(a_hi, w, acc=acc, input_precision="tf32")
            else:
                acc_lo = tl.dot(a_lo, w, acc=acc_lo, input_precision="tf32")
                acc_lo = tl.dot(a_hi, wl, acc=acc_lo, input_precision="tf32")
                acc = tl.dot(a_hi, w, acc=acc, input_precision="tf32")
    if MODE == 16:
        if tl.max(tl.max(tl.where(acc == acc, 0, 1), axis=1), axis=0) > 0:   # a NaN: again, with the mask
            acc = tl.full([BM, BN], 0.0, tl.float32)
            for k0 in range(0, K, BK):
                k = k0 + offs_k
                a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * K + k[None, :],
                            mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
                wmask = (k[:, None] < K) & (offs_n[None, :] < N)
                w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
                wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
                acc = split_dot_step(a, w, wl, acc, MASK_NAN=True)
    if MODE == 11 or MODE == 12:
        acc += tl.where(acc_lo == acc_lo, acc_lo, 0.0)
    else:
        acc += acc_lo
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _split_x(a_ptr, hi_ptr, lo_ptr, n, BLOCK: tl.constexpr):
    """x's TF32 parts in one pass (what mode 9 would pay per layer, ahead of the GEMM)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    a = tl.load(a_ptr + offs, mask=ok, other=0.0)
    bits = a.to(tl.int32, bitcast=True)
    hi = ((bits + 4096) & -8192).to(tl.float32, bitcast=True)
    hi = tl.where(a != a, a, tl.where(hi == hi * 2.0, (bits & -8192).to(tl.float32, bitcast=True), hi))
    tl.store(hi_ptr + offs, hi, mask=ok)
    tl.store(lo_ptr + offs, a - hi, mask=ok)


TILES = [(128, 128, 32, 8, 3), (128, 128, 64, 8, 2), (64, 64, 32, 4, 4), (64, 128, 32, 4, 3), (64, 128, 64, 4, 2)]
MODES = {0: "builtin", 5: "fresh", 1: "split1acc", 6: "fxfuse", 7: "nan mask", 8: "x masked", 9: "x split", 10: "x split nm", 11: "lo acc",
         12: "lo acc trn", 13: "trunc mask", 14: "trunc mask-", 15: "trunc xmask",
         16: "redo nan"}


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="256x1024,4096x4096,1024x2048", help="m x h list")
    ap.add_argument("--modes", default="0,5,1", help="comma list of MODE numbers (see _mm)")
    ap.add_argument("--tiles", help="indices into TILES (default all)")
    ap.add_argument("--rounds", type=int, default=1, help="time every mode this many times, interleaved")
    args = ap.parse_args(argv)
    modes = {int(k): MODES[int(k)] for k in args.modes.split(",")}
    tiles = [TILES[int(i)] for i in args.tiles.split(",")] if args.tiles else TILES
    torch.backends.cuda.matmul.allow_tf32 = False
    timing = types.SimpleNamespace(reps=5, min_rep_ms=5.0)
    dev = torch.device("cuda")
    for m, h in [tuple(int(v) for v in c.split("x")) for c in args.shapes.split(",")]:
        torch.manual_seed(0)
        a, w = torch.randn(m, h, device=dev), torch.randn(h, h, device=dev)
        w_hi, w_lo = split_tf32(w)
        a_hi, a_lo = split_tf32(a)
        ref = a.double() @ w.double().t()
        err = lambda c: ((c.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        flops = 2 * m * h * h
        lib = per_call_us(lambda: a @ w.t(), dev, timing)
        print(f"m={m} h={h}: cuBLAS fp32 {lib:.1f} us ({flops / lib / 1e6:.0f} TF/s) err {err(a @ w.t()):.1e}", flush=True)
        if 9 in modes or 10 in modes:
            xh, xl = torch.empty_like(a), torch.empty_like(a)
            split_us = per_call_us(lambda: _split_x[(triton.cdiv(a.numel(), 1024),)](a, xh, xl, a.numel(), BLOCK=1024),
                                   dev, timing)
            print(f"   x split ahead (one Triton pass): {split_us:.1f} us", flush=True)
        for mode, label in [mv for _ in range(args.rounds) for mv in modes.items()]:
            for bm, bn, bk, warps, stages in tiles:
                c = torch.empty(m, h, device=dev)
                grid = (triton.cdiv(m, bm) * triton.cdiv(h, bn),)
                x = a_hi if mode in (3, 9, 10) else a

                def run():
                    _mm[grid](x, a_lo, w if mode == 0 else w_hi, w_lo, c, m, h, h, BM=bm, BN=bn, BK=bk, MODE=mode,
                              GROUP=8, num_warps=warps, num_stages=stages)
                try:
                    run()
                    e = err(c)
                    us = per_call_us(run, dev, timing)
                    print(f"   {label:10s} {bm}x{bn}x{bk} w{warps} s{stages}: {us:.1f} us "
                          f"({flops / us / 1e6:.0f} TF/s, {lib / us:.2f}x cuBLAS) err {e:.1e}", flush=True)
                except Exception as ex:  # noqa: BLE001 -- a config that fails is a result too
                    print(f"   {label:10s} {bm}x{bn}x{bk} w{warps} s{stages}: {type(ex).__name__} {str(ex)[:80]}",
                          flush=True)


if __name__ == "__main__":
    main()
