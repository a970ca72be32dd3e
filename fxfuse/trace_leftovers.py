"""Values of a trace left in the user's Python state, taken out again.

Why: forward() may store what it computes outside the model: a module-level global filled on
the first call (`global _MASK; if _MASK is None: _MASK = ...`), or a functools.lru_cache helper
that builds a table or a causal mask per length. Traced, those hold a torch.fx Proxy or one of
torch.export's FakeTensors; left there, the eager model computed with them afterwards (it
returned a Proxy or a FakeTensor), later builds failed, and the check against eager failed on
them ("DataDependentOutputException: aten.equal", fuzz38e). The globals of every forward() of
the model and the lru caches among them and on the model's classes are noted before the build;
after the trace (and after the build) a global holding a trace value gets its old value back
(or goes, if it is new), and a cache that grew is cleared: the helper computes again on its
next call, which is all a cache promises.
"""
import functools
import types

import torch

from .code_walk import global_names, nested_code, plain_functions, user_module
from .module_state import WEAK_PROXIES, forward_function

_NEW = object()   # a name the build added

# functools.lru_cache's wrapper type (CPython's C one; a pure-Python functools has a function there)
LRU_CACHE = functools._lru_cache_wrapper if isinstance(getattr(functools, "_lru_cache_wrapper", None), type) else ()


def _stored_with(namespace: dict, names: set) -> set:
    """The globals that a function of this namespace (or a method of a class defined there, under
    its decorators) assigns in the same code as one of `names` (STORE_GLOBAL)."""
    candidates = list(namespace.values())
    candidates += [a for cls in list(namespace.values()) if isinstance(cls, type)
                   and cls.__module__ == namespace.get("__name__") for a in list(vars(cls).values())]
    found = set()
    for fn in [f for a in candidates for f in plain_functions(a) if f.__globals__ is namespace]:
        for code in nested_code(fn.__code__):
            stored = global_names(code, "STORE_GLOBAL")
            if stored & names:
                found |= stored
    return found


def is_trace_value(value) -> bool:
    """A torch.fx Proxy or a FakeTensor of torch.export's trace."""
    from torch._subclasses.fake_tensor import FakeTensor   # torch-internal: imported where used
    if type(value) in WEAK_PROXIES:   # isinstance() on a dead weakref.proxy raises (review41d)
        return False
    return isinstance(value, (torch.fx.Proxy, FakeTensor))


def _own_code(owner) -> bool:
    return not (getattr(owner, "__module__", None) or "").startswith("torch.")


def _namespace_of(value) -> dict | None:
    """The module namespace of a module object or a plain function, where it is the user's code
    (code_walk.user_module)."""
    if type(value) in WEAK_PROXIES:   # isinstance() on a dead one raises (review42f)
        return None
    if isinstance(value, types.ModuleType):
        name, namespace = value.__name__, vars(value)
    elif isinstance(value, types.FunctionType):
        name, namespace = value.__module__ or "", value.__globals__
    else:
        return None
    return namespace if user_module(name) else None


class TraceLeftovers:
    def __init__(self, model: torch.nn.Module):
        self.namespaces, self.caches, self.defaults = {}, {}, {}
        for m in model.modules():
            if not _own_code(type(m)):
                continue
            namespace = getattr(forward_function(m), "__globals__", None)
            if isinstance(namespace, dict) and self._note_namespace(namespace):
                for value in list(namespace.values()):   # helper modules and functions it names (review38b:
                    self._note_namespace(_namespace_of(value))   # `helpers.table(n)`, an imported helper's global)
            for cls in type(m).__mro__:
                if _own_code(cls):
                    for value in list(vars(cls).values()):
                        self._note_cache(value)
                        for fn in plain_functions(value):   # a memo default (`cache={}`: review39d's
                            self._note_defaults(fn)          # FakeTensor stayed in it)
        for _, saved in list(self.namespaces.values()):
            for value in saved.values():
                self._note_cache(value)
                if type(value) not in WEAK_PROXIES and isinstance(value, types.FunctionType) \
                        and _namespace_of(value) is not None:
                    self._note_defaults(value)   # a helper's memo default

    def _note_defaults(self, fn) -> None:
        for value in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            if isinstance(value, (dict, list)) and id(value) not in self.defaults:
                self.defaults[id(value)] = (value, dict(value) if isinstance(value, dict) else list(value))

    def _note_namespace(self, namespace) -> bool:
        if not isinstance(namespace, dict) or id(namespace) in self.namespaces:
            return False
        self.namespaces[id(namespace)] = (namespace, dict(namespace))
        return True

    def _note_cache(self, value) -> None:
        if type(value) in WEAK_PROXIES:   # isinstance() on a dead one raises (review42f)
            return
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, LRU_CACHE) and id(value) not in self.caches:   # no getattr on arbitrary objects:
            self.caches[id(value)] = (value, value.cache_info().currsize)    # some raise KeyError (fuzz35d's test)

    def clean(self) -> None:
        """A global the build left holding a trace value gets its old value back, and so do the
        globals the same code assigns with it (`_MASK, _LEN = build(n), n`: the length stayed and
        the mask went back; review38c); others stay (another thread's counter: review38d)."""
        for namespace, saved in self.namespaces.values():
            changed = {name for name, value in list(namespace.items()) if value is not saved.get(name, _NEW)}
            traced = {name for name in changed if is_trace_value(namespace[name])}   # the user's own fake
            if not traced:                                                           # tensors stay
                continue
            for name in traced | (changed & _stored_with(namespace, traced)):
                if name in saved:
                    namespace[name] = saved[name]
                else:
                    namespace.pop(name, None)
        for function, size in self.caches.values():
            if function.cache_info().currsize != size:
                function.cache_clear()
        for container, saved in self.defaults.values():   # trace values the build put into a default
            if isinstance(container, dict):
                for key in [k for k, v in container.items() if is_trace_value(v) and saved.get(k, _NEW) is not v]:
                    del container[key]
            elif any(is_trace_value(v) for v in container):
                kept = {id(v) for v in saved}
                container[:] = [v for v in container if not is_trace_value(v) or id(v) in kept]


METADATA_ATTRIBUTES = {"shape", "device", "dtype", "ndim", "is_cuda", "layout", "requires_grad"}
METADATA_METHODS = {"size", "dim", "numel", "stride", "get_device", "is_contiguous", "type", "is_floating_point",
                    "is_complex", "is_signed", "element_size", "ndimension", "nelement", "storage_offset",
                    "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}   # their self: metadata only
METADATA_FUNCTIONS = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}


def reads_input_values(value) -> bool:
    """Whether a Proxy the trace stored (a memo entry) was computed from an input's values, not only
    from shapes, dtypes and devices: a dict memo filled from the first call's data (ActNorm's
    init, `self.init["loc"] = -x.mean(0)`) is state, which the graph would recompute on every call
    (review39d). So is one drawn from a random number generator (`self.cache["noise"] =
    torch.randn(...)`): eager keeps the first draw, the graph would draw again on every call. A
    FakeTensor of torch.export's trace carries no graph: not known (False)."""
    if not isinstance(value, torch.fx.Proxy):
        return False
    return node_reads_input_values(value.node, getattr(value.tracer, "root", None))


def node_reads_input_values(node: torch.fx.Node, root=None) -> bool:
    """reads_input_values of a node (root: the traced module, for its submodules' kinds)."""
    from .graph_launch import draws_random   # (torch-heavy imports: late)
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or (root is not None or n.op != "call_module") and draws_random(root, n) \
                and not _dropout_off(root, n):
            return True
        metadata_of_first = (n.op == "call_method" and n.target in METADATA_METHODS
                             or n.op == "call_function" and n.target in METADATA_FUNCTIONS)
        if n.op == "call_function" and n.target is getattr and n.args[1:2] and n.args[1] in METADATA_ATTRIBUTES:
            continue
        stack += [a for a in n.all_input_nodes if not (metadata_of_first and n.args and a is n.args[0])]
    return False


def _dropout_off(root, n) -> bool:
    """A dropout that draws nothing: a module in eval mode, or F.dropout(training=False) or p=0
    (a memo computed through one in eval is no random draw: review40)."""
    from fxfuse.passes.spellings import DROPOUT_FUNCTIONS, DROPOUT_MODULES   # passes import fxfuse: late
    if n.op == "call_module":
        m = root.get_submodule(n.target) if root is not None else None
        return isinstance(m, DROPOUT_MODULES) and not m.training
    if n.op == "call_function" and n.target in DROPOUT_FUNCTIONS:
        k = DROPOUT_FUNCTIONS[n.target]
        training = n.kwargs.get("training", n.kwargs.get("train", n.args[k] if len(n.args) > k else True))
        return training is False or n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5) == 0
    return False
