"""The pass pipeline, as a table of contents: one commented line per pass.

Each pass is `fn(gm, options) -> gm` and leaves a graph that runs; shapes are re-propagated after each pass that
adds nodes, so later passes read shapes only from node.meta["tensor_meta"].
"""
import time

from fxfuse.tracing import propagate_shapes

from .fold_batchnorm import fold_batchnorm
from .fuse_gemm import fuse_gemm
from .fuse_mlp import fuse_mlp
from .fuse_pointwise import fuse_pointwise
from .hoist_permutes import hoist_permutes
from .hoist_slices import hoist_slices
from .linear_epilogue import linear_epilogue
from .normalize import normalize
from .sink_views import sink_views
from .plan_linears import plan_linears
from .strassen import strassen
from .weight_views import weight_views

PIPELINE = [
    # name              pass              re-propagate shapes after it
    ("fold_batchnorm", fold_batchnorm, True),    # eval BatchNorm -> folded weights or per-channel mul-add
    ("normalize", normalize, True),              # one canonical spelling per op; Linear/Conv bias split out
    ("sink_views", sink_views, True),            # view(y) -> pointwise op  =>  op(y) -> view: epilogues reach ops past views
    ("hoist_permutes", hoist_permutes, False),   # op(a, b).permute(p) -> op(a', b'): a residual add past a permute fuses
    ("hoist_slices", hoist_slices, False),       # op(a, b)[s] -> op(a[s], b[s]): a bias add past a chunk fuses with the gate
    ("plan_linears", plan_linears, False),       # cost model: per chain of Linears, which candidate each layer runs as
    ("strassen", strassen, False),               # large Linears -> Strassen prefix | one bmm | suffix+epilogue+next prefix
    ("fuse_mlp", fuse_mlp, False),               # chains of narrow Linear layers + epilogues -> one Triton kernel
    ("fuse_gemm", fuse_gemm, False),             # a Linear + its epilogue -> one generated split-K GEMM where it pays
    ("linear_epilogue", linear_epilogue, False), # bias back into the GEMM where the GPU measures that faster
    ("fuse_pointwise", fuse_pointwise, False),   # maximal convex pointwise groups -> one Triton kernel each
    ("weight_views", weight_views, False),       # library Linears read W stored [in, out] as W.t(), not a copy
]


def run_pipeline(gm, example_args, options):
    """Run every enabled pass; record what each did (ms, node count) for explain()."""
    log = []
    gm.meta["fxfuse_example_args"] = example_args   # passes that measure numerics (strassen) read it
    for name, fn, reprop in PIPELINE:
        start = time.perf_counter()
        gm = fn(gm, options)
        if reprop:
            propagate_shapes(gm, example_args)
        entry = {"pass": name, "ms": 1e3 * (time.perf_counter() - start), "nodes": len(gm.graph.nodes)}
        if gm.meta.pop("fxfuse_skipped", None):
            entry["skipped"] = "disabled by options"
        log.append(entry)
    gm.meta["fxfuse_passes"] = log
    return gm
