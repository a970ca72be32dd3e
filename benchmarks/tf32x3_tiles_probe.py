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
from fxfuse.tf32x3 import split_tf32


@triton.jit
def _mm(a_ptr, al_ptr, w_ptr, wl_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        MODE: tl.constexpr, GROUP: tl.constexpr):
    """MODE 0: builtin tf32x3; 1: W split once, x split here, one accumulator; 2: the same with
    the low products in their own accumulator; 3: x split by torch too (al_ptr), two
    accumulators; 4: the high product alone (plain TF32 of rounded operands); 5: W split once, x
    split here, each K step's three products from zero, added to the running sum in IEEE fp32."""
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
        else:
            wl = tl.load(wl_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None], mask=wmask, other=0.0)
            if MODE == 3:
                a_hi = a
                a_lo = tl.load(al_ptr + offs_m[:, None].to(tl.int64) * K + k[None, :], mask=amask, other=0.0)
            else:
                a_hi = ((a.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)
                a_lo = a - a_hi
            if MODE == 5:   # a fresh partial per K step on the tensor cores, added in IEEE fp32
                part = tl.dot(a_lo, w, input_precision="tf32")
                part = tl.dot(a_hi, wl, acc=part, input_precision="tf32")
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
    acc += acc_lo
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


TILES = [(128, 128, 32, 8, 3), (128, 128, 64, 8, 2), (64, 64, 32, 4, 4), (64, 128, 32, 4, 3), (64, 128, 64, 4, 2)]
MODES = {0: "builtin", 5: "fresh", 1: "split1acc"}


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    timing = types.SimpleNamespace(reps=5, min_rep_ms=5.0)
    dev = torch.device("cuda")
    for m, h in [(256, 1024), (4096, 4096), (1024, 2048)]:
        torch.manual_seed(0)
        a, w = torch.randn(m, h, device=dev), torch.randn(h, h, device=dev)
        w_hi, w_lo = split_tf32(w)
        a_hi, a_lo = split_tf32(a)
        ref = a.double() @ w.double().t()
        err = lambda c: ((c.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        flops = 2 * m * h * h
        lib = per_call_us(lambda: a @ w.t(), dev, timing)
        print(f"m={m} h={h}: cuBLAS fp32 {lib:.1f} us ({flops / lib / 1e6:.0f} TF/s) err {err(a @ w.t()):.1e}", flush=True)
        for mode, label in MODES.items():
            for bm, bn, bk, warps, stages in TILES:
                c = torch.empty(m, h, device=dev)
                grid = (triton.cdiv(m, bm) * triton.cdiv(h, bn),)
                x = a_hi if mode == 3 else a

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
