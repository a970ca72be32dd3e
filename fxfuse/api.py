"""The public entry points: optimize(), explain(), stats().

Policy everywhere: when fxfuse cannot do its job it returns the original module with one
warning that names the reason (or raises the FxfuseError under strict=True). Each new
specialization is checked against the original module on the input it was built from; a
mismatch is a bug in fxfuse, and it is never returned to the user as an answer.
"""

import collections
import collections.abc
import inspect
import numbers

import torch

from .call_context import user_mode_active
from .concrete_args import (UNBINDABLE, bind_positional, keyword_changing_wrapper, positional_names,
                            restore_argument_containers, same_default,
                            watch_argument_containers)
from .errors import FxfuseError, UnsupportedError, as_fxfuse_error, warn
from .kernel import FusedKernel, interpreting, kernels_available
from .log import logger
from .mode_watch import probe_mode_dependence
from .build_state import kept_state
from .module_state import forward_hook_owner, storage_address
from .options import Options
from .runtime import OptimizedModule
from .specialization import not_plain_tensor
from .tracing import autocast_enabled, clone_args, parametrization_cache_off, trace
from .verify import _differs_at_all, _differs_beyond_rounding, _torch_random_state, _verify
from .verify import _as_accurate_as_eager, _loosest_tolerance, _mismatch  # noqa: F401 (tests import them from api)


def _as_args(example_input, model) -> tuple:
    if isinstance(example_input, torch.Tensor):
        return (example_input,)
    if isinstance(example_input, collections.abc.Mapping) and isinstance(model, torch.nn.Module):
        example_input = _bound_keywords(example_input, model)
    if isinstance(example_input, (tuple, list)):
        try:
            leaves = torch.utils._pytree.tree_leaves(example_input)   # (a dataclass is one leaf: not a number)
        except RecursionError:   # review37c: a raw RecursionError from torch's pytree
            raise UnsupportedError("example_input holds a container that contains itself (`cfg['root'] = cfg`), "
                                   "which fxfuse cannot specialize on: pass forward() the values it reads") from None
        if all(isinstance(a, (numbers.Number, str)) or a is None for a in leaves):   # [1.0, 2.0]
            raise UnsupportedError("example_input holds no tensor (a list of numbers?): give a tensor, e.g. "
                                   "torch.tensor(...), or a tuple of the forward's arguments")
        return tuple(example_input)
    if isinstance(example_input, torch.fx.Proxy):   # fxfuse.optimize inside a forward() being traced (fuzz50i)
        raise UnsupportedError("fxfuse.optimize is called inside a forward() that is being traced (a submodule "
                               "optimized lazily on the first call?): optimize the submodule before, outside forward()")
    raise UnsupportedError(f"example_input must be a tensor, a tuple of forward()'s arguments or a dict of them by "
                           f"name, got {type(example_input).__name__}")


def _bound_keywords(example_input, model) -> tuple:
    """A dict example (`model(**inputs)`, as HF-style code calls) as the positional arguments
    it binds to: calls by keyword bind the same way (runtime.forward), so they find the same
    specialization. A name no parameter takes by position (**kwargs, keyword-only) cannot."""
    if (wrapper := keyword_changing_wrapper(model.forward)) is not None:
        raise UnsupportedError(f"example_input is a dict, and {type(model).__name__}.forward is wrapped by {wrapper}, "
                               "whose own signature takes keywords otherwise than the function it wraps; fxfuse "
                               "binds keywords to positions, a call the wrapper may treat differently. Pass a tuple "
                               f"of the arguments in order (parameters: {positional_names(model.forward)})")
    positional = bind_positional(model.forward, (), dict(example_input))
    if positional is UNBINDABLE or positional is None:
        raise UnsupportedError(
            f"example_input is a dict with keys {sorted(map(str, example_input))}, which fxfuse binds to "
            f"{type(model).__name__}.forward's parameters by name; "
            + ("they do not fit its signature" if positional is UNBINDABLE else
               "some go to a keyword-only or **kwargs parameter, or a default before them is no plain value")
            + f" (parameters taken by position: {positional_names(model.forward)}). Pass a tuple of the arguments in order")
    return positional


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedError(f"fxfuse.optimize takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedError("fxfuse.optimize takes an eager nn.Module, not a TorchScript module "
                               "(torch.jit.script / torch.jit.trace): neither torch.fx nor torch.export traces one")
    if any(cls.__name__ == "_StatefulGraphModule" for cls in type(model).__mro__):   # ExportedProgram.module()
        raise UnsupportedError("fxfuse.optimize takes an eager nn.Module, not the module of a torch.export "
                               "ExportedProgram (its mode is fixed at export, torch refuses its eval(), and it "
                               "checks its inputs in a forward pre-hook): optimize the model before exporting it")
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        raise UnsupportedError(
            f"{training[0]} is in training mode; fxfuse optimizes inference only. "
            "Call model.eval() before fxfuse.optimize (training support does not exist yet).")


def _check_call_path(model, args: tuple) -> None:
    """What a call runs besides forward(), which tracing would not see: lazy modules not
    materialized yet (their shape-inferring pre-hook runs on the first call), and a __call__
    overridden on the model's class (only forward() is traced; submodules' calls are traced
    through) unless it hands forward() exactly the call's arguments and returns its result
    (a __call__ defined for type hints, one that calls self.forward(x), one that spells out
    forward()'s defaults, or `__call__ = nn.Module.__call__`)."""
    lazy = next((name or type(model).__name__ for name, m in model.named_modules()
                 if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params()), None)
    if lazy is not None:
        raise UnsupportedError(f"{lazy} is a lazy module whose parameters are not materialized yet: call the model "
                               "once on a real input before fxfuse.optimize")
    owner = next(c for c in type(model).__mro__ if "__call__" in vars(c))
    if (owner.__module__ or "").startswith("torch.") or vars(owner)["__call__"] is torch.nn.Module.__call__:
        return   # torch's own (GraphModule's) only wrap nn.Module.__call__
    if not _call_only_forwards(model, args):
        raise UnsupportedError(f"{owner.__name__} overrides __call__ and does more than run forward() once on "
                               "the call's arguments and return its result; fxfuse traces forward() only, so the "
                               "optimized module would skip that. Move it into forward()")


def _call_only_forwards(model, args: tuple) -> bool:
    """Whether model(*args) runs forward() once, with the very argument objects (plus, at
    most, forward()'s own defaults spelled out), unchanged and outside autocast, and returns
    forward()'s very result, unchanged. Checked on one call, the model's state kept, with
    forward() watched on the instance: that sees a __call__ going through nn.Module.__call__
    and one calling self.forward() directly."""
    runs, own = [], model.__dict__.get("forward")
    forward = model.forward
    call_args = clone_args(args)
    before = clone_args(call_args)

    def watched(*a, **kw):
        # what forward() receives must be the call's values as given, outside autocast
        same_in = not autocast_enabled() and not any(_differs_at_all(b, x) for b, x in zip(before, a))
        out = forward(*a, **kw)
        runs.append((a, kw, out, same_in, clone_args(torch.utils._pytree.tree_leaves(out))))
        return out

    try:
        with torch.no_grad(), kept_state(model):
            model.__dict__["forward"] = watched
            try:
                out = model(*call_args)
            finally:
                if own is None:
                    del model.__dict__["forward"]
                else:
                    model.__dict__["forward"] = own
    except Exception as e:  # noqa: BLE001 -- the build would meet it too; here it only means "not transparent"
        logger.info("checking the overridden __call__ failed: %s", e)
        return False
    if len(runs) != 1 or runs[0][2] is not out:
        return False
    given, given_kwargs, _, same_in, produced = runs[0]
    if not same_in or any(_differs_at_all(p, o) for p, o in zip(produced, torch.utils._pytree.tree_leaves(out))):
        return False   # __call__ edited the input before forward() or the result after it, in place
    if len(given) < len(call_args) or not all(a is b for a, b in zip(given, call_args)):
        return False
    try:
        bound = inspect.signature(forward).bind(*given, **given_kwargs)
    except (TypeError, ValueError):
        return False
    params = bound.signature.parameters
    extra = list(bound.arguments.items())[len(call_args):]   # what __call__ added: forward()'s defaults only
    return all(params[name].kind not in (params[name].VAR_POSITIONAL, params[name].VAR_KEYWORD)
               and same_default(value, params[name].default) for name, value in extra)


def _check_example_binds(model, args: tuple) -> None:
    """The example input must be a valid call of forward(): caught here, a wrong argument count
    is the user's error, not "an internal error" when verify runs the model (or, with
    verify=False, a specialization no call can match)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args)
    except TypeError as e:
        raise UnsupportedError(f"the example input ({len(args)} argument(s)) does not fit "
                               f"{type(model).__name__}.forward{signature}: {e}") from None


def build_graph(model, args: tuple, options: Options):
    """Trace, rewrite, and verify one specialization; returns the rewritten GraphModule."""

    use_kernels, warning = options.use_kernels, None
    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    if any(t.is_meta for t in (*args, *model.parameters(), *model.buffers()) if isinstance(t, torch.Tensor)):
        raise UnsupportedError("the model or its input is on the meta device: there is no data to run or verify. "
                               "Optimize the model on a real device (or load its weights first)")
    available = bool(devices) and all(kernels_available(d) for d in devices)
    if use_kernels is None or (use_kernels and not available):   # use_kernels=True that cannot run: warned too
        use_kernels = available
        if not use_kernels and not interpreting() and devices and all(d.type == "cpu" for d in devices):
            warning = ("fxfuse: no CUDA device, so fused groups run their torch reference "
                       "(set TRITON_INTERPRET=1 to run the generated kernels on the CPU). "
                       "The rewritten graph runs and explain() tells the story; speed needs a GPU.")
    options = options.with_(use_kernels=use_kernels)
    _refuse_tensor_subclass_state(model)
    containers = watch_argument_containers(args)
    try:
        gm = _build_graph(model, args, options, warning)
    finally:
        written = restore_argument_containers(containers)   # the example's as given, also after a failure
    forget_memos = gm.meta.pop("fxfuse_forget_memos")
    if written:   # refused after kept_state kept the memos: the model as before, memos too (review40)
        forget_memos()
        raise UnsupportedError("forward() writes into a list, dict or set it is given (an append, an item "
                               "assigned): eager changes the caller's object on every call, which fxfuse's graphs "
                               "do not repeat, so the original module runs")
    return gm


def _build_graph(model, args: tuple, options: Options, warning):
    from fxfuse.passes import run_pipeline  # passes import fxfuse modules; import late
    # the model as before (but for the memos verify's eager run filled); forward() with state refused; inside
    # parametrize.cached(), the build's eager runs compute the weights, as the graph does (review48r1)
    with torch.no_grad(), parametrization_cache_off(), kept_state(model, options.verify) as snapshot:
        gm = trace(model, args)
        snapshot.written_back = {label for _, _, label in gm.meta.get("fxfuse_attribute_writes", ())}
        snapshot.drop_proxies()
        if gm.meta.get("fxfuse_proxy_attributes") and not options.verify:   # assigned during the trace:
            rewind = _torch_random_state(gm)                                 # eager shows whether that
            model(*clone_args(args))                                         # changes the model (kept_state)
            rewind()
        traced_reads = tensors_read(gm)
        gm = run_pipeline(gm, clone_args(args), options)  # passes may run the graph (strassen)
        traced = {storage_address(t) for t in traced_reads}
        gm.meta["fxfuse_read_storages"] = frozenset(traced) - {None}
        derived = any(t.is_floating_point() and storage_address(t) not in traced for t in tensors_read(gm))
        snapshots = gm.meta.get("fxfuse_snapshots", False)   # values taken from traced tensors (fold_literals)
        gm.meta["fxfuse_copied"] = (tuple(traced_reads) if derived or snapshots else ()) \
            + gm.meta.get("fxfuse_fold_sources", ())   # from any of them; what the trace computed from (fuzz47g)
        gm.meta["fxfuse_options"] = options
        gm.meta["fxfuse_warning"] = warning   # OptimizedModule warns once, not once per specialization
        if options.verify:
            rewind = _torch_random_state(gm)   # every eager and graph run below draws what the first drew
            try:
                expected = _verify(model, gm, args, rewind)
            except UnsupportedError:
                raise
            except FxfuseError as e:   # each Strassen / 3xTF32 layer passed its own check, the whole model
                if options.strassen == options.tf32x3 == "off":   # did not (an outlier row, an output that
                    raise                                            # nearly cancels: fuzz34d): without them
                logger.info("the rewritten graph differs from eager (%s); built again without Strassen and 3xTF32", e)
                classical = options.with_(strassen="off", tf32x3="off")
                gm = build_graph(model, args, classical)
                gm.meta["fxfuse_classical_because"] = str(e)
            else:
                probe_mode_dependence(model, args, expected, gm.meta["fxfuse_trace"], _differs_beyond_rounding,
                                      rewind)
        rewind = _torch_random_state(gm)   # a dict that only gained keys: another eager run tells a memo
        snapshot.moved_by(lambda: (options.verify or model(*clone_args(args)), model(*clone_args(args))))
        rewind()                           # from a counter or a log (without verify, one run fills it first)
    gm.meta["fxfuse_forget_memos"] = snapshot.forget_memos   # (build_graph: a refusal after this)
    return gm


def _refuse_tensor_subclass_state(model) -> None:
    """A parameter or buffer whose class has a __torch_function__ / __torch_dispatch__ of its own
    (a quantized or saturating weight type): eager runs it in every op, a fused kernel or a
    copy made at optimize time would not (fuzz34k: 83295 where eager gave 302, silently)."""
    plain_function = {torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        cls = type(t)
        if cls in (torch.Tensor, torch.nn.Parameter) or not isinstance(t, torch.Tensor):
            continue
        function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
        if function not in plain_function or cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
            raise UnsupportedError(f"{name} is a {cls.__name__}, a torch.Tensor subclass with a "
                                   "__torch_function__ or __torch_dispatch__ of its own: eager runs it in every "
                                   "op, fxfuse's kernels would not")


def tensors_read(gm) -> list:
    """The parameters, buffers and tensor constants a graph reads: through get_attr nodes and
    as the state of the modules it calls (of fxfuse's kernel modules only their own tensors:
    their reference graphs run only where the kernel cannot). Where the rewritten graph reads a
    float tensor that is no storage of what the traced one read, it holds a copy derived from
    the model's tensors (packed MLP weights and GEMM epilogue vectors, BatchNorm folded into a
    convolution, Strassen's operands), which an in-place edit of the original leaves stale; a
    copy may come from a tensor another layer reads live (tied weights), so then every tensor
    the trace read is watched (runtime.OptimizedModule: version counters, per call)."""
    from fxfuse.passes.fold_literals import LITERAL_PREFIX   # passes import fxfuse modules: import late
    read = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if node.target.startswith(LITERAL_PREFIX):   # a number forward() made a tensor: no model copy
                continue
            obj = gm
            for part in node.target.split("."):
                obj = getattr(obj, part, None)
            tensors = [obj] if isinstance(obj, torch.Tensor) else []
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)
            tensors = ([v for v in (*vars(mod).values(), *mod._buffers.values(), *mod._parameters.values())
                        if isinstance(v, torch.Tensor)] if isinstance(mod, FusedKernel)
                       else [*mod.parameters(), *mod.buffers()])
        else:
            continue
        read.update((id(t), t) for t in tensors)
    return list(read.values())


def optimize(model: torch.nn.Module, example_input, **options) -> torch.nn.Module:
    """Return a module computing what `model` computes on inputs like `example_input`, faster.

    Options (keyword arguments): see fxfuse.Options. Unknown options and values out of range
    raise OptionError (an FxfuseError and a ValueError).
    """
    opts = Options.from_kwargs(**options)
    given = model   # what a refusal returns
    if isinstance(model, OptimizedModule):   # optimize(optimize(m, x), x): build again from m
        logger.info("optimize() got an OptimizedModule: optimizing its original module again")
        model = model.original
    elif _compiled(model):   # torch.compile(m): the build's runs would each recompile it, spending dynamo's
        logger.info("optimize() got a torch.compile'd module: optimizing the module it compiled")   # recompile
        model = model._orig_mod                                                   # budget (fuzz40f)
    args = _as_args(example_input, model)
    _check_model(model)
    try:
        _check_example_binds(model, args)
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor) and (why := not_plain_tensor(a)):
                raise UnsupportedError(f"example input {k} {why}; fxfuse's kernels take plain strided tensors")
        _check_call_path(model, args)
        if user_mode_active():
            raise UnsupportedError("a TorchFunctionMode or TorchDispatchMode is active: tracing and the check "
                                   "against eager would run through it. Call fxfuse.optimize outside it (calls "
                                   "under a mode run the original module)")
        hooked = forward_hook_owner(model)
        if hooked:
            raise UnsupportedError(f"{hooked}; tracing does not run hooks, so the optimized graph would "
                                   "skip it. Remove the hook (or optimize without it)")
        return OptimizedModule(model, args, opts, build_graph)
    except Warning:   # a warning the caller's filter turned into an error (-W error): theirs, as raised
        raise
    except Exception as e:  # noqa: BLE001 -- the fallback policy covers internal errors too
        e = as_fxfuse_error(e, "optimizing")
        if opts.strict:
            raise e
        warn(f"fxfuse: {e} -- returning the original module unchanged")
        return given


def _compiled(model) -> bool:
    """A torch.compile'd module (torch._dynamo's OptimizedModule, holding the model as _orig_mod)."""
    return type(model).__module__.startswith("torch._dynamo") and isinstance(
        getattr(model, "_orig_mod", None), torch.nn.Module)


def stats(optimized) -> dict:
    """Counts that tests and benchmarks assert on: fused kernels, library calls, launches."""
    if not isinstance(optimized, OptimizedModule):
        return {"optimized": False, "fused_kernels": 0, "library_calls": 0, "views": 0, "library_epilogues": 0,
                "specializations": 0, "kernel_launches": 0, "reference_fallbacks": 0}
    from fxfuse.passes.linear_epilogue import linear_relu
    fused = library = epilogues = views = 0
    # the graph that served the latest call (the first built before any): a call with another
    # dtype or a 0-size example built one that fused nothing, and the counts stayed its (fuzz36e)
    current = max(list(optimized._specializations.values()), key=lambda s: s.last_call,
                  default=None)   # None after a load
    for node in current.gm.graph.nodes if current is not None else ():
        kind = node_kind(current.gm, node)
        fused += kind == "fused kernel"
        library += kind == "library call"
        views += kind == "view"
        epilogues += node.target is linear_relu     # library calls with bias and ReLU in cuBLASLt's epilogue
    kernels = list(optimized.fused_kernels())
    return {"optimized": True, "fused_kernels": fused, "library_calls": library, "views": views,
            "library_epilogues": epilogues,
            "specializations": len(optimized._specializations),
            "kernel_launches": sum(k.launches for k in kernels) + optimized._dropped[1],   # with the dropped
            "reference_fallbacks": sum(k.fallbacks for k in kernels) + optimized._dropped[2]}  # specializations


def _gathers(node) -> bool:
    """`x[idx]`, `x[:, [0, 2]]`, `x[mask]`: indexing by tensors or lists copies (review45h)."""
    if getattr(node.target, "__name__", node.target) not in ("getitem", "__getitem__") or len(node.args) < 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    from .node_meta import single_tensor_meta
    return any(isinstance(i, (torch.fx.Node, list)) for i in index) and isinstance(node.args[0], torch.fx.Node) \
        and single_tensor_meta(node.args[0]) is not None


def node_kind(gm, node) -> str:
    from .kernel import FusedKernel
    import operator
    if node.op in ("placeholder", "output", "get_attr"):
        return {"placeholder": "input", "output": "output", "get_attr": "constant"}[node.op]
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), FusedKernel):
        return "fused kernel"
    if node.op == "call_function" and node.target is operator.getitem and \
            node.args[0].op == "call_module" and isinstance(gm.get_submodule(node.args[0].target), FusedKernel):
        return "kernel output"
    from fxfuse.passes.linear_epilogue import split_k_partials
    if node.op == "call_function" and node.target is operator.getitem and \
            node.args[0].op == "call_function" and node.args[0].target is split_k_partials:
        return "kernel output"     # a view of one split-K GEMM's output, not a call
    if node.op == "call_function" and node.target is collections.OrderedDict:
        return "output container"  # tracing's OrderedDict output (tracing._AutocastWatchingTracer.create_arg)
    if is_view(node):
        return "view"              # no call: a view or a tuple's item (fuzz45g: counted as library calls)
    return "library call"


def is_view(node) -> bool:
    """A view or a tuple's item, which calls nothing (report.VIEWS; a gather by index is no view)."""
    from .fx_tracer import VIEW_ATTRIBUTES
    from .report import VIEWS
    if node.op == "call_function" and node.target is getattr:   # `x.mT`, `x.data` (review: were library calls)
        return len(node.args) > 1 and node.args[1] in VIEW_ATTRIBUTES
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.op in ("call_function", "call_method") and name.split(".")[0] in VIEWS and not _gathers(node)
