"""Whether a forward() asks torch's grad or inference mode while it is traced.

Why: builds trace under no_grad (and in whatever inference mode the building call had), so a
forward() that branches on the mode (`if not torch.is_grad_enabled(): h = h * 2`) is traced on
one side only; the runtime must then not run that graph in the other mode
(runtime.OptimizedModule). Calls through `torch.is_grad_enabled` are seen by replacing it for
the trace; names a forward() bound itself (`from torch import is_grad_enabled`) by reading
its globals and closures; and, where the build verifies, by running the model in the other
mode too (probe_mode_dependence), which catches every other way of asking (a helper that
imported the function, one stored on the module, `h.is_inference()`).
"""
import contextlib
import dis
import inspect
import os
import sys
import types
import warnings

import torch

from .code_walk import globals_read, plain_functions, user_classes
from .errors import FxfuseWarning
from .module_state import WEAK_PROXIES, forward_globals, mode_free, plain_object, storage_address, storages
from .written_constants import held_tensors

_PASSES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes", "")   # fxfuse.passes
LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep) + (
    (_PASSES,) if os.path.isfile(os.path.join(_PASSES, "fuse_pointwise.py")) else ())   # in a source tree (editable)
# ^ with the separator: torchvision/ and fxfuse_models/ are the model's code, not torch's or fxfuse's


@contextlib.contextmanager
def watching_mode_reads():
    """Notes whether tracing called torch.is_grad_enabled() ("grad") or
    torch.is_inference_mode_enabled() ("inference"): builds run under no_grad, so a forward()
    that branches on either (`if not torch.is_grad_enabled(): h = h * 2`) is traced on one side,
    and the runtime must not run that graph in the other mode (runtime.OptimizedModule).
    Builds run one at a time (runtime.BUILD_LOCK); another thread asking meanwhile only makes
    this conservative."""
    real = {"grad": torch.is_grad_enabled, "inference": torch.is_inference_mode_enabled}
    reads = set()

    def watching(kind):
        def watched():
            caller = sys._getframe(1).f_code.co_filename   # the model's code, not torch's (fx, export,
            if not caller.startswith(LIBRARY_DIRS):       # MultiheadAttention's fast-path test)
                reads.add(kind)
            return real[kind]()
        return watched

    for namespace in (torch, torch._C):   # (`torch._C.is_grad_enabled()`: the same function, fuzz47g)
        namespace.is_grad_enabled = watching("grad")
        namespace.is_inference_mode_enabled = watching("inference")
    try:
        yield reads
    finally:
        for namespace in (torch, torch._C):
            namespace.is_grad_enabled = real["grad"]
            namespace.is_inference_mode_enabled = real["inference"]


def mode_functions_imported(model) -> set:
    """{"grad", "inference"}: the mode functions a forward() reaches by a name of its own (a
    global or closure bound by `from torch import is_grad_enabled`), which watching_mode_reads
    cannot replace; counted as read (conservative: the runtime keeps that graph to the traced mode)."""
    found = set()
    for m in model.modules():
        fn, loaded = forward_globals(m)
        if fn is None:
            continue
        bound = list(loaded.values()) + [_cell(c) for c in fn.__closure__ or ()]
        for kind, real in (("grad", torch.is_grad_enabled), ("inference", torch.is_inference_mode_enabled)):
            if any(value is real for value in bound):
                found.add(kind)
    return found


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:   # an empty cell
        return None


def probe_mode_dependence(model, args, expected: list, reads: dict, differs, rewind=lambda: None) -> None:
    """Run eager in the three other (grad, inference) combinations than the build's (which runs
    under no_grad), and mark `reads` (tracing's "fxfuse_trace" record) wherever the output
    changes: the forward() depends on that mode whichever way it asks, and the runtime then
    runs the original in the modes the graph was not traced in.
    `expected` is eager's flattened output in the build's modes; `differs(e, g)` compares
    one output; `rewind()` puts torch's random generators back where `expected`'s run started
    (a model with random ops draws the same numbers). A run that raises counts as depending on the mode (conservative: those
    calls then run the original, which raises the model's own error). Also notes whether
    forward() records autograd at all (`reads["records_autograd"]`, _records_autograd)."""
    inference = torch.is_inference_mode_enabled()
    # an fxfuse OptimizedModule inside the model would warn about (and count) these calls as
    # its own user's: its bookkeeping is put back and its warnings are not shown
    inner = [(m, set(m._warned), m._original_calls.copy()) for m in model.modules()
             if getattr(type(m), "fxfuse_runtime", False)]
    plain = [t for t in (*model.parameters(), *model.buffers(), *held_tensors(model)) if not t.requires_grad]
    # with grad on, autograd saves nothing for this thread's runs (a large model's activations
    # would be kept for a backward pass that never comes); the parameters stay as they are
    # (freezing them would have frozen them for other threads training meanwhile)
    try:
        with warnings.catch_warnings(), _saving_nothing():
            warnings.simplefilter("ignore", FxfuseWarning)
            _probe(model, args, expected, reads, differs, inference, rewind)
            # recording through its own tensors (or asking the mode) already decides grad-mode calls
            reads["records_autograd"] = bool(reads.get("records_from_state", True) or reads.get("reads_grad_mode")) \
                or _records_autograd(model, args, grad=True)
            reads["enables_grad"] = _records_autograd(model, args, grad=False)   # torch.enable_grad() inside
    finally:
        for m, warned, calls in inner:
            m._warned, m._original_calls = warned, calls
        for t in plain:   # a scratch buffer written in place with grad on: it required grad afterwards, with a
            if t.requires_grad:   # grad_fn into the probe's graph, and so did eager's outputs (review43c)
                with contextlib.suppress(RuntimeError):   # (a view cannot be detached in place)
                    t.detach_()

def _drop(_):
    return None


def _saving_nothing():
    """Saved-tensor hooks that keep nothing, unless the caller disabled such hooks
    (`torch.autograd.graph.disable_saved_tensors_hooks`, as torch.func's transforms do): entering
    them then raised, and the build failed (review43c)."""
    disabled = getattr(torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", lambda: None)()
    return contextlib.nullcontext() if disabled else torch.autograd.graph.saved_tensors_hooks(_drop, _drop)


def _probe(model, args, expected, reads, differs, inference, rewind) -> None:
    """The three other (grad, inference) combinations a call may have; a difference in one
    that turns grad on marks grad, one in the other inference mode marks inference."""
    for grad, other in ((True, False), (False, True), (True, True)):
        if (not grad or reads.get("reads_grad_mode")) and (not other or reads.get("reads_inference_mode") is not None):
            continue   # everything this run could mark is marked already
        with torch.inference_mode(inference != other), torch.set_grad_enabled(grad):   # inference_mode(False)
            changed, records = _changes(model, args, expected, differs, rewind)     # turns grad on: set after it
        if grad and not other:   # with grad on and plain inputs: does forward() record through its own
            reads["records_from_state"] = records or changed   # tensors (a parameter, a tensor attribute)?
        if changed:   # the run flipping both marks grad only where the other mode alone changed nothing
            #             (review43c: an inference-mode branch marked grad too): a model made under
            #             inference_mode fails there (its parameters cannot be saved for backward)
            by_inference = other and reads.get("reads_inference_mode") is not None
            reads["reads_grad_mode"] = reads.get("reads_grad_mode") or grad and not by_inference
            if other and not grad and reads.get("reads_inference_mode") is None:
                reads["reads_inference_mode"] = inference


def _changes(model, args, expected, differs, rewind) -> tuple:
    """(whether the outputs differ from `expected`, whether autograd computed one: _computed)."""
    from .tracing import clone_args
    from .verify import flatten_output   # a dataclass's fields as leaves (review37b: one leaf, "changed")
    inputs = clone_args(args)
    rewind()
    try:
        got = flatten_output(model(*inputs))[0]
    except Exception:  # noqa: BLE001 -- see probe_mode_dependence
        return True, True
    return len(got) != len(expected) or any(differs(e, g.detach() if isinstance(g, torch.Tensor) else g)
                                            for e, g in zip(expected, got)), _computed(got, inputs)


def _computed(outputs, inputs) -> bool:
    """Whether autograd computed one of the outputs (a grad_fn): not an input passed through or
    a view of one, nor a parameter returned or viewed under no_grad (the graph returns those as
    eager does)."""
    storages = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(inputs)
                if isinstance(t, torch.Tensor)}
    return any(isinstance(g, torch.Tensor) and _grad_fn(g) is not None and g.untyped_storage().data_ptr() not in storages
               for g in outputs)


def _grad_fn(t: torch.Tensor):
    """t.grad_fn, or None where reading it raises: a view made under no_grad and then written in
    place (`v = x[:, 2:6]; v.mul_(0.5); return v`, fuzz31h) has no history autograd can give."""
    try:
        return t.grad_fn
    except RuntimeError:
        return None


def _records_autograd(model, args, grad: bool) -> bool:
    """Whether eager, in grad mode `grad` with its floating inputs requiring grad, returns a
    tensor that requires grad. With grad on, False for a forward() that turns grad off itself
    (`@torch.no_grad()`, an inference wrapper): calls in grad mode may then run the graph; with
    grad off, True for one that turns it on (`torch.enable_grad()` around a head): calls under
    no_grad then run the original (GradRecording). Only outputs autograd computed count
    (_computed). A run that raises counts as recording with grad on (such calls then run the
    original) and as not recording with grad off (no_grad calls run the graph, as before)."""
    from .tracing import clone_args

    def requiring_grad(a):   # not a leaf: forward() may write into its input in place
        if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
            return a.detach().requires_grad_().clone()
        return a
    try:
        with torch.inference_mode(False):
            with torch.enable_grad():   # builds run under no_grad: a clone made there would not require grad
                inputs = torch.utils._pytree.tree_map(requiring_grad, clone_args(args))
            with torch.set_grad_enabled(grad), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # inputs requiring grad warn where eager's do not
                from .verify import flatten_output   # ("Converting a tensor with requires_grad=True
                got = flatten_output(model(*inputs))[0]   # to a scalar": fuzz50g)
    except Exception:  # noqa: BLE001
        return grad
    return _computed(got, inputs)


def training_submodule(model) -> str | None:
    """The module of model (itself included) in training mode whose forward may read the mode
    (MODE_FREE types' does not), by name, else None. Checked before every build, not only in
    optimize(): a module assigned after optimize starts in training mode, and a rebuild would
    trace its training branch, which the graph then kept after model.eval() (fuzz34h)."""
    for name, m in model.named_modules():
        if m.training and (m is model or not mode_free(m)):
            return name or type(model).__name__
    return None


def _training_held(model) -> str | None:
    """training_submodule, or else a module the model holds unregistered that the graph reads
    (runtime watches those: a frozen encoder kept in a list, put in training mode; fuzz46c)."""
    found = training_submodule(model)
    if found is not None:
        return found
    return next((f"{type(h).__name__} (held unregistered)" for h in _held_apart(model)
                 if any(m.training and not mode_free(m) for m in h.modules())), None)


def training_key(model) -> str:
    """The warning's key: one warning per submodule found in training mode (review43c: a later
    train() of another submodule ran the original silently)."""
    return f"train:{_training_held(model)}"


def training_reason(model) -> str:
    where = _training_held(model)
    what = "the module is" if where is None or where == type(model).__name__ else f"its submodule {where} is"
    return (f"{what} in training mode; fxfuse's graphs are eval-mode graphs (Dropout removed, BatchNorm "
            "folded). Call .eval() to use them")


GRAD_REASON = ("this call would record autograd (grad mode on, or turned on by forward() itself, and "
               "parameters or inputs requiring grad), or forward()'s result depends on grad mode (it asks "
               "torch.is_grad_enabled() or the like) and was traced without grad; fxfuse runs inference only: "
               "call under torch.no_grad() or torch.inference_mode() to use the optimized graph")


def _decorated_to_enable_grad(model) -> bool:
    """A forward() of the model's or a submodule's class, or a method it calls by name, that
    turns grad on: decorated with @torch.enable_grad() or @torch.set_grad_enabled(True), a
    `with torch.enable_grad():` block, a decorator of its own that enters one. Entered outside
    any trace (or not recorded by it), so only a probe (verify) would see it (fuzz33a, review33b,
    fuzz33l); a training helper forward() never calls does not count (review33c)."""
    for cls in {type(m) for m in model.modules()}:
        if (cls.__module__ or "").startswith("torch."):
            continue
        try:
            forward = getattr(cls, "forward", None)
            called = set(getattr(getattr(inspect.unwrap(forward), "__code__", None), "co_names", ()))
            methods = [forward] + [getattr(cls, n, None) for n in called if n != "forward"]
            for value in methods:
                fn, seen = value, set()
                while callable(fn) and id(fn) not in seen:
                    seen.add(id(fn))
                    if _turns_grad_on(fn):
                        return True
                    fn = getattr(fn, "__wrapped__", None)
        except Exception:  # noqa: BLE001 -- an attribute whose __getattr__ raises (review33c): not a method
            continue
    return False


def _turns_grad_on(fn) -> bool:
    """fn enters enable_grad / set_grad_enabled in its code or holds one it entered as a decorator."""
    code = getattr(fn, "__code__", None)
    names = getattr(code, "co_names", ())
    if "enable_grad" in names or "set_grad_enabled" in names and _sets_grad_other_than_off(code):
        return True
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            manager = getattr(cell.cell_contents, "__self__", None)
        except ValueError:   # an empty cell
            continue
        if isinstance(manager, torch.enable_grad) or (isinstance(manager, torch.set_grad_enabled)
                                                      and getattr(manager, "mode", False) is True):
            return True
    return False


def _sets_grad_other_than_off(code) -> bool:
    """Whether some `set_grad_enabled(...)` in code (its nested functions too) may turn grad on:
    one not given the constant False (review43c: `with torch.set_grad_enabled(False):` around a
    frozen feature extractor sent every no_grad call to the original with verify=False)."""
    for c in (code, *(k for k in code.co_consts if isinstance(k, types.CodeType))):
        instructions = list(dis.get_instructions(c))
        for i, ins in enumerate(instructions):
            if ins.argval == "set_grad_enabled" and "LOAD" in ins.opname:
                following = [n for n in instructions[i + 1:i + 4] if n.opname not in ("PUSH_NULL", "CACHE")]
                if not (following and following[0].opname == "LOAD_CONST" and following[0].argval in (False, 0)):
                    return True
    return False


def unregistered_parameters(model: torch.nn.Module) -> tuple:
    """Parameters of modules the model holds without registering them (`self.shared =
    [nn.Linear(...)]`, in a tuple, dict, namespace, dataclass or plain object, or set with
    object.__setattr__): unfrozen after optimize(), eager records autograd through them (fuzz38a,
    review38c: the graph ran on, and the weight's .grad stayed None). A bounded walk: four levels,
    64 items a container, 4096 objects."""
    registered = {id(p) for p in model.parameters()}
    return tuple({id(p): p for m in unregistered_modules(model) for p in m.parameters()
                  if id(p) not in registered}.values())


def unregistered_modules(model: torch.nn.Module) -> tuple:
    """The modules the model holds without registering them (unregistered_parameters' walk)."""
    own, found, seen = {id(m) for m in model.modules()}, {}, set()

    def walk(value, depth):
        if id(value) in seen or len(seen) > 4096 or type(value) in WEAK_PROXIES:   # a dead one raises
            return
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            if id(value) not in own:
                found[id(value)] = value
        elif depth < 4:
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else vars(value).values() if plain_object(value) else ()
            for item in list(items)[:64]:
                walk(item, depth + 1)
    for m in model.modules():
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                walk(value, 0)
    for cls in {type(m) for m in model.modules()}:   # a module-level one forward() reads (fuzz46c)
        for _, value in globals_read(cls):
            if isinstance(value, torch.nn.Module) and id(value) not in own:
                found[id(value)] = value
    return tuple(found.values())


def watched_modules(model: torch.nn.Module, read: frozenset) -> tuple:
    """The model's modules, and those of each module it holds unregistered whose tensors' storages the
    graph reads (`read`): a frozen encoder kept in a list, then replaced, given new weights or put in
    training mode, was not seen (fuzz46c); an unused teacher held so stays out."""
    held = (m for h in _held_apart(model) if storages((*h.parameters(), *h.buffers())) & read for m in h.modules())
    return tuple(dict.fromkeys((*model.modules(), *held)))


def _held_apart(model) -> list:
    """unregistered_modules, less those holding the model (review46r: a child's back-reference to its parent)."""
    return [h for h in unregistered_modules(model) if all(m is not model for m in h.modules())]


def _closure_values(cls) -> list:
    """(index, value) of the cells the methods of cls close over (a class made in a factory)."""
    return [found for klass in user_classes(cls) for attr in list(vars(klass).values())
            for fn in plain_functions(attr) for found in _cells(fn)]


def _cells(fn) -> list:
    """(index, value) of a function's filled closure cells."""
    found = []
    for k, cell in enumerate(getattr(fn, "__closure__", None) or ()):
        try:
            found.append((k, cell.cell_contents))
        except ValueError:   # an empty cell
            pass
    return found


def _forward_defaults(cls) -> list:
    """(name, value) of forward()'s default values (`def forward(self, x, w=SCALE)`)."""
    forward = getattr(cls, "forward", None)
    return [("default", v) for v in (*(getattr(forward, "__defaults__", None) or ()),
                                     *(getattr(forward, "__kwdefaults__", None) or {}).values())]


def held_elsewhere(model: torch.nn.Module) -> tuple:
    """Tensors forward() may read besides its parameters, buffers and attributes: unregistered
    modules' parameters and module-level tensors. A trace folds what it computes from them into
    constants, so the aliasing guard names them all (review38c)."""
    global_tensors = {}
    for cls in {type(m) for m in model.modules()}:   # the names the model's own code loads: not every tensor
        for _, value in globals_read(cls) + _closure_values(cls) + _forward_defaults(cls):   # of a script's
            if isinstance(value, torch.Tensor):   # globals (an example input: fuzz38j); a closure's cells (fuzz44c)
                global_tensors[id(value)] = value
            for _, cell in _cells(value) if inspect.isfunction(value) else ():   # a module-level function's cells
                if isinstance(cell, torch.Tensor):                               # (`scale = make_scale(C)`: fuzz46c)
                    global_tensors[id(cell)] = cell
    return unregistered_parameters(model) + tuple(global_tensors.values())


class GradRecording:
    """What the builds' probes (probe_mode_dependence) found about autograd in one model's
    forward(), and the rule runtime.OptimizedModule asks on each call: would eager record
    autograd here? Then the original runs (GRAD_REASON). Unknown facts (a build without
    verify) count as recording, except turning grad on under no_grad, as before the probes."""

    def __init__(self, model, plain_tensors=()):
        self.model = model
        self.plain_tensors = plain_tensors   # the plain tensor attributes the traces read (`self.T`), kept current
        self.reads_grad_mode = False   # forward() asks torch.is_grad_enabled() (any build; kept)
        self.unregistered = ()         # tensors the model holds unregistered (note_build: held_elsewhere)
        self.traced_inference = None   # forward() asks torch.is_inference_mode_enabled(): its answer then
        self.input_inference = None    # forward() may ask an input's is_inference(): the example's answers
        self.forget_builds()

    def forget_builds(self) -> None:
        self.records_autograd = False      # records with grad on and its inputs requiring grad
        self.records_from_state = False    # records with grad on and plain inputs (parameters, tensor attributes)
        self.enables_grad = False          # records under no_grad (torch.enable_grad() inside)
        self.flags = ()                    # the requires_grad flags of parameters and buffers they held for

    def note_build(self, trace: dict, constants_require_grad: bool = False, read=frozenset(), args=()) -> None:
        if self.traced_inference is None:
            self.traced_inference = trace.get("reads_inference_mode")
        reads = trace.get("attribute_reads", {})   # (none recorded: as before, not "all")
        if self.input_inference is None and "is_inference" in reads.get("code_names", ()):   # (not where a
            #                                     profiler or coverage tool kept the names from being recorded)
            self.input_inference = _inference_inputs(args)
        # those the traces read (`read`: storages): a teacher model held in a list, unused, does not
        # make each call with grad on run the original (review38c); module-level tensors, closure cells
        # and forward()'s defaults too, whose flags may turn on after optimize() (fuzz46c)
        self.unregistered = tuple(p for p in held_elsewhere(self.model) if storage_address(p) in read)
        flags = self._flags()
        if flags != self.flags:   # what earlier builds saw held for other flags (a model frozen since)
            self.forget_builds()
        self.reads_grad_mode |= bool(trace.get("reads_grad_mode"))
        self.records_autograd |= trace.get("records_autograd", True)
        # unprobed (verify=False): it records from its state where some state tensor requires grad,
        # or a tensor the graph holds as a constant (a module-level global, one in a list attribute),
        # or it may start autograd itself (`h.detach().requires_grad_()`: review43c)
        self.records_from_state |= trace.get("records_from_state", any(flags) or constants_require_grad
                                             or "requires_grad_" in reads.get("code_names", ()))
        self.enables_grad |= trace["enables_grad"] if "enables_grad" in trace else _decorated_to_enable_grad(self.model)
        self.flags = flags

    def inference_reason(self, args) -> str | None:
        """Why this call may not run the graph as to inference: the mode, where forward() asks it
        and was traced in the other; an input an inference tensor where the example's was not (or
        the reverse), where forward() may ask `x.is_inference()` (review43c: the other branch,
        silently; a data pipeline's batches made under inference_mode)."""
        traced = self.traced_inference
        if traced is not None and torch.is_inference_mode_enabled() != traced:
            return (f"forward()'s result depends on inference mode (it asks torch.is_inference_mode_enabled() or "
                    f"the like) and was traced with inference mode {'on' if traced else 'off'}, and this call has "
                    f"it {'off' if traced else 'on'}")
        if self.input_inference is not None and _inference_inputs(args) != self.input_inference:
            return ("forward() asks is_inference(), and this call's inputs are inference tensors where the example's "
                    "were not, or the reverse")
        return None

    def _state(self) -> tuple:
        """Parameters, buffers and plain tensor attributes: `self.T.requires_grad_(True)` on a
        temperature after optimize() makes eager record as much as unfreezing a parameter does
        (fuzz33a)."""
        return (*self.model.parameters(), *self.model.buffers(), *self.plain_tensors, *self.unregistered)

    def _flags(self) -> tuple:
        return tuple(t.requires_grad for t in self._state())

    def _something_requires_grad(self, args) -> bool:
        if torch.is_inference_mode_enabled():
            return False
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or \
            any(t.requires_grad for t in self._state())

    def records(self, args) -> bool:
        """Under no_grad: where forward() turns grad on itself. With grad on: where forward()
        asks the mode, or recorded through its own tensors at the build (a tensor attribute
        requiring grad, which no flag shows), or records through inputs, parameters or buffers
        that require grad. What the probes saw holds only for the flags seen at the build: a
        parameter unfrozen since may be used outside a no_grad part."""
        if not torch.is_grad_enabled():
            return self.enables_grad and self._something_requires_grad(args)
        if self.reads_grad_mode:
            return True
        same_flags = self._flags() == self.flags
        if self.records_from_state and same_flags:
            return True
        return (self.records_autograd or not same_flags) and self._something_requires_grad(args)


def _inference_inputs(args) -> tuple:
    return tuple(a.is_inference() for a in args if isinstance(a, torch.Tensor))
