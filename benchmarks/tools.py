"""The tool columns of every benchmark table, as one list.

Each column is a `Tool`: a CLI key, a header, and a builder `build(model, example) -> callable`.
Adding a column (a new fxfuse option, another compiler mode) is one line in `TOOLS`.

Why builders are plain functions of (model, example): every tool then goes through the same
`build_tool` wrapper, which times construction plus the first call (for torch.compile that
first call is the compile; for fxfuse it is optimize plus its first call, which captures the
CUDA graph), records warnings, and sorts failures into "n/a" (the tool does not support this
yet) and "err" (it broke). A failing tool never stops the run.

Imports of fxfuse happen inside the builders, so this module (and the whole harness) imports
while fxfuse is incomplete; a missing fxfuse shows as "n/a" with the ImportError recorded.
"""
import copy
import functools
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

import torch


class NotApplicable(Exception):
    """A tool that cannot run in this setting (e.g. a CUDA-only tool on the CPU)."""


@dataclass(frozen=True)
class Tool:
    key: str                 # name on the command line (--tools)
    label: str               # column header
    build: Callable          # build(model, example) -> callable(x) -> output
    default: bool = True     # in the table unless --tools says otherwise
    fxfuse: bool = False     # an fxfuse variant: not an "other tool" when ranking competitors
    compiled: bool = False   # uses torch.compile: reset dynamo around it
    private_copy: bool = False  # build from a deep copy (made before the build clock starts)


# ---------------------------------------------------------------------------- builders

def build_eager(model, example):
    """The model as written: the baseline every speedup is measured against."""
    return model


def build_cudagraph(model, example):
    """Eager captured by hand in one CUDA graph: what removing launch overhead alone gives.

    Static input and output buffers; each call copies the input in and replays. The returned
    tensor is the static output, overwritten by the next call (the harness clones it when it
    needs to keep it). Warm-up runs on a side stream, as torch.cuda.graphs recommends.
    """
    if example.device.type != "cuda":
        raise NotApplicable("CUDA graphs need a CUDA device")
    static_in = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    from fxfuse.graph_launch import clear_cublas_workspaces   # its docstring: why, around a capture
    clear_cublas_workspaces()
    with torch.cuda.graph(graph):
        static_out = model(static_in)
    clear_cublas_workspaces()

    def run(x):
        static_in.copy_(x)
        graph.replay()
        return static_out

    run.graph = graph  # keep the graph alive with the callable
    return run


def build_compile(model, example, mode=None):
    """torch.compile in the given mode; the compile itself happens at the first call."""
    return torch.compile(model, mode=mode)


def build_fxfuse(model, example, **options):
    """fxfuse.optimize with the given options (its Tool gets a private copy of the model).

    The copy keeps a pass that rewrites the module in place from changing what the other
    columns measure. An option fxfuse does not know yet raises FxfuseError or TypeError,
    which `build_tool` shows as "n/a".
    """
    import fxfuse  # lazy: the harness must import while fxfuse is being written

    if not hasattr(fxfuse, "optimize"):
        raise NotApplicable("fxfuse.optimize does not exist yet")
    return fxfuse.optimize(model, example, **options)


def _fxfuse_unsupported():
    """Exception types that mean "this fxfuse column is not supported yet" (shown as n/a)."""
    kinds = [NotApplicable, TypeError, ImportError]
    try:
        from fxfuse.errors import FxfuseError

        kinds.append(FxfuseError)
    except Exception:  # noqa: BLE001 - fxfuse absent or broken: ImportError already covers it
        pass
    return tuple(kinds)


def fxfuse_tool(key, label, default=True, **options):
    """A column running fxfuse.optimize(model, example, **options) on a private model copy."""
    return Tool(key, label, functools.partial(build_fxfuse, **options), default=default,
                fxfuse=True, private_copy=True)


def compile_tool(key, label, mode=None, default=True):
    """A column running torch.compile(model, mode=mode); dynamo is reset around each build."""
    return Tool(key, label, functools.partial(build_compile, mode=mode), default=default,
                compiled=True)


# One line per column, in table order. default=False columns run only when --tools names them.
TOOLS = [
    Tool("eager", "eager", build_eager),
    Tool("cudagraph", "eager+graph", build_cudagraph),
    compile_tool("compile", "compile"),
    compile_tool("compile-ro", "compile r-o", mode="reduce-overhead"),
    compile_tool("compile-ma", "compile m-a", mode="max-autotune-no-cudagraphs", default=False),
    fxfuse_tool("fxfuse-overhead", "fxfuse ovh", fuse=False, cuda_graphs=True),
    fxfuse_tool("fxfuse", "fxfuse", fuse=True, cuda_graphs=True),
    fxfuse_tool("fxfuse-lib", "fxfuse lib", default=False, gemm="off", fused_mlp="off"),
    fxfuse_tool("fxfuse-gemm", "fxfuse gemm", default=False, gemm="force", fused_mlp="off"),
    fxfuse_tool("fxfuse-mlp", "fxfuse mlp", default=False, fused_mlp="force"),
    fxfuse_tool("fxfuse-nomlp", "fxfuse no-mlp", default=False, fused_mlp="off", strassen="auto", strassen_levels=2),
    fxfuse_tool("fxfuse-auto", "fxfuse auto", default=False, strassen="auto", strassen_levels=2),
    fxfuse_tool("fxfuse-all", "fxfuse all", default=False, strassen="auto", strassen_levels=2, tf32x3="auto"),
    fxfuse_tool("fxfuse-x3", "fxfuse x3", default=False, tf32x3="auto"),
    fxfuse_tool("fxfuse-gemm3", "fxfuse gemm x3", default=False, gemm="force", tf32x3="force", fused_mlp="off"),
    fxfuse_tool("fxfuse-s1x3", "fxfuse S1 x3", default=False, strassen="force", strassen_levels=1, tf32x3="force"),
    fxfuse_tool("fxfuse-s2x3", "fxfuse S2 x3", default=False, strassen="force", strassen_levels=2, tf32x3="force"),
    fxfuse_tool("fxfuse-s1", "fxfuse S1", default=False, strassen="force", strassen_levels=1),
    fxfuse_tool("fxfuse-s2", "fxfuse S2", default=False, strassen="force", strassen_levels=2),
]
TOOLS_BY_KEY = {t.key: t for t in TOOLS}
HEADLINE = "fxfuse"  # the column whose speedups the tables report


def select_tools(keys=None, max_autotune=False):
    """Tools named in `keys` (comma string or list), else the defaults (+ max-autotune)."""
    if keys:
        names = [k.strip() for k in keys.split(",")] if isinstance(keys, str) else list(keys)
        unknown = [k for k in names if k not in TOOLS_BY_KEY]
        if unknown:
            raise SystemExit(f"unknown tool(s) {unknown}; known: {', '.join(TOOLS_BY_KEY)}")
        if max_autotune and "compile-ma" not in names:
            names.append("compile-ma")
        return [t for t in TOOLS if t.key in names]
    return [t for t in TOOLS if t.default or (max_autotune and t.key == "compile-ma")]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_tool(tool, model, example):
    """Build one tool's callable and time construction plus first call.

    Returns (fn, record): fn is None unless the build succeeded; record holds "status"
    ("ok", "n/a" or "err"), "build_s", "error" (short), "traceback", "warnings", and for fxfuse
    columns its stats() and explain().
    """
    record = {"status": "ok"}
    if tool.compiled:
        torch._dynamo.reset()
    unsupported = _fxfuse_unsupported() if tool.fxfuse else (NotApplicable,)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if tool.private_copy:
                model = copy.deepcopy(model)
            _sync(example.device)
            start = time.perf_counter()
            fn = tool.build(model, example)
            fn(example)
            _sync(example.device)
            record["build_s"] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - every failure becomes a cell, never a crash
            fn = None
            record["status"] = "n/a" if isinstance(exc, unsupported) else "err"
            record["error"] = f"{type(exc).__name__}: {exc}"[:500]
            record["traceback"] = traceback.format_exc()[-4000:]
    record["warnings"] = sorted({str(w.message)[:300] for w in caught})
    if fn is not None and tool.fxfuse:
        record.update(_fxfuse_report(fn))
    return fn, record


def _fxfuse_report(opt):
    """fxfuse.stats() and explain() of a built module; failures are recorded, not raised."""
    out = {}
    try:
        import fxfuse

        out["stats"] = dict(fxfuse.stats(opt))
    except Exception as exc:  # noqa: BLE001
        out["stats_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        import fxfuse

        out["explain"] = str(fxfuse.explain(opt))[:20000]
    except Exception as exc:  # noqa: BLE001
        out["explain_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out

