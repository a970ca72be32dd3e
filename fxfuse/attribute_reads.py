"""Which plain attributes of the model a trace may have read, so that assigning one later rebuilds.

Why: a trace bakes the plain attributes forward() reads into the graph (`h * self.scale` holds
the number, `if self.use_bias:` the branch taken), so `model.scale = 2.0` after optimize() must
rebuild (runtime.OptimizedModule). Watching every attribute would also rebuild, on every call,
a model whose user writes bookkeeping onto it between calls (`model.calls = i`), at a build's
cost per call. So the trace notes, by name, what the model's code could have read:
`recording_attribute_reads` collects, through a profile hook on this thread, the code objects
of every function of the model's own code that runs during the trace (forward, helpers,
properties, __getattr__ overrides), and their attribute and global names and string constants
(`self.scale`, `"scale"`, names in tuple constants) are the names read; code that reads by
computed names (getattr, vars, __dict__: DYNAMIC) has every attribute watched. The standard
library, the libraries torch brings and code they generate from strings do not count as the
model's. Nothing of the model changes for it (an earlier recording subclass leaked into class
registries and other threads' pickling). On the model's own classes and the ATTRIBUTE_FREE
types the attributes so named are watched, on the instance and on the class; on torch's other
modules, whose attributes the passes read directly after the trace (a LeakyReLU's slope), and
subclasses running torch's forward, all are. Under a profiler the hook is a trace function
that fires on calls only; with both a profiler and a tracer on, every attribute is watched.
"""
import contextlib
import importlib.util
import inspect
import operator
import os
import sys

import torch

from .code_walk import plain_functions
from .mode_watch import LIBRARY_DIRS
from .module_state import same_attr

ATTRIBUTE_FREE = {torch.nn.Linear, torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Identity,
                  torch.nn.ReLU, torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.SiLU, torch.nn.Mish, torch.nn.Hardswish,
                  torch.nn.Hardsigmoid, torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d,
                  torch.nn.Dropout3d, torch.nn.AlphaDropout}
# ^ module types whose own forward reads no plain attribute that changes its result (ReLU's
#   `inplace`, Dropout's `p` in eval mode): only what the model's code reads of them is watched
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_MISSING = object()


def _other_code_prefixes() -> tuple:
    """Code that runs during a trace but is not the model's: the libraries torch and fxfuse
    bring (their names would make common attribute names such as `name` or `cache` look
    read); the standard library is told apart in _other_code."""
    found = []
    for name in ("sympy", "numpy", "triton", "networkx", "tabulate", "typing_extensions", "mpmath", "filelock",
                 "fsspec", "jinja2", "markupsafe", "packaging", "_pytest", "pluggy", "importlib_metadata"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin:   # a package's folder, or a one-file module itself
            found.append(os.path.join(os.path.dirname(spec.origin), "") if spec.submodule_search_locations
                         else spec.origin)
    return LIBRARY_DIRS + tuple(found) + ("<frozen", "<eval_with_key")


OTHER_CODE = _other_code_prefixes()
STDLIB = os.path.join(os.path.dirname(os.__file__), "")


def _other_code(filename: str) -> bool:
    return filename.startswith(OTHER_CODE) or (filename.startswith(STDLIB) and "-packages" not in filename)


DYNAMIC = {"getattr", "vars", "__dict__", "attrgetter", "getattr_static", "__getattribute__", "asdict", "astuple"}
# ^ a model's code using one of these may read attributes by computed names: watch them all (dataclasses'
# asdict / astuple read every field in the standard library's code, which does not count: review39b)


def _strings(const):
    if isinstance(const, str):
        if len(const) < 200:
            yield const
            yield from const.split(".")
    elif isinstance(const, (tuple, frozenset)):
        for c in const:
            yield from _strings(c)


def _names_of(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        names.update(_strings(const))
    return names


@contextlib.contextmanager
def recording_attribute_reads(model: torch.nn.Module):
    """Yields a dict filled when the block ends: {"names": the names the model's code running
    in the block could read}, or {"all": True}: that code reads attributes by computed names
    (DYNAMIC), or both a profiler and a tracer are installed (no hook left to use)."""
    reads, codes, own = {}, set(), class_code(model)

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            # code compiled from a string counts, except what libraries generate that way: the
            # exec'd wrappers (`<module>`, dataclasses' `__create_fn__`) and the dunder methods
            # they make (a dataclass's __init__/__eq__), unless a method of the model's classes
            if not _other_code(name) and (not name.startswith("<") or code in own or not _generated(code.co_name)):
                codes.add(code)

    if sys.getprofile() is None:   # this thread's only: builds run in the calling thread
        install, remove = (lambda: sys.setprofile(hook)), (lambda: sys.setprofile(None))
    elif sys.gettrace() is None:   # a profiler is on (cProfile): a trace hook that traces no lines
        install, remove = (lambda: sys.settrace(hook)), (lambda: sys.settrace(None))
    else:
        reads["all"] = True
        yield reads
        return
    install()
    try:
        yield reads
    finally:
        remove()
        names = set().union(*map(_names_of, codes))
        reads["code_names"] = names   # also where every attribute is watched (tracing._checks_tensor_type)
        if names & DYNAMIC:
            reads["all"] = True
        else:
            reads["names"] = names
        reads["probed"] = _probed(codes)


def _probed(codes) -> dict:
    """Class qualname ("" for a plain function) -> (the names its code may look up while they are
    absent, the names it reads): string constants of code that calls getattr or hasattr
    (`getattr(self, "temperature", 1.0)`), and its co_names (`self.block` in `hasattr(self.block,
    "scale")`: the child it may probe). A model without such code watches no absent name."""
    def owner(c):   # a helper or generator expression inside forward() belongs to forward's class (fuzz33l)
        return getattr(c, "co_qualname", "").split(".<locals>")[0].rpartition(".")[0]
    probed = {}
    for c in codes:
        if "getattr" in c.co_names or "hasattr" in c.co_names:
            probed.setdefault(owner(c), (set(), set()))[0].update(
                s for k in c.co_consts for s in _strings(k) if s.isidentifier())
    for c in codes:   # what the owner's code names, the probing part or not (`for b in self.blocks`)
        if owner(c) in probed:
            probed[owner(c)][1].update(c.co_names)
    return probed


def _generated(name: str) -> bool:
    return name in ("<module>", "__create_fn__", "_") or (name.startswith("__") and name.endswith("__"))


def class_code(model: torch.nn.Module) -> set:
    """The code objects of the functions and properties defined on the model's own classes."""
    found = set()
    for cls in {c for m in model.modules() for c in type(m).__mro__[:-2] if not _torch_class(c)}:
        for value in list(vars(cls).values()):
            found.update(fn.__code__ for fn in plain_functions(value))
    return found


INPLACE_FLAGGED = (torch.nn.ReLU, torch.nn.SiLU, torch.nn.Mish, torch.nn.Hardswish, torch.nn.Hardsigmoid)


def note_inplace_flags(gm, reads: dict) -> None:
    """ATTRIBUTE_FREE activations' `inplace` changes no result, but where one is applied to a
    tensor the caller sees (an input, a parameter, a view of one), setting it after optimize()
    makes eager write into that tensor: watch the name then (fuzz34h). Found by the node's
    module: a call_module node (symbolic_trace), else export's nn_module_stack."""
    from .state_writes import VIEW_FUNCTIONS, VIEW_METHODS
    if reads.get("all") or "names" not in reads:
        return
    kinds = {cls.__name__ for cls in INPLACE_FLAGGED}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            kind = type(gm.get_submodule(n.target)).__name__
        else:
            stack = list((n.meta.get("nn_module_stack") or {}).values())
            kind = str(getattr(stack[-1][1], "__name__", stack[-1][1])).rsplit(".", 1)[-1] if stack else None
        if kind not in kinds or not n.args:
            continue
        a = n.args[0]
        while isinstance(a, torch.fx.Node) and a.args and (
                a.op == "call_method" and a.target in VIEW_METHODS or a.op == "call_function" and (
                a.target in VIEW_FUNCTIONS or getattr(a.target, "is_view", False))):
            a = a.args[0]
        if isinstance(a, torch.fx.Node) and a.op in ("placeholder", "get_attr"):
            reads["names"].add("inplace")
            return


def merge_reads(into: dict, new: dict) -> dict:
    """The union of two builds' reads ({"all": True}: every attribute is watched); "probed": the
    string constants that name an attribute (`getattr(self, "temperature", 1.0)`, `hasattr(self,
    "shift")`), which may be read while absent."""
    probed = {}
    for part in (into.get("probed", {}), new.get("probed", {})):
        for owner, (names, refs) in part.items():
            have = probed.setdefault(owner, (set(), set()))
            have[0].update(names)
            have[1].update(refs)
    if into.get("all") or new.get("all") or "names" not in new:
        return {"all": True, "probed": probed}
    return {"names": into.get("names", set()) | new["names"], "probed": probed}


def _torch_class(cls) -> bool:
    return (cls.__module__ or "").startswith("torch.")


def _own_class(m) -> bool:
    """The model's own class, all the way down: a subclass of a torch module (`class
    MyLeaky(nn.LeakyReLU)`) runs torch's forward, which reads attributes no hook sees."""
    return not any(map(_torch_class, type(m).__mro__[:-2]))


def plain_attributes(model: torch.nn.Module, reads: dict | None) -> tuple:
    """Per dict with any to watch: (the dict, an itemgetter of the names, their values now,
    the names) for the plain attributes a rebuild must follow (module docstring), on each
    module's instance dict and, for the model's own classes, on their class dicts; where a
    class attribute is watched, the instance's own entry of that name is watched to stay
    absent. An OptimizedModule inside the model keeps its own watch."""
    names = None if reads is None or reads.get("all") else reads.get("names")
    probed = {} if reads is None else reads.get("probed", {})
    out, absent, classes, contents = [], [], set(), []
    for m in dict.fromkeys(model.modules()):
        if isinstance(m, torch.jit.ScriptModule) or getattr(type(m), "fxfuse_runtime", False):
            continue
        # a name the model's code may look up while it is absent (getattr / hasattr), set after
        # optimize() on the instance or a class (fuzz33e): on the modules of the classes whose
        # code looks it up and on the children that code names (`hasattr(self.block, "scale")`,
        # review33), each class once (review33b: 245 dicts a call for a 123-module model otherwise)
        for owner in ("", *(c.__qualname__ for c in type(m).__mro__[:-2])) if probed and _own_class(m) else ():
            looked_up, refs = probed.get(owner, ((), ()))
            targets = [m] + _named_children(m, refs)
            for t in targets:
                missing = [k for k in looked_up if k not in t.__dict__ and not _defined(t, k)]
                absent += [(t, k) for k in missing] + [(c, k) for k in missing for c in type(t).__mro__[:-2]]
        narrowed = names is not None and (_own_class(m) or type(m) in ATTRIBUTE_FREE)
        # a plain tensor on an ATTRIBUTE_FREE module is its input all the same: a Linear whose
        # weight is `del lin.weight; lin.weight = t` (fast weights: MAML, test-time adaptation;
        # folded or copied into kernels, it went stale: fuzz35d)
        free = type(m) in ATTRIBUTE_FREE
        keys = tuple(k for k, v in m.__dict__.items()
                     if k not in _MODULE_INTERNALS and not k.startswith("_tensor_constant")
                     and (free and isinstance(v, torch.Tensor) or (k in names if narrowed else not free)))
        if keys:
            out.append(_entry(m.__dict__, keys))
            contents += [(k, m.__dict__[k]) for k in keys]
        if _own_class(m):   # its class attributes too (`Net.temperature = 0.5`)
            mro = type(m).__mro__[:-2]
            for i, cls in enumerate(mro):
                if cls in classes:
                    continue
                classes.add(cls)
                class_keys = tuple(k for k in vars(cls) if (names is None or k in names) and not k.startswith("__"))
                if class_keys:
                    out.append(_entry(vars(cls), class_keys))
                    absent += [(m, k) for k in class_keys if k not in m.__dict__]
                    # and on the subclasses before it: `Sub.scale = 5.0` shadows `A.scale` (fuzz34h)
                    absent += [(c, k) for c in mro[:i] for k in class_keys if k not in vars(c)]
    if absent:   # grouped by owner (a module or a class)
        grouped = {}
        for owner, k in absent:
            grouped.setdefault(id(owner), (owner.__dict__, set()))[1].add(k)
        out.append((None, tuple((d, tuple(keys)) for d, keys in grouped.values()), None, ()))
    unique = {id(value): (k, value) for k, value in contents}.values()   # a config shared by 48 layers: once
    snapshots = tuple((value, snap, k, names) for k, value in unique if (snap := _contents(value, names)) is not None)
    if snapshots:
        out.append((CONTENTS, snapshots, None, ()))
    return tuple(out)


CONTENTS = "contents"   # marks the entry of plain_attributes whose containers are watched item by item
MAX_WATCHED_ITEMS = 256


def _contents(value, names=None):
    """A shallow snapshot of a list, dict or set the model's code reads, or of a plain object's
    attributes (a config namespace or dataclass), else None: an item appended or an attribute
    set in place (peft's LoRA merge appends to `merged_adapters`, which forward() branches on:
    fuzz34g; `self.config.scale = 2`) rebuilds. Shallow: a container inside one is compared by
    identity."""
    if isinstance(value, (list, dict, set)) and len(value) > MAX_WATCHED_ITEMS:
        return None   # compared per call: a 10^5-entry dict cost 12-27 ms a call (fuzz34i); not watched
    if isinstance(value, set):
        return frozenset(value)
    if isinstance(value, (list, dict)):
        return _items(value)
    if isinstance(value, (torch.nn.Module, torch.Tensor, type)) or callable(value) or inspect.ismodule(value):
        return None
    return _items(value, names) if type(getattr(value, "__dict__", None)) is dict else None


def _items(value, names=None) -> tuple:
    """A list's items, a dict's keys and values (interleaved), an object's attribute names and
    values: those the model's code may read (`names`; review34: `state.step += 1` each call, never
    read by forward, rebuilt the graph per call)."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return tuple(x for item in value.items() for x in item)
    return tuple(x for k, v in vars(value).items() if names is None or k in names for x in (k, v))


def _contents_changed(value, snap, names=None) -> bool:
    if isinstance(value, set):
        return frozenset(value) != snap
    now = _items(value, names)
    return len(now) != len(snap) or not all(a is b or same_attr(a, b) for a, b in zip(now, snap))


CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def _named_children(m, refs, depth: int = 0) -> list:
    """The modules below m that code reading `refs` may probe: the children it names
    (`self.block`), and theirs down the names it reads (`self.block.inner`, review33c), all of
    them where it walks `self.children()`/`modules()`, and the elements of a named container
    (`for b in self.blocks: hasattr(b, "gamma")`, fuzz33l)."""
    every = bool({"children", "named_children", "modules", "named_modules"} & set(refs))
    out = []
    for name, child in m._modules.items():
        if child is not None and (every or name in refs):
            out.append(child)
            if isinstance(child, CONTAINERS):
                out += [c for c in child._modules.values() if c is not None]
            if depth < 8:
                out += _named_children(child, refs, depth + 1) if not every else []
    return out


def _defined(m, name: str) -> bool:
    """A parameter, buffer, submodule or class attribute of that name (no property runs)."""
    return name in m._parameters or name in m._buffers or name in m._modules or any(
        name in vars(c) for c in type(m).__mro__)


def _entry(d, keys: tuple) -> tuple:
    get = operator.itemgetter(*keys)
    return d, get, get(d), keys   # one key: the value itself, not a tuple


def watched_values(watched: tuple) -> list:
    return [v for d, _, values, keys in watched if d is not None and d is not CONTENTS
            for v in (values if len(keys) > 1 else (values,))]


def contained_tensors(watched: tuple) -> list:
    """The tensors in watched containers (a dict or list attribute the model's code reads): their
    requires_grad flag counts for the grad rule (fuzz35d: set after optimize, the gradient was
    missing). All of them: the graph may read one through a view or a copy made at optimize time
    (review35c: matching the graph's constants by identity missed `cfg["W"].t()`). Not watched by
    version: the graph reads them live, or a copy the version watch of copies covers."""
    return [item for d, get, _, _ in watched if d is CONTENTS for _, snap, _, _ in get for item in snap
            if isinstance(item, torch.Tensor)]


def reassigned(watched: tuple) -> str | None:
    """The first watched attribute (plain_attributes) no longer the same object or an equal
    value (a float by its repr: -0.0 is not 0.0), or set on an instance where the class's was
    read. Per call: one C-level lookup and identity compare per dict."""
    for d, get, values, keys in watched:
        if d is CONTENTS:
            for value, snap, k, names in get:
                if _contents_changed(value, snap, names):
                    return k
            continue
        if d is None:                    # entries that must stay absent, by dict: each name looked up (a
            for inst, keys in get:       # size check missed `del m.a; m.probed = 1` between calls: fuzz33n)
                for k in keys:
                    if k in inst:
                        return k
            continue
        try:
            now = get(d)
        except KeyError:                 # deleted
            return next(k for k in keys if k not in d)
        if now is values if len(keys) == 1 else all(map(operator.is_, now, values)):   # the usual case
            continue
        now, values = (now, values) if len(keys) > 1 else ((now,), (values,))
        for k, v, w in zip(keys, now, values):
            if v is not w and not same_attr(v, w):
                return k
    return None
