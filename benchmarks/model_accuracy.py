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

Plan against oracle is taken inside ONE run: the latest record that measured candidate
columns, where the plan's own candidate column (or a plan column of that run, for a mixed
plan) is compared with the fastest candidate. Across runs the host's speed alone moves the
small cells by 20% (benchmarks/README.md), which once showed a plan that was the oracle's own
candidate as 27% slower than it. "est/meas" uses the latest measurement of the plan; the model
estimates GPU time of the layers only, while a measured call also pays the runtime (input
copy, replay, output clone), so it compares with the call, overhead included.
"""
import argparse
import glob
import json
import re
import statistics
from pathlib import Path

import torch
from tabulate import tabulate

from fxfuse.chain_plan import plan_chain
from fxfuse.cost_model import CostModel, LinearLayer

CANDIDATE_COLUMNS = {"fxfuse-lib": "library", "fxfuse-gemm": "gemm", "fxfuse-mlp": "mlp",
                     "fxfuse-s1": "strassen1", "fxfuse-s2": "strassen2"}
PLAN_COLUMNS = ("fxfuse-auto", "fxfuse")
# --all: every candidate on (strassen="auto", tf32x3="auto"); Strassen's products then run in 3xTF32
ALL_CANDIDATE_COLUMNS = {"fxfuse-lib": "library", "fxfuse-gemm": "gemm", "fxfuse-gemm3": "gemm_x3",
                         "fxfuse-mlp": "mlp", "fxfuse-s1x3": "strassen1", "fxfuse-s2x3": "strassen2"}
ALL_PLAN_COLUMNS = ("fxfuse-all",)
HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results" / "nvidia-h100-80gb-hbm3"
DEFAULT_CALIBRATION = HERE.parent / "fxfuse" / "calibration" / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json"


def measured_cells(results_dir) -> dict:
    """(layers, hidden, batch) -> [(record name, {column: us}), ...], oldest record first."""
    cells = {}
    for path in sorted(glob.glob(str(Path(results_dir) / "mlp_*.json"))):
        data = json.load(open(path))
        if data.get("dtype", "fp32") != "fp32" or not re.fullmatch(r"mlp_\d{8}-\d{6}", Path(path).stem) \
                or "--residual" in data.get("command", ""):
            continue   # mlp_residual_*: another model (and it sorted after every seed record as "latest")
        for cell in data["cells"]:
            p = cell.get("params", {})
            key = (p.get("layers"), p.get("hidden"), p.get("batch"))
            cols = {column: rec["us"] for column, rec in cell.get("results", {}).items()
                    if rec.get("status") == "ok" and rec.get("us")}
            if cols:
                cells.setdefault(key, []).append((Path(path).stem, cols))
    return cells


def oracle_gap(runs, choice, candidate_columns=CANDIDATE_COLUMNS, plan_columns=PLAN_COLUMNS):
    """(gap of the plan over the fastest candidate, best candidate, its us, record) inside the
    latest run with candidate columns; None where no run has them and the plan's time."""
    for name, cols in reversed(runs):
        candidates = {candidate_columns[c]: us for c, us in cols.items() if c in candidate_columns}
        plan_us = candidates.get(choice) or next((cols[c] for c in plan_columns if c in cols), None)
        if candidates and plan_us:
            best, best_us = min({**candidates, choice: plan_us}.items(), key=lambda kv: kv[1])
            return plan_us / best_us - 1, best, best_us, name
    return None


def plan_for(model, layers_n, hidden, batch, every_candidate=False):
    """The plan passes/plan_linears.py makes for the seed network with strassen="auto" (and
    tf32x3="auto" with every_candidate): its own legality rules (a simplified copy once planned
    fp32 width-256 chains as a fused MLP, which the pass refuses, and compared an estimate of a
    plan that never runs)."""
    from fxfuse.options import Options
    from fxfuse.passes.plan_linears import _legal, _mlp_legal, _with_tf32x3_products
    options = Options(strassen="auto", strassen_levels=2, tf32x3="auto" if every_candidate else "off")
    layers = [_with_tf32x3_products(LinearLayer(batch, hidden, hidden, torch.float32, 2, i == layers_n - 1),
                                    options, model) for i in range(layers_n)]
    legal = [_legal(layer, options, model) for layer in layers]
    plans = plan_chain(model, layers, legal, lambda i, j: _mlp_legal(layers[i:j + 1], options, model))
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
    ap.add_argument("--all", action="store_true", help="every candidate on: the fxfuse-all plan against the "
                    "lib, gemm, gemm3, mlp, s1x3 and s2x3 columns")
    args = ap.parse_args(argv)
    model = CostModel.load(args.calibration)
    candidate_columns, plan_columns = ((ALL_CANDIDATE_COLUMNS, ALL_PLAN_COLUMNS) if args.all
                                       else (CANDIDATE_COLUMNS, PLAN_COLUMNS))
    rows, gaps, ratios = [], [], []
    for (layers_n, hidden, batch), runs in sorted(measured_cells(args.results).items()):
        plan_us = next((cols[c] for _, cols in reversed(runs) for c in plan_columns if c in cols), None)
        if plan_us is None or layers_n is None:
            continue
        choice, estimate = plan_for(model, layers_n, hidden, batch, every_candidate=args.all)
        found = oracle_gap(runs, choice, candidate_columns, plan_columns)
        if found is None:
            continue
        gap, best, best_us, record = found
        gaps.append(gap)
        ratios.append(estimate / plan_us)
        rows.append([layers_n, hidden, batch, choice, f"{estimate:.1f}", f"{plan_us:.1f}",
                     f"{best} {best_us:.1f}", record.removeprefix("mlp_"), f"{100 * gap:+.0f}%",
                     f"{estimate / plan_us:.2f}"])
    print(f"cost model: {model.description}")
    print(tabulate(rows, headers=["layers", "hidden", "batch", "plan", "est us", "meas us (latest)",
                                  "best candidate (meas)", "oracle run", "plan vs oracle", "est/meas"],
                   tablefmt="github"))
    if gaps:
        within = sum(g <= 0.05 for g in gaps)
        print(f"\ncells: {len(gaps)}; plan within 5% of the oracle: {within} ({100 * within / len(gaps):.0f}%); "
              f"worst {100 * max(gaps):+.0f}%; median est/meas {statistics.median(ratios):.2f} "
              f"(|1 - ratio| <= 0.2 in {sum(abs(1 - r) <= 0.2 for r in ratios)} cells)")
    print("plan vs oracle: inside the oracle run (the plan's candidate column there); est/meas: the latest "
          "measured call, the runtime's per-call overhead in 'meas' but not in 'est'")


if __name__ == "__main__":
    main()
