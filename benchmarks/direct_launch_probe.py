"""A/B: a model whose graph is one fused MLP kernel, run through the CUDA-graph runtime or
launched directly (fxfuse/direct_launch.py), in interleaved rounds on the same host.

    python -m benchmarks.direct_launch_probe --cells 1x64,16x64,1x128,64x128 --rounds 5

Per cell: eager in a CUDA graph (reference), fxfuse with the direct launch switched off (the
graph runtime: memcpy node, graph copies, cuGraphLaunch) and on, as users call them (4 inputs
in turn, back-to-back calls, CUDA events, median of 5 blocks); the median over rounds. Then
host parts of one direct call on this host: the launch alone (ctypes cuLaunchKernel with the
prepared argument block), Triton's own launcher for the same kernel, and the output allocation.
"""
import argparse
import statistics
import time

import torch

import fxfuse
from benchmarks.common import time_per_call
from benchmarks.mlp_probe import graphed, seed_model
from fxfuse import direct_launch


def wall_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def build(model, x, direct: bool):
    saved = direct_launch.DirectLaunch.build
    if not direct:
        direct_launch.DirectLaunch.build = classmethod(lambda cls, gm, args: (None, "switched off (A/B)"))
    try:
        return fxfuse.optimize(model, x, fused_mlp="force")
    finally:
        direct_launch.DirectLaunch.build = saved


def cell(batch, hidden, rounds):
    model = seed_model(hidden)
    xs = [torch.randn(batch, hidden, device="cuda") for _ in range(4)]
    with torch.no_grad():
        replay, _ = graphed(model, xs[0])
        opts = {"graph": build(model, xs[0], False), "direct": build(model, xs[0], True)}
        spec = next(iter(opts["direct"].specializations.values()))
        assert spec.direct is not None, spec.cuda_graph_note
        for x in xs:
            torch.testing.assert_close(opts["direct"](x), model(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(opts["graph"](x), model(x), rtol=1e-5, atol=1e-5)
        times = {"eager+graph": [], "graph": [], "direct": []}
        for _ in range(rounds):
            times["eager+graph"].append(time_per_call(lambda _x: replay(), xs, reps=5).us)
            for name, opt in opts.items():
                times[name].append(time_per_call(opt, xs, reps=5).us)
        d = spec.direct
        module = d.module
        kernel, grid, args = module.launch_plan(xs[0])
        runner = kernel[grid]
        stream = torch.cuda.current_stream().cuda_stream
        parts = {"direct call": wall_us(lambda: d(xs[0])),
                 "ctypes launch alone": wall_us(lambda: d.launch(*d.fixed, stream, d.params, None)),
                 "triton launcher alone": wall_us(lambda: runner(*args, stream=stream)),
                 "torch.empty(shape, device=)": wall_us(lambda: torch.empty(d.out_shape, device="cuda")),
                 "prototype.new_empty(shape)": wall_us(lambda: d.prototype.new_empty(d.out_shape))}
    return {k: statistics.median(v) for k, v in times.items()}, parts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="1x64,16x64,256x64,1x128,16x128,64x128,256x128")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"direct launch A/B, {torch.cuda.get_device_name()}, torch {torch.__version__}; 8 x (Linear(h), ReLU) fp32 "
          f"as one fused MLP kernel; per-call us, median of {a.rounds} interleaved rounds")
    for c in a.cells.split(","):
        batch, hidden = map(int, c.split("x"))
        t, parts = cell(batch, hidden, a.rounds)
        print(f"{c:8} eager+graph {t['eager+graph']:6.1f} | fxfuse graph runtime {t['graph']:6.1f} | "
              f"fxfuse direct {t['direct']:6.1f}   host parts (wall us, back to back): "
              + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)


if __name__ == "__main__":
    main()
