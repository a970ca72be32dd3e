"""The benchmark harness's timing in rounds (benchmarks.timing.time_interleaved), on the CPU."""
import gc

import torch

from benchmarks import timing


def test_rounds_time_every_tool_with_rotated_order():
    order = []

    def tool(name):
        def fn(x):
            if not order or order[-1] != name:
                order.append(name)
            return x + 1
        return fn

    fns = {"a": tool("a"), "b": tool("b"), "c": tool("c")}
    got = timing.time_interleaved(fns, [torch.randn(4)], reps=5, min_rep_s=0.001, max_calls=50)
    assert set(got) == {"a", "b", "c"}
    for t in got.values():
        assert len(t.reps_us) == 5 and t.us > 0 and t.calls_per_rep >= 1
    timed = order[-15:]   # the 5 rounds after the per-tool probes
    rounds = [timed[i:i + 3] for i in range(0, 15, 3)]
    assert rounds[0] == ["a", "b", "c"] and rounds[1] == ["b", "c", "a"] and rounds[2] == ["c", "a", "b"]


def test_gc_is_back_on_after_timing():
    assert gc.isenabled()
    timing.time_per_call(lambda x: x * 2, [torch.randn(3)], reps=5, min_rep_s=0.001, max_calls=10)
    assert gc.isenabled()
