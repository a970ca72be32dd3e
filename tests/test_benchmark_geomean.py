"""benchmarks.geomean: issue 6's headline from records, with the seed grid's coverage."""
import math

from benchmarks.geomean import issue3, speedups, summary


def record(cells):
    return {"cells": [{"params": {"layers": layers, "hidden": h, "batch": b},
                       "results": {k: ({"status": "ok", "us": us} if us else {"status": "error"})
                                   for k, us in results.items()}}
                      for layers, h, b, results in cells]}


def test_best_other_tool_geomean_and_coverage():
    first = record([(8, 128, 1, {"eager": 300.0, "cudagraph": 30.0, "fxfuse": 14.0, "fxfuse-auto": 15.0}),
                    (8, 2048, 256, {"eager": 700.0, "compile-ro": 480.0, "compile": None, "fxfuse-auto": 470.0}),
                    (4, 128, 1, {"eager": 1.0, "fxfuse-auto": 100.0})])       # other layer count: ignored
    again = record([(8, 128, 1, {"cudagraph": 45.0, "fxfuse-auto": 15.0})])   # the later file wins
    cells = speedups([first, again], "fxfuse-auto", 8)
    assert cells == {(128, 1): ("cudagraph", 45.0, 15.0), (2048, 256): ("compile-ro", 480.0, 470.0)}
    rows, lines = summary(cells, 8)
    assert len(rows) == 2
    geo = math.sqrt(3.0 * 480 / 470)
    assert f"over 2 cells: {geo:.3f}x" in lines[0] and "worst cell 256 x 2048: 1.02x" in lines[0]
    assert lines[1].startswith("seed grid at 8 layers: 2 of 42 cells measured; missing") and "8192x4096" in lines[1]


def test_a_slower_cell_is_counted_and_failed_columns_skipped():
    cells = speedups([record([(8, 512, 16, {"cudagraph": 40.0, "fxfuse-auto": 50.0}),
                              (8, 512, 64, {"cudagraph": 40.0, "fxfuse-auto": None})])], "fxfuse-auto", 8)
    assert list(cells) == [(512, 16)]
    assert "cells slower than the best other tool: 1" in summary(cells, 8)[1][0]


def test_issue3_view_names_met_missed_and_out_of_reach_cells():
    data = record([(8, 128, 1, {"compile-ro": 90.0, "cudagraph": 30.0, "fxfuse-auto": 12.0}),      # met
                   (8, 1024, 64, {"compile-ro": 135.0, "cudagraph": 240.0, "fxfuse-auto": 68.0}),  # missed
                   (8, 4096, 1, {"compile-ro": 240.0, "cudagraph": 230.0, "fxfuse-auto": 235.0}),  # below the floor
                   (8, 4096, 64, {"compile-ro": 555.0, "cudagraph": 700.0, "fxfuse-auto": 311.0}),  # below a FLOP floor
                   (8, 128, 256, {"compile-ro": 90.0, "fxfuse-auto": 17.0})])                      # batch > 64
    floors = {(1024, 64): (21.0, "flops"), (4096, 1): (178.0, "bytes"), (4096, 64): (331.0, "flops")}
    for cell in data["cells"]:
        p = cell["params"]
        cell["floor_us"], cell["floor_bound"] = floors.get((p["hidden"], p["batch"]), (2.6, "launch"))
    rows, lines = issue3([data], "fxfuse-auto", 8)
    assert [(r[0], r[1], r[-1]) for r in rows] == [
        (128, 1, "met"), (1024, 64, "missed"), (4096, 1, "out of reach: below the bytes floor"),
        (4096, 64, "missed (target below the FLOP floor at the library's fp32 rate, which tensor-core products escape)")]
    assert lines == ["batch <= 64, 8 layers: 1 of 4 cells at least 3x over compile-ro; 1 out of reach (4096x1); "
                     "fxfuse-auto no slower than eager in a CUDA graph in 3 of 4"]


def test_issue3_target_below_one_launch_is_out_of_reach():
    """Only the FLOP floor at the library's fp32 rate is escapable (3xTF32); a launch floor is
    not (review27: every bound but bytes had been counted as missed)."""
    data = record([(8, 128, 1, {"compile-ro": 6.0, "cudagraph": 30.0, "fxfuse-auto": 12.0})])
    data["cells"][0]["floor_us"], data["cells"][0]["floor_bound"] = 2.6, "launch"
    rows, lines = issue3([data], "fxfuse-auto", 8)
    assert rows[0][-1] == "out of reach: below the launch floor" and "1 out of reach (128x1)" in lines[0]
