"""Probe: the fully fused MLP with its fp32 tl.dot products in 3xTF32 (GPU time of the graph).

    python -m benchmarks.mlp_x3_probe [--cells 1024x128,4096x256]

Why: in fp32 with TF32 off the fused MLP's tl.dot is FMA code, so past the row-wise batches it
is used only for chains of identical layers up to width 128 (the looped form); hidden 128-256
at batch 256-4096 run per-layer GEMMs instead (8 layers, H100: 128 x 1024 25.7 us, 256 x 1024
57.8). With input_precision="tf32x3" the same kernel runs on tensor cores. This times, per
cell, the chain as fxfuse-all plans it and the fused MLP forced with tf32x3 dots over a few
configs, each as its CUDA graph replayed back to back, with the error against float64.
"""
import argparse

import torch

import fxfuse
import fxfuse.passes.fuse_mlp as fm
from fxfuse.mlp_kernel import FusedMLP
from fxfuse.mlp_spec import KernelConfig, why_not_kernel

from .common import time_per_call
from .mlp import seed_cells

# name -> (block_m, warps, max_tile, looped)
VARIANTS = {
    "m16 w4 t64": (16, 4, 64, False),
    "m32 w4 t64": (32, 4, 64, False),
    "m64 w4 t64": (64, 4, 64, False),
    "m32 w8 t64": (32, 8, 64, False),
    "m64 w8 t64": (64, 8, 64, False),
    "m16 w4 t128": (16, 4, 128, False),
    "m32 w8 t128": (32, 8, 128, False),
    "m64 w8 t128": (64, 8, 128, False),
    "loop m32 w8 t128": (32, 8, 128, True),
    "loop m64 w8 t128": (64, 8, 128, True),
    "loop m64 w8 t256": (64, 8, 256, True),
    "loop m128 w8 t128": (128, 8, 128, True),
}


def _graph_us(opt, inputs, ref):
    spec = next(iter(opt._specializations.values()))
    err = ((opt(inputs[1]) - ref).norm() / ref.norm()).item()
    us = time_per_call(lambda _x: spec.graph.replay(), inputs).us
    mlps = [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]
    return us, err, mlps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="256x128,1024x128,4096x128,256x256,1024x256,4096x256")
    ap.add_argument("--variants", help="comma list of variant names (default all)")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    variants = {k: VARIANTS[k] for k in args.variants.split(",")} if args.variants else VARIANTS
    print(f"fused MLP 3xTF32 probe: {args.layers} layers fp32 (TF32 off), {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {__import__('triton').__version__}; GPU us per call of the graph; "
          "err = relative error vs float64", flush=True)
    for cell, model, inputs, ref in seed_cells(args.cells, args.layers):
        with torch.no_grad():
            eager = ((model(inputs[1]) - ref).norm() / ref.norm()).item()
            print(f"{cell:>9} eager fp32 err {eager:.1e}", flush=True)
            for label, opts in (("plan ieee", dict(strassen="auto")), ("plan all", dict(strassen="auto", tf32x3="auto"))):
                try:
                    us, err, mlps = _graph_us(fxfuse.optimize(model, inputs[0], **opts), inputs, ref)
                    print(f"{cell:>9} {label:18s} {us:9.1f} us  err {err:.1e}  fused MLPs {len(mlps)}", flush=True)
                except Exception as e:  # noqa: BLE001 -- a probe: report and go on
                    print(f"{cell:>9} {label:18s} failed: {type(e).__name__} {str(e)[:120]}", flush=True)
            original = fm.choose_config
            for label, (bm, warps, tile, looped) in variants.items():
                def config(spec, batch, allow_tf32=False, numels=None, **override):
                    return KernelConfig(block_m=bm, rowwise=False, num_warps=warps, precision="tf32x3",
                                        max_tile=tile, looped=looped)
                fm.choose_config = config
                try:
                    opt = fxfuse.optimize(model, inputs[0], fused_mlp="force", gemm="off", strassen="off")
                    us, err, mlps = _graph_us(opt, inputs, ref)
                    why = why_not_kernel(mlps[0].spec, mlps[0].config) if mlps else "no fused MLP built"
                    note = f"fused MLPs {len(mlps)}" + (f" ({why})" if why else "")
                    print(f"{cell:>9} {label:18s} {us:9.1f} us  err {err:.1e}  {note}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{cell:>9} {label:18s} failed: {type(e).__name__} {str(e)[:120]}", flush=True)
                finally:
                    fm.choose_config = original


if __name__ == "__main__":
    main()
