"""Probe: row-wise GEMM tiles for small batch, timed as 8-layer chains with PDL (GPU time).

    python -m benchmarks.rowwise_probe [--cells 1x1024,16x512]

gemm_probe.py times one layer alone; with programmatic dependent launch a layer's weight read
overlaps the previous layer, so tiles are compared here the way they run: the seed network,
gemm="force", the CUDA graph's replay timed back to back (benchmarks.common.time_per_call).
Each variant changes the chosen row-wise config (gemm_config._rowwise_config) by one field.
"""
import argparse

import torch

import fxfuse
import fxfuse.gemm_config as gc
import fxfuse.gemm_kernel as gk

from .common import make_inputs, time_per_call
from .mlp import seed_mlp

VARIANTS = {
    "chosen": {},
    "block_n x2": {"block_n": 2.0},
    "block_n /2": {"block_n": 0.5},
    "block_k x2": {"block_k": 2.0},
    "block_k /2": {"block_k": 0.5},
    "8 warps": {"num_warps": 8},
    "2 warps": {"num_warps": 2},
    "n /4, k x2": {"block_n": 0.25, "block_k": 2.0},   # gemm_sweep's best single layer at 16 x 2048
    "m /2, 4 warps": {"block_m": 0.5, "num_warps": 4},  # past 16 rows: fewer rows per program
    "m /2, n x2, w4": {"block_m": 0.5, "block_n": 2.0, "num_warps": 4},   # gemm_sweep's best at 64 x 512
    "m x2": {"block_m": 2.0},
    "split 2": {"split_k": 2},                              # serial split-K: fewer x re-reads per program
    "n x2 split 2": {"block_n": 2.0, "split_k": 2},
    "n x4 split 4": {"block_n": 4.0, "split_k": 4},
    "n x4 k /2 s4": {"block_n": 4.0, "block_k": 0.5, "split_k": 4},
}

PIPE = {"pipelined": True}
PIPELINED_VARIANTS = {   # --set pipelined: the K loop as tl.range(num_stages=...), loads through shared memory
    "chosen": {},
    "plain loop": {"pipelined": False, "num_stages": 3},
    "pipe s2": {**PIPE, "num_stages": 2},
    "pipe s3": {**PIPE, "num_stages": 3},
    "pipe s4": {**PIPE, "num_stages": 4},
    "s3 n x2": {**PIPE, "num_stages": 3, "block_n": 2.0},
    "s3 k x2": {**PIPE, "num_stages": 3, "block_k": 2.0},
    "s3 k /2": {**PIPE, "num_stages": 3, "block_k": 0.5},
    "s3 8 warps": {**PIPE, "num_stages": 3, "num_warps": 8},
    "s3 n x2 k /2": {**PIPE, "num_stages": 3, "block_n": 2.0, "block_k": 0.5},
    "s4 n x4 k /4": {**PIPE, "num_stages": 4, "block_n": 4.0, "block_k": 0.25},
    "s3 m /2": {**PIPE, "num_stages": 3, "block_m": 0.5},
}

LOAD_VARIANTS = {   # --set loads: cache hints on the row-wise loads (source rewrites of the generated kernel)
    "chosen": {},
    "w .cg": {"w": ", cache_modifier='.cg'"},
    "w evict_first": {"w": ", eviction_policy='evict_first'"},
    "x evict_last": {"x": ", eviction_policy='evict_last'"},
    "w ef, x el": {"w": ", eviction_policy='evict_first'", "x": ", eviction_policy='evict_last'"},
    "w .cg, x el": {"w": ", cache_modifier='.cg'", "x": ", eviction_policy='evict_last'"},
    "n x2 w8": {"block_n": 2.0, "num_warps": 8},
    "n x4 k /2 w8": {"block_n": 4.0, "block_k": 0.5, "num_warps": 8},
}


def with_load_hints(source: str, w: str = "", x: str = "") -> str:
    """The generated row-wise kernel with extra tl.load keywords on its W loads (the prefetched
    ones and the loop's) and its x loads."""
    lines = []
    for line in source.splitlines():
        if w and ("tl.load(w_rows" in line):
            line = line.replace("other=0.0)", "other=0.0" + w + ")", 1)
        if x and ("tl.load(x_rows" in line):
            line = line.replace("other=0.0)", "other=0.0" + x + ")", 1)
        lines.append(line)
    return "\n".join(lines) + "\n"


def patched(change):
    original = gc._rowwise_config

    def config(m, spec, allow_tf32):
        cfg = original(m, spec, allow_tf32)
        for key, value in change.items():
            if key in ("w", "x"):
                continue
            cfg[key] = max(1, int(cfg[key] * value)) if isinstance(value, float) else value
        return cfg
    return original, config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="1x128,1x512,1x1024,1x2048,16x512,16x1024")
    ap.add_argument("--variants", help="comma list of variant names (default all)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    ap.add_argument("--set", choices=("tiles", "pipelined", "loads"), default="tiles", help="which variant table")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    print(f"rowwise probe: {args.layers} layers {args.dtype}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}; GPU us per call of the graph (config of layer 0)")
    table = {"pipelined": PIPELINED_VARIANTS, "loads": LOAD_VARIANTS}.get(args.set, VARIANTS)
    variants = {k: table[k] for k in args.variants.split(",")} if args.variants else table
    print(f"{'cell':>8} " + " ".join(f"{v:>14}" for v in variants))
    for cell in args.cells.split(","):
        batch, hidden = (int(v) for v in cell.split("x"))
        torch.manual_seed(0)
        model = seed_mlp(args.layers, hidden).cuda().eval().to(dtype)
        inputs = make_inputs((batch, hidden), dtype, torch.device("cuda"))
        ref = model(inputs[1])
        row, notes = [], []
        for change in variants.values():
            original, config = patched(change)
            gc._rowwise_config = config
            generate = gk.generate_gemm
            gk.generate_gemm = lambda *a, generate=generate, change=change: (
                lambda src, name: (with_load_hints(src, change.get("w", ""), change.get("x", "")), name))(*generate(*a))
            try:
                with torch.no_grad():
                    opt = fxfuse.optimize(model, inputs[0], gemm="force", fused_mlp="off")
                    spec = next(iter(opt._specializations.values()))
                    err = ((opt(inputs[1]) - ref).norm() / ref.norm()).item()
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    assert err < tol and fxfuse.stats(opt)["fused_kernels"] == args.layers, (err, fxfuse.stats(opt))
                    row.append(time_per_call(lambda _x: spec.graph.replay(), inputs).us)
                    c = next(m for m in spec.gm.modules() if isinstance(m, gk.EpilogueGemm)).config
                    notes.append(f"{c.block_m}x{c.block_n}x{c.block_k}/s{c.split_k}/w{c.num_warps}"
                                 + (f"/p{c.num_stages}" if c.pipelined else ""))
            except Exception as e:  # noqa: BLE001 -- a probe: report and go on
                row.append(float("nan"))
                notes.append(type(e).__name__)
            finally:
                gc._rowwise_config = original
                gk.generate_gemm = generate
        print(f"{cell:>8} " + " ".join(f"{us:14.1f}" for us in row), flush=True)
        print(f"{'':>8} " + " ".join(f"{n:>14}" for n in notes), flush=True)


if __name__ == "__main__":
    main()
