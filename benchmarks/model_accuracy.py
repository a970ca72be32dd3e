"""How good are the cost model's choices? Its plan against measured candidates, on the CPU.

    python -m benchmarks.model_accuracy                        # H100 results + shipped calibration
    python -m benchmarks.model_accuracy --results DIR --calibration FILE

Reads the seed-network benchmark records under benchmarks/results/<gpu>/mlp_*.json, where
each fxfuse variant column measured one candidate for every layer: `fxfuse lib` (library
GEMM + fused epilogue), `fxfuse gemm`, `fxfuse mlp`, `fxfuse S1`, `fxfuse S2`; and `fxfuse
auto` (strassen="auto", levels <= 2) and `fxfuse` (default) measured the plan itself. Per
(layers, hidden, batch) cell it prints the plan the model makes now (plan_chain on 8 x
LinearLayer with the same legality rules as passes/plan_linears.py), its estimate, the
measured time of the plan, and the oracle: the fastest measured candidate column.

Caveats, printed with the table: candidate columns and plan columns may come from different
runs (the latest record of each column is used), and the model estimates GPU time of the
layers only, while a measured call also pays the runtime (input copy, replay, output clone):
"est/meas" compares the estimate with the measured call, overhead included.
"""
import argparse
import glob
import json
import statistics
from pathlib import Path

import torch
from tabulate import tabulate

from fxfuse.chain_plan import plan_chain
from fxfuse.cost_model import CostModel, LinearLayer

CANDIDATE_COLUMNS = {"fxfuse-lib": "library", "fxfuse-gemm": "gemm", "fxfuse-mlp": "mlp",
                     "fxfuse-s1": "strassen1", "fxfuse-s2": "strassen2"}
PLAN_COLUMNS = ("fxfuse-auto", "fxfuse")
HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results" / "nvidia-h100-80gb-hbm3"
DEFAULT_CALIBRATION = HERE.parent / "fxfuse" / "calibration" / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json"


def measured_cells(results_dir) -> dict:
    """(layers, hidden, batch) -> {column: us}, the latest record of each column winning."""
    cells = {}
    for path in sorted(glob.glob(str(Path(results_dir) / "mlp_*.json"))):
        data = json.load(open(path))
        if data.get("dtype", "fp32") != "fp32":
            continue
        for cell in data["cells"]:
            p = cell.get("params", {})
            key = (p.get("layers"), p.get("hidden"), p.get("batch"))
            for column, rec in cell.get("results", {}).items():
                if rec.get("status") == "ok" and rec.get("us"):
                    cells.setdefault(key, {})[column] = rec["us"]
    return cells


def plan_for(model, layers_n, hidden, batch):
    """The plan passes/plan_linears.py would make for the seed network with strassen="auto"."""
    from fxfuse.passes.plan_linears import STRASSEN_MIN_ROWS, STRASSEN_MIN_WIDTH, MLP_MAX_WIDTH
    layers = [LinearLayer(batch, hidden, hidden, torch.float32, 2, i == layers_n - 1) for i in range(layers_n)]
    big = batch >= STRASSEN_MIN_ROWS and hidden >= STRASSEN_MIN_WIDTH
    legal = [{"library": None, "gemm": None, "strassen1": None if big else "small",
              "strassen2": None if big else "small"} for _ in layers]
    plans = plan_chain(model, layers, legal, lambda i, j: None if hidden <= MLP_MAX_WIDTH else "wide")
    seen, total = set(), 0.0
    for p in plans:
        key = p.segment or id(p)
        if key not in seen:
            seen.add(key)
            total += p.estimates[p.choice].us
    choice = "/".join(sorted({p.choice for p in plans}))
    return choice, total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(DEFAULT_RESULTS))
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    args = ap.parse_args(argv)
    model = CostModel.load(args.calibration)
    rows, gaps, ratios = [], [], []
    for (layers_n, hidden, batch), cols in sorted(measured_cells(args.results).items()):
        candidates = {CANDIDATE_COLUMNS[c]: us for c, us in cols.items() if c in CANDIDATE_COLUMNS}
        plan_col = next((c for c in PLAN_COLUMNS if c in cols), None)
        if not candidates or plan_col is None or layers_n is None:
            continue
        choice, estimate = plan_for(model, layers_n, hidden, batch)
        oracle_name, oracle_us = min(candidates.items(), key=lambda kv: kv[1])
        oracle_us = min(oracle_us, cols[plan_col])   # the plan itself is a measured candidate too
        gap = cols[plan_col] / oracle_us - 1
        gaps.append(gap)
        ratios.append(estimate / cols[plan_col])
        rows.append([layers_n, hidden, batch, choice, f"{estimate:.1f}", f"{cols[plan_col]:.1f}", plan_col,
                     f"{oracle_name} {min(candidates.values()):.1f}", f"{100 * gap:+.0f}%",
                     f"{estimate / cols[plan_col]:.2f}"])
    print(f"cost model: {model.description}")
    print(tabulate(rows, headers=["layers", "hidden", "batch", "plan", "est us", "meas us", "plan column",
                                  "best candidate (meas)", "plan vs oracle", "est/meas"], tablefmt="github"))
    if gaps:
        within = sum(g <= 0.05 for g in gaps)
        print(f"\ncells: {len(gaps)}; plan within 5% of the oracle: {within} ({100 * within / len(gaps):.0f}%); "
              f"worst {100 * max(gaps):+.0f}%; median est/meas {statistics.median(ratios):.2f} "
              f"(|1 - ratio| <= 0.2 in {sum(abs(1 - r) <= 0.2 for r in ratios)} cells)")
    print("caveat: plan and candidate columns may come from different runs; est/meas includes the runtime's "
          "per-call overhead in 'meas' but not in 'est'")


if __name__ == "__main__":
    main()
