"""What a call of an optimized module is part of, asked first on every call (OptimizedModule.forward).

torch.compile, torch.export and torch.fx traces record the original module (fxfuse's runtime
is no graph: Triton's launcher, CUDA graphs); torch.func transforms and forward-mode AD hand in
wrapped or dual tensors that the kernels would strip. Each check is one attribute read or one
C call: forward() runs them on every call. At the end, fxfuse's own call of torch.export
(quiet_export): quiet, and with torch.compiler's flags as eager has them where it can.
"""
import collections
import contextlib
import sys
import warnings

import torch
import torch.fx

from .log import quiet_this_thread

FX_TRACE_STATE = torch.fx._symbolic_trace   # its _is_fx_tracing_flag is set while torch.fx traces
if not hasattr(FX_TRACE_STATE, "_is_fx_tracing_flag"):   # a torch without it: never seen as tracing
    FX_TRACE_STATE = type("NotTracing", (), {"_is_fx_tracing_flag": False})


def holds_proxy(args, kwargs) -> bool:
    return any(isinstance(a, torch.fx.Proxy) for a in (*args, *kwargs.values()))


# torch.compiler.is_compiling() costs two Python calls per call (~0.15 us of a ~3.3 us path):
# Dynamo folds is_dynamo_compiling() to True where it traces (it knows the function, not the
# name), and non-strict torch.export sets the flag read second (after the call, so that Dynamo
# never reads, and guards on, the flag's value while it compiles)
dynamo_traces = torch.compiler.is_dynamo_compiling
COMPILER = torch.compiler
functorch_active = torch._C._are_functorch_transforms_active   # vmap, jvp, jacfwd, grad of torch.func
FORWARD_AD = torch.autograd.forward_ad   # _current_level >= 0 inside a dual_level(): inputs may carry tangents


def trace_tensors(args, kwargs) -> bool:
    """Whether a call made while torch.compiler's flag is on gets a trace's tensors (non-strict
    torch.export passes FakeTensors). The flag is process-wide, and torch 2.13 sets it for every
    torch.compile of any thread too (review42d): a call with plain tensors runs the graph."""
    return any(isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter)
               for a in torch.utils._pytree.tree_leaves((args, kwargs)))


def traced_in_this_thread() -> bool:
    """Whether a torch.fx Tracer.trace is on this thread's stack: a traced forward() may call opt
    with concrete tensors only (`self.inner(self.prompt)`); the specialization's own submodule
    calls would then go through fx's patched nn.Module.__call__ and fail (NameError: not a
    submodule of the traced root). Only asked while fx traces somewhere (rare)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _TRACE_CODE:
            return True
        frame = frame.f_back
    return False


_TRACE_CODE = torch.fx.Tracer.trace.__code__


_FUNCTION_MODES = getattr(torch._C, "_len_torch_function_stack", None)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)


def user_mode_active() -> bool:
    """A TorchFunctionMode or TorchDispatchMode is on (other than `with torch.device(...)`): eager
    runs every op through it, a fused kernel would run outside it (fuzz34k: a mode that rounds or
    replaces ops gave other values, silently). Two C calls per call while none is on."""
    if _DISPATCH_MODES is not None and _DISPATCH_MODES():
        return True
    if _FUNCTION_MODES is None or not _FUNCTION_MODES():
        return False
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    return any(not isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())


def autocast_off() -> contextlib.ExitStack:
    """torch.autocast off on every device for a build (the model's own dtypes are traced)."""
    stack = contextlib.ExitStack()
    if getattr(torch._C, "_is_any_autocast_enabled", lambda: False)():
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


@contextlib.contextmanager
def compile_flags_as_eager(asked: list):
    """torch.compiler.is_compiling() and is_exporting() answer False, as in eager, while torch.export
    traces the model for fxfuse (each call noted in `asked`): a forward() branching on them was
    traced down its compile-only branch, refused with an unclear reason, or with verify=False
    silently wrong (fuzz38e). The functions' code is swapped, not the attributes: a name bound by
    `from torch.compiler import is_compiling` and the old aliases (`torch._dynamo.is_compiling()`,
    `torch._utils.is_compiling()`, which call through) answer so too (fuzz47d)."""
    functions = {name: getattr(torch.compiler, name) for name in ("is_compiling", "is_exporting")}
    saved = {name: (f, f.__code__, type(f)(f.__code__, f.__globals__, name, f.__defaults__, f.__closure__))
             for name, f in functions.items() if type(f) is type(_ask_compiling) and not f.__code__.co_freevars}
    aliases = {getattr(getattr(sys.modules.get(m), "is_compiling", None), "__code__", None)
               for m in ("torch._dynamo", "torch._dynamo.external_utils", "torch._utils")} - {None}

    def answer(name: str) -> bool:   # torch's own code gets torch's answer: it picks its paths by it (review38c)
        frame = sys._getframe(2)     # (1: the swapped function, 2: its caller; past the aliases)
        while frame is not None and frame.f_code in aliases:
            frame = frame.f_back
        if frame is not None and frame.f_globals.get("__name__", "").startswith(("torch.", "fxfuse.")):
            return saved[name][2]()
        asked.append(True)
        return False

    for name, (f, _, _) in saved.items():
        f.__globals__[ANSWER] = answer
        f.__code__ = (_ask_compiling if name == "is_compiling" else _ask_exporting).__code__
    try:
        yield
    finally:
        for f, code, _ in saved.values():
            f.__code__ = code
            f.__globals__.pop(ANSWER, None)


ANSWER = "_fxfuse_compile_flag_as_eager"   # looked up in torch.compiler's globals by the swapped code


def _ask_compiling():
    return _fxfuse_compile_flag_as_eager("is_compiling")   # noqa: F821 -- torch.compiler's global then


def _ask_exporting():
    return _fxfuse_compile_flag_as_eager("is_exporting")   # noqa: F821


def quiet_export(model, args):
    """torch.export logs warnings, errors (fake-tensor tracebacks) and graph dumps on failure,
    and raises Python warnings about the model's internals (an LSTM's _flat_weights) that the
    user cannot act on; fxfuse prints nothing unless asked: its TraceError carries the reason."""
    # it also prints a partial graph to stderr when it fails; stdout: a print() in forward() would print fake
    # tensors. Traced first with is_compiling() False, as eager has it; where forward() asked and that failed
    # (HF's is_torchdynamo_compiling() guards checks of data the trace cannot read: review38b), as torch answers
    asked = []
    for eager_flags in (True, False):
        with quiet_this_thread(logs=True), warnings.catch_warnings(), _attribute_objects_kept(model), \
                _tensors_kept(model), \
                compile_flags_as_eager(asked) if eager_flags else contextlib.nullcontext():
            warnings.simplefilter("ignore")
            try:   # (the program, whether is_compiling() answered True for forward(): explain says so)
                return torch.export.export(model, args, strict=False), not eager_flags
            except Exception:
                if not (eager_flags and asked):
                    raise


@contextlib.contextmanager
def _tensors_kept(model):
    """The parameters and buffers of the model's modules, and of those it holds unregistered (a module-level
    encoder), as they were before torch.export: forward()'s `inner.to(x.dtype)` put fake tensors into them
    (fuzz49k: the user's module then failed on every call, "Couldn't swap Linear.weight")."""
    from .snapshot import modules_held_apart, tensor_slots, tensor_slots_put_back   # (imports mode_watch, which
    #                                                                                  imports this module)
    saved = tensor_slots([*model.named_modules(), *modules_held_apart(model)]) \
        if isinstance(model, torch.nn.Module) else []
    try:
        yield
    finally:
        tensor_slots_put_back(saved)


@contextlib.contextmanager
def _attribute_objects_kept(model):
    """torch.export (non-strict) puts every module attribute back from a pytree copy made before
    its trace: a dict, list or tuple the model holds was another object afterwards, so a cache or
    config shared with other code was cut off from it, and fxfuse's state snapshot watched the old
    object (a memo dict filled by the next eager call read as state: the model was refused). The
    user's own objects go back, holding what torch's copy holds."""
    before = [(m, dict(vars(m))) for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    try:
        yield
    finally:
        for m, attributes in before:
            now = vars(m)
            for k, v in attributes.items():
                if k in now and now[k] is not v:
                    now[k] = _same_object(v, now[k])


def _same_object(original, copy):
    """original holding copy's contents (nested containers too), where both are the same kind of
    container; else copy."""
    if type(original) is not type(copy) or original is copy:
        return copy
    if isinstance(original, dict):
        items = {k: _same_object(original[k], v) if k in original else v for k, v in copy.items()}
        original.clear()
        original.update(items)
        return original
    if isinstance(original, (list, collections.deque)):
        kept = len(original) >= len(copy)   # (the trace appended, or nothing: the items pair up)
        items = [_same_object(o, c) if kept else c for o, c in zip(original, copy)] + list(copy)[len(original):]
        original.clear()
        original.extend(items)
        return original
    if isinstance(original, tuple) and len(original) == len(copy):
        items = [_same_object(o, c) for o, c in zip(original, copy)]
        return original if all(i is o for i, o in zip(items, original)) else copy
    return copy
