"""Probe: a narrow fp32 MLP at 1024-4096 rows as one simple looped kernel, against the per-layer plan.

    python -m benchmarks.narrow_mlp_probe --cells 1024x128,4096x128,1024x256,4096x256 --budget-s 200

Why: at 8 x (Linear(128), ReLU) fp32 (TF32 off) the per-layer plan (cuBLASLt's bias + ReLU
epilogue per layer) takes 41.8 us at batch 1024 and 75.3 us at 4096, against a FLOP floor of
5 and 21 us: a 4096 x 128 output is only 32 of cuBLAS's tiles, so most SMs idle. The fused MLP
(mlp_codegen.py) unrolls every tile product and took 429-475 us in its fp32 tl.dot form. Here a
program takes BM rows through every layer with the layer loop NOT unrolled (small code):
  full     the activation [BM, W] stays in registers; each layer loads W.T [W, W] whole and
           does one tl.dot (ieee: FMAs)
  kloop    each layer is a K loop over BK-wide chunks: the activation chunk comes back from the
           output buffer (the program's own rows, L1/L2-resident; a CTA barrier around the
           store), the weight chunk [BK, W] from L2, as an ordinary GEMM's K loop
GPU time of the kernel alone in a CUDA graph (median of back-to-back replays) next to fxfuse's
default plan graph; max relative error against float64.
"""
import time

import torch
import triton
import triton.language as tl

from benchmarks.fused_form_probe import default_plan, kernel_row, probe_main

LAYERS = 8


@triton.jit
def mlp_full(x_ptr, wt_ptr, b_ptr, y_ptr, M, L: tl.constexpr, W: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, W)
    mask = rows[:, None] < M
    h = tl.load(x_ptr + rows[:, None] * W + cols[None, :], mask=mask, other=0.0)
    for layer in range(L):
        w = tl.load(wt_ptr + layer * W * W + cols[:, None] * W + cols[None, :])      # W.T [K, N]
        b = tl.load(b_ptr + layer * W + cols)
        h = tl.maximum(tl.dot(h, w, input_precision="ieee") + b[None, :], 0.0)
    tl.store(y_ptr + rows[:, None] * W + cols[None, :], h, mask=mask)


@triton.jit
def mlp_kloop(x_ptr, wt_ptr, b_ptr, y_ptr, M, L: tl.constexpr, W: tl.constexpr, BM: tl.constexpr,
              BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, W)
    ks = tl.arange(0, BK)
    mask = rows[:, None] < M
    for layer in tl.static_range(L):
        src = x_ptr if layer == 0 else y_ptr
        acc = tl.zeros((BM, W), dtype=tl.float32)
        for k in range(0, W, BK):
            a = tl.load(src + rows[:, None] * W + (k + ks)[None, :], mask=mask, other=0.0)
            w = tl.load(wt_ptr + layer * W * W + (k + ks)[:, None] * W + cols[None, :])
            acc += tl.dot(a, w, input_precision="ieee")
        h = tl.maximum(acc + tl.load(b_ptr + layer * W + cols)[None, :], 0.0)
        tl.debug_barrier()          # every warp has read this layer's input rows
        tl.store(y_ptr + rows[:, None] * W + cols[None, :], h, mask=mask)
        tl.debug_barrier()          # the next layer reads what other warps stored


def variants(h):
    for bm in (16, 32, 64) if h <= 256 else ():     # wider: W.T does not fit in registers
        for warps in (4, 8):
            yield f"full bm{bm} w{warps}", mlp_full, dict(BM=bm), warps
    for bm in (16, 32, 64):
        for bk in (16, 32):
            for warps in (4, 8):
                yield f"kloop bm{bm} bk{bk} w{warps}", mlp_kloop, dict(BM=bm, BK=bk), warps


def run_cell(batch, h, deadline):
    model, layers, x, y64, us, err = default_plan(batch, h)
    rows = [(f"{batch}x{h}", "default plan (whole graph)", "", "", us, err)]
    wt = torch.stack([l.weight.detach().t().contiguous() for l in layers]).contiguous()
    b = torch.stack([l.bias.detach() for l in layers]).contiguous()
    for name, kernel, meta, warps in variants(h):
        if time.time() > deadline:
            rows.append((f"{batch}x{h}", name, "", "", float("nan"), "deadline"))
            continue
        out = torch.empty(batch, h, device="cuda")
        grid = (triton.cdiv(batch, meta["BM"]),)

        def fn(xx, kernel=kernel, meta=meta, warps=warps, out=out, grid=grid):
            kernel[grid](xx, wt, b, out, batch, L=LAYERS, W=h, num_warps=warps, **meta)
            return out
        rows.append(kernel_row(
            f"{batch}x{h}", name, fn=fn, x=x, y64=y64,
            launch=lambda kernel=kernel, meta=meta, warps=warps, out=out, grid=grid: kernel[grid](
                x, wt, b, out, batch, L=LAYERS, W=h, num_warps=warps, **meta)))
    return rows


def main():
    probe_main("narrow MLP probe", "1024x128,4096x128,1024x256,4096x256", 200, run_cell, 30)


if __name__ == "__main__":
    main()
