"""Probe: 3xTF32 GEMM tiles at small batch (1-64 rows), timed as 8-layer chains (GPU time).

    python -m benchmarks.x3_small_probe [--cells 16x2048,64x1024] [--variants ...]

Why: at 64 rows the generated GEMM runs fp32 on the CUDA cores (row-wise IEEE form), 8.6 us a
layer at width 1024 for 134 MFLOP; 3xTF32 with the tiles chosen so far (builtin dot, 64 x 64,
split-K) measured slower in the chain. At <= 16 rows the generated GEMM is the IEEE GEMV,
which reads W at about half of HBM bandwidth at batch 16, width 2048. A tl.dot needs 16 rows,
so 3xTF32 at 1-16 rows pads the tile; the arithmetic is free there, the bytes are what count.
This times, per cell, the chain as fxfuse plans it (tf32x3 off and "auto") and the chain with
every Linear forced to a 3xTF32 GEMM of given tiles (row-wise limit lifted for the probe),
each as its CUDA graph replayed back to back (benchmarks.common.time_per_call).
"""
import argparse

import torch

import fxfuse
import fxfuse.gemm_config as gc
import fxfuse.gemm_kernel as gk
import fxfuse.passes.fuse_gemm as fg
import fxfuse.passes.plan_linears as pl

from .common import time_per_call
from .mlp import seed_cells

# name -> (block_m (0: 16 up to 16 rows, else 64), block_n, block_k, warps, stages, split_weights, split-K factor vs _split_k)
VARIANTS = {
    "n16 k64": (0, 16, 64, 4, 4, False, 1.0),
    "n32 k64": (0, 32, 64, 4, 4, False, 1.0),
    "n64 k32": (0, 64, 32, 4, 4, False, 1.0),
    "n32 k128 s3": (0, 32, 128, 4, 3, False, 1.0),
    "n16 k128 s3": (0, 16, 128, 4, 3, False, 1.0),
    "n32 k64 sk/2": (0, 32, 64, 4, 4, False, 0.5),
    "n32 k64 sk x2": (0, 32, 64, 4, 4, False, 2.0),
    "n64 k64 w8": (0, 64, 64, 8, 3, False, 1.0),
    "split n32 k64": (0, 32, 64, 4, 4, True, 1.0),
    "split n64 k32": (0, 64, 32, 4, 4, True, 1.0),
    "m32 n64 k32": (32, 64, 32, 4, 4, False, 1.0),
    "m32 n32 k64": (32, 32, 64, 4, 4, False, 1.0),
}

VARIANTS_64 = {   # --set 64: past 16 rows, where W's bytes and the split-K fixup are what count
    "n64 k64 p3": (0, 64, 64, 4, 3, False, 1.0),
    "n128 k32 p3": (0, 128, 32, 4, 3, False, 1.0),
    "n128 k64 p3 w8": (0, 128, 64, 8, 3, False, 1.0),
    "n64 k128 p2": (0, 64, 128, 4, 2, False, 1.0),
    "n32 k128 p3": (0, 32, 128, 4, 3, False, 1.0),
    "n32 k128 sk x2": (0, 32, 128, 4, 3, False, 2.0),
    "n64 k64 sk x2": (0, 64, 64, 4, 3, False, 2.0),
    "n64 k64 sk/2": (0, 64, 64, 4, 3, False, 0.5),
    "n32 k256 p2": (0, 32, 256, 4, 2, False, 1.0),
    "n128 k64 sk x2 w8": (0, 128, 64, 8, 3, False, 2.0),
    "n64 k32 p5": (0, 64, 32, 4, 5, False, 1.0),
    "split n64 k64 p3": (0, 64, 64, 4, 3, True, 1.0),
    "n32 k128 p4": (0, 32, 128, 4, 4, False, 1.0),
    "n16 k256 p3": (0, 16, 256, 4, 3, False, 1.0),
}


def _patched_config(variant):
    bm0, bn, bk, warps, stages, split_weights, sk = variant
    original = gc.choose_gemm_config

    def config(m, spec, allow_tf32=False, tf32x3=False, **override):
        if not tf32x3:
            return original(m, spec, allow_tf32, tf32x3, **override)
        bm = bm0 or (16 if m <= 16 else 64)
        _, split = gc._split_k(m, spec.n, spec.k, bm, bn, bk)
        split = max(1, min(gc.MAX_SPLIT_K, int(split * sk)))
        while split > 1 and spec.k < bk * split:
            split //= 2
        return gc.GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                             num_stages=stages, precision="tf32x3", split_weights=split_weights)
    return config


def _time_plan(model, inputs, ref, layers, **options):
    with torch.no_grad():
        opt = fxfuse.optimize(model, inputs[0], **options)
        spec = next(iter(opt._specializations.values()))
        err = ((opt(inputs[1]) - ref).norm() / ref.norm()).item()
        gemms = [m for m in spec.gm.modules() if isinstance(m, gk.EpilogueGemm)]
        x3 = sum(g.config.precision == "tf32x3" for g in gemms)
        us = time_per_call(lambda _x: spec.graph.replay(), inputs).us
        c = gemms[0].config if gemms else None
        note = (f"{c.block_m}x{c.block_n}x{c.block_k}/s{c.split_k}/w{c.num_warps}/p{c.num_stages}"
                f"{'/sw' if c.split_weights else ''} x3:{x3}") if c else f"{fxfuse.stats(opt)}"
        return us, err, note, x3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="16x2048,16x1024,16x512,64x1024,64x512,64x2048,1x2048,1x1024,16x4096")
    ap.add_argument("--variants", help="comma list of variant names (default all)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--set", choices=("small", "64"), default="small", help="which variant table")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    table = VARIANTS_64 if args.set == "64" else VARIANTS
    variants = {k: table[k] for k in args.variants.split(",")} if args.variants else table
    print(f"x3 small-batch probe: {args.layers} layers fp32 (TF32 off), {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {__import__('triton').__version__}; GPU us per call of the graph; "
          "err = relative error vs float64", flush=True)
    for cell, model, inputs, ref in seed_cells(args.cells, args.layers):
        for label, opts in (("plan ieee", dict(strassen="auto")), ("plan all", dict(strassen="auto", tf32x3="auto"))):
            try:
                us, err, note, _ = _time_plan(model, inputs, ref, args.layers, **opts)
                print(f"{cell:>8} {label:16s} {us:9.1f} us  err {err:.1e}  {note}", flush=True)
            except Exception as e:  # noqa: BLE001 -- a probe: report and go on
                print(f"{cell:>8} {label:16s} failed: {type(e).__name__} {str(e)[:120]}", flush=True)
        saved = (fg.choose_gemm_config, gc.ROWWISE_MAX_BATCH, fg.GEMM_ROWWISE_MAX_BATCH,
                 pl.GEMM_ROWWISE_MAX_BATCH)
        for label, variant in variants.items():
            config = _patched_config(variant)
            fg.choose_gemm_config = config
            gc.ROWWISE_MAX_BATCH = fg.GEMM_ROWWISE_MAX_BATCH = pl.GEMM_ROWWISE_MAX_BATCH = 0
            try:
                us, err, note, x3 = _time_plan(model, inputs, ref, args.layers, gemm="force", tf32x3="force",
                                               fused_mlp="off", strassen="off")
                flag = "" if x3 == args.layers else "  (NOT all layers x3)"
                print(f"{cell:>8} {label:16s} {us:9.1f} us  err {err:.1e}  {note}{flag}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{cell:>8} {label:16s} failed: {type(e).__name__} {str(e)[:120]}", flush=True)
            finally:
                (fg.choose_gemm_config, gc.ROWWISE_MAX_BATCH, fg.GEMM_ROWWISE_MAX_BATCH,
                 pl.GEMM_ROWWISE_MAX_BATCH) = saved


if __name__ == "__main__":
    main()
