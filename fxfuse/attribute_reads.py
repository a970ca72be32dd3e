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
import dis
import importlib.util
import inspect
import operator
import os
import sys

import torch

from .code_walk import plain_functions
from .fingerprint import DESCRIPTORS, _contents, _contents_changed, _tensors_in
from .mode_watch import LIBRARY_DIRS
from .module_state import WEAK_PROXIES, same_attr

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


PROBES = {"getattr", "hasattr", "vars", "__dict__"}   # code that may look a name up while it is absent
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
    from .trace_checks import tests_identity, held_iterators, refuse_iterators_read   # (they read this module)
    reads, codes, own = {}, set(), class_code(model)
    iterators = held_iterators(model)

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            if code in RNG_SETTERS and _called_by_the_model(frame):
                reads["rng"] = code.co_name
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
        refuse_iterators_read(iterators, None)
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
        files = {c.co_filename for c in own}   # the model's own files and code outside installed packages (a
        reads["tests_identity"] = tests_identity([c for c in codes if c.co_filename in files or "-packages" not in
                                                  c.co_filename])   # utils.py): a library's `is` tests are none
        refuse_iterators_read(iterators, names)


def _rng_setters() -> set:
    """The code of torch's functions that set the random state (and fork_rng's, which restores
    it): the graph draws from the generator as it runs and sets nothing, so a forward() calling
    them is refused (fuzz41a: fork_rng's noise left the caller's generator advanced, silently)."""
    found = set()
    for owner, names in ((torch, ("manual_seed", "seed", "set_rng_state")),
                         (torch.random, ("manual_seed", "seed", "set_rng_state", "fork_rng")),
                         (torch.cuda, ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state",
                                       "set_rng_state_all"))):
        for name in names:
            fn = inspect.unwrap(getattr(owner, name, None) or (lambda: None))
            if getattr(fn, "__code__", None) is not None and name in fn.__code__.co_name:
                found.add(fn.__code__)
    return found


RNG_SETTERS = _rng_setters()
_WRAPPERS = tuple(os.path.join(os.path.dirname(torch.__file__), *p) for p in (("_compile.py",), ("_dynamo", "")))


def _called_by_the_model(frame) -> bool:
    """Whether the model's code (or fork_rng) called frame's function: through torch's own
    wrappers (once torch._dynamo is imported, torch.manual_seed is a disable wrapper of it), not
    by torch itself (torch.export's tracing)."""
    caller = frame.f_back
    for _ in range(4):
        if caller is None or not caller.f_code.co_filename.startswith(_WRAPPERS):
            break
        caller = caller.f_back
    return caller is not None and (caller.f_code in RNG_SETTERS or not _other_code(caller.f_code.co_filename))


def _probed(codes) -> dict:
    """Class qualname ("" for a plain function) -> (the names its code may look up while they are
    absent, the names it reads): string constants of code that calls getattr or hasattr
    (`getattr(self, "temperature", 1.0)`), and its co_names (`self.block` in `hasattr(self.block,
    "scale")`: the child it may probe). A model without such code watches no absent name."""
    def owner(c):   # a helper or generator expression inside forward() belongs to forward's class (fuzz33l)
        return getattr(c, "co_qualname", "").split(".<locals>")[0].rpartition(".")[0]
    probed = {}
    for c in codes:
        if PROBES & set(c.co_names):
            probed.setdefault(owner(c), (set(), set()))[0].update(
                s for k in c.co_consts for s in _strings(k) if s.isidentifier())
        if "AttributeError" in c.co_names:   # `try: t = self.temperature / except AttributeError:` (fuzz41f)
            probed.setdefault(owner(c), (set(), set()))[0].update(_self_attributes(c))
    for c in codes:   # what the owner's code names, the probing part or not (`for b in self.blocks`)
        if owner(c) in probed:
            probed[owner(c)][1].update(c.co_names)
    return probed


def _self_attributes(code) -> set:
    """The attributes code reads off its local variables and chains of them (`self.temperature`,
    `self.block.temperature`, `blk.temperature` in a loop): what a `try/except AttributeError` may
    look up while absent (all its names were 345 watches for 12 blocks: review41; not its globals'
    attributes, `torch.relu`)."""
    found, rooted = set(), False
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and rooted:
            found.add(ins.argval)
            continue
        rooted = ins.opname in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_FAST_LOAD_FAST")
    return found


def _generated(name: str) -> bool:
    return name in ("<module>", "__create_fn__", "_") or (name.startswith("__") and name.endswith("__"))


def class_code(model: torch.nn.Module) -> set:
    """The code objects of the functions and properties defined on the model's own classes."""
    found = set()
    for cls in {c for m in model.modules() for c in _classes(m) if not _torch_class(c)}:
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
    code_names = into.get("code_names", set()) | new.get("code_names", set())   # (the deeper watch's filter)
    if into.get("all") or new.get("all") or "names" not in new:
        return {"all": True, "probed": probed, "code_names": code_names}
    return {"names": into.get("names", set()) | new["names"], "probed": probed, "code_names": code_names}


def _torch_class(cls) -> bool:
    return (cls.__module__ or "").startswith("torch.")


def _classes(m) -> tuple:
    """m's classes but nn.Module and object, wherever a mixin puts them (`class Net(nn.Module,
    HubMixin)`: the MRO does not end in (Module, object), fuzz41f)."""
    return tuple(c for c in type(m).__mro__ if c is not torch.nn.Module and c is not object)


def _own_class(m) -> bool:
    """The model's own class, all the way down: a subclass of a torch module (`class
    MyLeaky(nn.LeakyReLU)`) runs torch's forward, which reads attributes no hook sees."""
    return not any(map(_torch_class, _classes(m)))


def _user_classes(m) -> tuple:
    return tuple(c for c in _classes(m) if not _torch_class(c))


def plain_attributes(model: torch.nn.Module, reads: dict | None, written: frozenset = frozenset()) -> tuple:
    """Per dict with any to watch: (the dict, an itemgetter of the names, their values now,
    the names) for the plain attributes a rebuild must follow (module docstring), on each
    module's instance dict and, for the model's own classes, on their class dicts; where a
    class attribute is watched, the instance's own entry of that name is watched to stay
    absent. An OptimizedModule inside the model keeps its own watch. `written`: (id(module), name)
    of the attributes the graph itself assigns each call (attribute_writes): not watched."""
    names = None if reads is None or reads.get("all") else reads.get("names")
    # what the model's code names, also where it reads by computed names: the items one level down
    # that the per-call contents watch compares by value (review41: a tokenizer's vocabulary, a
    # stats dict the training loop bumps, rebuilt the graph on every call)
    deeper = (reads or {}).get("code_names") if names is None else names
    probed = {} if reads is None else reads.get("probed", {})
    out, absent, classes, contents = [], [], {}, []
    for m in dict.fromkeys(model.modules()):
        if isinstance(m, torch.jit.ScriptModule) or getattr(type(m), "fxfuse_runtime", False):
            continue
        # a name the model's code may look up while it is absent (getattr / hasattr), set after
        # optimize() on the instance or a class (fuzz33e): on the modules of the classes whose
        # code looks it up and on the children that code names (`hasattr(self.block, "scale")`,
        # review33), each class once (review33b: 245 dicts a call for a 123-module model otherwise)
        # (a subclass of a torch module: what its own methods look up, fuzz41f)
        own = _own_class(m)
        for owner in ("",) * own + tuple(c.__qualname__ for c in _user_classes(m)) if probed else ():
            looked_up, refs = probed.get(owner, ((), ()))
            targets = [m] + _named_children(m, refs)
            for t in targets:
                missing = [k for k in looked_up if k not in t.__dict__ and not _defined(t, k)]
                absent += [(t, k) for k in missing] + [(c, k) for k in missing for c in _classes(t)]
        narrowed = names is not None and (own or type(m) in ATTRIBUTE_FREE)
        # a plain tensor on an ATTRIBUTE_FREE module is its input all the same: a Linear whose
        # weight is `del lin.weight; lin.weight = t` (fast weights: MAML, test-time adaptation;
        # folded or copied into kernels, it went stale: fuzz35d)
        free = type(m) in ATTRIBUTE_FREE
        keys = tuple(k for k, v in m.__dict__.items()
                     if k not in _MODULE_INTERNALS and not k.startswith("_tensor_constant") and (id(m), k) not in written
                     and (free and type(v) not in WEAK_PROXIES and isinstance(v, torch.Tensor)
                          or (k in names if narrowed else True)))   # every attribute where the code
        #                                 reads by computed names, a Linear's and a ReLU's too (fuzz50d)
        if keys:
            out.append(_entry(m.__dict__, keys))
            contents += [(k, m.__dict__[k]) for k in keys]
        # its class attributes too (`Net.temperature = 0.5`); a torch module's subclass: those of the
        # user's classes its code names (`class ScaledLinear(nn.Linear): scale = 2.0`, fuzz41f, review41)
        mro = _classes(m) if own else _user_classes(m)
        for i, cls in enumerate(mro):
            if cls not in classes:
                classes[cls] = tuple(k for k in vars(cls) if (k in names if names is not None else deeper is None
                                                              or own or k in deeper) and not k.startswith("__"))
                if classes[cls]:
                    out.append(_entry(vars(cls), classes[cls]))
                    contents += [(k, v) for k in classes[cls] if not isinstance(v := vars(cls)[k], DESCRIPTORS)]
            # on every module of the class (`blocks[2].scale = 3.0` shadows `Block.scale`, fuzz50d: each
            # class's first module only, before), and on the subclasses before it: `Sub.scale = 5.0`
            # shadows `A.scale` (fuzz34h), also where an A came first (fuzz50d)
            absent += [(m, k) for k in classes[cls] if k not in m.__dict__ and (id(m), k) not in written]
            absent += [(c, k) for c in mro[:i] for k in classes[cls] if k not in vars(c)]
    if absent:   # grouped by owner (a module or a class)
        grouped = {}
        for owner, k in absent:
            grouped.setdefault(id(owner), (owner.__dict__, set()))[1].add(k)
        out.append((None, tuple((d, tuple(keys)) for d, keys in grouped.values()), None, ()))
    unique = {id(value): (k, value) for k, value in contents}.values()   # a config shared by 48 layers: once
    snapshots = tuple((value, snap, k, (names, deeper)) for k, value in unique
                      if (snap := _contents(value, names, deeper)) is not None)
    if snapshots:
        out.append((CONTENTS, snapshots, None, ()))
    return tuple(out)


CONTENTS = "contents"   # marks the entry of plain_attributes whose containers are watched item by item
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
            for v in (values if len(keys) > 1 else (values,)) if type(v) not in WEAK_PROXIES]   # (by identity)


def contained_tensors(watched: tuple) -> list:
    """The tensors in watched containers (a dict or list attribute the model's code reads): their
    requires_grad flag counts for the grad rule (fuzz35d: set after optimize, the gradient was
    missing). All of them: the graph may read one through a view or a copy made at optimize time
    (review35c: matching the graph's constants by identity missed `cfg["W"].t()`). Not watched by
    version: the graph reads them live, or a copy the version watch of copies covers."""
    return [t for d, get, _, _ in watched if d is CONTENTS for _, snap, _, _ in get for t in _tensors_in(snap)]


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
