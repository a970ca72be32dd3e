"""Probe: one program per row through a whole narrow MLP, weights prefetched a layer ahead,
weight orientation alternating so the activation never changes layout.

    python -m benchmarks.gemv_chain_probe --cells 1x128,16x128,64x128,256x128 --budget-s 200

Why: the fused-MLP forms probed before (fused_form_probe_20261123.txt) took 30-51 us for 8 x 128
at batch 1, against 11.3 us for the per-layer plan's graph, and were read as "one SM's work".
One SM reading 8 x 64 KB of weights from L2 at ~64 B/clock needs ~4.5 us, so those kernels
were latency-bound, not work-bound: each layer's weights were loaded after the previous layer
finished, and the activation went through a layout conversion (shared memory and a barrier)
between layers. Here (1) layer i + 1's weight tile is loaded before layer i is computed, and
(2) even layers store W [N, K] and reduce over axis 1, odd layers store W.T [K, N] and reduce
over axis 0: the reduction of one layer leaves the activation in the slice layout that the next
layer broadcasts, so no conversion is needed. Variants: warps, prefetch on/off. GPU time of
the kernel alone in a CUDA graph (median of back-to-back replays) next to fxfuse's default
plan graph.
"""
import time

import torch
import triton
import triton.language as tl

from benchmarks.fused_form_probe import default_plan, kernel_row, probe_main, seed

LAYERS = 8


@triton.jit
def gemv_chain(x_ptr, w_ptr, b_ptr, out_ptr, L: tl.constexpr, H: tl.constexpr, PREFETCH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, H)
    tile = r[:, None] * H + r[None, :]
    h = tl.load(x_ptr + row * H + r)
    w_next = tl.load(w_ptr + tile)
    for layer in tl.static_range(L):
        w = w_next
        if PREFETCH:
            if layer + 1 < L:
                w_next = tl.load(w_ptr + (layer + 1) * H * H + tile)
        if layer % 2 == 0:
            acc = tl.sum(w * h[None, :], axis=1)      # W [N, K]
        else:
            acc = tl.sum(w * h[:, None], axis=0)      # W.T [K, N]
        h = tl.maximum(acc + tl.load(b_ptr + layer * H + r), 0.0)
        if not PREFETCH:
            if layer + 1 < L:
                w_next = tl.load(w_ptr + (layer + 1) * H * H + tile)
    tl.store(out_ptr + row * H + r, h)


def pack(layers):
    """Even layers as W [N, K], odd layers as W.T [K, N] (contiguous), stacked."""
    return torch.stack([l.weight.detach() if k % 2 == 0 else l.weight.detach().t().contiguous()
                        for k, l in enumerate(layers)]).contiguous()


def run_cell(batch, h, deadline):
    model, layers, x, y64, us, err = default_plan(batch, h)
    rows = [(f"{batch}x{h}", "default plan (whole graph)", "", "", us, err)]
    w, b = pack(layers), torch.stack([l.bias.detach() for l in layers]).contiguous()
    for warps in (4, 8, 16):
        for prefetch in (1, 0):
            name = f"gemv chain w{warps} prefetch{prefetch}"
            if time.time() > deadline:
                rows.append((f"{batch}x{h}", name, "", "", float("nan"), "deadline"))
                continue
            out = torch.empty(batch, h, device="cuda")

            def fn(xx, warps=warps, prefetch=prefetch, out=out):
                gemv_chain[(batch,)](xx, w, b, out, L=LAYERS, H=h, PREFETCH=prefetch, num_warps=warps)
                return out
            rows.append(kernel_row(
                f"{batch}x{h}", name, fn=fn, x=x, y64=y64,
                launch=lambda warps=warps, prefetch=prefetch, out=out: gemv_chain[(batch,)](
                    x, w, b, out, L=LAYERS, H=h, PREFETCH=prefetch, num_warps=warps)))
    return rows


def main():
    probe_main("gemv chain probe", "1x128,16x128,64x128,256x128,1x64,64x64,1x256,16x256", 200, run_cell, 30)


if __name__ == "__main__":
    main()
