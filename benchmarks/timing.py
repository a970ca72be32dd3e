"""Timing on the GPU: blocks of back-to-back calls between CUDA events, medians, rounds.

Split out of benchmarks.common (which re-exports these names); DESIGN.md, "Measuring", says
why calls are queued back to back with one synchronization per block.
"""
import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    us: float           # median per-call time over the repetitions
    reps_us: list       # per-call time of each repetition
    calls_per_rep: int


def time_per_call(fn, inputs, reps=7, min_rep_s=0.02, max_calls=5000, warmup=3):
    """Median per-call time of fn over `reps` blocks of back-to-back calls.

    Each block is N calls with one synchronization at its end; N is chosen from a short
    probe so that a block lasts at least `min_rep_s` (at most `max_calls` calls), which keeps
    event resolution and the final sync negligible. Call i uses inputs[i % len(inputs)].
    """
    calls = calls_per_block(fn, inputs, min_rep_s, max_calls, warmup)
    with gc_paused():
        per_call = [time_block(fn, inputs, calls) for _ in range(max(reps, 5))]
    return Timing(statistics.median(per_call), per_call, calls)


def calls_per_block(fn, inputs, min_rep_s=0.02, max_calls=5000, warmup=3):
    """Warm fn up, then the number of back-to-back calls that makes a block last `min_rep_s`."""
    device, k = inputs[0].device, len(inputs)
    for i in range(warmup):
        fn(inputs[i % k])
    sync(device)
    n = 1
    while True:  # probe: grow the block until it lasts a quarter of a repetition
        start = time.perf_counter()
        for i in range(n):
            fn(inputs[i % k])
        sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_rep_s / 4 or n >= max_calls:
            break
        n = min(max_calls, n * 4)
    return max(1, min(max_calls, math.ceil(min_rep_s / max(elapsed / n, 1e-9))))


def time_block(fn, inputs, calls):
    """Per-call time in us of one block of `calls` back-to-back calls (one sync at its end)."""
    device, k = inputs[0].device, len(inputs)
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for i in range(calls):
            fn(inputs[i % k])
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3 / calls
    start = time.perf_counter()
    for i in range(calls):
        fn(inputs[i % k])
    return (time.perf_counter() - start) * 1e6 / calls


def time_interleaved(fns, inputs, reps=7, min_rep_s=0.02, max_calls=5000, warm_s=0.25):
    """{key: Timing} of several callables measured in rounds: one block of each per round,
    the round's order rotated by one each time.

    Why not one tool after the other: on the H100 host, timings drifted within a column
    (mlp_20261125-094434, 16 x 1024: 546, 511, 92, 97, 60, 57, 49 us per call over one
    column's 7 blocks, 29.5 in the next run) and jumped in single blocks of every tool
    (eager+graph 34, 34, 34, 111, 49, 34, 34), so the tool that happened to be timed during
    a slow stretch lost. In rounds every tool sees the same stretches, each tool's median
    drops them, and a tool's place in the order changes every round. The GPU's clocks are
    brought up first (the builds before leave it idle), and Python's garbage collector
    stays off while blocks run, as in timeit.
    """
    calls = {key: calls_per_block(fn, inputs, min_rep_s, max_calls) for key, fn in fns.items()}
    warm_clocks(inputs[0].device, warm_s)
    keys, per_call = list(fns), {key: [] for key in fns}
    with gc_paused():
        for r in range(max(reps, 5)):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                per_call[key].append(time_block(fns[key], inputs, calls[key]))
    return {key: Timing(statistics.median(v), v, calls[key]) for key, v in per_call.items()}


@contextlib.contextmanager
def gc_paused():
    """Python's garbage collector off (after one collection) while timed blocks run."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def warm_clocks(device, seconds):
    """Keep the GPU busy with matmuls for `seconds`: a GPU left idle (during a build) drops its
    clocks, and the first timed blocks after would pay for the ramp up."""
    if device.type != "cuda" or seconds <= 0:
        return
    a = torch.randn(2048, 2048, device=device)
    c = torch.empty_like(a)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(4):
            torch.mm(a, a, out=c)
        sync(device)
