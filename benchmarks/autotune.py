"""Autotune: measure on this GPU what fxfuse's cost model needs, and write a calibration file.

    python -m benchmarks.autotune --out DIR             # 6.5 minutes on an H100 (--budget-s 390)
    python -m benchmarks.autotune --quick --out DIR     # a coarse grid, fp32 only, a few minutes
    python -m benchmarks.autotune --device cpu --out DIR   # smoke test: tiny grid, no CUDA graphs
    FXFUSE_CALIBRATION=DIR/<file>.json python ...       # make fxfuse use it

Writes DIR/<gpu-slug>__torch-<ver>__triton-<ver>.json (fxfuse.cost_model.calibration_name;
schema in fxfuse/calibration/README.md). Tables (per dtype; times are per call in us):
  linear, linear_bias   cuBLAS F.linear(x, W) and F.linear(x, W, b), m x square h
  bmm7, bmm49           torch.bmm of Strassen's 7 (49) products for the layer m x h x h
  gemm_epilogue         fxfuse's Triton GEMM with bias + ReLU in its epilogue (EpilogueGemm)
  gemm_tf32x3           the same in fp32 3xTF32 on tensor cores (option tf32x3), h up to 8192
  bmm7_tf32x3, bmm49_tf32x3   Strassen's products in 3xTF32 (fxfuse.tf32x3.bmm_tf32x3), Strassen rows
  pointwise             a generated fxfuse kernel, relu(x + b), against bytes moved
  strassenL_prefix/_fused/_suffix   the pointwise kernels around the bmm, timed in a real chain
  mlp                   fxfuse's fused MLP (FusedMLP), 8 x (Linear(w, w), ReLU), whole kernel
plus ceilings (matmul rate per dtype, copy bandwidth, launch cost from a CUDA graph and eager).
The cells themselves (what each table times, and the check before it) are in autotune_cells.py.

How (DESIGN.md, "Measuring"): every cell is captured `calls` times back to back in one CUDA
graph and replayed (the per-kernel cost fxfuse pays at run time, launches included), timed with
CUDA events after warm-up, median of >= 5 repetitions (benchmarks.common.time_per_call);
random inputs, never zeros; fp32 is IEEE (TF32 off). Sections run in order of importance (all
fp32 first); a cell that fails, runs out of memory or over its time limit is recorded under
"skipped" with the reason and the run goes on; no cell starts after --budget-s; the file is
rewritten after every cell, so a killed run keeps what it measured. The fused-MLP cells run
in a child process: their unrolled kernels can compile for minutes inside C++, where no signal
reaches, so the parent kills the child at the cell's limit (on an H100, fp32: 8 layers of
width 256 in the tl.dot form did not compile within 70 s, and is recorded as skipped).

Measured on an H100 (torch 2.11, triton 3.6): 385 s in all, of which ~240 s are fused-MLP
compiles; everything else (536 cells: fp32, bf16, fp16) takes ~150 s.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from fxfuse.cost_model import DTYPE_NAMES, SCHEMA, calibration_name, validate_calibration

from . import common
from .autotune_cells import MLP_LAYERS, NEEDS_KERNELS, SECTIONS, randn

FULL = dict(m=(1, 16, 64, 256, 1024, 4096), h=(128, 256, 512, 1024, 2048, 4096, 8192), bmm_min_h=1024,
            gemm_max_h=4096, x3_m=(32, 64, 128, 256, 1024, 4096),
            rows=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536), widths=(64, 128, 256),
            strassen_m=(256, 1024, 4096), strassen_h=(2048, 4096, 8192))
QUICK = dict(m=(1, 64, 1024), h=(256, 1024, 4096), bmm_min_h=1024, gemm_max_h=4096, x3_m=(64, 1024),
             rows=(1, 64, 4096, 65536), widths=(64, 128), strassen_m=(1024,), strassen_h=(2048,))
CPU = dict(m=(1, 16, 64), h=(64, 128), bmm_min_h=64, gemm_max_h=128, x3_m=(32, 64), rows=(1, 16, 256),
           widths=(32,), strassen_m=(64,), strassen_h=(64,))
PLAN = [("linear", "fp32"), ("bmm", "fp32"), ("pointwise", "fp32"), ("gemm", "fp32"), ("gemm_x3", "fp32"),
        ("bmm_x3", "fp32"), ("strassen", "fp32"),
        ("linear", "bf16"), ("bmm", "bf16"), ("pointwise", "bf16"), ("gemm", "bf16"),
        ("linear", "fp16"), ("bmm", "fp16"), ("mlp", "fp32"), ("mlp", "bf16"), ("mlp", "fp16")]
# the fused MLP compiles longest: last
CHILD_MARK = "@@autotune-cell "


class CellTimeout(Exception):
    pass


# ---------------------------------------------------------------------------- timing

@contextlib.contextmanager
def time_limit(seconds):
    """Raise CellTimeout after `seconds` where Python gets control back (between compile
    steps, in a subprocess wait); a long call inside C++ ends first. Main thread, Unix only."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise CellTimeout(f"over the {seconds:.0f} s limit per cell")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)




# ---------------------------------------------------------------------------- ceilings

def measure_ceilings(device, dtypes) -> dict:
    """benchmarks.common's ceilings (fp32 matmul, copy, launches), plus the matmul rate of
    every other dtype measured; in the cost model's units."""
    c = common.measure_ceilings(device, torch.float32)
    rates = {"float32": c["matmul_flops_per_s"] / 1e12}
    for dtype in dtypes:
        if dtype != torch.float32:
            n = 8192 if device.type == "cuda" else 512
            a, b = randn(n, n, dtype=dtype, device=device), randn(n, n, dtype=dtype, device=device)
            t = common.time_per_call(lambda x: torch.mm(x, b), [a], min_rep_s=0.05)
            rates[DTYPE_NAMES[dtype]] = 2 * n ** 3 / (t.us * 1e-6) / 1e12
    out = {"matmul_tflops": rates, "copy_gbps": c["copy_bytes_per_s"] / 1e9,
           "launch_us_graph": c.get("graph_kernel_s", c["launch_s"]) * 1e6,
           "launch_us_eager": c["eager_launch_s"] * 1e6, "launch_us_graph_replay": c["launch_s"] * 1e6}
    if device.type == "cuda":
        out["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return out


# ---------------------------------------------------------------------------- the run

def grid_tables(cells, measured) -> dict:
    """{table: {dtype: {axis: [...], "us": nested}}}; a planned cell not measured is null."""
    tables = {}
    for cell in cells:
        for name in cell.tables:
            tables.setdefault(name, {}).setdefault(DTYPE_NAMES[cell.dtype], []).append(cell)
    out = {}
    for name, per_dtype in tables.items():
        for dt, group in per_dtype.items():
            axes = list(group[0].point)
            values = {a: sorted({c.point[a] for c in group}) for a in axes}
            got = {tuple(c.point[a] for a in axes): measured.get((name, dt, tuple(c.point.items())))
                   for c in group}

            def nest(prefix, depth):
                if depth == len(axes):
                    return got.get(tuple(prefix))
                return [nest(prefix + [v], depth + 1) for v in values[axes[depth]]]
            entry = {**values, "us": nest([], 0)}
            if name == "mlp":
                entry["layers"] = MLP_LAYERS
            out.setdefault(name, {})[dt] = entry
    return out


def write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def run_cell(cell, args, deadline) -> tuple:
    """(results or None, reason when skipped); frees the cell's memory afterwards."""
    left = deadline - time.perf_counter()
    if left <= 0:
        return None, f"not run: --budget-s {args.budget_s:g} spent"
    try:
        with torch.no_grad(), time_limit(max(5.0, min(args.timeout_s, left))):
            return cell.run(), None
    except torch.cuda.OutOfMemoryError:
        return None, "out of memory"
    except Exception as e:  # noqa: BLE001 - a failing candidate is a record, not the end of the run
        return None, f"{type(e).__name__}: {e}"[:300]
    finally:
        gc.collect()
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".", help="directory for the calibration file (default: .)")
    p.add_argument("--quick", action="store_true", help="coarse grid, fp32 only unless --dtypes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", help="comma list of fp32,bf16,fp16 (default all; --quick: fp32)")
    p.add_argument("--sections", help=f"comma list of {','.join(SECTIONS)} (default all)")
    p.add_argument("--m", help="comma list of rows, replacing the grid's (the Strassen cells' too)")
    p.add_argument("--h", help="comma list of square layer sizes, replacing the grid's (the Strassen cells' too)")
    p.add_argument("--widths", help="comma list of fused-MLP widths, replacing the grid's")
    p.add_argument("--budget-s", type=float, default=390.0, help="start no cell after this many seconds")
    p.add_argument("--timeout-s", type=float, default=60.0, help="time limit of one cell (compiles included)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell (at least 5)")
    p.add_argument("--min-rep-ms", type=float, default=10.0, help="each repetition lasts at least this long")
    p.add_argument("--child", help=argparse.SUPPRESS)   # internal: cell indices to run in a child process
    args = p.parse_args(argv)
    # fuzz36g: an unknown section, dtype or row count wrote an empty calibration (and said to use it)
    for flag, given, known in (("--sections", args.sections, SECTIONS), ("--dtypes", args.dtypes, common.DTYPES)):
        unknown = [v for v in (given or "").split(",") if v.strip() not in known] if given is not None else []
        if unknown:
            p.error(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    for flag in ("m", "h", "widths"):
        if getattr(args, flag) is not None:
            try:
                common.csv_ints(getattr(args, flag))
            except argparse.ArgumentTypeError as e:
                p.error(f"--{flag}: {e}")
    if args.reps < 5:
        p.error(f"--reps {args.reps}: at least 5")
    return args


def plan(args, device) -> tuple:
    """(cells, skipped records, grid): the same for the same arguments, so a child process
    rebuilds exactly the parent's list and runs cells by index."""
    from fxfuse.kernel import kernels_available
    grid = dict(CPU if device.type == "cpu" else QUICK if args.quick else FULL)
    for axis in ("m", "h"):
        if getattr(args, axis):   # the Strassen rows too: re-measuring one m re-measures all its tables
            grid[axis] = grid[f"strassen_{axis}"] = tuple(common.csv_ints(getattr(args, axis)))
            if axis == "m":   # 3xTF32 only past the row-wise batches (gemm_config.ROWWISE_MAX_BATCH)
                grid["x3_m"] = tuple(m for m in grid["m"] if m > 16)
    if args.widths:
        grid["widths"] = tuple(common.csv_ints(args.widths))
    dtypes = (args.dtypes or ("fp32" if args.quick or device.type == "cpu" else "fp32,bf16,fp16")).split(",")
    sections = (args.sections or ",".join(SECTIONS)).split(",")
    cells, skipped = [], []
    for section, dt in PLAN:
        if section in sections and dt in dtypes:
            new = SECTIONS[section](common.DTYPES[dt][0], grid, device, args)
            if section in NEEDS_KERNELS and not kernels_available(device):
                skipped += [{"what": c.label, "reason": "generated kernels need CUDA (or TRITON_INTERPRET=1)"}
                            for c in new]
            else:
                cells += new
    return cells, skipped, grid, dtypes


class Recorder:
    """The calibration document being built: every result lands here, is shown as one
    progress line, and the file is rewritten (a killed run keeps what it measured)."""

    def __init__(self, path, doc, cells, started):
        self.path, self.doc, self.cells, self.started = path, doc, cells, started
        self.measured = {}

    def add(self, k, results, reason, seconds):
        cell = self.cells[k]
        if results is None:
            self.doc["skipped"].append({"what": cell.label, "reason": reason})
            shown = f"skipped: {reason}"
        else:
            for table, us in results.items():
                self.measured[(table, DTYPE_NAMES[cell.dtype], tuple(cell.point.items()))] = us
            shown = "  ".join(f"{t} {us:.2f} us" for t, us in results.items())
        print(f"[{k + 1}/{len(self.cells)}] {cell.label} ... {shown}  ({seconds:.1f} s, "
              f"{time.perf_counter() - self.started:.0f} s total)", file=sys.stderr, flush=True)
        self.doc["tables"] = grid_tables(self.cells, self.measured)
        self.doc["seconds"] = round(time.perf_counter() - self.started, 1)
        write(self.path, self.doc)


def run_isolated(argv, indices, args, deadline, rec) -> None:
    """Run cells[indices] in a child process (this script with --child), so that a compile
    running for minutes inside C++, where no signal reaches it, can be killed: a cell over
    its limit is recorded as skipped, and a fresh child goes on with the rest."""
    pending = list(indices)
    while pending:
        if time.perf_counter() >= deadline:
            for k in pending:
                rec.add(k, None, f"not run: --budget-s {args.budget_s:g} spent", 0.0)
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.autotune", *argv, "--child",
                                  ",".join(map(str, pending))], stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
        try:
            lines = queue.Queue()
            reader = threading.Thread(target=lambda: [lines.put(x) for x in child.stdout] + [lines.put(None)])
            reader.daemon = True
            reader.start()
            current, t0, grace = pending[0], time.perf_counter(), 30.0   # the first cell: + the child's start-up
            while pending:
                limit = max(5.0, min(args.timeout_s, deadline - t0)) + grace
                try:
                    line = lines.get(timeout=max(0.1, t0 + limit - time.perf_counter()))
                except queue.Empty:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                    rec.add(current, None, f"over the {limit:.0f} s limit per cell (compile included); child killed",
                            time.perf_counter() - t0)
                    key = rec.cells[current].kernel
                    same = [k for k in pending if k != current and key is not None and rec.cells[k].kernel == key]
                    for k in same:
                        rec.add(k, None, "not run: its kernel did not compile within the limit "
                                         f"({rec.cells[current].label})", 0.0)
                    pending = [k for k in pending if k != current and k not in same]
                    break
                if line is None:
                    rec.add(current, None, f"child process exited (rc {child.wait()})", time.perf_counter() - t0)
                    pending.remove(current)
                    break
                if line.startswith(CHILD_MARK):
                    k, results, reason = json.loads(line[len(CHILD_MARK):])
                    rec.add(k, results, reason, time.perf_counter() - t0)
                    pending.remove(k)
                    current, t0, grace = (pending[0] if pending else None), time.perf_counter(), 10.0
        finally:   # whatever happened, no child outlives its cells
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


def child_main(args, cells) -> int:
    """--child: run the listed cells, one result line each on stdout for the parent."""
    for k in map(int, args.child.split(",")):
        results, reason = run_cell(cells[k], args, math.inf)
        print(CHILD_MARK + json.dumps([k, results, reason]), flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    from fxfuse.kernel import interpreting
    if device.type == "cuda" and interpreting():
        print("TRITON_INTERPRET is set: unset it to measure compiled kernels on the GPU", file=sys.stderr)
        return 2
    common.set_precision("fp32")                      # IEEE fp32: TF32 off
    cells, skipped, grid, dtypes = plan(args, device)
    if args.child:
        return child_main(args, cells)
    started = time.perf_counter()
    deadline = started + args.budget_s
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Path(args.out) / calibration_name(name, torch.__version__, triton_version)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "device": name, "torch": torch.__version__, "triton": triton_version,
           "cuda": torch.version.cuda, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python -m benchmarks.autotune " + shlex.join(argv),
           "precision": common.precision_settings(), "grid": grid, "ceilings": {}, "tables": {},
           "skipped": skipped, "complete": False}
    print(f"[ceilings] {name} ...", file=sys.stderr, flush=True)
    with torch.no_grad():
        doc["ceilings"] = measure_ceilings(device, [common.DTYPES[d][0] for d in dtypes])
    print(f"[ceilings] {json.dumps(doc['ceilings'])}", file=sys.stderr, flush=True)
    rec = Recorder(out, doc, cells, started)
    k = 0
    while k < len(cells):
        if cells[k].isolated and device.type == "cuda":
            group = [j for j in range(k, len(cells)) if cells[j].isolated]
            group = group[:next((n for n, j in enumerate(group) if j != k + n), len(group))]   # consecutive
            run_isolated(argv, group, args, deadline, rec)
            k = group[-1] + 1
        else:
            t0 = time.perf_counter()
            results, reason = run_cell(cells[k], args, deadline)
            rec.add(k, results, reason, time.perf_counter() - t0)
            k += 1
    doc["complete"] = True
    write(out, doc)
    problems = validate_calibration(doc)
    for p in problems:
        print(f"INVALID: {p}", file=sys.stderr)
    print(f"wrote {out}: {len(rec.measured)} measurements, {len(doc['skipped'])} skipped, "
          f"{time.perf_counter() - started:.0f} s\nuse it: FXFUSE_CALIBRATION={out.resolve()}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
