"""Probe: where the host time of one call of a small optimized model goes.

    python -m benchmarks.host_profile [--batch 64] [--hidden 128] [--calls 20000]

Why: at batch <= 64 a call's time is the host's (the graph's GPU time is lower), so the per-call
Python and driver work is what the small cells measure. Prints, for the seed network with 4
inputs in turn (as benchmarks.mlp calls it): per-call wall time of back-to-back calls; the same
for parts of a call (the bare graph launch, the launch plus the input binding); and a cProfile
of the calls sorted by own time (C functions included, so driver calls show as ctypes entries).
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch

import fxfuse
from benchmarks.mlp_probe import seed_model


def wall_us(fn, calls):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
    return best


def built(batch, hidden):
    """(opt, its specialization, call() with 4 inputs in turn, call's counter) for the seed network."""
    model = seed_model(hidden)
    xs = [torch.randn(batch, hidden, device="cuda") for _ in range(4)]
    opt = fxfuse.optimize(model, xs[0])
    state = {"i": 0}

    def call():
        state["i"] += 1
        return opt(xs[state["i"] & 3])
    call.inputs = xs
    return opt, next(iter(opt._specializations.values())), call, state


def ab(cells, rounds, calls):
    """Interleaved rounds: whole calls with and without address affinity, and the slot graphs
    launched in turn vs one of them alone (GPU cost of switching graph executables)."""
    for batch, hidden in cells:
        opt, spec, call, state = built(batch, hidden)

        def in_turn():
            state["i"] += 1
            spec.handout[state["i"] % len(spec.handout)].launcher.replay()   # 1 copy where affinity is off
        rows = {"affinity": [], "no affinity": [], "4 graphs in turn": [], "1 graph alone": []}
        with torch.no_grad():
            for _ in range(20):
                call()
            chosen = spec.affinity
            for _ in range(rounds):
                spec.affinity = True
                rows["affinity"].append(wall_us(call, calls))
                spec.affinity = False          # the first free copy, re-pointed per call
                rows["no affinity"].append(wall_us(call, calls))
                spec.affinity = chosen
                rows["4 graphs in turn"].append(wall_us(in_turn, calls))
                rows["1 graph alone"].append(wall_us(spec.handout[0].launcher.replay, calls))
        print(f"{batch}x{hidden} (slots {len(spec.handout)}, chosen: {'affinity' if chosen else 'none'}): " + ", ".join(
            f"{k} {statistics.median(v):.2f}" for k, v in rows.items()) + " us (median of rounds)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", default="", help="cells BxH,... : interleaved A/B rounds only")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if a.ab:
        print(f"host profile A/B, {torch.cuda.get_device_name()}, torch {torch.__version__}; min of 5 blocks per round")
        ab([tuple(map(int, c.split("x"))) for c in a.ab.split(",")], rounds=7, calls=2000)
        return
    opt, spec, call, _ = built(a.batch, a.hidden)
    xs = call.inputs
    print(f"host profile: 8 x Linear({a.hidden}) batch {a.batch}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with torch.no_grad():
        for _ in range(20):
            call()
        slot = spec.handout[0] if spec.handout else None
        print(f"slots {len(spec.handout or [])}; launcher {spec.launcher.note}; inputs {spec.inputs.note}")
        n = a.calls // 4
        print(f"  whole call (min of 5 blocks of {n}):        {wall_us(call, n):7.2f} us")
        print(f"  graph launch alone (first graph):             {wall_us(spec.launcher.replay, n):7.2f} us")
        if slot is not None:
            print(f"  slot launch alone:                            {wall_us(slot.launcher.replay, n):7.2f} us")
            print(f"  slot.free():                                  {wall_us(slot.free, n):7.2f} us")
            print(f"  slot.hand_out():                              {wall_us(slot.hand_out, n):7.2f} us")
            print(f"  slot.inputs.load([x]), same x:                {wall_us(lambda: slot.inputs.load([xs[0]]), n):7.2f} us")
        launchers = [sl.launcher for sl in spec.handout or []]
        if launchers:
            turn = {"i": 0}

            def round_robin():
                turn["i"] += 1
                launchers[turn["i"] % len(launchers)].replay()
            print(f"  {len(launchers)} slot launches in turn:                      {wall_us(round_robin, n):7.2f} us")
        print(f"  whole call, same x:                           {wall_us(lambda: opt(xs[0]), n):7.2f} us")
        affinity, spec.affinity = spec.affinity, False       # A/B: the runtime's own switch
        print(f"  whole call, no address affinity:              {wall_us(call, n):7.2f} us")
        spec.affinity = affinity
        print(f"  whole call again (affinity):                  {wall_us(call, n):7.2f} us")
        print(f"  opt.forward minus __call__ (same x):          {wall_us(lambda: opt.forward(xs[0]), n):7.2f} us")
        print(f"  fxfuse.specialization.signature((x,)):               "
              f"{wall_us(lambda: fxfuse.specialization.signature((xs[0],)), n):7.2f} us")
        print(f"  empty nn.Module call:                         "
              f"{wall_us(lambda m=torch.nn.Identity(): m(xs[0]), n):7.2f} us")
        repoints = sum(s.inputs.repoints for s in spec.handout or [])
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            call()
        prof.disable()
        torch.cuda.synchronize()
        print(f"  re-pointed nodes during the profiled calls: {sum(s.inputs.repoints for s in spec.handout or []) - repoints}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
