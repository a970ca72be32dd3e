"""The measuring harness every benchmark shares: timing, floors, correctness, the run loop.

Why it is built this way (DESIGN.md, "Measuring"):

- Calls are queued back to back and timed as a block, one synchronization per repetition.
  A sync after every call would add the CPU's launch overhead to every call instead of
  letting it overlap the GPU's work, which is exactly what the small cells are about.
- On CUDA the block is timed with CUDA events after a warm-up; on the CPU with
  time.perf_counter, so the harness runs (slowly, meaninglessly) on a machine without a GPU.
- The reported time is the median over >= 5 repetitions of the per-call time.
- Inputs are fresh torch.randn, never zeros, rotated among a few tensors when they are small.
- Every cell gets a floor from ceilings measured in the same run (matmul rate, copy
  bandwidth, one CUDA-graph launch), and tools are compared as ratios from the same run.
- Every tool's output is checked against a float64 reference: a fast wrong answer is no win.
"""
import argparse
import copy
import gc
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import report, tools as toolmod
from .timing import Timing, sync, time_interleaved, time_per_call, warm_clocks  # noqa: F401 (re-exported)

DTYPES = {  # --dtype: (torch dtype, TF32 allowed)
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
}


@dataclass
class Case:
    """One cell of a benchmark: a model factory, an input shape and the labels of its row."""

    params: dict                      # row labels, e.g. {"layers": 8, "hidden": 1024, "batch": 64}
    make_model: Callable              # () -> nn.Module in fp32 on the CPU (seeded by the harness)
    input_shape: tuple
    est_bytes: Callable | None = None  # (element size) -> GPU bytes needed; None: always fits
    notes: list = field(default_factory=list)

    @property
    def label(self):
        return " ".join(f"{k}={v}" for k, v in self.params.items())


# ---------------------------------------------------------------------------- precision

def set_precision(name):
    """Set TF32 flags for --dtype and return the torch dtype (fp32 means IEEE fp32: TF32 off)."""
    dtype, tf32 = DTYPES[name]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return dtype


def precision_settings():
    return {
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


# ---------------------------------------------------------------------------- inputs

def make_inputs(shape, dtype, device, rotate=4, rotate_max_bytes=256 << 20):
    """Fresh randn inputs: `rotate` distinct tensors when they are small, else one."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    count = rotate if nbytes * rotate <= rotate_max_bytes else 1
    return [torch.randn(shape, dtype=dtype, device=device) for _ in range(count)]


# ---------------------------------------------------------------------------- ceilings, floors

def measure_ceilings(device, dtype, warm_s=1.0):
    """Measure this run's matmul rate, copy bandwidth and one-launch cost.

    CUDA: a square cuBLAS product in `dtype` under the current TF32 flags (8192^3, 4096^3 if
    memory is short), after ~1 s of matmuls to bring the clocks up; a device-to-device copy of
    up to 1 GiB (bytes read + written); one replay of a CUDA graph holding one tiny kernel
    (and, for reference only, the per-kernel cost in a graph of 64 such kernels).
    CPU: the same with small sizes and one tiny eager op as the "launch"; rough, for testing.
    Both: the host time of an empty nn.Module call (the host's speed, which the small cells follow).
    """
    cuda = device.type == "cuda"
    elt = torch.empty((), dtype=dtype).element_size()
    free = torch.cuda.mem_get_info(device)[0] if cuda else 8 << 30
    n = 1024
    if cuda:
        n = 8192 if 3 * 8192 * 8192 * elt * 1.5 < free else 4096
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)
    warm_clocks(device, warm_s)  # a cold GPU is slower than a busy one
    t_mm = time_per_call(lambda x: torch.mm(x, b, out=c), [a], min_rep_s=0.05)
    del a, b, c
    numel = min(256 << 20, int(free / 4 / 4)) if cuda else 16 << 20
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    t_copy = time_per_call(lambda x: dst.copy_(x), [src], min_rep_s=0.05)
    copy_bytes = 2 * src.nbytes
    del src, dst
    tiny = torch.randn(1, device=device)
    t_eager = time_per_call(lambda x: x.add_(1.0), [tiny], max_calls=20000)
    # host speed: the small cells are bound by the CPU, whose speed differed ~2x between
    # sessions on the device host (SUMMARY.md, 2026-11-23); an empty module call shows which
    out = {
        "host_module_call_s": host_call_us() * 1e-6,
        "matmul_n": n,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "matmul_flops_per_s": 2 * n**3 / (t_mm.us * 1e-6),
        "copy_bytes_per_s": copy_bytes / (t_copy.us * 1e-6),
        "eager_launch_s": t_eager.us * 1e-6,
        "launch_s": t_eager.us * 1e-6,
    }
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tiny.add_(1.0)
        torch.cuda.current_stream().wait_stream(side)
        graph, graph64 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tiny.add_(1.0)
        with torch.cuda.graph(graph64):  # per-kernel cost inside a graph, for reference
            for _ in range(64):
                tiny.add_(1.0)
        t_graph = time_per_call(lambda x: graph.replay(), [tiny], max_calls=20000)
        t_graph64 = time_per_call(lambda x: graph64.replay(), [tiny], max_calls=2000)
        out["launch_s"] = t_graph.us * 1e-6
        out["graph_kernel_s"] = t_graph64.us * 1e-6 / 64
    out.update({"precision": precision_settings(), "tiny_kernel": "x.add_(1) on 1 element"})
    return out


def floor_of(flops, nbytes, ceilings):
    """(floor in us, what bounds it): max of FLOPs/rate, bytes/bandwidth and one launch."""
    parts = {
        "flops": flops / ceilings["matmul_flops_per_s"],
        "bytes": nbytes / ceilings["copy_bytes_per_s"],
        "launch": ceilings["launch_s"],
    }
    bound = max(parts, key=parts.get)
    return parts[bound] * 1e6, bound


def host_call_us():
    """Host time of an empty nn.Module call now (us): the host's speed drifts on this machine,
    and the small, host-bound cells follow it."""
    return time_per_call(torch.nn.Identity(), [torch.randn(1)], reps=5, min_rep_s=0.005, max_calls=20000).us


def count_flops(model, x):
    """FLOPs of one call, counted by torch's FlopCounterMode (matmuls and convolutions)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(x)
    return int(counter.get_total_flops())


def min_bytes(model, x, out):
    """Bytes any implementation must move: parameters and buffers read once, input, output."""
    state = list(model.parameters()) + list(model.buffers())
    return sum(t.nbytes for t in state) + x.nbytes + out.numel() * x.element_size()


def rel_error(out, ref):
    """||out - ref|| / ||ref|| in float64 (ref is the float64 model's output)."""
    out = out.detach().to(ref.device, torch.float64)
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


# ---------------------------------------------------------------------------- one cell

def _cleanup(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_checked(tool, model, inputs, ref):
    """(fn or None, record): one tool built and its output checked against the reference."""
    fn, rec = toolmod.build_tool(tool, model, inputs[0])
    if fn is None:
        return None, rec
    try:
        for _ in range(2):  # reduce-overhead records its graph on a later call, not the first
            fn(inputs[0])
        rec["rel_err"] = rel_error(fn(inputs[0]), ref)
    except Exception as exc:  # noqa: BLE001 - a broken tool is a cell, not a crash
        _record_error(rec, exc)
        return None, rec
    return fn, rec


def _record_error(rec, exc):
    import traceback

    rec.update(status="err", error=f"{type(exc).__name__}: {exc}"[:500],
               traceback=traceback.format_exc()[-4000:])
    print(f"    error: {rec['traceback'][-2500:]}", file=sys.stderr, flush=True)


def _store_timing(rec, t):
    rec.update(us=t.us, reps_us=t.reps_us, calls_per_rep=t.calls_per_rep)


def run_tool(tool, model, inputs, ref, args):
    """Build, check and time one tool on its own (--order sequential); every failure lands
    in the record."""
    fn, rec = build_checked(tool, model, inputs, ref)
    try:
        if fn is not None:
            _store_timing(rec, time_per_call(fn, inputs, reps=args.reps, min_rep_s=args.min_rep_ms / 1e3,
                                             max_calls=args.max_calls))
    except Exception as exc:  # noqa: BLE001
        _record_error(rec, exc)
    finally:
        fn = None
        if tool.compiled:
            torch._dynamo.reset()
        _cleanup(inputs[0].device)
    return rec


def run_tools_interleaved(tools, model, inputs, ref, args):
    """Build and check every tool, then time them together in rounds (time_interleaved).

    torch.compile columns are built after a dynamo reset each (a fair compile time), so the
    first one recompiles once during the warm-up calls; its cache entry and the next one's
    then coexist (dynamo keeps one entry per backend)."""
    results, fns = {}, {}
    for tool in tools:
        fn, results[tool.key] = build_checked(tool, model, inputs, ref)
        if fn is not None:
            fns[tool.key] = fn
    try:
        if fns:
            timings = time_interleaved(fns, inputs, reps=args.reps, min_rep_s=args.min_rep_ms / 1e3,
                                       max_calls=args.max_calls)
            for key, t in timings.items():
                _store_timing(results[key], t)
    except Exception as exc:  # noqa: BLE001 - e.g. a recompile failing: no tool of the cell is timed
        for key in fns:
            _record_error(results[key], exc)
    finally:
        fns.clear()
        torch._dynamo.reset()
        _cleanup(inputs[0].device)
    return results


def run_case(case, tools, device, dtype, ceilings, args, seed):
    """Measure every tool on one case; returns the cell record (JSON-ready)."""
    cell = {"label": case.label, "params": dict(case.params),
            "input_shape": list(case.input_shape), "notes": list(case.notes), "results": {}}
    elt = torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda" and case.est_bytes is not None:
        need, free = case.est_bytes(elt), torch.cuda.mem_get_info(device)[0]
        if need > 0.8 * free:
            cell["skipped"] = f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            return cell
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            cpu_model = case.make_model().eval().to(dtype)
            ref_model = copy.deepcopy(cpu_model).double().to(device)
            model = cpu_model.to(device)
            inputs = make_inputs(case.input_shape, dtype, device)
            ref = ref_model(inputs[0].double())
            del ref_model
            cell["flops"] = count_flops(model, inputs[0])
            cell["bytes"] = min_bytes(model, inputs[0], ref)
            cell["inputs_rotated"] = len(inputs)
            cell["floor_us"], cell["floor_bound"] = floor_of(cell["flops"], cell["bytes"], ceilings)
            cell["timing"] = args.order
            cell["host_module_call_us"] = host_call_us()
            if args.order == "interleaved":
                cell["results"] = run_tools_interleaved(tools, model, inputs, ref, args)
            else:
                for tool in tools:
                    cell["results"][tool.key] = run_tool(tool, model, inputs, ref, args)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the reference
        import traceback

        cell["skipped"] = f"setup failed: {type(exc).__name__}: {exc}"[:500]
        print(f"    setup failed:\n{traceback.format_exc()[-3000:]}", file=sys.stderr, flush=True)
    finally:
        model = inputs = ref = cpu_model = None
        _cleanup(device)
    return cell


# ---------------------------------------------------------------------------- run

def add_common_args(parser):
    default = ",".join(t.key for t in toolmod.select_tools())
    extra = ",".join(t.key for t in toolmod.TOOLS if not t.default)
    parser.add_argument("--tools", help=f"comma list of columns (default {default}; "
                                        f"also known: {extra})")
    parser.add_argument("--max-autotune", action="store_true",
                        help="add torch.compile mode=max-autotune-no-cudagraphs (slow to compile)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="fp32 = IEEE fp32 (TF32 off); tf32 = fp32 with TF32 allowed")
    parser.add_argument("--quick", action="store_true", help="tiny smoke grid")
    parser.add_argument("--out", help="write results under OUT/<device-slug>/ instead of "
                                      "benchmarks/results/<device-slug>/")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (at least 5)")
    parser.add_argument("--order", choices=["interleaved", "sequential"], default="interleaved",
                        help="interleaved: every tool built first, then timed in rounds, one block "
                             "each per round; sequential: one tool after the other (the method "
                             "before 2026-11-25 noon)")
    parser.add_argument("--min-rep-ms", type=float, default=20.0,
                        help="each repetition queues enough calls to last this long")
    parser.add_argument("--max-calls", type=int, default=5000, help="cap on calls per repetition")
    parser.add_argument("--budget-s", type=float,
                        help="start no new cell after this many seconds (results so far are kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-heatmap", action="store_true")
    return parser


def csv_ints(text):
    """A comma list of positive integers (argparse type): an empty list or a size below 1 is a
    usage error, not a run of the default axis or a skipped cell (fuzz36g)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


class BenchmarkParser(argparse.ArgumentParser):
    """Checks the common arguments after parsing: a bad value is a usage error (exit 2) with its
    reason, where it was a traceback or silently changed (fuzz36g)."""

    def parse_args(self, args=None, namespace=None):
        args = super().parse_args(args, namespace)
        try:
            device = torch.device(args.device)
        except RuntimeError:
            self.error(f"--device {args.device!r} is no torch device (cuda, cuda:1, cpu)")
        if device.type == "cuda" and not torch.cuda.is_available():
            self.error("--device cuda needs a CUDA GPU and none is available here; --device cpu (with "
                       "TRITON_INTERPRET=1) runs a smoke test")
        if args.reps < 5:
            self.error(f"--reps {args.reps}: at least 5 (the median of fewer is no measurement)")
        if args.max_calls < 1 or args.min_rep_ms <= 0 or args.budget_s is not None and args.budget_s < 0:
            self.error("--max-calls must be at least 1, --min-rep-ms and --budget-s above 0")
        if args.tools is not None and not args.tools.strip(","):
            self.error("--tools is empty")
        if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
            self.error(f"--out {args.out} is a file, not a directory")
        return args


def environment(bench, device, args):
    """What a reader needs to trust or reproduce the numbers."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    # the device tool's copy of the tree carries stale git metadata: the caller can name the commit
    commit = os.environ.get("FXFUSE_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = ""
    return {
        "benchmark": bench,
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": f"python -m {_main_module(bench)} " + shlex.join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "git_commit": commit or None,
        "dtype": args.dtype,
        "timing": args.order,
        "precision": precision_settings(),
    }


def _main_module(bench: str) -> str:
    """The module run with -m (benchmarks.mlp also writes the "mlp_residual" benchmark)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None and spec.name.startswith("benchmarks.") else f"benchmarks.{bench}"


def run_benchmark(bench, cases, args, heatmap_keys=None):
    """Run `cases` with the selected tools, writing JSON + markdown after every cell.

    Results are rewritten after each cell so a run killed by a time limit keeps what it had.
    `heatmap_keys` = (row, column, group) param names for the speedup heatmaps, or None.
    """
    device = torch.device(args.device)
    dtype = set_precision(args.dtype)
    tools = toolmod.select_tools(args.tools, args.max_autotune)
    meta = environment(bench, device, args)
    rep = report.Report(meta, tools, args.out)
    started = time.perf_counter()
    print(f"[ceilings] {meta['device']} {args.dtype} ...", file=sys.stderr, flush=True)
    with torch.no_grad():
        meta["ceilings"] = measure_ceilings(device, dtype)
    print("[ceilings] " + report.ceilings_line(meta["ceilings"]), file=sys.stderr, flush=True)
    for i, case in enumerate(cases):
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            rep.add({"label": case.label, "params": dict(case.params), "results": {},
                     "skipped": f"not run: --budget-s {args.budget_s:g} s spent"})
            continue
        print(f"[{i + 1}/{len(cases)}] {case.label} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        cell = run_case(case, tools, device, dtype, meta["ceilings"], args, args.seed + i)
        rep.add(cell)
        rep.write()
        print(f"    {report.progress_line(cell, tools)}  ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    rep.write()
    rep.print_table()
    if heatmap_keys and not args.no_heatmap:
        rep.heatmaps(*heatmap_keys)
    print(f"results: {rep.json_path}  {rep.md_path}", file=sys.stderr)
    return rep


def main_parser(description):
    return add_common_args(BenchmarkParser(description=description))
