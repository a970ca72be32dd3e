"""What a build changed in the model, and putting it back (build_state.kept_state): each
submodule's attributes, buffers (by value), parameters (by identity and version), submodules,
the tensors and containers its forward() holds or reads (module_state._held), and containers
on the model's own classes. A memo forward() fills on a miss (a dict that only gained keys) is
no change; with keep_memos it stays as the check's eager run filled it (stop 40).
"""
import array
import collections
import functools
import inspect
import types

import torch
import torch.fx

from .module_state import (WEAK_PROXIES, _forward_state, _held, _is_record, forward_function, forward_globals, is_ndarray,
                           same_attr, same_value, version)
from .trace_leftovers import TraceLeftovers, is_trace_value, reads_input_values


def _contents(container):
    if is_ndarray(container) or isinstance(container, (bytearray, array.array)):
        return container[:] if not is_ndarray(container) else container.copy()
    if isinstance(container, set):
        return set(container)
    return list(container) if isinstance(container, (list, collections.deque)) else dict(
        vars(container) if _is_record(container) else container)


def _same_contents(container, saved) -> bool:
    now = _contents(container)
    if isinstance(now, (bytearray, array.array)):
        return now == saved
    if is_ndarray(now):
        import numpy
        return now.shape == saved.shape and now.dtype == saved.dtype and bool(numpy.array_equal(
            now, saved, equal_nan=now.dtype.kind in "fc"))
    if isinstance(now, set):   # by identity: a Proxy the trace added compares equal to nothing
        return {id(v) for v in now} == {id(v) for v in saved}
    if isinstance(now, list):
        return len(now) == len(saved) and all(same_attr(a, b) for a, b in zip(now, saved))
    return now.keys() == saved.keys() and all(same_attr(now[k], saved[k]) for k in saved)


def _only_memoized(container, saved) -> bool:
    """Whether forward() only added keys to a dict: a cache filled on a miss (`if T not in
    self.cache: self.cache[T] = rotary(T, x.device)`). The graph computes or holds what it read
    from it, and eager fills it again after it is put back (entries made of torch.fx Proxies
    or fake tensors never stay in the model). A replaced entry, or anything appended to a list
    (a history, a call counter), is state; so is a dict that moves again on another eager run
    (`d["n"] = d.get("n", 0) + 1`, `d[len(d)] = y`, `d.setdefault("k", []).append(v)`: moved_by)."""
    now = _contents(container)
    if not isinstance(now, dict) or not all(k in now and (now[k] is v or _equal_tensor(now[k], v))
                                            for k, v in saved.items()):
        return False
    return len(now) > len(saved) or any(now[k] is not v for k, v in saved.items())


def _equal_tensor(new, old) -> bool:
    """An entry refilled with an equal fresh tensor (a scratch dict written each call: its second
    build saw the first's entry replaced, and refused it)."""
    return isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and same_value(new, old)


RNN_CACHES = ("_flat_weights", "_flat_weight_refs")   # an RNN's own per-call lists of its (parametrized) weights
#                                                       (fuzz48c: a weight-normed LSTM was refused as state)

def _entries(container) -> dict:
    """A dict's entries: each value, with a tensor's version (`.add_(1)` on a counter) or a
    container's size (an append)."""
    return {k: (v, version(v) if isinstance(v, torch.Tensor) else len(v)
                if isinstance(v, (list, dict, set, collections.deque)) else None)
            for k, v in _contents(container).items()}


def _proxy_text(value) -> bool:
    """A string made from a trace's Proxy (`f"width {x.shape[-1]}"`: review42j)."""
    return type(value) is str and "Proxy(" in value   # (type(): isinstance() of a dead weakref.proxy raises)


def _moved(before: dict, after: dict) -> bool:
    """Whether a rerun changed the entries: other keys, another value (an equal fresh tensor, as
    a scratch dict refilled per call holds, is none: review42j), one written in place or grown."""
    if before.keys() != after.keys():
        return True
    for k, (old, mark) in before.items():
        new, now = after[k]
        if new is old:
            if now != mark:
                return True
        elif not (_equal_tensor(new, old) and mark == version(old)):
            return True
    return False


def _restore_container(name: str, container, saved, changed: list, data_filled: bool = False,
                       kept: list | None = None) -> None:
    """Put a container's items back; name it in `changed` unless forward() only memoized (and the
    trace did not fill it from the input's values: drop_proxies). Given `kept` (a build whose
    check ran the model eagerly on the example), a memo keeps what that eager run filled it with
    and is listed there."""
    if data_filled or not _same_contents(container, saved):
        memo = not data_filled and _only_memoized(container, saved)
        if not memo:
            changed.append(name)
        elif kept is not None and not _holds_trace_values(_contents(container)):
            kept.append((container, saved))
            return
        _put_back(container, saved)


def _holds_trace_values(items: dict) -> bool:
    return any(is_trace_value(v) for v in torch.utils._pytree.tree_leaves(list(items.values())))


def _put_back(container, saved) -> None:
    if is_ndarray(container):
        container[...] = saved
    elif isinstance(container, (bytearray, array.array)):
        container[:] = saved
    elif isinstance(container, (set, collections.deque)):
        container.clear()
        container.update(saved) if isinstance(container, set) else container.extend(saved)
    elif isinstance(container, list):
        container[:] = saved
    else:
        target = vars(container) if _is_record(container) else container
        target.clear()
        target.update(saved)


# torch's registries of state_dict hooks: fxfuse's own OptimizedModules add to and remove from
# them (runtime: rebuild on load_state_dict), also when the garbage collector finalizes an old
# one while another build runs; what forward() computes with is not in them
STATE_DICT_HOOKS = frozenset({"_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                              "_load_state_dict_post_hooks"})


class _Snapshot:
    def __init__(self, model: torch.nn.Module):
        self.modules, seen = [], set()
        runtimes = [name for name, m in model.named_modules() if getattr(type(m), "fxfuse_runtime", False)]
        for name, m in model.named_modules():
            if name in runtimes or isinstance(m, torch.jit.ScriptModule):
                continue   # an fxfuse OptimizedModule inside the model: its counters are not model state;
                #            a TorchScript child runs as one opaque call (its state is not Python's)
            attrs = {k: v for k, v in m.__dict__.items() if k not in ("_buffers", "_parameters", "_modules")}
            # a plain tensor attribute (not a buffer) written in place: torch.fx runs `t += 1` on it
            # at trace time, and the graph holds the changed tensor as a constant
            held = list(_held({k: v for k, v in attrs.items() if k not in STATE_DICT_HOOKS}, _forward_state(m), seen))
            tensors = {k: (v, v.detach().clone()) for kind, k, v in held if kind == "tensor"}
            containers = {k: (v, _contents(v)) for kind, k, v in held if kind == "container"}
            buffers = {k: (b, b.detach().clone() if b is not None else None) for k, b in m._buffers.items()}
            # by value only where torch's own forward writes them (max_norm rescales looked-up rows)
            renorms = isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None
            params = {k: (p, version(p) if p is not None else None,
                          p.detach().clone() if renorms and p is not None else None) for k, p in m._parameters.items()}
            self.modules.append((name or type(m).__name__, m, attrs, buffers, params, dict(m._modules), tensors,
                                 containers))
        # the tensors of the modules held apart, and the data of the model's parameters (a conversion: review49r2)
        self.apart = tensor_slots(modules_held_apart(model), " (held apart)")
        self.datas = parameter_data((name, m) for name, m, *_ in self.modules)
        self.leftovers, self.data_filled = TraceLeftovers(model), set()
        self.written_back = set()   # labels of the attributes the graph writes back (attribute_writes)
        # containers on the model's own classes (`_masks = {}` shared by every instance): a Proxy
        # stored there by the trace would reach every later eager call of the class
        self.class_containers, self.class_values = [], []   # and their plain values (`calls = 0`, which
        #                                                     `type(self).calls += 1` moves: fuzz50d)
        held_classes = [type(v) for _, _, attrs, *_ in self.modules for v in attrs.values()
                        if type(v) not in WEAK_PROXIES and _is_record(v)]   # `type(self.cfg).calls += 1` (review50r2)
        for cls in dict.fromkeys(c for t in (*map(type, model.modules()), *held_classes) for c in t.__mro__):
            if (cls.__module__ or "").startswith(("torch.", "builtins")):   # base classes too (fuzz42h)
                continue
            shared = {k: v for k, v in vars(cls).items() if not k.startswith("__")}
            self.class_containers += [(f"{cls.__name__}.{k}", v, _contents(v))
                                      for kind, k, v in _held(shared, {}, seen) if kind == "container"]
            self.class_values.append((cls, {k: v for k, v in shared.items() if _counted(v)}))
        # the cells of functions the modules hold or their forward()s call (`self.step = make_step()`
        # counting with `nonlocal c`): a count moved by the trace was frozen into the graph (fuzz50d)
        self.cells = [(f"{name}.{k} (closure)", cell, cell.cell_contents) for name, m, attrs, *_ in self.modules
                      for k, fn in _functions(m, attrs) for cell in fn.__closure__ or () if _plain_cell(cell)]

    def drop_proxies(self) -> None:
        """The trace's Proxies and FakeTensors out of the snapshotted containers (a class's
        `_masks["causal"]`), the forward()s' globals and lru caches (trace_leftovers), which verify's
        eager run read: its output was a Proxy, the check empty. Plain values the trace left stay:
        they are how verify sees a container that grows per call (stop 36)."""
        self.leftovers.clean()
        containers = [(c, saved) for _, c, saved in self.class_containers]
        containers += [held for module in self.modules for held in module[7].values()]
        for c, saved in containers:   # what the trace put there: not the user's own fake tensors (review38b)
            target = vars(c) if _is_record(c) else c
            if isinstance(target, dict):   # a Proxy as a key too (`self.seen[x.shape[0]] = True`: review42j)
                for k in [k for k, v in target.items() if (is_trace_value(v) or is_trace_value(k) or _proxy_text(v))
                          and (k not in saved or saved[k] is not v)]:
                    if reads_input_values(target[k]):   # filled from the input's values: state, not a memo
                        self.data_filled.add(id(c))
                    del target[k]
            elif isinstance(target, (list, set, collections.deque)) and any(is_trace_value(v) for v in target):
                kept = {id(v) for v in saved}
                _put_back(target, [v for v in target if not is_trace_value(v) or id(v) in kept])

    def moved_by(self, run) -> None:
        """Run forward() once more where a dict only gained keys so far: a memo stays as it is (its
        keys are there now), a counter or a log moves, and is state (review42e)."""
        candidates = [c for _, c, saved in self.class_containers if _only_memoized(c, saved)]
        candidates += [c for module in self.modules for c, saved in module[7].values() if _only_memoized(c, saved)]
        if candidates:
            before = [_entries(c) for c in candidates]
            try:
                run()
            except Exception:  # noqa: BLE001 -- forward() raised on another call: its dicts are state
                self.data_filled |= {id(c) for c in candidates}
                return
            self.data_filled |= {id(c) for c, entries in zip(candidates, before) if _moved(entries, _entries(c))}

    def restore(self, keep_memos: bool = False) -> list:
        """Put everything back, with keep_memos all but the memos (build_state.kept_state; put
        back by forget_memos); the names of what forward() had changed."""
        changed, kept = [], [] if keep_memos else None
        self.kept_memos = kept if kept is not None else []
        self.leftovers.clean()
        for name, c, saved in self.class_containers:
            _restore_container(name, c, saved, changed, id(c) in self.data_filled, kept)
        for cls, values in self.class_values:
            for k in [k for k, v in vars(cls).items() if _counted(v) and k not in values and not k.startswith("__")]:
                changed.append(f"{cls.__name__}.{k}")
                delattr(cls, k)
            for k, v in values.items():
                if k not in vars(cls) or not same_attr(vars(cls)[k], v):
                    changed.append(f"{cls.__name__}.{k}")
                    setattr(cls, k, v)
        for name, cell, value in self.cells:
            if not _plain_cell(cell) or not same_attr(cell.cell_contents, value):
                changed.append(name)
                cell.cell_contents = value
        for name, m, attrs, buffers, params, modules, tensors, containers in self.modules:
            for k, (c, saved) in containers.items():
                _restore_container(f"{name}.{k}", c, saved, changed, id(c) in self.data_filled, kept)
            for k, (t, saved) in tensors.items():
                if not same_value(t, saved):
                    changed.append(f"{name}.{k}")
                    with torch.inference_mode(t.is_inference()), torch.no_grad():
                        t.copy_(saved)
            for k in [k for k in m.__dict__ if k not in attrs and k not in ("_buffers", "_parameters", "_modules")]:
                if not k.startswith("_tensor_constant") and not _cached(m, k):   # torch.fx's own constants;
                    changed.append(f"{name}.{k}")                                 # a cached_property's cache
                del m.__dict__[k]
            for k, v in attrs.items():
                if k not in m.__dict__ or not same_attr(m.__dict__[k], v):
                    if not (k in RNN_CACHES and isinstance(m, torch.nn.RNNBase)):
                        changed.append(f"{name}.{k}")
                    m.__dict__[k] = v
            for k, (b, saved) in buffers.items():
                if m._buffers.get(k) is not b:
                    changed.append(f"{name}.{k}")
                    m._buffers[k] = b
                if b is not None and not same_value(b, saved):
                    changed.append(f"{name}.{k}")
                    with torch.inference_mode(b.is_inference()), torch.no_grad():
                        b.copy_(saved)
            for k in [k for k in m._buffers if k not in buffers]:
                changed.append(f"{name}.{k}")
                del m._buffers[k]
            for k, (p, v, saved) in params.items():
                if m._parameters.get(k) is not p or (p is not None and v is not None and version(p) != v):
                    changed.append(f"{name}.{k}")
                    m._parameters[k] = p
                if saved is not None and not same_value(p, saved):
                    changed.append(f"{name}.{k}")
                    with torch.inference_mode(p.is_inference()), torch.no_grad():   # inference_mode(False)
                        p.copy_(saved)                                              # turns grad on again
            for k in [k for k in m._parameters if k not in params]:   # registered by forward() (review48r3)
                changed.append(f"{name}.{k}")
                del m._parameters[k]
            if dict(m._modules) != modules or any(m._modules[k] is not v for k, v in modules.items()):
                changed.append(f"{name} (submodules)")
                m._modules.clear()
                m._modules.update(modules)
        changed += data_put_back(self.datas) + tensor_slots_put_back(self.apart)
        return [c for c in dict.fromkeys(changed) if c not in self.written_back]   # put back all the same

    def forget_memos(self) -> None:
        """The memos restore(keep_memos=True) kept, put back too (the build was refused)."""
        for container, saved in self.kept_memos:
            _put_back(container, saved)


DATA_REBINDING = (torch.nn.RNNBase, torch.jit.ScriptModule)   # an RNN's flatten_parameters() may move its weights
#                              into one buffer on CUDA, on a call; a script module's dicts are no dicts (review49r4)


PLAIN_TYPES = (int, float, bool, str, bytes, complex, type(None))


def _plain(v) -> bool:
    """A number, string, flag or None, or a tuple of them: a value forward() may count with."""
    return type(v) in PLAIN_TYPES or type(v) is tuple and len(v) <= 16 and all(type(a) in PLAIN_TYPES for a in v)


def _counted(v) -> bool:
    """A plain value but a flag: a warn-once decorator's `warned` moves once, as in eager (review50r4)."""
    return _plain(v) and type(v) is not bool


def _functions(m, attrs: dict):
    """(name, function) for the functions module m may call: its attributes (also in a dict, list or
    tuple, a functools.partial's, a bound method's), the functions its forward() names as globals,
    forward() itself and its class's static and class methods (review50r2: counters in each)."""
    candidates = [*attrs.items(), *forward_globals(m)[1].items(), ("forward", forward_function(m)),
                  ("forward", getattr(type(m), "forward", None))]   # (a decorator's closure: review50r4)
    candidates += [(k, v) for c in type(m).__mro__ if not (c.__module__ or "").startswith(("torch.", "builtins"))
                   for k, v in vars(c).items() if type(v) in (staticmethod, classmethod)]
    for k, v in candidates:
        if type(v) in WEAK_PROXIES:   # (a dead one raises on any use: review50r2)
            continue
        items = v.values() if isinstance(v, dict) and len(v) <= 64 else v if isinstance(v, (list, tuple)) \
            and len(v) <= 64 else (v,)
        for item in items:
            if type(item) in WEAK_PROXIES:
                continue
            item = item.func if isinstance(item, functools.partial) else item
            item = item.__func__ if isinstance(item, (staticmethod, classmethod, types.MethodType)) else item
            if isinstance(item, types.FunctionType):
                yield k, item


def _plain_cell(cell) -> bool:
    try:
        return _counted(cell.cell_contents)
    except ValueError:   # an empty cell (a name bound later in the enclosing function)
        return False


def tensor_data(named) -> list:
    """(name, tensor, an alias of its data, a parameter's .grad and an alias of that) of the named plain strided
    tensors (sparse, mkldnn, uninitialized ones have no data to compare: review49r4): what a conversion
    (nn.Module._apply: `.half()`, `.to(device)`) replaces, data_put_back's record."""
    saved = []
    for name, t in named:
        if _storage_key(t) is not None:
            grad = t.grad if isinstance(t, torch.nn.Parameter) else None   # (a buffer's .grad warns: a non-leaf)
            saved.append((name, t, t.detach(), grad, grad.detach() if _storage_key(grad) is not None else None))
    return saved


def _storage_key(t):
    """(dtype, device, storage address) of a plain strided tensor, else None."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_meta or t.is_mkldnn \
            or isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        return None
    try:
        return t.dtype, t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # a wrapper subclass with no storage
        return None


def data_put_back(saved: list) -> list:
    """Each tensor's data and .grad as tensor_data saved them, where a conversion replaced them; the names of
    the tensors whose data it had replaced (a conversion converts the .grad in place too: review49r2)."""
    changed = []
    for name, t, data, grad, grad_data in saved:
        if _storage_key(t) != _storage_key(data):
            changed.append(name)
            t.data = data
        if isinstance(t, torch.nn.Parameter) and t.grad is not grad:
            t.grad = grad
        if grad_data is not None and _storage_key(grad) != _storage_key(grad_data):
            grad.data = grad_data
    return changed


def parameter_data(named_modules) -> list:
    """tensor_data of the parameters of (name, module) pairs, RNNs' and script modules' aside."""
    return tensor_data((f"{name}.{k}" if name else k, p) for name, m in named_modules
                       if not isinstance(m, DATA_REBINDING) for k, p in m._parameters.items())


def tensor_slots(named_modules, label: str = "") -> list:
    """(name, module, its _parameters and _buffers entries, their tensor_data) of (name, module) pairs (not
    script modules'; an RNN's data aside): tensor_slots_put_back's record of which tensor objects a module
    holds, and their data; `label` follows each name in what it reports."""
    return [(name, label, m, dict(m._parameters), dict(m._buffers),
             tensor_data((f"{name}.{k}{label}", t) for k, t in (*m._parameters.items(), *m._buffers.items()))
             if not isinstance(m, DATA_REBINDING) else [])
            for name, m in named_modules if not isinstance(m, torch.jit.ScriptModule)]


def tensor_slots_put_back(saved: list) -> list:
    """Each module's parameters and buffers, and their data, as tensor_slots saved them (torch.export's fake
    tensors, a conversion of a module held apart: fuzz49k); the names of what had changed."""
    changed = []
    for name, label, m, params, buffers, data in saved:
        for slots, kept in ((m._parameters, params), (m._buffers, buffers)):
            for k, t in kept.items():
                if slots.get(k, t) is not t:
                    changed.append(f"{name}.{k}{label}")
                    slots[k] = t
        changed += data_put_back(data)
    return changed


def modules_held_apart(model) -> list:
    """(name, module) of the modules the model holds unregistered (a module-level encoder): forward()'s
    `inner.to(x.dtype)` converts them (fuzz49k: the build left them converted, the graph kept the old
    weights as constants and missed later edits)."""
    from .mode_watch import unregistered_modules   # (mode_watch imports module_state, as this module)
    own = {id(m) for m in model.modules()}
    return list({id(m): (name, m) for h in unregistered_modules(model)
                 for name, m in h.named_modules(prefix=type(h).__name__) if id(m) not in own}.values())


def _cached(m: torch.nn.Module, k: str) -> bool:
    """A functools.cached_property filled by the trace with a real value (not a Proxy) that its
    function gives again (not a random draw, a clock, a counter): a memo, emptied again like a
    memo dict; eager fills it anew, with the same value, on its next call."""
    prop = inspect.getattr_static(type(m), k, None)
    if not isinstance(prop, functools.cached_property):
        return False
    value = torch.utils._pytree.tree_leaves(m.__dict__[k])
    if any(isinstance(v, torch.fx.Proxy) for v in value):
        return False
    try:
        with torch.no_grad():
            again = torch.utils._pytree.tree_leaves(prop.func(m))
    except Exception:  # noqa: BLE001 -- it cannot be recomputed here: not known to be a memo
        return False
    return len(again) == len(value) and all(
        same_value(a, v) if isinstance(a, torch.Tensor) and isinstance(v, torch.Tensor) else same_attr(a, v)
        for a, v in zip(again, value))
