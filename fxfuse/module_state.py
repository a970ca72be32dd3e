"""A build must leave the user's model as it found it, and must not optimize a forward() that
keeps state in the module.

Why: symbolic tracing runs forward() with proxies, so `self.last = y` stores a torch.fx Proxy
in the model and `self.count = self.count + 1` stores one in its buffers; an in-place update
(`self.count.add_(1)`) runs once on the real tensor and only its result reaches the graph.
The build then runs the graph and the model (shape propagation, verification), which moves
any state once more (`F.batch_norm(..., training=True)` on module buffers, even without
bumping their version counters). A graph cannot keep such state between calls, so every
call would return the same thing.

`build_state.kept_state(model)` (its snapshot: snapshot._Snapshot) snapshots each submodule's attributes, buffers (by value), parameters
and submodules before the build, puts everything back afterwards, and raises
UnsupportedError naming what forward() changed. Parameters are compared by identity and
version counter only (copying them would double the model's memory). Inference tensors
(a model created under torch.inference_mode) have no version counter: they are compared
by identity (and buffers by value).
"""
import array
import collections
import contextlib
import dataclasses
import dis
import functools
import inspect
import types
import weakref

import torch
import torch.fx

from .code_walk import user_module


try:   # the global hook dicts nn.Module.__call__ checks (filled in place, never rebound)
    from torch.nn.modules.module import (_global_backward_hooks, _global_backward_pre_hooks,
                                         _global_forward_hooks, _global_forward_pre_hooks)
    GLOBAL_HOOKS = (_global_backward_hooks, _global_backward_pre_hooks, _global_forward_hooks,
                    _global_forward_pre_hooks)
except ImportError:   # another torch: runtime always takes the full nn.Module.__call__
    GLOBAL_HOOKS = None


MODE_FREE = {torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
             torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d, torch.nn.ReLU, torch.nn.ReLU6, torch.nn.GELU,
             torch.nn.SiLU, torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.Softmax,
             torch.nn.Hardswish, torch.nn.Hardsigmoid, torch.nn.Mish, torch.nn.Softplus, torch.nn.Identity,
             torch.nn.Flatten, torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.LayerNorm,
             torch.nn.GroupNorm, torch.nn.Embedding, torch.nn.MaxPool1d, torch.nn.MaxPool2d, torch.nn.AvgPool1d,
             torch.nn.AvgPool2d, torch.nn.AdaptiveAvgPool1d, torch.nn.AdaptiveAvgPool2d, torch.nn.Upsample}
# ^ module types whose forward does not read self.training: forward() need not check their mode per call
_MODE_FREE_FORWARDS = {cls.forward for cls in MODE_FREE}


def mode_free(m: torch.nn.Module) -> bool:
    """Whether m's own forward ignores its training flag: one of MODE_FREE, a subclass that keeps
    its forward (torch.ao's ConvReLU2d is an nn.Sequential: fuzz38i), or a container with no
    forward of its own (a ModuleList subclass: review38e), unless it overrides __call__ (review38d)."""
    forward = getattr(type(m), "forward", None)
    if forward is torch.nn.Module.forward:
        return type(m).__call__ is torch.nn.Module.__call__
    return type(m) in MODE_FREE or forward in _MODE_FREE_FORWARDS


_MISSING = object()

REGISTRATIONS = [0]   # parameters, buffers and submodules assigned to any module of this process


def _count_registration(module, name, value) -> None:
    REGISTRATIONS[0] += 1


for _register in ("register_module_parameter_registration_hook", "register_module_buffer_registration_hook",
                  "register_module_module_registration_hook"):
    if hasattr(torch.nn.modules.module, _register):   # torch >= 2.0
        getattr(torch.nn.modules.module, _register)(_count_registration)


def structure(modules) -> list:
    """Each module's parameters, buffers and children (the model's modules and those it holds
    unregistered), by identity: what a build baked in
    (`model.lin = nn.Linear(...)` or a new Parameter after optimize() makes it stale); and the
    storage of each parameter and buffer: torch.nn.utils.prune.remove puts the same Parameter
    back with its .data replaced, which no version counter sees (runtime compares this only
    after a registration somewhere, so a plain `p.data = ...` stays unseen: documented)."""
    return [(m, dict(m._parameters), dict(m._buffers), dict(m._modules), _addresses(m)) for m in modules
            if not isinstance(m, torch.jit.ScriptModule)]   # a TorchScript child: run as one opaque call


def _addresses(m) -> tuple:
    return tuple(_address(t) for t in (*m._parameters.values(), *m._buffers.values()))


def _address(t):
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        return t.data_ptr()
    except (RuntimeError, ValueError):   # a tensor subclass without storage, an UninitializedParameter
        return None


def children_now(children: tuple) -> list:
    """The submodules in each of these live _modules dicts, for a compare with == (identity first,
    in C: a call's cost): a deletion, and `m._modules["act"] = nn.Sigmoid()` (torch.ao's convert,
    torchvision's _replace_relu), which fires no registration hook (review39b)."""
    return list(map(list, map(dict.values, children)))


def structure_changed(saved: list) -> bool:
    return any(len(now) != len(then) or any(now.get(k, _MISSING) is not v for k, v in then.items())
               for m, *dicts, _ in saved for now, then in zip((m._parameters, m._buffers, m._modules), dicts)) \
        or any(_addresses(m) != addresses for m, *_, addresses in saved)


def moved(watched: tuple) -> bool:
    """Whether a watched tensor (watch_entries) changed in place since the build, or the
    _parameters / _buffers entry that held it holds another tensor now: learn2learn's MAML
    writes fast weights there, which fires no hook (fuzz38a: the graph's copies went stale)."""
    for t, seen, holder, key, _ in watched:
        if t._version != seen or holder is not None and holder.get(key) is not t:
            return True
    return False


def swapped(watched: tuple) -> bool:
    """Whether a watched tensor lies elsewhere now: torch.utils.swap_tensors gives the object another's
    memory and version counter (fuzz48d: a dict's tensor the trace computed from). Checked only after
    a swap or registration moved REGISTRATIONS (torch_hooks counts swaps)."""
    return any(storage_address(t) != address for t, *_, address in watched)


def watch_entries(model: torch.nn.Module, tensors) -> tuple:
    """(tensor, version, the dict of the model that holds it or None, its key, its storage) for moved()."""
    holders = {id(v): (d, k) for m in model.modules() for d in (m._parameters, m._buffers) for k, v in d.items()}
    return tuple((t, t._version, *holders.get(id(t), (None, None)), storage_address(t)) for t in tensors
                 if version(t) is not None)


def overlapping(watched, candidates) -> list:
    """The candidates whose memory overlaps a watched tensor's though they are other tensor objects, with
    version counters of their own: `self.pd = self.p.data` read at trace time, then `p.mul_(2)` (fuzz48d)."""
    spans = {}
    for t in watched:
        if isinstance(t, torch.Tensor) and (address := storage_address(t)) is not None:
            spans.setdefault(address, []).append(_span(t))
    ids = {id(t) for t in watched}
    return [c for c in candidates if isinstance(c, torch.Tensor) and id(c) not in ids
            and (address := storage_address(c)) in spans and any(_overlap(_span(c), s) for s in spans[address])]


def _span(t: torch.Tensor) -> tuple:
    """The bytes of its storage a tensor can reach: [start, end)."""
    start = t.storage_offset() * t.element_size()
    reach = sum((size - 1) * abs(step) for size, step in zip(t.shape, t.stride()))
    return start, start + (reach + 1) * t.element_size()


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


INFERENCE_COPIES = (   # the runtime's one warning where version() is None for a tensor a copy came from
    "fxfuse: the optimized graph holds copies derived from the model's tensors (BatchNorm folded into "
    "weights, packed or transposed weights), and some of those tensors are inference tensors (the model was "
    "created or loaded under torch.inference_mode()): torch keeps no version counter for them, so an "
    "in-place edit after optimize() (p.copy_(...), p.mul_(...)) is not seen and the copies go stale. "
    "load_state_dict() and assigning a new parameter are seen; after other edits, call fxfuse.optimize again "
    "(or create the model outside inference mode)")


def same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype, device, layout and values, NaN equal to NaN. A sparse tensor (a GCN's
    adjacency buffer) is compared dense: == is not defined on sparse layouts (fuzz33k)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.layout != b.layout:
        return False
    if a.layout != torch.strided:
        try:
            a, b = a.to_dense(), b.to_dense()
        except (RuntimeError, NotImplementedError):   # a layout with no dense form: the same object only
            return a is b
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def held_fields(obj) -> dict:
    """An object's attributes: its __dict__ and its slots, both where it has both (review41c).
    Raises what a record's own attribute lookup raises."""
    try:
        fields = dict(vars(obj))
    except TypeError:   # slots only (review41d: every slots object compared unequal to its copy)
        fields = {}
    fields.update((n, getattr(obj, n, None)) for n in slot_names(type(obj)))
    return fields


def library_class(cls) -> bool:
    """torch's or a builtin type: not the user's, whose instances' fields are compared."""
    return (cls.__module__ or "").startswith(("torch", "builtins"))


@functools.lru_cache(maxsize=1024)
def slot_names(cls) -> tuple:
    """The attribute names of cls's slots, private ones mangled (`__scale` is `_Cfg__scale`:
    review41d), without __dict__ and __weakref__; cached: the per-call watch asks (review41d)."""
    names = []
    for c in cls.__mro__:
        slots = vars(c).get("__slots__", ())
        for n in [slots] if isinstance(slots, str) else slots:
            if n not in ("__dict__", "__weakref__"):
                names.append(f"_{c.__name__.lstrip('_')}{n}" if n.startswith("__") and not n.endswith("__") else n)
    return tuple(names)


def same_attr(a, b, depth: int = 0) -> bool:
    """The same object, or an equal plain value (torch.export rebuilds some modules' bookkeeping
    lists, e.g. LSTM's _flat_weights_names, with the same contents). Containers and the user's
    objects by what they hold, typed (fuzz41f, review41, fuzz41h: (2, 3) is not (2.0, 3), nor 0.0
    -0.0, also in a list, dict, NamedTuple, dataclass or namespace, whatever its __eq__ says),
    six containers down: a back-reference (a tree node's `parent`) counts as changed beyond that."""
    if a is b:
        return True
    if type(a) in WEAK_PROXIES or type(b) in WEAK_PROXIES or isinstance(a, (torch.Tensor, torch.fx.Proxy)) \
            or isinstance(b, (torch.Tensor, torch.fx.Proxy)):   # (a dead proxy raises on any other use)
        return False
    if isinstance(a, float) and type(a) is type(b):   # (np.float64 too: review41d)
        return float.__repr__(a) == float.__repr__(b)   # -0.0 is not 0.0 (a baked 0.0 would lose a sign), nan is nan
    if type(a) is not type(b):
        return False
    if isinstance(a, complex):   # (0j == -0j)
        return same_attr(a.real, b.real) and same_attr(a.imag, b.imag)
    if type(a).__module__ == "numpy" and getattr(a, "ndim", None) == 0 and hasattr(a, "tobytes"):
        return a.tobytes() == b.tobytes()   # np.float32(-0.0) == 0.0 (fuzz47g), nan is nan
    if depth > 6 and (isinstance(a, (tuple, list, dict)) or plain_object(a)):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_attr(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_attr(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, functools.partial):   # by what it calls, with what: its __dict__ is empty (fuzz44d: a
        return same_attr((a.func, a.args, a.keywords, vars(a)),   # partial replaced by another was not seen)
                         (b.func, b.args, b.keywords, vars(b)), depth + 1)
    if dataclasses.is_dataclass(a) or plain_object(a) or slot_names(type(a)) and not library_class(type(a)):
        try:   # one level, as its items
            return same_attr(held_fields(a), held_fields(b), depth)
        except Exception:  # noqa: BLE001 -- a record whose attribute lookup raises (review41c: KeyError)
            return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- values that cannot be compared count as changed
        return False


WEAK_PROXIES = weakref.ProxyTypes   # (code_walk, which this module imports, reads it from weakref too)


def dead(value) -> bool:
    try:
        value.__class__
    except ReferenceError:
        return True
    return False


class _DeadReference:
    """A dead weakref.proxy's stand-in while torch traces: every use but isinstance() raises as
    the proxy's does (`try: self.trainer.step / except ReferenceError` traces as eager runs)."""

    def _gone(self, *args, **kwargs):
        raise ReferenceError("weakly-referenced object no longer exists")

    __getattr__ = __bool__ = __call__ = __eq__ = __ne__ = __len__ = __iter__ = __getitem__ = _gone   # (review42j)
    __hash__ = None


@contextlib.contextmanager
def dead_proxies_hidden(model):
    """Dead weakref.proxy attributes of the model's modules replaced while torch traces it: both
    torch.fx and torch.export test every module attribute with isinstance(), which raises on a
    dead proxy (a module kept after the trainer it pointed to)."""
    hidden = [(m, k, v) for m in model.modules() for k, v in list(vars(m).items())
              if type(v) in WEAK_PROXIES and dead(v)]
    for m, k, _ in hidden:
        m.__dict__[k] = _DeadReference()
    try:
        yield
    finally:
        for m, k, v in hidden:
            if isinstance(m.__dict__.get(k), _DeadReference):
                m.__dict__[k] = v


def _held(attrs: dict, globals_read: dict, seen: set):
    """("tensor" | "container", name, object) for the plain state a module holds besides its
    parameters and buffers: tensor attributes, the lists, dicts and namespaces among its
    attributes and the tensors inside them (`self.acc = [torch.zeros(8)]`), and the module-level
    tensors and containers its forward() reads. torch.fx runs an in-place write on such a
    tensor (`self.acc[0].add_(1)`) once at trace time, and an item replaced in a container
    (`self.hist[0] = y`) receives a Proxy; neither reaches the graph. `seen` (ids) skips what an
    earlier submodule already holds (48 blocks reading one global are one snapshot)."""
    def walk(label, value, depth, in_object=False):
        if id(value) in seen or type(value) in WEAK_PROXIES:   # a dead one raises on any use (review41d)
            return
        if isinstance(value, torch.Tensor):   # (a big one in a plain object, say a preallocated cache, not
            if not isinstance(value, torch.nn.Parameter) and _comparable(value) and not (   # copied per
                    in_object and value.numel() * value.element_size() > MAX_OBJECT_TENSOR_BYTES):   # build)
                seen.add(id(value))
                yield "tensor", label, value
            return
        if depth >= MAX_CONTAINER_DEPTH:
            return
        if isinstance(value, (set, bytearray, array.array)) or is_ndarray(value) and value.nbytes <= MAX_ARRAY_BYTES \
                and value.dtype.kind in "biufc":   # numbers (object and datetime arrays: not compared)
            if is_ndarray(value) or len(value) <= MAX_SHALLOW_ITEMS:   # `self.seen.add(n)`, a numpy
                seen.add(id(value))                                    # counter (review42e): compared
                yield "container", label, value                       # and put back whole
            return
        try:   # a dead weakref.proxy raises ReferenceError on any use (review41d)
            items = (list(enumerate(value)) if isinstance(value, (list, tuple, collections.deque))
                     else list(value.items()) if isinstance(value, dict) else list(vars(value).items())
                     if _is_record(value) else None)
        except ReferenceError:
            return
        if items is None or len(items) > MAX_SHALLOW_ITEMS:
            return
        seen.add(id(value))
        if not isinstance(value, tuple):
            yield "container", label, value
        if len(items) > MAX_CONTAINER_ITEMS:   # a long history: compared item by item, not walked (fuzz42h)
            return
        plain = in_object or _is_record(value) and plain_object(value)
        for key, item in items:
            yield from walk(f"{label}.{key}" if _is_record(value) else f"{label}[{key!r}]", item, depth + 1, plain)

    for k, v in attrs.items():
        yield from walk(k, v, 0)
    for k, v in globals_read.items():
        yield from walk(f"forward's global {k}", v, 0)


def is_ndarray(value) -> bool:
    """A numpy array (numpy itself is imported only where one exists)."""
    return type(value).__name__ == "ndarray" and type(value).__module__ == "numpy"


def plain_object(value) -> bool:
    """An object of the user's with attributes to look into (not a class, function, module, tensor
    or nn.Module, nor torch's own objects): the walks of mode_watch and the fingerprints of
    concrete_args ask it."""
    try:   # a __getattr__ may raise anything (KeyError from a dict-backed record: review38d)
        has_dict = isinstance(getattr(value, "__dict__", None), dict)
    except Exception:  # noqa: BLE001
        return False
    return has_dict and not isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType,
                                               types.BuiltinFunctionType, torch.Tensor, torch.nn.Module)) \
        and not (type(value).__module__ or "").startswith("torch")


def _is_record(value) -> bool:
    """A SimpleNamespace, a dataclass instance (a decode state, a config) or a plain object of the
    user's (a helper with a cache of its own: its Proxy reached the user's eager model, fuzz42h):
    walked by its fields."""
    return isinstance(value, types.SimpleNamespace) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "__dict__")) \
        or type(value) not in WEAK_PROXIES and plain_object(value) and _may_hold_state(type(value).__module__) \
        and not isinstance(value, (dict, list, tuple, set, frozenset, collections.deque))   # (a Counter: by items)


def _may_hold_state(module: str | None) -> bool:
    """Not logging's or io's objects: a logger's handler keeps its records, a StringIO what was
    printed, which is no model state (fuzz42k); the standard library's containers and records
    (UserList, UserDict, ChainMap, argparse.Namespace, queue.Queue) are (fuzz43g: their writes
    went unseen, and a UserList kept the trace's Proxy)."""
    return user_module(module) or not (module or "").split(".")[0] in ("logging", "io", "_io")


def _comparable(t: torch.Tensor) -> bool:
    """A tensor whose value the snapshot can copy and compare (not sparse, nested or meta)."""
    return t.layout == torch.strided and t.device.type != "meta" and not t.is_nested


MAX_CONTAINER_DEPTH = 4     # nesting of lists/dicts searched for tensors
MAX_CONTAINER_ITEMS = 64    # longer containers (a cache of many tensors) are not walked into
MAX_SHALLOW_ITEMS = 4096    # up to this many items, they are snapshotted by their items' identities
MAX_ARRAY_BYTES = 1 << 16   # numpy arrays snapshotted by value (a counter, a running statistic)
MAX_OBJECT_TENSOR_BYTES = 1 << 20   # tensors in the user's plain objects copied by the snapshot (review42j)


def forward_function(m: torch.nn.Module):
    """The function type(m).forward runs, under its decorators (@torch.no_grad(), functools.wraps):
    its code and globals are the model's, the wrapper's are torch's or functools'."""
    fn = getattr(type(m), "forward", None)
    try:
        return inspect.unwrap(fn) if fn is not None else None
    except ValueError:   # a wrapper chain that loops
        return fn


def forward_globals(m: torch.nn.Module) -> tuple:
    """(the function under type(m).forward's decorators, {name: value} of the module-level names
    it loads: LOAD_GLOBAL, not attribute names that happen to match); (None, {}) for torch's own
    modules and forwards without Python code."""
    fn = forward_function(m)
    if getattr(fn, "__code__", None) is None or (type(m).__module__ or "").startswith("torch."):
        return None, {}
    names = {ins.argval for ins in dis.get_instructions(fn.__code__) if ins.opname == "LOAD_GLOBAL"}
    return fn, {name: fn.__globals__[name] for name in names   # (not a weakref.proxy: a dead one raises on
                if name in fn.__globals__ and type(fn.__globals__[name]) not in WEAK_PROXIES}   # any use)


def _forward_state(m: torch.nn.Module) -> dict:
    """The module-level tensors and containers type(m).forward loads."""
    return {name: v for name, v in forward_globals(m)[1].items()
            if isinstance(v, (torch.Tensor, list, tuple, dict, set, collections.deque, bytearray, array.array))
            or is_ndarray(v) or _is_record(v)}


def forward_hook_owner(model: torch.nn.Module) -> str | None:
    """Where a forward (pre-)hook would run in eager but not in a traced graph, or None.

    Tracing calls each submodule's forward() directly, so hooks on the submodules (and on the
    model itself, and global module hooks, which eager runs for every submodule) would silently
    not run: a hook that edits an output would give another answer."""
    if GLOBAL_HOOKS is not None and any(GLOBAL_HOOKS[2:]):
        kind = "forward hook" if GLOBAL_HOOKS[2] else "forward pre-hook"
        return f"a global module {kind} (torch.nn.modules.module.register_module_{kind.replace(' ', '_').replace('-', '_')})"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            where = f"submodule {name} ({type(m).__name__})" if name else type(model).__name__
            return f"{where} has a forward {'hook' if m._forward_hooks else 'pre-hook'}{_hook_advice(m)}"
    return None


def _hook_advice(m) -> str:
    """torch's own hook-based reparametrizations, which fxfuse could take in another form (fuzz34g)."""
    kinds = {type(h).__module__ for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())}
    if "torch.nn.utils.prune" in kinds:
        return " (torch.nn.utils.prune's mask: call prune.remove(module, name) to make the pruning permanent first)"
    if kinds & {"torch.nn.utils.weight_norm", "torch.nn.utils.spectral_norm"}:
        return (" (the old torch.nn.utils.weight_norm / spectral_norm: torch.nn.utils.parametrizations.weight_norm "
                "/ spectral_norm, which fxfuse follows, compute the same)")
    return ""


def storage_address(t: torch.Tensor):
    """Where t's storage lies (views of one tensor share it), None for an empty or meta tensor, for a
    sparse one (no storage of its own: a GCN's adjacency buffer, fuzz33k) and for a lazy module's
    uninitialized parameter (review49r4: one held apart made every build an internal error)."""
    return t.untyped_storage().data_ptr() if not isinstance(t, torch.nn.parameter.UninitializedTensorMixin) \
        and t.numel() and t.device.type != "meta" and t.layout == torch.strided else None


def share_memory(args, taken=frozenset()) -> bool:
    """Whether two tensor arguments share storage (opt(x, x), or two views of one tensor), or
    one shares a storage of `taken` (the model's own tensors: opt(model.lin.weight), `taken`
    from storages())."""
    seen = set()
    for a in args:
        if isinstance(a, torch.Tensor):
            try:   # a sparse, meta or wrapper-subclass tensor has no storage to share: the layout check
                address = storage_address(a)   # after this one runs the original for it (review39b)
            except Exception:  # noqa: BLE001 -- "invalid python storage" of a wrapper subclass
                continue
            if address is None:
                continue
            if address in seen or address in taken:
                return True
            seen.add(address)
    return False


def storages(tensors) -> frozenset:
    return frozenset(storage_address(t) for t in tensors if isinstance(t, torch.Tensor)) - {None}
