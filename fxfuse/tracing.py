"""Capture a model as a torch.fx graph and record shapes, dtypes and strides on every node.

torch.fx.symbolic_trace first (it keeps nn.Linear, nn.ReLU, ... as readable call_module
nodes); when it cannot follow the model (Python control flow on tensor values or shapes)
torch.export(strict=False) is tried, which specializes shapes and yields aten-level nodes
that the normalize pass also understands. Shapes come only from ShapePropagation
(shape_propagation.py: ShapeProp without its fake-tensor machinery), stored the torch.fx way in
node.meta["tensor_meta"]; non-tensor values (sizes, dims) go to fxfuse's own meta so the
normalize pass can fold them into constants.
"""
import contextlib
import inspect
import re
import time
import traceback
import warnings

import torch
import torch.fx
from torch.utils._pytree import tree_leaves
from torch.nn.utils import parametrize

from .call_context import quiet_export
from .concrete_args import (check_exported, drop_value_checks, inline_disabled_autocast,
                            one_placeholder_per_parameter, sizes_returned_as_sizes, split_concrete)
from .errors import TraceError, UnsupportedError
from .export_asserts import users_checks
from .fx_tracer import (GRAD_READ_REFUSAL, AutocastInForward, _AutocastWatchingTracer, _failing_line,
                        _swallowed_refusal, autocast_enabled)  # noqa: F401 (autocast_enabled re-exported: api, runtime)
from .log import logger, quiet_this_thread
from .attribute_reads import class_code, merge_reads, note_inplace_flags, recording_attribute_reads
from .attribute_writes import assigned_first, plan_attribute_writes
from .mode_watch import mode_functions_imported, watching_mode_reads
from .fold_sources import FoldSources
from .random_streams import refuse_frozen_draws, torch_states
from .torch_hooks import REPARAMETRIZED
from .module_state import dead_proxies_hidden, version
from .node_meta import ancestors, fetch_attr, fxfuse_meta, tensor_meta  # noqa: F401 (re-exported: the passes import them here)
from .state_writes import (assigns_parameter, parameter_versions, refuse_state_writes,
                           refuse_written_parameters)
from .snapshot import data_put_back, parameter_data
from .shape_propagation import (ShapePropagation, ShapePropagationError, clone_args,  # noqa: F401 (re-exported)
                                propagate_shapes, tensor_metadata)
from .transformer_blocks import blocks_given_padding, opaque_blocks
from .written_constants import held_tensor_versions, refuse_written_constants, written_constant


def trace(model: torch.nn.Module, example_args: tuple) -> torch.fx.GraphModule:
    """Return a GraphModule equivalent to model on inputs like example_args, with shapes; its
    meta says what the trace read (the grad/inference mode, the model's attribute names).
    Not thread-safe (torch.fx's tracing is not): runtime.BUILD_LOCK serializes builds."""
    start = time.perf_counter()
    concrete = split_concrete(model, example_args)[0]
    held = held_tensor_versions(model)   # before the trace: a write during it moves a version
    inference_mode = torch.is_inference_mode_enabled()
    with watching_mode_reads() as mode_reads, recording_attribute_reads(model) as attribute_reads, \
            parametrization_cache_off(), dead_proxies_hidden(model):
        gm, how = _trace(model, example_args, concrete, held)
    identity = not _checks_tensor_type(attribute_reads) and attribute_reads.get("tests_identity")   # `x.dtype is
    if how == "torch.fx.symbolic_trace" and (identity or _checks_tensor_type(attribute_reads)):   # torch.float16`
        with recording_attribute_reads(model) as again, contextlib.suppress(*(Exception,) * bool(identity)):
            gm, how = _exported(model, example_args), "torch.export(strict=False)"   # (an identity test may be of
        attribute_reads = {**merge_reads(attribute_reads, again), "rng": attribute_reads.get("rng") or again.get(
            "rng")}   # another value: the fx graph stays where export fails, verified; export's reads watched: review50r4)
    if attribute_reads.get("rng"):
        raise UnsupportedError(f"forward() calls torch's {attribute_reads['rng']} (or fork_rng): the optimized graph "
                               "draws random numbers without setting or restoring the generator's state")
    mode_reads |= mode_functions_imported(model)
    note_inplace_flags(gm, attribute_reads)
    entered = [n for n in gm.graph.nodes if n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "")]
    if entered:   # torch.export records autocast regions as ops no pass of fxfuse respects
        raise AutocastInForward(f"forward() enters torch.autocast (node {entered[0].name}: {entered[0].target}); apply "
                                "autocast around the call instead (fxfuse then runs the original module)")
    if how == "torch.fx.symbolic_trace" and written_constant(gm, held, attributes=True) is not None:
        try:   # `h = torch.zeros(4, 8); h[:, :4] = x`: torch.fx made h a constant and wrote it; torch.export
            gm, how = _exported(model, example_args), "torch.export(strict=False)"   # records both (fuzz38h)
        except Exception:  # noqa: BLE001 -- the refusal below says why
            pass
    refuse_written_constants(gm, held, attributes=how == "torch.fx.symbolic_trace")
    if gm.meta.get("fxfuse_traced_as_compiling"):   # review38c: explain() says which branch the graph took
        how += ", with torch.compiler.is_compiling() True (forward() asks it, and the trace as eager answers failed)"
    gm.meta["fxfuse_trace"] = {"tracer": how, "ms": 1e3 * (time.perf_counter() - start),
                               "concrete_args": concrete or {}, "reads_grad_mode": "grad" in mode_reads,
                               "reads_inference_mode": inference_mode if "inference" in mode_reads else None,
                               "attribute_reads": attribute_reads}
    return gm


TENSOR_TYPE_CHECKS = {"isinstance", "is_tensor", "type", "issubclass"}


def _checks_tensor_type(reads: dict) -> bool:
    """Whether the model's code that ran in the trace may test a value against torch.Tensor:
    under symbolic_trace `isinstance(mask, torch.Tensor)` is false for a Proxy, so the traced
    graph dropped the tensor branch, silently where the example input hid it (fuzz31h). Such a
    model is traced by torch.export instead (which runs fake tensors). From the names its code
    reads (attribute_reads): a type test and `Tensor`, or torch.is_tensor; also where the code
    reads attributes by computed names (getattr), whose names are all watched."""
    names = reads.get("code_names") or reads.get("names") or set()
    return "is_tensor" in names or bool(names & TENSOR_TYPE_CHECKS) and "Tensor" in names


@contextlib.contextmanager
def parametrization_cache_off():
    """Inside torch.nn.utils.parametrize.cached(), a parametrized weight is read from (or put
    into) torch's cache: traced there, the graph held the cached tensor as a constant that no
    later edit reached, or torch's cache kept a tracing Proxy that the user's own eager calls
    then returned. Off while tracing, the trace records the parametrization's computation."""
    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled


def _clear_frames(error: BaseException) -> None:
    """The locals of every frame in the error's tracebacks, its causes' and contexts' too."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _refuse_input_attributes(gm) -> None:
    """forward() reading a Python attribute set on an input tensor (`x.rows`, `getattr(x, "scale", 1.0)`):
    the guards check a tensor's shape, dtype and strides, not its attributes, and torch.fx records the
    read without its default (review49r2: a size read so was frozen at the example's)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is getattr and len(node.args) >= 2 \
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "placeholder" \
                and isinstance(node.args[1], str) and not hasattr(torch.Tensor, node.args[1]):
            raise UnsupportedError(f"forward() reads {node.args[0].name}.{node.args[1]}, a Python attribute set on an "
                                   "input tensor: fxfuse's guards check the inputs' shapes, dtypes and strides, not "
                                   "such attributes, so the original module runs")


def _trace(model, example_args, concrete, held):
    """(GraphModule with shapes, the tracer's name): symbolic_trace, else torch.export (which
    binds the defaults itself, and specializes on non-tensor arguments as the runtime's
    signature does: None, flags and numbers are checked by value on every call)."""
    try:
        versions = _buffer_versions(model)
        try:
            gm = _quiet_symbolic_trace(model, concrete)
        except UnsupportedError:
            raise
        except Exception as first:  # noqa: BLE001 -- `self.pe[:x.size(1)]`: a buffer indexed by a size
            if not _buffer_versions(model):   # (a Proxy) fails on the real tensor; as a node it slices (fuzz37f)
                raise
            try:
                gm = _quiet_symbolic_trace(model, concrete, proxy_buffers=True)
            except Exception:  # noqa: BLE001 -- the first failure says more
                raise first from None
        # a write torch.fx ran instead of recording it (into a buffer, or into a value it computed
        # from buffers at trace time: `v = self.scale.exp(); v.clamp_(max=1.5)`, fuzz35a): buffers as nodes
        if _buffer_versions(model) != versions or _buffer_versions(model) and written_constant(gm, held):
            gm = _quiet_symbolic_trace(model, concrete, proxy_buffers=True)
        how = "torch.fx.symbolic_trace"
        refuse_state_writes(gm)   # before the graph first runs on the model's own tensors
        _refuse_input_attributes(gm)
        propagate_shapes(gm, example_args)  # concrete args stay placeholders (their values are checked)
        opaque = opaque_blocks(gm)
        if opaque:
            gm, how = _exported_through(model, example_args, gm, how, opaque)
    except UnsupportedError:   # fxfuse's own refusal (autocast inside forward, a size read from a
        raise                  # value-dependent shape): another tracer would meet it too
    except Exception as fx_error:  # noqa: BLE001 -- any failure means "try the next tracer"
        # the failed trace's frames hold their locals; torch.fx's Proxy.__iter__ keeps its own frame
        # in one (a cycle), which kept every caller's frame up to OptimizedModule.__init__, and so
        # the OptimizedModule and its CUDA graphs, alive after `del opt` until a garbage collection
        where = _failing_line(fx_error)
        _clear_frames(fx_error)
        refused = assigns_parameter(fx_error)
        if refused is not None:
            raise refused from fx_error
        logger.info("symbolic_trace failed (%s: %s); trying torch.export", type(fx_error).__name__, fx_error)
        padded = blocks_given_padding(model, clone_args(example_args))
        if padded:
            raise UnsupportedError(f"{padded[0]} is given a mask (key-padding or attention): torch.export "
                                   "records its slow path, which differs from eager's inference fast path at "
                                   "padded positions (zeros) and where a mask hides every key of a row (NaN)"
                                   ) from fx_error
        versions = parameter_versions(model)
        try:
            gm, how = _exported(model, example_args), "torch.export(strict=False)"
        except UnsupportedError:
            raise
        except Exception as export_error:  # noqa: BLE001
            export_where = _failing_line(export_error)
            eager_error = _eager_error(model, example_args)
            if eager_error is not None:   # neither tracer's fault: the model rejects its example (fuzz35b)
                raise TraceError(f"{type(model).__name__} itself raises on the example input "
                                 f"({type(eager_error).__name__}: {_first_line(eager_error)}). Check the example "
                                 "input's shapes and dtypes against the model") from export_error
            # either graph traced, but failed on the input: the input's problem, not control flow
            ran = isinstance(fx_error, ShapePropagationError) or isinstance(export_error, ShapePropagationError)
            if "torch/distributions/" in export_where.replace("\\", "/"):
                advice_first = ("torch.distributions checks its arguments' values (validate_args): call "
                                "torch.distributions.Distribution.set_default_validate_args(False), or build the "
                                "distributions with validate_args=False (some, such as StudentT, build inner ones "
                                "that check anyway), to optimize the model")   # (fuzz41b: StudentT)
            elif "torch/nn/utils/rnn" in (where + export_where).replace("\\", "/"):
                advice_first = ("packed sequences (pack_padded_sequence and the RNNs that read them) are no tensor "
                                "graph either tracer records: optimize the layers around them "
                                "(model.head = fxfuse.optimize(model.head, h)) and keep the packing outside")
            elif "fake tensor in the exported program constant" in str(export_error) \
                    and not _runs_autograd(model):   # `w = self.lin.weight.data`
                advice_first = ("torch.export cannot follow a tensor's `.data` (or another op that hides a tensor from "
                                "it): where forward() reads `.data`, `.detach()` computes the same in inference and "
                                "both tracers follow it")   # (fuzz43b)
            elif "in output, which is not a known type" in str(export_error):   # a dataclass / own class (fuzz40b)
                advice_first = ("torch.export takes only outputs of types torch's pytree knows: return a tuple, dict "
                                "or NamedTuple, or register the output's class (torch.utils._pytree.register_dataclass)")
            elif "DataDependent" in type(export_error).__name__ and re.search(r"\bint\(", export_where):
                advice_first = ("forward() converts a tensor to a Python int (`int(t)`, `int(t.item())`): torch.export "
                                "keeps `t.item()` as a symbolic size, but int() asks for its value. Write `t.item()` "
                                "where a size or an index needs the number")   # (fuzz47c, fuzz47d)
            elif "DataDependent" in type(export_error).__name__ and "float() arg" in str(fx_error) \
                    and not re.search(r"\b(if|elif|while|assert)\b|[<>]=?|==|!=", export_where):   # (a branch: review50r2)
                advice_first = ("forward() converts a tensor with float(): where it is used as a number, write "
                                "`t.item()`, which symbolic_trace records (a branch on it: torch.where)")
            elif "DataDependent" in type(export_error).__name__ and re.search(r"\]\s*[-+*/]?=[^=]", export_where):
                advice_first = ("forward() assigns into a tensor at a 0-d integer tensor index (`h[i] = v`), which "
                                "torch.export reads as a value: `h[i.view(1)] = v` writes the same and both tracers "
                                "follow it")   # (fuzz47c)
            else:
                advice_first = None
            advice = advice_first or ("forward() runs autograd (torch.autograd.grad or backward()), which fxfuse's inference "
                      "graphs do not capture: keep that part out of the optimized module" if _runs_autograd(model)
                      else "Check the example input's shapes and dtypes against the model" if ran else
                      "Remove the Python code that reads a tensor's value from forward() (a branch on it: use "
                      "torch.where; .item() or float() of it, also inside a print or log call), or optimize the "
                      "submodules around that part (model.block = fxfuse.optimize(model.block, h))")
            raise TraceError(
                f"could not capture a graph of {type(model).__name__}: "
                f"symbolic_trace failed{where} with {type(fx_error).__name__}: {_first_line(fx_error)}"
                f"{_root_cause(fx_error)}; torch.export(strict=False) failed"
                f"{' there too' if export_where and export_where == where else export_where} with "
                f"{type(export_error).__name__}: {_first_line(export_error).rstrip('.')}{_root_cause(export_error)}. "
                f"{advice}.") from export_error
        refuse_written_parameters(versions)   # before the graph runs: shape propagation and the checks write again
    return gm, how


def _eager_error(model, example_args):
    """The exception the model itself raises on (a copy of) the example input, else None. Only
    after both tracers failed; the build's kept_state puts back what the run changes."""
    try:
        with torch.no_grad(), quiet_this_thread(stderr=False):
            model(*clone_args(example_args))
    except Exception as e:  # noqa: BLE001 -- any error of the model's own is the answer
        return e
    return None


def _runs_autograd(model) -> bool:
    """A forward() of the model's own classes calls torch.autograd (forces from an energy,
    fuzz33a) or backward(); other methods (a train_step) do not count (review33b)."""
    return isinstance(model, torch.nn.Module) and any(
        code.co_name == "forward" and ({"autograd", "grad"} <= set(code.co_names) or "backward" in code.co_names)
        for code in class_code(model))


def _check_traceable_forward(model) -> None:
    """torch.fx traces type(model).forward with the parameters of the function it wraps
    (inspect.unwrap): a forward set on the instance, or a decorator whose own parameters or
    defaults differ from the wrapped function's, would be traced as something else than what a
    call runs. TraceError: _trace then tries torch.export, which calls the module."""
    if isinstance(model, torch.nn.Module) and "forward" in vars(model):
        raise TraceError("forward is an attribute of the instance; torch.fx traces the class's forward")
    fn = getattr(type(model), "forward", None)
    if fn is not None and inspect.unwrap(fn) is not fn:
        outer = inspect.signature(fn, follow_wrapped=False).parameters
        inner = inspect.signature(inspect.unwrap(fn)).parameters
        if not _only_passes_through(outer) and [(n, p.kind, p.default) for n, p in outer.items()] != \
                [(n, p.kind, p.default) for n, p in inner.items()]:
            raise TraceError(f"forward is wrapped by {fn.__qualname__}, whose parameters differ from those of "
                             "the function it wraps; torch.fx would trace the inner function's")


def _only_passes_through(params) -> bool:
    """(*args, **kwargs) or (self, *args, **kwargs): a decorator that binds nothing itself."""
    kinds = [p.kind for p in params.values()]
    return kinds[-2:] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD] and len(kinds) <= 3


def _exported(model, example_args) -> torch.fx.GraphModule:
    """torch.export's graph of model, with shapes."""
    own = tree_leaves(example_args) + (list(model.parameters()) + list(model.buffers())
                                       if isinstance(model, torch.nn.Module) else [])
    with users_checks() as checks, FoldSources(own) as folds:   # Python reads of held values (`w.tolist()`: fuzz48d)
        try:
            program, compiling = quiet_export(model, tuple(example_args))
        finally:
            folds.restore()
    gm = program.module()
    gm.meta["fxfuse_traced_as_compiling"] = compiling
    gm.meta["fxfuse_fold_sources"] = folds.sources()
    check_exported(gm)
    _specialize_values(gm, example_args)
    inline_disabled_autocast(gm)
    sizes_returned_as_sizes(gm)
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SIZE_ASSERTIONS]:
        if _asserts_a_size(node) or not checks.made(node):   # export's own range assumptions
            gm.graph.erase_node(node)   # (`u0 >= -8` of a slice bound eager clamps: review40), and `u0 <= 24`
            #     on a masked index's size (fuzz35g); the user's `torch._check(n.item() <= 6)` stays (fuzz40e)
    # export's module() refuses train()/eval() (its graph has the mode baked in); so does
    # fxfuse's, but opt.eval() must still reach it: the flag then only reports the mode
    for name in ("train", "eval"):
        vars(gm).pop(name, None)
    # a view that raised inside forward's try/except stays in export's graph with no reader: it
    # would raise again when the graph runs (fuzz31h). Dead pure nodes go; writes and asserts stay
    gm.graph.eliminate_dead_code()
    gm.recompile()
    propagate_shapes(gm, example_args)   # one placeholder per argument, None and flags too
    return gm


SIZE_ASSERTIONS = {getattr(torch.ops.aten, name).default for name in (
    "_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range") if hasattr(torch.ops.aten, name)}


def _asserts_a_size(node) -> bool:
    """Whether an assertion of export's graph reads a size (through Python arithmetic on it)."""
    from .data_dependent import SIZE_OPS

    def tensor(n):
        return n.meta.get("tensor_meta") is not None or n.op == "placeholder"
    return any(n.op == "call_function" and n.target in SIZE_OPS
               for n in ancestors(node.all_input_nodes, stop=tensor) if not tensor(n))


def _specialize_values(gm, example_args) -> None:
    """Readers of a non-tensor argument's placeholder read its example value: the runtime's
    signature checks the value on every call, and an export that kept an int symbolic (torch
    2.11: `x[:, :n]`) left a graph the later passes' size folding does not expect."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_args):
        return
    for node, value in zip(placeholders, example_args):
        if not isinstance(value, torch.Tensor) and isinstance(value, (bool, int, float)):
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, lambda a, n=node, v=value: v if a is n else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a, n=node, v=value: v if a is n else a)


def _exported_through(model, example_args, gm, how, opaque) -> tuple:
    """(graph, tracer): torch.export's graph, which goes through the transformer blocks that
    symbolic_trace left opaque (transformer_blocks); the symbolic_trace graph where export fails."""
    try:
        exported = _exported(model, example_args)
    except UnsupportedError:
        raise
    except Exception as e:  # noqa: BLE001 -- keep the symbolic_trace graph, the blocks opaque
        logger.info("torch.export failed (%s: %s); %s stay one call each", type(e).__name__, e, ", ".join(opaque))
        return gm, how
    return exported, f"torch.export(strict=False) (symbolic_trace kept {', '.join(opaque)} as one call)"


def _buffer_versions(model) -> list:
    return [version(b) for b in model.buffers()] if isinstance(model, torch.nn.Module) else []   # None: inference


def _without_proxies(show):
    """A warning forward() raises with a traced value in its text (`warnings.warn(f"... {x.shape}")`
    gives "Proxy(getattr_1)") is the trace's artefact: dropped; the eager runs show the real one
    (review44g: both were shown, and with verify=False only the Proxy one)."""
    def shown(message, *args, **kwargs):
        if "Proxy(" not in str(message):
            show(message, *args, **kwargs)
    return shown


def _quiet_symbolic_trace(model, concrete, proxy_buffers: bool = False):
    """symbolic_trace, printing nothing, to stdout, stderr or logs (review44g: stderr and logs were
    not quieted): a print() in forward() would print its proxies
    ("Proxy(linear)"), a tracing artefact; and torch.fx's own warnings about the model's
    internals (a pruned Linear's get_attr of a recomputed weight) would come on top of the one
    warning fxfuse gives when it falls back. torch.fx hands forward() the real buffers, so a
    write with no traced operand (`self.buf.zero_()`, a scratch buffer's reset) runs once and is
    not recorded (review35, fuzz35c: silently lost); `proxy_buffers` makes them graph nodes."""
    _check_traceable_forward(model)
    before = {id(m): (dict(vars(m)), dict(m._buffers)) for m in model.modules()} \
        if isinstance(model, torch.nn.Module) else {}
    datas = parameter_data(model.named_modules()) if isinstance(model, torch.nn.Module) else []
    generators = torch_states()
    with quiet_this_thread(logs=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.fx")
        warnings.showwarning = _without_proxies(warnings.showwarning)
        tracer = _AutocastWatchingTracer()
        tracer.proxy_buffer_attributes = proxy_buffers
        swallowed = None
        swaps = REPARAMETRIZED[0]   # (torch.export swaps the module's tensors itself: counted here only)
        try:
            try:
                with FoldSources() as folds:   # the real tensors ops ran on while tracing: their results are constants
                    try:
                        graph = tracer.trace(model, concrete_args=concrete)
                    finally:
                        folds.restore()   # parameters written through real tensors (`p.data.mul_`): as they were
            finally:
                converted = data_put_back(datas)   # `self.p.half()`, `.to(x.device)` (fuzz49k, review49r2)
            if converted:
                more = f" and {len(converted) - 2} more" if len(converted) > 2 else ""
                raise UnsupportedError(f"forward() converts {', '.join(converted[:2])}{more} (module.half(), .to(), "
                                       ".float(): nn.Module._apply), which changes the model's parameters while it "
                                       "runs: convert the model before optimize")
            if folds.grad_read:
                raise UnsupportedError(GRAD_READ_REFUSAL.format("grad"))   # (review47r4)
            if folds.written:
                names = {id(p): n for n, p in model.named_parameters()} if isinstance(model, torch.nn.Module) else {}
                t, _, op = next(iter(folds.written.values()))
                raise UnsupportedError(
                    f"forward() writes the parameter {names.get(id(t), 'of the model')} in place while it runs "
                    f"({op} on it or its .data): eager changes the weights on every call, which a traced graph does "
                    "not repeat, so the original module runs (its parameters as they were before optimize)")
            swallowed = tracer.swallowed()
            if REPARAMETRIZED[0] != swaps:   # the graph reads the module's own tensors, not the swapped ones
                raise UnsupportedError(   # (fuzz41a: verify=False silently wrong)
                    "forward() calls torch.func.functional_call (or torch.nn.utils.stateless): the traced graph "
                    "would read the module's own parameters, not the ones it passes")
        except Exception as e:
            if (swallowed := tracer.swallowed(e)) is not None and swallowed[1]:   # the other tracer would
                raise _swallowed_refusal(swallowed[0]) from e                        # follow one way too
            raise
        finally:
            tracer.refusals.clear()   # their frames: a failed trace must not keep its callers alive (fuzz30)
            assigned, proxies = _undo_proxy_attributes(model, before)
        def retrace():
            again = _AutocastWatchingTracer()
            again.proxy_buffer_attributes = proxy_buffers
            try:
                return again.trace(model, concrete_args=concrete)
            finally:
                again.refusals.clear()
                _undo_proxy_attributes(model, before)
        if proxies:   # tensor attributes forward() assigned: written back where assigned before any read
            proxies = assigned_first(model, proxies, retrace, graph)
        if isinstance(graph._codegen, torch.fx.graph._PyTreeCodeGen):
            one_placeholder_per_parameter(graph, model, concrete)
        if concrete:
            drop_value_checks(graph)
        name = type(model).__name__ if isinstance(model, torch.nn.Module) else model.__name__
        gm = torch.fx.GraphModule(tracer.root, graph, name)
        written = plan_attribute_writes(gm, model, proxies)   # scratch attributes, written back per call
        gm.meta["fxfuse_attribute_writes"] = written
        gm.meta["fxfuse_fold_sources"] = folds.sources()
        gm.meta["fxfuse_proxy_attributes"] = [a for a in assigned if a not in {
            f"{type(m).__name__}.{k}" for m, k, _ in written}]
        refuse_frozen_draws(generators, gm, model, retrace)
    if swallowed is not None:   # the trace got past it: forward() caught the tracer's error
        if not swallowed[1]:   # at a branch on a size: torch.export specializes on it (_trace)
            raise TraceError(f"forward() catches the error symbolic_trace raised{swallowed[0]}, a branch on a size")
        raise _swallowed_refusal(swallowed[0])
    if tracer.autocast_node is not None:
        raise AutocastInForward(
            f"forward() enters torch.autocast (around node {tracer.autocast_node}), which torch.fx does not "
            "record: the traced graph would compute in the model's own dtypes. Apply autocast around the call "
            "instead (fxfuse then runs the original module), or cast the model (model.half()) before "
            "fxfuse.optimize")
    return gm


def _undo_proxy_attributes(model, before: dict) -> list:
    """The trace's Proxies out of the modules' plain attributes, their values before it back
    (`self.freqs_cis = self.freqs_cis.to(h.device)` in LLaMA's reference left a Proxy there,
    which torch.export and verify's eager run then read: the model was refused; fuzz37f).
    Returns their names: whether eager's assignment changes anything, an eager run shows
    (api.build_graph), and kept_state refuses a forward() whose assignment does."""
    assigned, proxies = [], []
    for path, m in model.named_modules() if before else ():
        for now, then in zip((vars(m), m._buffers), before.get(id(m), ({}, {}))):   # a buffer too (`self.fc =
            for k in [k for k, v in now.items() if _holds_proxy(v)]:                # self.fc.to(x.device)`)
                assigned.append(f"{type(m).__name__}.{k}")
                if now is not m._buffers and isinstance(now[k], torch.fx.Proxy):   # (attribute_writes)
                    proxies.append((path, k, now[k]))
                if k in then:
                    now[k] = then[k]
                else:
                    del now[k]
    return assigned, proxies


def _holds_proxy(v) -> bool:
    """A Proxy, or a tuple / list / dict holding one (`self.dims = (x.shape[-1], 3)`; review37b)."""
    if isinstance(v, torch.fx.Proxy):
        return True
    if type(v) in (tuple, list):
        return any(map(_holds_proxy, v))
    return type(v) is dict and any(map(_holds_proxy, v.values()))


def _root_cause(e: BaseException) -> str:
    """': <first line of the innermost cause>' where e has a cause that says more, else ''."""
    root = e
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    return f" ({type(root).__name__}: {_first_line(root)})" if root is not e else ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""
