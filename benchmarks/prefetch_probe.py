"""Probe: the fully fused MLP at small batch with and without cross-layer weight prefetch.

    python -m benchmarks.prefetch_probe [--cells 1x128,1x256,16x128] [--budget-s 240]

Why: at batch 1 the fused kernel is one program that streams every weight tile from L2 right
before its product, so each tile's load latency is paid in series (52 us for 8 x 128 on the
H100, where the 8 separate PDL GEMMs take 11 us). KernelConfig.prefetch issues layer i+1's
loads before layer i's products. This times the kernel alone in a CUDA graph for each
(prefetch, num_warps, max_tile) against the default plan's graph, checks each against float64,
and prints one table.
"""
import argparse
import copy
import time

import torch
from tabulate import tabulate

import fxfuse
import passes.fuse_mlp as fuse_mlp
from fxfuse.mlp_kernel import FusedMLP, KernelConfig

from .mlp_probe import graphed, max_rel_err, per_call_us, seed_model


def variants():
    for prefetch in (False, True):
        for warps in (4, 8, 16):
            for tile in (64, 128):
                yield KernelConfig(block_m=1, rowwise=True, num_warps=warps, max_tile=tile, prefetch=prefetch)


def build_with(model, x, config):
    saved = fuse_mlp.choose_config
    fuse_mlp.choose_config = lambda spec, batch, allow_tf32=False, **kw: config
    try:
        return fxfuse.optimize(model, x, fused_mlp="force", strict=True)
    finally:
        fuse_mlp.choose_config = saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="1x128,1x256,16x128")
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    started, rows = time.perf_counter(), []
    for cell in args.cells.split(","):
        batch, h = map(int, cell.split("x"))
        model = seed_model(h)
        x = torch.randn(batch, h, device="cuda")
        with torch.no_grad():
            y64 = copy.deepcopy(model).double()(x.double())
            default = fxfuse.optimize(model, x)
            spec = next(iter(default.specializations.values()))
            rows.append([cell, "default plan", per_call_us(spec.graph.replay), per_call_us(lambda: default(x)),
                         max_rel_err(default(x), y64)])
            for config in variants():
                if time.perf_counter() - started > args.budget_s:
                    print("budget spent", flush=True)
                    break
                label = f"{'prefetch' if config.prefetch else 'plain'} w{config.num_warps} t{config.max_tile}"
                try:
                    opt = build_with(model, x, config)
                    mods = [m for s in opt.specializations.values() for m in s.gm.modules() if isinstance(m, FusedMLP)]
                    assert len(mods) == 1, "not one fused MLP"
                    replay, out = graphed(mods[0], x)
                    rows.append([cell, label, per_call_us(replay), per_call_us(lambda: opt(x)), max_rel_err(out, y64)])
                except Exception as e:  # noqa: BLE001 -- a probe: record and go on
                    rows.append([cell, label, None, None, f"{type(e).__name__}: {str(e)[:80]}"])
                print(f"  {rows[-1]}", flush=True)
    print(f"prefetch probe, {torch.cuda.get_device_name()}, torch {torch.__version__}, 8 layers fp32 (TF32 off)")
    print(tabulate(rows, headers=["cell", "variant", "graph us (GPU)", "whole call us", "max rel err"],
                   floatfmt=".2f"))


if __name__ == "__main__":
    main()
