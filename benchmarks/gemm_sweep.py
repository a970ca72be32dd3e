"""Sweep: tl.dot tile sizes, split-K, warps and stages of the epilogue GEMM at batch >= 64.

    python -m benchmarks.gemm_sweep --cells 64x1024,256x2048 --budget-s 200

Why: at batch 64 and 256 the fp32 (IEEE, TF32 off) layer is bound by the FMA-based tl.dot, and
choose_gemm_config's rule (64x64 tiles, split-K to ~one program per SM, 4 warps) was set from a
handful of variants (benchmarks/gemm_probe.py). This times a wider grid per cell, one layer
relu(x @ W.T + b) in a CUDA graph of back-to-back calls, next to the library and the current
choice, and prints the fastest configs. Each cell stops after --budget-s seconds (compiles
dominate), fastest-looking candidates first.
"""
import argparse
import itertools
import json
import os
import time
import types

import torch
import torch.nn.functional as F

from benchmarks.autotune_cells import per_call_us
from benchmarks.gemm_probe import probe

SMS = 132


def candidates(m: int, h: int, rowwise_only: bool = False):
    """Overrides to try, ordered so that the likely ones come first."""
    out = []
    for bm, bn, bk, split, warps in itertools.product([16, 32, 64], [2, 4, 8, 16], [32, 64, 128, 256], [1, 2, 4, 8],
                                                      [4, 8]):
        programs = -(-m // bm) * -(-h // bn) * split   # row-wise form
        if bm * bn * bk <= 2048 * warps and h >= split * bk and programs <= 32 * SMS and bm <= max(16, m):
            score = abs(programs - 2 * SMS) / SMS / 4 + (bm != 16) * 0.2 + (warps != 4) * 0.3
            out.append((score, dict(rowwise=True, block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps)))
    if rowwise_only:
        return [o for _, o in sorted(out, key=lambda t: t[0])]
    for (bm, bn), bk, split, warps, stages in itertools.product(
            [(64, 64), (64, 128), (128, 64), (128, 128), (32, 64), (64, 32), (32, 128), (128, 32),
             (16, 16), (16, 32), (32, 16), (32, 32), (16, 64)],
            [32, 16, 64], [1, 2, 4, 8, 16], [4, 8], [3, 2, 4]):
        tiles = -(-m // bm) * -(-h // bn)
        if tiles * split > 4 * SMS or h < split * bk * 2 or bm > max(32, m):
            continue
        if warps == 4 and bm * bn > 64 * 128 or warps == 8 and bm * bn < 64 * 64 or tiles * split < 8:
            continue
        score = abs(tiles * split - SMS) / SMS + (stages != 3) * 0.5 + (bk != 32) * 0.3
        out.append((score, dict(rowwise=False, block_m=bm, block_n=bn, block_k=bk, split_k=split,
                                num_warps=warps, num_stages=stages)))
    return [o for _, o in sorted(out, key=lambda t: t[0])]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="64x1024,256x2048")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--rowwise-only", action="store_true", help="only the row-wise (broadcast-reduce) form")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    timing = types.SimpleNamespace(reps=3, min_rep_ms=3.0)
    results = []
    for cell in args.cells.split(","):
        m, h = (int(v) for v in cell.split("x"))
        x, w, b = torch.randn(m, h, device="cuda"), torch.randn(h, h, device="cuda"), torch.randn(h, device="cuda")
        library = per_call_us(lambda: F.linear(x, w, b), torch.device("cuda"), timing)
        chosen, note = probe(m, h, "chosen", {}, timing)
        rows = [dict(label="chosen", us=chosen, note=note)]
        start = time.perf_counter()
        for override in candidates(m, h, args.rowwise_only):
            if time.perf_counter() - start > args.budget_s:
                break
            try:
                us, note = probe(m, h, "", override, timing)
            except Exception as e:  # noqa: BLE001 -- a config that fails is a result too
                us, note = None, f"{type(e).__name__}: {str(e)[:100]}"
            rows.append(dict(label=str(override), us=us, note=note))
        done = [r for r in rows if r["us"]]
        done.sort(key=lambda r: r["us"])
        print(f"== m={m} h={h}: library {library:.2f} us, chosen {chosen:.2f} us, {len(rows) - 1} tried in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        for r in done[:12]:
            print(f"  {r['us']:7.2f}  {r['note']}", flush=True)
        results.append(dict(m=m, h=h, library=library, rows=rows))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemm_sweep.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
