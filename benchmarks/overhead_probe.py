"""Probe: where the per-call time of a tiny optimized model goes (CPU overhead vs GPU work).

    python -m benchmarks.overhead_probe            # seed network 8 x Linear(128), batch 1

At batch 1 / hidden 128 the GPU work of a fully fused MLP is a few microseconds, so the
per-call cost is the runtime's own: guard check, input copy into the CUDA graph's static
buffer, replay, output clone. Each part is timed alone, back to back (CUDA events around
N calls, median of 7), so the sum can be compared with the whole call.
"""
import argparse
import copy
import ctypes
import statistics
import time

import torch

import fxfuse
from fxfuse.specialization import signature

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


def host_us(fn, calls=400) -> float:
    """Host time of one call started on an idle GPU (synchronized before each), median: the
    CPU cost alone, which back-to-back loops cannot separate from GPU time they wait for."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def direct_launch(graph):
    """cuGraphLaunch of the graph's executable on the current stream, through ctypes (what
    torch's replay() does, less its bookkeeping), or None without the driver library."""
    from fxfuse.input_copy import driver
    lib = driver()
    if lib is None:
        return None
    lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    exec_, dev = ctypes.c_void_p(graph.raw_cuda_graph_exec()), torch.cuda.current_device()
    return lambda: lib.cuGraphLaunch(exec_, ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(dev)))


def host_rows(label, opt, spec, x):
    """Host-only costs (idle GPU) of the parts of a call."""
    flip, count = [x, x.clone() + 1], [0]

    def other_input():
        count[0] += 1
        return flip[count[0] % 2]

    rows = [(label, "host: whole call, same x", host_us(lambda: opt(x)), None),
            (label, "host: whole call, 2 inputs", host_us(lambda: opt(other_input())), None)]
    if spec.graph is not None:
        rows.append((label, "host: graph.replay()", host_us(spec.graph.replay), None))
        launch = direct_launch(spec.graph)
        if launch is not None:
            assert launch() == 0
            rows.append((label, "host: cuGraphLaunch (ctypes)", host_us(launch), None))
        rows.append((label, "host: inputs.load, 2 inputs", host_us(lambda: spec.inputs.load((other_input(),))), None))
        slot = spec.handout[0] if spec.handout else None
        if slot is not None:
            rows.append((label, "host: slot.free()", host_us(slot.free), None))
            rows.append((label, "host: slot.hand_out()", host_us(slot.hand_out), None))
    rows.append((label, "host: signature", host_us(lambda: signature((x,))), None))
    rows.append((label, "host: opt.original.training", host_us(lambda: opt.original.training), None))
    ident = torch.nn.Identity()
    rows.append((label, "host: Identity()(x), built once", host_us(lambda: ident(x)), None))
    return rows


def ab_rows(model, x, rounds=15):
    """Same process, interleaved rounds: the whole call (two inputs in turn) with and without
    the direct graph launch and the own-pool handout, and each variant's handout graph alone."""
    import fxfuse.handout as rt
    xs = [x, x.clone() + 1]
    variants = {}
    for own_pool in (True, False):
        for direct in (True, False):
            saved = rt.OWN_POOL_MAX_BYTES
            rt.OWN_POOL_MAX_BYTES = saved if own_pool else -1
            try:
                opt = fxfuse.optimize(model, x, strict=True)
            finally:
                rt.OWN_POOL_MAX_BYTES = saved
            for k in range(6):
                opt(xs[k % 2])
            spec = next(iter(opt._specializations.values()))
            if not direct:
                for launcher in [spec.launcher] + [slot.launcher for slot in spec.handout]:
                    launcher.launch = None
            variants[f"{'own pool' if own_pool else 'copy out'}, {'cuGraphLaunch' if direct else 'torch replay'}"] = (opt, spec)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (opt, _) in variants.items():
            calls = [0]

            def call(opt=opt):
                calls[0] += 1
                return opt(xs[calls[0] % 2])
            times[name].append(per_call_us(call, reps=3))
    rows = [("a/b", f"whole call: {name}", statistics.median(t), None) for name, t in times.items()]
    rows += [("a/b", f"  min of rounds: {name}", min(t), None) for name, t in times.items()]
    for name, (_, spec) in variants.items():
        print(f"  {name}: handed out {spec.handed_out}, cloned {spec.cloned}, slots {len(spec.handout or [])}, "
              f"{spec.handout_note}")
    for name, (_, spec) in variants.items():
        if spec.handout:
            rows.append(("a/b", f"handout graph alone: {name.split(',')[0]}", per_call_us(spec.handout[0].launcher.graph.replay), None))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--host-only", action="store_true", help="only the idle-GPU host costs of the default plan")
    ap.add_argument("--ab", action="store_true", help="only the same-process A/B of direct launch and own-pool handout")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = seed_mlp(args.layers, args.hidden).cuda().eval()
    x = torch.randn(args.batch, args.hidden, device="cuda")
    rows = []
    with torch.no_grad():
        if args.host_only:
            opt = fxfuse.optimize(model, x, strict=True)
            rows += host_rows("default", opt, next(iter(opt._specializations.values())), x)
        if args.ab:
            rows += ab_rows(model, x)
        for label, opts in [] if args.host_only or args.ab else [("default", {}), ("fused mlp", dict(fused_mlp="force")),
                            ("gemm", dict(fused_mlp="off", gemm="force")), ("library", dict(fused_mlp="off", gemm="off"))]:
            opt = fxfuse.optimize(model, x, strict=True, **opts)
            spec = next(iter(opt._specializations.values()))
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
            rows.append((label, "grad check (cpu)", cpu_us(lambda: opt._grad.records((x,))), None))
        rows.append(("torch", "raw stream query (cpu)", cpu_us(lambda: torch._C._cuda_getCurrentRawStream(0)), None))
        rows.append(("torch", "empty Module call (cpu)", cpu_us(lambda: torch.nn.Identity()(x)), None))
    print(f"overhead probe: {args.layers} x Linear({args.hidden}) batch {args.batch}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for label, what, us, err in rows:
        print(f"{label:10s} {what:22s} {us:9.2f} us" + (f"   rel err {err:.1e}" if err is not None else ""))


if __name__ == "__main__":
    main()
