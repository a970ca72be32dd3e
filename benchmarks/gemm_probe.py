"""Probe: block sizes and forms of the epilogue GEMM (fxfuse/gemm_kernel.py), checked and timed.

    python -m benchmarks.gemm_probe                       # default shapes and configs, ~2 minutes
    python -m benchmarks.gemm_probe --m 16,64 --h 1024    # a subset

Why: `choose_gemm_config` holds the rules (row-wise up to batch 16, columns per program, split-K);
this times the alternatives around them for one layer, relu(x @ W.T + b), fp32 with TF32 off,
each in a CUDA graph of back-to-back calls (benchmarks.autotune_cells.per_call_us), next to the
library GEMM with its bias (F.linear) and what choose_gemm_config picks ("chosen").
"""
import argparse
import json
import os
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks import common
from benchmarks.autotune_cells import per_call_us

VARIANTS = {   # label -> GemmConfig overrides; the row-wise ones get block_m from the batch
    "chosen": {},
    "dot16x64": dict(rowwise=False, block_m=16, block_n=64, block_k=32, split_k=1),
    "dot32x32s2": dict(rowwise=False, block_m=32, block_n=32, block_k=32, split_k=2),
    "dot64x32s2": dict(rowwise=False, block_m=64, block_n=32, block_k=32, split_k=2),
    "dot64x64s4": dict(rowwise=False, block_m=64, block_n=64, block_k=32, split_k=4),
    "row n1": dict(rowwise=True, block_n=1, block_k=256, split_k=1),
    "row n4": dict(rowwise=True, block_n=4, block_k=256, split_k=1),
    "row n16 k32": dict(rowwise=True, block_n=16, block_k=32, split_k=1),
    "row n16 k32 s2": dict(rowwise=True, block_n=16, block_k=32, split_k=2),
    "row n8 k64": dict(rowwise=True, block_n=8, block_k=64, split_k=1),
}


def probe(m, h, label, override, args):
    from fxfuse.gemm_kernel import EpilogueGemm, GemmSpec, Pointwise, choose_gemm_config, why_not_gemm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(h, h), nn.ReLU()).eval().cuda()
    spec = GemmSpec(h, h, torch.float32, (Pointwise(1, "add", (("value", 0), ("vector", 0))),
                                          Pointwise(2, "relu", (("value", 1),))), 2)
    override = dict(override)
    if override.get("rowwise") and "block_m" not in override:   # block_m given: the sweep's row-wise tiles
        if m > 16:
            return None, "row-wise is for batch <= 16"
        override["block_m"] = 1 << (m - 1).bit_length()
        override["block_k"] = min(override["block_k"], max(16, 8192 // (override["block_m"] * override["block_n"])))
    config = choose_gemm_config(m, spec, **override)
    problem = why_not_gemm(spec, config)
    if problem:
        return None, problem
    mod = EpilogueGemm(spec, model[0].weight, [model[0].bias], torch.fx.symbolic_trace(model), (), config=config)
    x = torch.randn(m, h, device="cuda")
    with torch.no_grad():
        err = ((mod(x).double() - model.double()(x.double())).abs().max()).item()
        model.float()
        us = per_call_us(lambda: mod(x), torch.device("cuda"), args)
    return us, f"err {err:.1e} {config}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,4,16,64")
    ap.add_argument("--h", default="128,512,1024,2048")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    timing = types.SimpleNamespace(reps=5, min_rep_ms=5.0)
    rows = []
    for h in common.csv_ints(args.h):
        for m in common.csv_ints(args.m):
            x, w, b = torch.randn(m, h, device="cuda"), torch.randn(h, h, device="cuda"), torch.randn(h, device="cuda")
            row = {"m": m, "h": h, "library": per_call_us(lambda: F.linear(x, w, b), torch.device("cuda"), timing)}
            for label, override in VARIANTS.items():
                try:
                    us, note = probe(m, h, label, override, timing)
                except Exception as e:  # noqa: BLE001 -- a config that fails is a result too
                    us, note = None, f"{type(e).__name__}: {str(e)[:120]}"
                row[label] = us
                if label == "chosen" or us is None:
                    row[label + " note"] = note
            rows.append(row)
            best = min((k for k in VARIANTS if row[k]), key=lambda k: row[k])
            print(f"m={m} h={h}: library {row['library']:.2f} | " +
                  " | ".join(f"{k} {row[k]:.2f}" if row[k] else f"{k} -" for k in VARIANTS) +
                  f"  best {best}; chosen: {row['chosen note']}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemm_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
