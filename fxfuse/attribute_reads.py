"""Which plain attributes of the model a trace read, so that assigning one later rebuilds.

Why: a trace bakes the plain attributes forward() reads into the graph (`h * self.scale` holds
the number, `if self.use_bias:` the branch taken), so `model.scale = 2.0` after optimize() must
rebuild (runtime.OptimizedModule). Watching every attribute would also rebuild, on every call,
a model whose user writes bookkeeping onto it between calls (`model.calls = i`), at a build's
cost per call. So for the model's own classes the trace records what it reads:
`recording_attribute_reads` gives each such module, for the trace only, a subclass of its class
whose __getattribute__ notes the instance attributes read (helpers and properties included).
torch's own modules are leaves of the trace whose attributes the passes read directly (a
LeakyReLU's slope); there everything but the ATTRIBUTE_FREE types' is watched. Where the
recording cannot be trusted (a class with __slots__, forward() reading self.__dict__, an
instance the recording does not know), every attribute of that module is watched.
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
# ^ module types whose forward reads no plain attribute that changes its result (ReLU's
#   `inplace`, Dropout's `p` in eval mode): assigning one after optimize() needs no rebuild
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_MISSING = object()
ALL = None            # a module's entry in the reads: watch every attribute
_RECORDING: dict = {}  # id(module) -> the set its reads go into, while a trace records
_SUBCLASSES: dict = {}


def _recording_subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        def __getattribute__(self, name):
            d = object.__getattribute__(self, "__dict__")
            if name in d or name == "__dict__":
                reads = _RECORDING.get(id(self), _MISSING)
                if reads is _MISSING:       # a copy made during the trace: nothing can be trusted
                    _RECORDING["unknown"] = True
                elif reads is not ALL:
                    if name == "__dict__":   # the model's vars(self), self.__dict__[k]: any attribute may be
                        if not sys._getframe(1).f_code.co_filename.startswith(LIBRARY_DIRS):   # read (torch.fx
                            _RECORDING[id(self)] = ALL                                        # walks it itself)
                    else:
                        reads.add(name)
            return super(sub, self).__getattribute__(name)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _SUBCLASSES[cls] = sub
    return _SUBCLASSES[cls]


def _records(m: torch.nn.Module) -> bool:
    cls = type(m)
    return not (cls.__module__.startswith("torch.") or isinstance(m, torch.jit.ScriptModule)
                or getattr(cls, "fxfuse_runtime", False))


@contextlib.contextmanager
def recording_attribute_reads(model: torch.nn.Module):
    """Yields a dict filled when the block ends: id(module) -> names of its instance attributes
    read in the block (ALL: watch every one), for the model's own classes; {"all": True} where
    nothing recorded can be trusted. The classes are restored however the block ends. Builds
    run one at a time (runtime.BUILD_LOCK)."""
    reads, swapped = {}, []
    try:
        for m in dict.fromkeys(model.modules()):
            if not _records(m):
                continue
            cls = type(m)
            try:
                m.__class__ = _recording_subclass(cls)
            except Exception:  # noqa: BLE001 -- __slots__, another layout, an __init_subclass__ that refuses
                # (a registry of subclass names): no recording possible, every attribute is watched
                reads[id(m)] = ALL
                continue
            swapped.append((m, cls))
            _RECORDING[id(m)] = set()
        yield reads
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        unknown = _RECORDING.pop("unknown", False)
        for m, _ in swapped:
            reads[id(m)] = _RECORDING.pop(id(m), ALL)
        _RECORDING.clear()
        if unknown:
            reads.clear()
            reads["all"] = True


def merge_reads(into: dict | None, new: dict) -> dict | None:
    """The union of two builds' reads (None: everything is watched)."""
    if into is None or new.get("all"):
        return None
    for k, names in new.items():
        into[k] = ALL if names is ALL or into.get(k, set()) is ALL else into.get(k, set()) | names
    return into


def plain_attributes(model: torch.nn.Module, reads: dict | None) -> tuple:
    """Per module with any to watch: (its instance dict, an itemgetter of the names, their
    values now) for the plain attributes a rebuild must follow: those the traces read on the
    model's own classes (`reads`, from recording_attribute_reads; None: all), and all of torch's
    modules' but nn.Module's bookkeeping and the ATTRIBUTE_FREE types'. An OptimizedModule
    inside the model keeps its own watch (its counters are not the model's)."""
    out = []
    for m in dict.fromkeys(model.modules()):
        if (type(m) in ATTRIBUTE_FREE or isinstance(m, torch.jit.ScriptModule)
                or getattr(type(m), "fxfuse_runtime", False)):
            continue
        names = ALL if reads is None or not _records(m) else reads.get(id(m), set())
        keys = tuple(k for k in m.__dict__ if k not in _MODULE_INTERNALS and not k.startswith("_tensor_constant")
                     and (names is ALL or k in names))
        if keys:
            get = operator.itemgetter(*keys)
            out.append((m.__dict__, get, get(m.__dict__), keys))   # one key: the value itself, not a tuple
    return tuple(out)


def watched_values(watched: tuple) -> list:
    return [v for _, _, values, keys in watched for v in (values if len(keys) > 1 else (values,))]


def reassigned(watched: tuple) -> str | None:
    """The first watched attribute (plain_attributes) no longer the same object or an equal
    value (a float by its repr: -0.0 is not 0.0). Per call: one C-level lookup and identity
    compare per module."""
    for d, get, values, keys in watched:
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
