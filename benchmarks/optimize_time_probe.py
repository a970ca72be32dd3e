"""Probe: where fxfuse.optimize plus the first call spends its time on a large network.

    python -m benchmarks.optimize_time_probe --hidden 8192 --batch 4096 --strassen auto

Issue 3's target: optimize plus the first call under 2 s with a warm kernel cache. Runs the
build twice in one process (the first pays CUDA/cuBLAS/Triton start-up, the second is what
a warm process pays) and prints a cProfile of each and the passes' own timings.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import Counter

import torch

import fxfuse

from .mlp import seed_mlp


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--strassen", default="auto")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true", help="time only (cProfile slows the build down)")
    ap.add_argument("--imports", action="store_true", help="list the modules the first build imports, by package")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = seed_mlp(args.layers, args.hidden).cuda().eval()
    x = torch.randn(args.batch, args.hidden, device="cuda")
    for attempt in ("first in process", "second"):
        before = set(sys.modules)
        profiler = None if args.no_profile else cProfile.Profile()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        opt = fxfuse.optimize(model, x, strassen=args.strassen)
        built = time.perf_counter()
        with torch.no_grad():
            opt(x)
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        done = time.perf_counter()
        print(f"{attempt}: optimize {built - start:.2f} s, first call {done - built:.2f} s, "
              f"total {done - start:.2f} s", flush=True)
        if args.imports:
            new = sorted(set(sys.modules) - before)
            by_package = Counter(".".join(name.split(".")[:2]) for name in new)
            print(f"  {len(new)} modules imported: " + ", ".join(f"{k} {n}" for k, n in by_package.most_common(15)))
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
            print(text.getvalue())
        del opt
        torch.cuda.empty_cache()
    opt = fxfuse.optimize(model, x, strassen=args.strassen)
    print("\n".join(line for line in fxfuse.explain(opt).splitlines() if line.startswith("# ")))


if __name__ == "__main__":
    main()
