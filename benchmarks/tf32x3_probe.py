"""Probe: fp32 GEMMs on tensor cores with the 3xTF32 split (tl.dot input_precision="tf32x3").

    python -m benchmarks.tf32x3_probe                          # default shapes, a few minutes
    python -m benchmarks.tf32x3_probe --m 64,1024 --h 1024     # a subset

Why: fp32 with TF32 off runs on the CUDA cores (cuBLAS: 51.6 TFLOP/s on the H100, Triton's
"ieee" dot about a third of that at small batch). 3xTF32 splits each fp32 operand into a TF32
high part and a TF32 low part and sums three tensor-core products (hi*hi + hi*lo + lo*hi),
which keeps about 21 of fp32's 24 mantissa bits. This times one layer relu(x @ W.T + b) per
config in a CUDA graph next to the library's F.linear and the row-wise/ieee plan, and reports
each one's relative error (Frobenius) against a float64 product.
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

CONFIGS = {   # label -> GemmConfig overrides for the tl.dot form with tf32x3
    "64x64x32 w4": dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3),
    "64x128x32 w4": dict(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3),
    "128x64x32 w4": dict(block_m=128, block_n=64, block_k=32, num_warps=4, num_stages=3),
    "128x128x32 w8": dict(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3),
    "128x128x32 w8 s4": dict(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4),
    "128x256x32 w8": dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=3),
    "32x64x32 w4": dict(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=4),
    "16x64x64 w4": dict(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=4),
}


def rel_err(got, ref64):
    return ((got.double() - ref64).norm() / ref64.norm()).item()


def main(argv=None):
    from fxfuse.gemm_kernel import EpilogueGemm, GemmSpec, Pointwise, _split_k, choose_gemm_config
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="16,64,256,1024,4096")
    ap.add_argument("--h", default="512,1024,2048,4096,8192")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    timing = types.SimpleNamespace(reps=5, min_rep_ms=5.0)
    dev = torch.device("cuda")
    rows = []
    for h in common.csv_ints(args.h):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(h, h), nn.ReLU()).eval().cuda()
        gm = torch.fx.symbolic_trace(model)
        spec = GemmSpec(h, h, torch.float32, (Pointwise(1, "add", (("value", 0), ("vector", 0))),
                                              Pointwise(2, "relu", (("value", 1),))), 2)
        w, b = model[0].weight.detach(), model[0].bias.detach()
        for m in common.csv_ints(args.m):
            if m * h * h > 4096 * 8192 * 8192:
                continue
            x = torch.randn(m, h, device=dev)
            with torch.no_grad():
                ref = torch.relu(x.double() @ w.double().t() + b.double())
                row = {"m": m, "h": h}
                lib = lambda: F.relu(F.linear(x, w, b))  # noqa: E731
                row["library"] = (per_call_us(lib, dev, timing), rel_err(lib(), ref))
                variants = {"chosen(ieee)": {}}
                for label in args.configs.split(","):
                    cfg = dict(CONFIGS[label])
                    if cfg["block_m"] > max(16, m) * 2:
                        continue
                    _, split = _split_k(m, h, h, cfg["block_m"], cfg["block_n"], cfg["block_k"])
                    variants["x3 " + label] = dict(cfg, rowwise=False, precision="tf32x3", split_k=split)
                variants["tf32 128x128x32 w8"] = dict(CONFIGS["128x128x32 w8"], rowwise=False, precision="tf32",
                                                      split_k=_split_k(m, h, h, 128, 128, 32)[1])
                for label, override in variants.items():
                    try:
                        cfg = choose_gemm_config(m, spec, **override)
                        mod = EpilogueGemm(spec, w, [b], gm, (), config=cfg)
                        err = rel_err(mod(x), ref)
                        row[label] = (per_call_us(lambda: mod(x), dev, timing), err)
                    except Exception as e:  # noqa: BLE001 -- a config that fails is a result too
                        row[label] = (None, f"{type(e).__name__}: {str(e)[:100]}")
            rows.append(row)
            x3 = {k: v for k, v in row.items() if k.startswith("x3") and v[0]}
            best = min(x3, key=lambda k: x3[k][0]) if x3 else None
            flops = 2 * m * h * h
            line = f"m={m} h={h}: library {row['library'][0]:.1f} us err {row['library'][1]:.1e}"
            line += f" | ieee {row['chosen(ieee)'][0] or 0:.1f} err {row['chosen(ieee)'][1]}"
            if best:
                line += f" | best x3 {best} {x3[best][0]:.1f} us ({flops / x3[best][0] / 1e6:.0f} TF/s) err {x3[best][1]:.1e}"
                line += f" | lib/x3 {row['library'][0] / x3[best][0]:.2f}x"
            tf = row["tf32 128x128x32 w8"]
            line += f" | tf32 {tf[0] or 0:.1f} err {tf[1]}"
            print(line, flush=True)
            print("   " + " | ".join(f"{k} {v[0]:.1f}" for k, v in row.items() if isinstance(v, tuple) and v[0]), flush=True)
            fails = [f"{k}: {v[1]}" for k, v in row.items() if isinstance(v, tuple) and v[0] is None]
            if fails:
                print("   failed: " + "; ".join(fails), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tf32x3_probe.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
