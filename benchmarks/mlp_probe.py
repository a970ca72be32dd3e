"""Probe: the fully fused MLP (fxfuse/mlp_kernel.py, passes/fuse_mlp.py) on the GPU, checked and timed.

    python -m benchmarks.mlp_probe                 # main table and a short sweep; <= 3 minutes
    python -m benchmarks.mlp_probe --no-sweep      # main table only
    OUT=dir python -m benchmarks.mlp_probe         # also writes dir/mlp_probe.json

Why: `should_fuse_mlp` (passes/fuse_mlp.py) and `choose_config` (fxfuse/mlp_spec.py) carry
provisional constants (fuse while every width <= 256; one program per row up to batch 32).
This measures the fused kernel against what it replaces, so they can be set from data.

Model: Sequential of 8 x (Linear(h, h), ReLU(inplace=True)), fp32, TF32 off. Per-call times in
us: calls queued back to back, CUDA events, one synchronization per repetition, median of 5
(DESIGN.md, "Measuring"). Columns of the main table:
  eager, eager+graph   the model; the model captured in one CUDA graph (static input)
  force, off           fxfuse.optimize(model, x, fused_mlp=...) called as users call it (its
                       own CUDA graph replay, input copy and output clone included)
  kernel+graph         the FusedMLP module alone in a CUDA graph: the kernel's own GPU time
  err                  max |y - y64| / max |y64| against the model run in float64
  floor                max(weights / 3.0 TB/s, FLOPs / 51.6 TFLOP/s, 1.2 us): DESIGN.md's ceilings
A width the kernel cannot hold (> 1024) is not fused even under "force": the note says why.
The sweep (narrow widths) gives kernel+graph / plan graph (GPU time of the fused kernel over that of
fxfuse's per-layer plan, fused_mlp="off"): < 1 pays. `--sweep 1x64:rows,256x64:dot,...` picks cells.

Cells run in a child process, a fresh one after a cell that hangs (an unrolled kernel of a
wide chain can compile for a long time) or crashes; a deadline keeps the whole run short, and
the two width-1024 cells (the longest compiles) run last.
"""
import argparse
import contextlib
import copy
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MAIN_CELLS = [(1, 128), (16, 512), (1, 1024), (64, 1024), (256, 2048), (1024, 256)]
CHEAP_CELLS = [(1, 128), (1024, 256), (256, 2048), (16, 512)]   # run first: short compiles
WIDE_CELLS = [(1, 1024), (64, 1024)]                              # run last: long unrolled compiles
# (batch, hidden, form): "auto" is choose_config's pick; "rows" / "dot" force the other form
# where the crossover (ROWWISE_MAX_BATCH) is in question
SWEEP_CELLS = [(1, 64, "auto"), (256, 64, "auto")] + [
    (b, h, f) for h in (128, 256) for b, f in ((1, "auto"), (16, "auto"), (16, "dot"), (256, "auto"),
                                                (256, "rows"), (4096, "auto"))]
LAYERS = 8
MATMUL_FLOPS, HBM_BYTES_S, GRAPH_LAUNCH_US = 51.6e12, 3.0e12, 1.2


# ---------------------------------------------------------------------------- measuring (child)

def per_call_us(fn, reps=5):
    """Median per-call time of fn() queued back to back; one sync per repetition."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n = 1
    while True:                       # enough calls per repetition for ~2 ms of GPU work
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 > 2e-3 or n >= 2048:
            break
        n *= 4
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def graphed(fn, x):
    """fn(x) captured in a CUDA graph on a static copy of x; returns (replay, static output)."""
    import torch
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            fn(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = fn(static)
    return g.replay, out


def max_rel_err(y, y64):
    return ((y.double() - y64).abs().max() / y64.abs().max().clamp_min(1e-30)).item()


def floor_us(batch, h, esize=4):
    weights = LAYERS * (h * h + h) * esize
    flops = 2 * batch * h * h * LAYERS
    return max(weights / HBM_BYTES_S * 1e6, flops / MATMUL_FLOPS * 1e6, GRAPH_LAUNCH_US)


def seed_model(h):
    import torch
    torch.manual_seed(0)
    mods = []
    for _ in range(LAYERS):
        mods += [torch.nn.Linear(h, h), torch.nn.ReLU(inplace=True)]
    return torch.nn.Sequential(*mods).eval().cuda()


def fused_mlps(opt):
    from fxfuse.mlp_kernel import FusedMLP
    return [m for spec in opt._specializations.values() for m in spec.gm.modules() if isinstance(m, FusedMLP)]


def why_not_fused(opt) -> str:
    for spec in opt._specializations.values():
        for node in spec.gm.graph.nodes:
            why = node.meta.get("fxfuse", {}).get("fused_mlp")
            if why:
                return why
    return "no fused MLP module"


def measure_fxfuse(model, x, y64, mode, row, kernel_alone):
    """Build with fused_mlp=mode, check it, time it as users call it (and the kernel alone)."""
    import torch
    import fxfuse
    t0 = time.perf_counter()
    opt = fxfuse.optimize(model, x, fused_mlp=mode)
    if not isinstance(opt, fxfuse.OptimizedModule):
        row[f"{mode}_note"] = "optimize fell back to the original module (see its warning)"
        return None
    y = opt(x)
    torch.cuda.synchronize()
    row[f"{mode}_build_s"] = time.perf_counter() - t0
    row[f"err_{mode}"] = max_rel_err(y, y64)
    row[mode] = per_call_us(lambda: opt(x))
    row[f"{mode}_kernels"] = fxfuse.stats(opt)["fused_kernels"]
    mods = fused_mlps(opt)
    if not kernel_alone:
        return opt
    if len(mods) != 1:
        row["note"] = why_not_fused(opt)
        return opt
    mod = mods[0]
    cfg = mod.config
    row["form"] = f"rows{cfg.block_m}" if cfg.rowwise else f"dot{cfg.block_m}"
    replay, out = graphed(mod, x)
    row["kernel+graph"] = per_call_us(replay)
    row["err_kernel"] = max_rel_err(out, y64)
    row["fallbacks"] = mod.fallbacks
    row["decision"] = next(n.meta["fxfuse"]["decision"] for spec in opt._specializations.values()
                           for n in spec.gm.graph.nodes if n.meta.get("fxfuse", {}).get("kind") == "fused mlp")
    return opt


def main_cell(batch, h):
    """One row of the main table: eager, eager+graph, fxfuse force and off, the kernel alone."""
    import torch
    model = seed_model(h)
    torch.manual_seed(batch)
    x = torch.randn(batch, h, device="cuda")
    row = {"batch": batch, "hidden": h, "floor": floor_us(batch, h)}
    with torch.no_grad():
        y64 = copy.deepcopy(model).double()(x.double())
        row["err_eager"] = max_rel_err(model(x), y64)
        row["eager"] = per_call_us(lambda: model(x))
        row["eager+graph"] = per_call_us(graphed(model, x)[0])
        measure_fxfuse(model, x, y64, "off", row, kernel_alone=False)
        measure_fxfuse(model, x, y64, "force", row, kernel_alone=True)
    return row


def sweep_cell(batch, h, form="auto"):
    """Narrow widths: fused kernel (in a graph) vs eager in a graph, in the form auto picks
    or, to find the crossover, in the other one (through choose_config's threshold)."""
    import torch
    from fxfuse import mlp_spec
    model = seed_model(h)
    torch.manual_seed(batch)
    x = torch.randn(batch, h, device="cuda")
    row = {"batch": batch, "hidden": h, "asked": form}
    saved = mlp_spec.ROWWISE_MAX_BATCH
    mlp_spec.ROWWISE_MAX_BATCH = {"auto": saved, "rows": 1 << 40, "dot": 0}[form]
    try:
        with torch.no_grad():
            y64 = copy.deepcopy(model).double()(x.double())
            row["eager+graph"] = per_call_us(graphed(model, x)[0])
            off = measure_fxfuse(model, x, y64, "off", row, kernel_alone=False)
            spec = next(iter(off._specializations.values())) if off is not None else None
            if spec is not None and spec.graph is not None:   # the per-layer plan's GPU time
                row["plan graph"] = per_call_us(spec.launcher.replay)
            measure_fxfuse(model, x, y64, "force", row, kernel_alone=True)
    finally:
        mlp_spec.ROWWISE_MAX_BATCH = saved
    return row


def child(kind, cells):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    fn = main_cell if kind == "main" else sweep_cell
    for cell in cells:
        print("START", flush=True)
        try:
            row = fn(*cell)
        except Exception as e:  # noqa: BLE001 -- report and go on with the next cell
            row = {"batch": cell[0], "hidden": cell[1], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print("ROW " + json.dumps(row), flush=True)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- orchestration (parent)

def run_cells(kind, cells, cell_timeout, deadline):
    """Run cells in a child; a cell that hangs or crashes costs only itself."""
    rows, pending = [], list(cells)
    while pending:
        if deadline - time.time() < 10:
            rows += [{"batch": c[0], "hidden": c[1], "error": "skipped: time budget"} for c in pending]
            break
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen([sys.executable, "-m", "benchmarks.mlp_probe", "--child", kind, json.dumps(pending)],
                             stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(s) for s in p.stdout] + [lines.put(None)], daemon=True).start()
        limit = time.time() + 60              # import + CUDA start
        while pending:
            try:
                line = lines.get(timeout=max(0.1, min(limit, deadline) - time.time()))
            except queue.Empty:
                line = "TIMEOUT"
            if line == "TIMEOUT" or line is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)   # the child and its compilers (ptxas)
                p.wait()
                err.seek(0)
                tail = " | ".join(err.read().strip().splitlines()[-3:])[:300]
                if line is None:
                    why = f"child died rc={p.returncode}: {tail}"
                elif limit <= deadline:
                    why = f"timed out after {cell_timeout:.0f} s (a long compile?)"
                else:
                    why = "timed out: probe time budget spent"
                cell = pending.pop(0)
                rows.append({"batch": cell[0], "hidden": cell[1], "error": why})
                print(f"# {kind} {cell}: {why}", flush=True)
                break
            if line.startswith("START"):
                limit = time.time() + cell_timeout
            elif line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                pending.pop(0)
                print(f"# {kind} {json.dumps(rows[-1])[:300]}", flush=True)
        if p.poll() is None and not pending:
            p.wait(timeout=30)
    return rows


def fmt(v, digits=1):
    if isinstance(v, float):
        return f"{v:.1e}" if abs(v) < 0.01 else f"{v:.{digits}f}"
    return "-" if v is None else str(v)


def check_ok(row) -> bool:
    tol = max(1e-5, 4 * row.get("err_eager", 0.0))
    errs = [row[k] for k in ("err_force", "err_off", "err_kernel") if k in row]
    return all(e <= tol for e in errs) and not row.get("fallbacks")


def print_main(rows):
    from tabulate import tabulate
    by_cell = {(r["batch"], r["hidden"]): r for r in rows}
    table = []
    for cell in MAIN_CELLS:
        r = by_cell.get(cell, {"error": "not run"})
        if "error" in r:
            table.append([*cell] + [""] * 11 + [r["error"]])
            continue
        eg, k = r["eager+graph"], r.get("kernel+graph")
        note = r.get("note") or r.get("force_note") or ("" if check_ok(r) else "CHECK FAILED")
        table.append([r["batch"], r["hidden"], fmt(r["floor"]), fmt(r["eager"]), fmt(eg), fmt(r.get("off")),
                      fmt(r.get("force")), fmt(k), r.get("form", "-"),
                      fmt(eg / k, 2) if k else "-", fmt(r.get("err_force")), fmt(r.get("err_eager")),
                      fmt(r.get("force_build_s")), note])
    print(tabulate(table, headers=["batch", "hidden", "floor", "eager", "eager+graph", "off", "force",
                                   "kernel+graph", "form", "eager+graph / kernel", "err force", "err eager",
                                   "build s", "note"], tablefmt="github"), flush=True)


def print_sweep(rows):
    from tabulate import tabulate
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["hidden"], r["batch"]] + [""] * 6 + [r["error"]])
            continue
        k, eg, plan = r.get("kernel+graph"), r["eager+graph"], r.get("plan graph")
        note = r.get("note") or ("" if check_ok(r) else "CHECK FAILED")
        table.append([r["hidden"], r["batch"], fmt(eg), fmt(plan), fmt(k), fmt(r.get("off")), fmt(r.get("force")),
                      f"{r.get('form', '-')} ({r.get('asked')})",
                      fmt(k / plan, 2) if k and plan else "-", fmt(r.get("force_build_s")), note])
    print(tabulate(table, headers=["hidden", "batch", "eager+graph", "plan graph", "kernel+graph", "off", "force",
                                   "form (asked)", "kernel / plan graph", "build s", "note"], tablefmt="github"),
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-sweep", action="store_true", help="main table only")
    ap.add_argument("--budget", type=float, default=180, help="seconds for the whole probe")
    ap.add_argument("--cell-timeout", type=float, default=60, help="seconds per cell, compile included")
    ap.add_argument("--sweep", help="sweep cells instead of the default ones: BATCHxHIDDEN:FORM,... "
                    "(FORM auto, rows or dot); with --no-main, the sweep alone")
    ap.add_argument("--no-main", action="store_true", help="skip the main table")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.child[1]))
        return
    import torch
    import triton
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("mlp_probe needs a CUDA GPU with compiled Triton kernels (TRITON_INTERPRET unset or 0)")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{LAYERS} x (Linear(h, h) + ReLU), fp32, TF32 off; us per call, median of 5", flush=True)
    deadline = time.time() + args.budget
    sweep = SWEEP_CELLS
    if args.sweep:
        sweep = [(int(c.split("x")[0]), int(c.split("x")[1].split(":")[0]), (c.split(":") + ["auto"])[1])
                 for c in args.sweep.split(",")]
    results = {"main": [] if args.no_main else run_cells("main", CHEAP_CELLS, args.cell_timeout, deadline)}
    if not args.no_sweep:
        results["sweep"] = run_cells("sweep", sweep, args.cell_timeout, deadline)
    if not args.no_main:
        results["main"] += run_cells("main", WIDE_CELLS, args.cell_timeout, deadline)
        print("\n## fused MLP (fused_mlp='force') vs 'off' vs eager vs eager in a CUDA graph")
        print_main(results["main"])
    if not args.no_sweep:
        print("\n## narrow widths: the fused kernel in a CUDA graph vs the per-layer plan's graph (< 1 pays)")
        print_sweep(results["sweep"])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mlp_probe.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
