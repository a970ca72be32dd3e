"""explain(): what every stage left behind, as text a person reads.

For each specialization: the input signature, one "constructed by <pass> (N ms)" line per
pass, the rewritten graph as Python with a shape/dtype comment per line, and a table with one
row per node (kind, shape, members of fused groups, the decision and its reason, kernel name).
"""
import torch
import torch.fx
from tabulate import tabulate

from .api import _gathers, is_view, node_kind
from .cost_model import CANDIDATES
from .kernel import FusedKernel
from .ops import row_major
from .runtime import OptimizedModule

DTYPE_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
               torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8"}


def _is_tensor_meta(meta) -> bool:
    return hasattr(meta, "shape") and hasattr(meta, "dtype")


def shape_str(node) -> str:
    meta = node.meta.get("tensor_meta")
    if meta is None:
        return ""
    if _is_tensor_meta(meta):
        return f"{DTYPE_SHORT.get(meta.dtype, str(meta.dtype))}{list(meta.shape)}"
    if isinstance(meta, (tuple, list)):   # a NamedTuple with a field named `shape` is no tensor's (fuzz40b)
        return "(" + ", ".join(f"{DTYPE_SHORT.get(m.dtype, m.dtype)}{list(m.shape)}"
                               for m in meta if _is_tensor_meta(m)) + ")"
    return ""


def _call_text(node) -> str:
    args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
    if node.op == "call_module":
        return f"self.{node.target}({args})"
    if node.op == "call_method":
        rest = [_arg(a) for a in node.args[1:]] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
        return f"{_arg(node.args[0])}.{node.target}({', '.join(rest)})"
    if node.op == "get_attr":
        return _attr_path(node.target)
    return f"{_function_name(node.target)}({args})"


def _attr_path(target: str) -> str:
    """`self.fc.weight`, or `self.get_submodule("0").weight` where a name is not an identifier."""
    *mods, leaf = target.split(".")
    if all(m.isidentifier() for m in mods):
        return "self." + ".".join(mods + [leaf])
    return f'self.get_submodule("{".".join(mods)}").{leaf}'


def _function_name(fn) -> str:
    name = getattr(fn, "__name__", "")
    if getattr(torch.nn.functional, name, None) is fn:
        return f"torch.nn.functional.{name}"
    if getattr(torch, name, None) is fn:
        return f"torch.{name}"
    return torch.fx.node._get_qualified_name(fn)


def _arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (tuple, list)):
        inner = ", ".join(_arg(x) for x in a)
        return f"({inner},)" if isinstance(a, tuple) and len(a) == 1 else (f"({inner})" if isinstance(a, tuple) else f"[{inner}]")
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v)}" for k, v in a.items()) + "}"
    return repr(a)


def graph_as_python(gm: torch.fx.GraphModule) -> str:
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    lines = [f"def forward(self, {', '.join(inputs)}):"]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        comment = shape_str(node)
        if node.op == "output":
            lines.append(f"    return {_arg(node.args[0])}")
            continue
        lines.append(f"    {node.name} = {_call_text(node)}" + (f"  # {comment}" if comment else ""))
    return "\n".join(lines)


def _why_reference(gm) -> str:
    """Why fused groups run their torch reference: the user's option, or no device to run kernels
    on (review44g: the option was named where the user had passed nothing, or use_kernels=True)."""
    if gm.meta.get("fxfuse_warning"):   # (api.build_graph's: the option was auto, or True and not possible)
        return "no CUDA device, and TRITON_INTERPRET=1 is not set to run the kernels on the CPU"
    return "option use_kernels=False"


def node_table(gm: torch.fx.GraphModule) -> str:
    rows = []
    for node in gm.graph.nodes:
        kind = node_kind(gm, node)
        if kind in ("input", "output", "constant", "kernel output"):
            continue
        meta = node.meta.get("fxfuse", {})
        members, kernel, decision = "", "", meta.get("decision", "")
        if kind == "fused kernel":
            mod = gm.get_submodule(node.target)
            members = ", ".join(mod.members)
            kernel = mod.kernel_name
            joined = [m.split("=")[0] for m in mod.members if m.endswith(("=stack", "=cat"))]   # join_outputs
            decision = decision or (f"fused {len(mod.members) - len(joined)} pointwise ops" + (
                f"; writes {', '.join(joined)} itself" if joined else ""))
            if not getattr(mod, "use_kernel", True):   # (a GEMM's, MLP's or Strassen kernel's too: fuzz45g)
                decision += f"; runs the torch reference ({_why_reference(gm)})"
        elif meta.get("note"):
            decision = meta["note"]
        elif meta.get("kept"):
            decision = "kept: " + meta["kept"]
        elif not decision:
            decision = _library_reason(node)
        rows.append([node.name, kind, shape_str(node), members, decision, kernel])
    return tabulate(rows, headers=["node", "kind", "output", "members", "decision / reason", "kernel"],
                    tablefmt="simple", maxcolwidths=[None, None, None, 48, 56, None])


VIEWS = {"view", "unflatten", "transpose", "permute", "squeeze", "unsqueeze", "expand", "split", "chunk", "unbind",
         "narrow", "select", "t", "detach", "view_as", "expand_as", "getitem", "__getitem__", "movedim", "swapaxes",
         "slice", "tensor_split", "hsplit", "vsplit", "dsplit", "split_with_sizes", "moveaxis", "swapdims",
         "diagonal", "adjoint", "real", "imag", "view_as_real", "view_as_complex"}   # (torch.export's aten.slice.Tensor;
#                                                 splits: fuzz47f; `x.mT`: api.is_view; torch.real: review48r2)
RESHAPES = {"reshape", "flatten", "contiguous"}   # views where the strides allow, else copies


def _library_reason(node) -> str:
    """Why a node stays outside the kernels, for explain (review42e: write-backs and views read as
    library ops)."""
    from .attribute_writes import write_attribute
    if node.target is write_attribute:
        return f"assigns the attribute {node.args[2] if len(node.args) > 2 else ''} each call, as forward() does"
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if is_view(node):   # (api.node_kind: "view")
        return "a view or an item of a tuple (no kernel; the kernels read it where it lies)"
    if _gathers(node):
        return "indexing by a tensor or list: the library's gather (a copy)"
    if node.op in ("call_function", "call_method") and name.split(".")[0] in RESHAPES:
        return "a view where the strides allow it, else the library's copy"
    if node.op == "call_module":
        return "a module kept as one call (its own forward runs: a layer fxfuse does not rewrite)"
    return "library op (not one of the pointwise ops fxfuse fuses)"


PLAN_COLUMNS = CANDIDATES   # library, gemm, gemm_x3, strassen1, strassen2, mlp


FORCED_NOTES = {   # options whose "force" acts after the plan, whatever it chose (explain's plan table)
    "strassen": "strassen='force': the Strassen pass rewrites every Linear it can, whatever this table chose",
    "gemm": "gemm='force' overrides this table's choice: every Linear the fused-MLP and Strassen passes "
            "leave becomes a generated GEMM where it is legal (the node table shows what was built)",
    "fused_mlp": "fused_mlp='force' overrides this table's choice: every chain that fits one kernel becomes a "
                 "fused MLP where it is legal (the node table shows what was built)",
    "tf32x3": "tf32x3='force': gemm_x3 is legal without a calibration (priced by the roofline) and every "
              "generated fp32 GEMM runs as 3xTF32 where its guard passes",
}


def plan_table(gm, options=None) -> str:
    """One row per planned Linear: every candidate's estimated time (us; '-' where illegal),
    the cost model's choice and why the runner-up lost (where nothing else was legal, why the
    others were not), then a line per option set to "force". Empty when no plan was made."""
    plans = gm.meta.get("fxfuse_plans") or []
    if not plans:
        return ""
    rows, illegal = [], {}
    for p in plans:
        layer = p["layer"]
        est = [f"{p['estimates'][c]:.1f}" if c in p["estimates"] else "-" for c in PLAN_COLUMNS]
        losers = sorted((v, c) for c, v in p["estimates"].items() if c != p["choice"])
        why = f"next best {losers[0][1]}: {p['reasons'].get(losers[0][1], '')}" if losers else \
            "the only legal candidate"
        rows.append([p["node"], f"{layer.m}x{layer.k}->{layer.n}", *est, p["choice"], why])
        for c in PLAN_COLUMNS:
            if c not in p["estimates"] and c in p["reasons"]:
                illegal.setdefault((c, p["reasons"][c]), []).append(p["node"])
    head = f"cost model: {gm.meta.get('fxfuse_cost_model', '?')}; estimated us per layer ('-': not legal, see below)"
    lines = [f"not legal: {c} ({', '.join(nodes) if len(nodes) < len(rows) else 'every layer'}): {reason}"
             for (c, reason), nodes in illegal.items()]
    lines += [f"note: {note}" for opt, note in FORCED_NOTES.items() if getattr(options, opt, None) == "force"]
    if getattr(options, "strassen", None) == "off" and getattr(options, "strassen_levels", 1) != 1:
        lines.append(f"note: strassen_levels={options.strassen_levels} has no effect: strassen='off' (the default; "
                     "opt in with 'auto' or 'force')")
    return head + "\n" + tabulate(rows, headers=["linear", "m x k->n", *PLAN_COLUMNS, "choice", "why"],
                                   tablefmt="simple", maxcolwidths=[None] * (3 + len(PLAN_COLUMNS)) + [60]) + \
        "".join("\n" + line for line in lines)


def _measured_line(spec, gm) -> str:
    """explain(measure=True): the specialization's CUDA-graph replay timed on the GPU next to
    the sum of the chosen candidates' estimates (which leaves out the input copy and the replay's host cost)."""
    if spec.graph is None:
        return f"# measured: not available ({spec.cuda_graph_note}; measure=True times CUDA-graph replays)"
    torch.cuda.synchronize()
    for _ in range(3):
        spec.graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            spec.graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    measured = sorted(times)[len(times) // 2]
    plans = gm.meta.get("fxfuse_plans") or []
    counted, estimate = set(), 0.0
    for p in plans:       # a fused MLP's estimate covers its whole segment: count it once
        key = (p["chain"], p["segment"]) if p["segment"] else p["node"]
        if key not in counted:
            counted.add(key)
            estimate += p["estimates"].get(p["choice"], 0.0)
    versus = f" vs {estimate:.1f} us estimated for the planned Linear layers" if plans else ""
    return f"# measured: {measured:.1f} us per graph replay (median of 5 x 20 replays){versus}"


ORIGINAL_CALL_REASONS = {   # runtime._run_original's keys in words
    "full": "max_specializations reached", "build": "build failed or refused", "aliased": "inputs share memory",
    "swapped": "a submodule was replaced", "kwargs": "keyword arguments", "layout": "input layout",
    "mode": "a TorchFunctionMode / TorchDispatchMode", "transform": "torch.func transform or forward AD",
    "hook": "hooks", "train": "training mode", "grad": "grad mode", "autocast": "autocast",
    "inference": "inference mode", "jit": "torch.jit.trace"}


def explain(optimized, kernels: bool = False, measure: bool = False) -> str:
    """A report of what fxfuse did to a model (a str; print it). kernels=True adds the generated
    Triton sources; measure=True (CUDA) times each specialization next to the cost model's estimate."""
    if not isinstance(optimized, OptimizedModule):
        if not isinstance(optimized, torch.nn.Module):
            raise TypeError(f"fxfuse.explain takes what fxfuse.optimize returned, got {type(optimized).__name__}")
        return (f"{type(optimized).__name__} is not optimized by fxfuse (not an OptimizedModule): if "
                "fxfuse.optimize returned it, it is the original module, and optimize's warning says why.")
    out = [f"fxfuse report for {type(optimized.original).__name__}: "
           f"{len(optimized._specializations)} specialization(s)"]
    for k, spec in enumerate(list(optimized._specializations.values())):
        gm = spec.gm
        sig = ", ".join(f"{DTYPE_SHORT.get(s[1], s[1])}{list(s[0])} on {s[2]}" + (
            f" strides {tuple(s[3])}" if tuple(s[3]) != row_major(s[0]) else "") if s[0] != "const" else s[2]
            for s in spec.signature)   # (review42e: builds for other strides read alike)
        out.append(f"\n== specialization {k}: inputs ({sig}); built in {spec.build_ms:.0f} ms; "
                   f"calls so far: {spec.calls}")
        t = gm.meta.get("fxfuse_trace", {})
        out.append(f"# constructed by {t.get('tracer', 'trace')} ({t.get('ms', 0):.1f} ms)")
        for p in gm.meta.get("fxfuse_passes", []):
            extra = f", skipped: {p['skipped']}" if "skipped" in p else ""
            out.append(f"# constructed by {p['pass']} ({p['ms']:.1f} ms, {p['nodes']} nodes{extra})")
        out.append(f"# CUDA graph: {spec.cuda_graph_note}")
        if gm.meta.get("fxfuse_classical_because"):
            out.append("# Strassen and 3xTF32 off for this specialization: every layer passed its own check, but "
                       f"the whole model did not ({gm.meta['fxfuse_classical_because'].split('. ')[0]})")
        if spec.graph is not None:
            out.append(f"# inputs: {spec.inputs.note}{spec.affinity_note()}")
            out.append(f"# outputs: {spec.handout_note}")
            out.append(f"# replay: {spec.launcher.note}")
        out.append(graph_as_python(gm))
        out.append("")
        out.append(node_table(gm))
        plans = plan_table(gm, optimized._options)
        if plans:
            out.append("\n" + plans)
        if measure:
            out.append(_measured_line(spec, gm))
        if kernels:
            for mod in gm.modules():
                if isinstance(mod, FusedKernel):
                    out.append(f"\n# ---- {mod.kernel_name} ({', '.join(mod.members)})\n{mod.source}")
    if optimized._dropped[0]:
        out.append(f"\nrebuilds: {optimized._dropped[0]} (every specialization dropped; last because "
                   f"{optimized._dropped[3]})")
    if optimized._miss_count:
        out.append(f"\nguard misses: {optimized._miss_count} (last: {optimized._last_miss})")
    if optimized._original_calls:
        reasons = ", ".join(f"{ORIGINAL_CALL_REASONS.get(k, k)}: {n}" for k, n in optimized._original_calls.most_common())
        out.append(f"calls that ran the original module: {sum(optimized._original_calls.values())} ({reasons})")
    return "\n".join(out)
