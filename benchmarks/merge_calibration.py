"""Merge rows of a new autotune file into a shipped calibration table.

    python -m benchmarks.merge_calibration NEW.json --into fxfuse/calibration/X.json \\
        --table gemm_epilogue --dtype float32 --why "the row-wise rule now covers batch <= 64"

Why: when one kernel's rules change, re-measuring the whole calibration costs minutes of GPU
time for tables that did not move. `autotune --sections gemm --m 32,64` measures only the rows
that changed; this puts them into the shipped table (a row of the same m is replaced, a new m
is inserted in order), keeps every other row and table, records the merge under "updates",
and checks the result with validate_calibration.
"""
import argparse
import json
import sys
import time

from fxfuse.calibration import validate_calibration


def merge_rows(old: dict, new: dict, axis: str = "m") -> dict:
    """old's table entry with new's rows (by the first axis) put in. new may cover only some of
    the other axis's points (a re-measured width), or skip some (null): the row keeps the old
    values there (None for a new row); a point old does not have is an error."""
    other = next(k for k in old if k not in (axis, "us"))
    missing = [v for v in new[other] if v not in old[other]]
    if missing:
        raise ValueError(f"the {other} axes differ: {new[other]} has {missing}, not in {old[other]}")
    rows = dict(zip(old[axis], old["us"]))
    for key, values in zip(new[axis], new["us"]):
        row = list(rows.get(key, [None] * len(old[other])))
        for point, value in zip(new[other], values):
            if value is not None:     # a point the new run skipped keeps what was measured before
                row[old[other].index(point)] = value
        rows[key] = row
    keys = sorted(rows)
    extra = {k: v for k, v in old.items() if k not in (axis, other, "us")}   # e.g. the fused MLP's "layers"
    return {axis: keys, other: old[other], "us": [rows[k] for k in keys], **extra}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new")
    ap.add_argument("--into", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--dtype", required=True, help="e.g. float32")
    ap.add_argument("--why", required=True)
    args = ap.parse_args(argv)
    with open(args.new) as f:
        new = json.load(f)
    with open(args.into) as f:
        shipped = json.load(f)
    if (new["device"], new["torch"], new["triton"]) != (shipped["device"], shipped["torch"], shipped["triton"]):
        print("device, torch or triton differ: not merged", file=sys.stderr)
        return 1
    table, rows = shipped["tables"].setdefault(args.table, {}), new["tables"][args.table][args.dtype]
    empty = [m for m, values in zip(rows["m"], rows["us"]) if all(v is None for v in values)]
    if empty:   # every cell of the row skipped: merging it would erase what the shipped row measured
        print(f"rows {empty} of {args.table}/{args.dtype} hold no measurement (see the file's 'skipped'): "
              "not merged", file=sys.stderr)
        return 1
    table[args.dtype] = merge_rows(table[args.dtype], rows) if args.dtype in table else rows   # a new dtype: whole
    shipped.setdefault("updates", []).append({
        "tables": [args.table], "dtype": args.dtype, "rows": new["tables"][args.table][args.dtype]["m"],
        "created": new.get("created", time.strftime("%Y-%m-%d %H:%M:%S")), "command": new.get("command"),
        "why": args.why})
    problems = validate_calibration(shipped)
    if problems:
        print("not merged: " + "; ".join(problems), file=sys.stderr)
        return 1
    with open(args.into, "w") as f:
        json.dump(shipped, f, indent=1)
    print(f"merged {args.table}/{args.dtype} rows {new['tables'][args.table][args.dtype]['m']} into {args.into}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
