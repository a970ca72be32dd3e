"""Which plain attributes of the model a trace may have read, so that assigning one later rebuilds.

Why: a trace bakes the plain attributes forward() reads into the graph (`h * self.scale` holds
the number, `if self.use_bias:` the branch taken), so `model.scale = 2.0` after optimize() must
rebuild (runtime.OptimizedModule). Watching every attribute would also rebuild, on every call,
a model whose user writes bookkeeping onto it between calls (`model.calls = i`), at a build's
cost per call. So the trace notes, by name, what the model's code could have read:
`recording_attribute_reads` collects, through a profile hook on this thread, the code objects
of every function of the model's own code that runs during the trace (forward, helpers,
properties, __getattr__ overrides), and their attribute and global names and string constants
(`getattr(self, "scale")`, `vars(self)["k"]`, attrgetter paths) are the names read. Nothing of
the model changes for it (an earlier recording subclass leaked into class registries and
other threads' pickling). On the model's own classes and the ATTRIBUTE_FREE types the
attributes so named are watched, on the instance and on the class; on torch's other modules,
whose attributes the passes read directly after the trace (a LeakyReLU's slope), all are.
Where a profiler is already installed, nothing is recorded and every attribute is watched.
"""
import contextlib
import operator
import sys

import torch

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


def _names_of(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, str) and len(const) < 200:
            names.add(const)
            names.update(const.split("."))
    return names


@contextlib.contextmanager
def recording_attribute_reads(model: torch.nn.Module):
    """Yields a dict filled when the block ends: {"names": the names the model's code running
    in the block could read}, or {"all": True} (another profiler is installed: watch all)."""
    reads = {}
    if sys.getprofile() is not None:
        reads["all"] = True
        yield reads
        return
    codes = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if not code.co_filename.startswith(LIBRARY_DIRS):
                codes.add(code)

    sys.setprofile(profile)
    try:
        yield reads
    finally:
        sys.setprofile(None)
        reads["names"] = set().union(*map(_names_of, codes))


def merge_reads(into: dict | None, new: dict) -> dict | None:
    """The union of two builds' reads (None: everything is watched)."""
    if into is None or new.get("all") or "names" not in new:
        return None
    into["names"] = into.get("names", set()) | new["names"]
    return into


def _own_class(m) -> bool:
    cls = type(m)
    return not (cls.__module__ or "").startswith("torch.")


def plain_attributes(model: torch.nn.Module, reads: dict | None) -> tuple:
    """Per dict with any to watch: (the dict, an itemgetter of the names, their values now,
    the names) for the plain attributes a rebuild must follow (module docstring), on each
    module's instance dict and, for the model's own classes, on their class dicts; where a
    class attribute is watched, the instance's own entry of that name is watched to stay
    absent. An OptimizedModule inside the model keeps its own watch."""
    names = None if reads is None else reads.get("names")
    out, absent, classes = [], [], set()
    for m in dict.fromkeys(model.modules()):
        if isinstance(m, torch.jit.ScriptModule) or getattr(type(m), "fxfuse_runtime", False):
            continue
        narrowed = names is not None and (_own_class(m) or type(m) in ATTRIBUTE_FREE)
        if not narrowed and type(m) in ATTRIBUTE_FREE:
            continue
        keys = tuple(k for k in m.__dict__ if k not in _MODULE_INTERNALS and not k.startswith("_tensor_constant")
                     and (not narrowed or k in names))
        if keys:
            out.append(_entry(m.__dict__, keys))
        if narrowed and _own_class(m):
            for cls in type(m).__mro__:
                if cls in classes or cls.__module__ is None or cls.__module__.startswith(("torch.", "builtins")):
                    continue
                classes.add(cls)
                class_keys = tuple(k for k in vars(cls) if k in names and not k.startswith("__"))
                if class_keys:
                    out.append(_entry(vars(cls), class_keys))
                    absent += [(m.__dict__, k) for k in class_keys if k not in m.__dict__]
    if absent:
        out.append((None, absent, None, ()))
    return tuple(out)


def _entry(d, keys: tuple) -> tuple:
    get = operator.itemgetter(*keys)
    return d, get, get(d), keys   # one key: the value itself, not a tuple


def watched_values(watched: tuple) -> list:
    return [v for d, _, values, keys in watched if d is not None
            for v in (values if len(keys) > 1 else (values,))]


def reassigned(watched: tuple) -> str | None:
    """The first watched attribute (plain_attributes) no longer the same object or an equal
    value (a float by its repr: -0.0 is not 0.0), or set on an instance where the class's was
    read. Per call: one C-level lookup and identity compare per dict."""
    for d, get, values, keys in watched:
        if d is None:                    # instance entries that must stay absent
            for inst, k in get:
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
