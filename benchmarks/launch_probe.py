"""Probe: what programmatic dependent launch, the weight prefetch and bound inputs save (A/B).

    python -m benchmarks.launch_probe                       # the issue-5 cells, 8 layers
    python -m benchmarks.launch_probe --cells 1x128,64x1024

For each cell (batch x hidden of the seed network) and each combination of the two switches,
one fxfuse build (defaults otherwise) timed like the benchmark (benchmarks.common.time_per_call:
back-to-back calls on 4 rotating random inputs, CUDA events, median of 7), plus the replay of
its CUDA graph alone (GPU time where the host keeps up) and eager captured by hand for scale.
Switches: kernel.PDL_ENABLED (gdc_wait/launch_pdl in the epilogue GEMM),
gemm_kernel.PREFETCH_ELEMENTS (W read before the wait: 1 = the first K step only) and
input_copy.BIND_INPUTS (the graph's memcpy node re-pointed at the input; off = tensor.copy_).
"""
import argparse

import torch

import fxfuse
import fxfuse.gemm_kernel
import fxfuse.input_copy
import fxfuse.kernel

from .common import time_per_call
from .mlp import seed_cells
from .tools import build_cudagraph


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="1x128,16x128,1x512,16x512,1x1024,16x1024,1x2048,16x2048,64x1024")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefetch", type=lambda t: [int(v) for v in t.split(",")], default=[1, 4096],
                    help="PREFETCH_ELEMENTS values to compare (1: the first K step only)")
    ap.add_argument("--only-pdl", action="store_true", help="skip the two variants without PDL")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"launch probe: {args.layers} layers, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}; us per call (graph = its replay alone)")
    variants = {"copy_, no PDL": (False, False, 1), "bound, no PDL": (False, True, 1)}
    variants.update({f"bound, PDL, prefetch {n}": (True, True, n) for n in args.prefetch})
    if args.only_pdl:
        variants = {k: v for k, v in variants.items() if v[0]}
    print(f"{'cell':>10} {'eager+graph':>11} " + " ".join(f"{v:>26}" for v in variants))
    defaults = (fxfuse.kernel.PDL_ENABLED, fxfuse.input_copy.BIND_INPUTS, fxfuse.gemm_kernel.PREFETCH_ELEMENTS)
    for cell, model, inputs, _ in seed_cells(args.cells, args.layers):
        with torch.no_grad():
            row = [time_per_call(build_cudagraph(model, inputs[0]), inputs).us]
            ref = model(inputs[1])
            for pdl, bind, prefetch in variants.values():
                fxfuse.kernel.PDL_ENABLED, fxfuse.input_copy.BIND_INPUTS = pdl, bind
                fxfuse.gemm_kernel.PREFETCH_ELEMENTS = prefetch
                opt = fxfuse.optimize(model, inputs[0])
                spec = next(iter(opt._specializations.values()))
                err = ((opt(inputs[1]) - ref).norm() / ref.norm()).item()
                whole = time_per_call(opt, inputs).us
                replay = time_per_call(lambda _x: spec.graph.replay(), inputs).us if spec.graph else float("nan")
                row.append((whole, replay, err))
        cells = " ".join(f"    {w:8.1f} (graph {r:5.1f})  " for w, r, _ in row[1:])
        print(f"{cell:>10} {row[0]:11.1f} {cells}  max rel err {max(e for *_, e in row[1:]):.1e}", flush=True)
    fxfuse.kernel.PDL_ENABLED, fxfuse.input_copy.BIND_INPUTS, fxfuse.gemm_kernel.PREFETCH_ELEMENTS = defaults


if __name__ == "__main__":
    main()
