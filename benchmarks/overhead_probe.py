"""Probe: where the per-call time of a tiny optimized model goes (CPU overhead vs GPU work).

    python -m benchmarks.overhead_probe            # seed network 8 x Linear(128), batch 1

At batch 1 / hidden 128 the GPU work of a fully fused MLP is a few microseconds, so the
per-call cost is the runtime's own: guard check, input copy into the CUDA graph's static
buffer, replay, output clone. Each part is timed alone, back to back (CUDA events around
N calls, median of 7), so the sum can be compared with the whole call.
"""
import argparse
import copy
import statistics
import time

import torch

import fxfuse
from fxfuse.runtime import signature

from .mlp import seed_mlp


def per_call_us(fn, calls=200, reps=7) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def cpu_us(fn, calls=2000) -> float:
    """Host time per call; the GPU work queued meanwhile is drained first and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = seed_mlp(args.layers, args.hidden).cuda().eval()
    x = torch.randn(args.batch, args.hidden, device="cuda")
    rows = []
    with torch.no_grad():
        for label, opts in [("default", {}), ("fused mlp", dict(fused_mlp="force")),
                            ("gemm", dict(fused_mlp="off", gemm="force")), ("library", dict(fused_mlp="off", gemm="off"))]:
            opt = fxfuse.optimize(model, x, strict=True, **opts)
            spec = next(iter(opt.specializations.values()))
            ref = copy.deepcopy(model).double()(x.double())
            err = ((opt(x).double() - ref).norm() / ref.norm()).item()
            rows.append((label, "whole call", per_call_us(lambda: opt(x)), err))
            rows.append((label, "whole call (cpu)", cpu_us(lambda: opt(x)), None))
            rows.append((label, "spec(args) (cpu)", cpu_us(lambda: spec((x,))), None))
            if spec.graph is not None:
                rows.append((label, "graph.replay()", per_call_us(spec.graph.replay), None))
                rows.append((label, "graph.replay() (cpu)", cpu_us(spec.graph.replay), None))
                rows.append((label, "copy_ input (cpu)", cpu_us(lambda: spec.static_in[0].copy_(x)), None))
                rows.append((label, "inputs.load (cpu)", cpu_us(lambda: spec.inputs.load((x,))), None))
                slot = spec.handout[0] if spec.handout else None
                if slot is not None:
                    rows.append((label, "slot free+hand_out (cpu)", cpu_us(lambda: slot.free() and slot.hand_out()),
                                 None))
                rows.append((label, "clone output", per_call_us(lambda: spec.static_out.clone()), None))
            rows.append((label, "gm(x) no graph", per_call_us(lambda: spec.gm(x)), None))
            rows.append((label, "signature (cpu)", cpu_us(lambda: signature((x,))), None))
            rows.append((label, "needs_autograd (cpu)", cpu_us(lambda: opt._needs_autograd((x,))), None))
        rows.append(("torch", "raw stream query (cpu)", cpu_us(lambda: torch._C._cuda_getCurrentRawStream(0)), None))
        rows.append(("torch", "empty Module call (cpu)", cpu_us(lambda: torch.nn.Identity()(x)), None))
    print(f"overhead probe: {args.layers} x Linear({args.hidden}) batch {args.batch}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for label, what, us, err in rows:
        print(f"{label:10s} {what:22s} {us:9.2f} us" + (f"   rel err {err:.1e}" if err is not None else ""))


if __name__ == "__main__":
    main()
