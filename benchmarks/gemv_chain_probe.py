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
import argparse
import time

import torch
import triton
import triton.language as tl

from benchmarks.fused_form_probe import default_plan, seed
from benchmarks.mlp_probe import graphed, max_rel_err, per_call_us

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
            try:
                ck = gemv_chain[(batch,)](x, w, b, out, L=LAYERS, H=h, PREFETCH=prefetch, num_warps=warps)
                replay, y = graphed(fn, x)
                rows.append((f"{batch}x{h}", name, getattr(ck, "n_regs", "?"), getattr(ck, "n_spills", "?"),
                             per_call_us(replay), max_rel_err(y, y64)))
            except Exception as e:  # noqa: BLE001 -- a probe: record and go on
                rows.append((f"{batch}x{h}", name, "", "", float("nan"), f"{type(e).__name__}: {str(e)[:80]}"))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1x128,16x128,64x128,256x128,1x64,64x64,1x256,16x256")
    ap.add_argument("--budget-s", type=float, default=200)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    deadline = time.time() + a.budget_s
    print(f"gemv chain probe, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{LAYERS} layers fp32 (TF32 off); GPU us of the kernel alone in a CUDA graph")
    print(f"{'cell':8} {'variant':30} {'regs':>5} {'spills':>7} {'us':>9}  err")
    for c in a.cells.split(","):
        batch, h = map(int, c.split("x"))
        for r in run_cell(batch, h, deadline):
            err = f"{r[5]:.1e}" if isinstance(r[5], float) else r[5]
            print(f"{r[0]:8} {r[1]:30} {r[2]!s:>5} {r[3]!s:>7} {r[4]:9.2f}  {err}", flush=True)


if __name__ == "__main__":
    main()
