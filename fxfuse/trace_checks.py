"""Checks on what forward() did while it was traced, beyond the attributes it read
(attribute_reads): whether it took values from an iterator the model holds (each eager call takes
the next, a graph would hold the trace's), and whether it tests a traced dtype, device or flag by
identity (a Proxy is no dtype: the test took its False way), which sends the model to torch.export.
"""
import collections.abc
import dis
import functools
import io
import itertools
import types
import warnings

import torch

from .attribute_reads import _names_of, _user_classes
from .fingerprint import _cell_contents
from .module_state import WEAK_PROXIES, forward_function, forward_globals, plain_object

BOUND = (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)


def tests_identity(codes) -> bool:
    """Whether the code that ran may test a tensor's dtype, device or flag by identity (`x.dtype is
    torch.float16`, `x.is_floating_point() is True`): under symbolic_trace the attribute is a Proxy,
    which is nothing else, so the graph took the test's False way silently (fuzz50d: an fp16 input
    came back fp16). Such a model is traced by torch.export (tracing.trace): code that reads such a
    value (by attribute or by name: `getattr(x, "dtype")`) and anywhere, in any function of it, tests
    anything but None by identity (a value held in a local, passed to a helper: review50r2, r4)."""
    from .fx_tracer import PLAIN_ATTRIBUTES, PLAIN_METHODS
    if not ({*PLAIN_ATTRIBUTES, *PLAIN_METHODS} - {"shape", "size", "item", "tolist"}) & set().union(
            *map(_names_of, codes)):
        return False
    for code in codes:
        ops = list(dis.get_instructions(code))
        if any(op.opname == "IS_OP" and not (ops[i - 1].opname == "LOAD_CONST" and ops[i - 1].argval is None)
               for i, op in enumerate(ops)) or "is_" in code.co_names:   # (operator.is_)
            return True
    return False


def held_iterators(model: torch.nn.Module) -> list:
    """(label, names, iterator) for the iterators a module, its class or its forward's globals hold,
    also one level into a dict, list, tuple or record and in a held function's closure: where
    forward() takes values from one (`next(self.schedule)` of an itertools.cycle, a generator), each
    eager call takes the next, a graph would hold the trace's (fuzz50d, review50r2). Not files,
    StringIOs (written logs) or weak proxies (every proxy type has __next__)."""
    def iterator(v):
        return type(v) not in WEAK_PROXIES and isinstance(v, collections.abc.Iterator) and not isinstance(
            v, (torch.Tensor, torch.nn.Module, io.IOBase))

    found = []
    for name, m in model.named_modules():
        held = {**{k: v for c in _user_classes(m) for k, v in vars(c).items()}, **m.__dict__, **forward_globals(m)[1]}
        forwards = [("", f) for f in (getattr(type(m), "forward", None), forward_function(m)) if f is not None]
        for k, v in [*held.items(), *forwards]:   # ("": forward's own closure, a decorator's: review50r4)
            if type(v) in WEAK_PROXIES:
                continue
            try:   # (an object whose attribute lookup raises: not looked into)
                v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                inner = list(v.items()) if isinstance(v, dict) else list(enumerate(v)) if isinstance(
                    v, (list, tuple)) else list(vars(v).items()) if plain_object(v) else []
                inner += list(enumerate(_cell_contents(v))) if isinstance(v, types.FunctionType) else []
                inner += list(enumerate((v.func, *v.args))) if isinstance(v, functools.partial) else []
                inner += [(None, v.__self__)] if isinstance(v, BOUND) else []   # `it.__next__` held
            except Exception:  # noqa: BLE001
                inner = []
            for key, item in [(None, v)] + inner[:64]:
                if type(item) in WEAK_PROXIES:   # (a dead one raises on any use)
                    continue
                if iterator(item):
                    label = f"{name + '.' if name else ''}{k or 'forward'}" + ("" if key is None else f"[{key!r}]")
                    keys = ({k} if k else set()) | ({key} if isinstance(key, str) else set())
                    found.append((label, keys, item, _iterator_state(item)))
    return found


SEQUENCE_ITERATORS = tuple({type(iter(x)) for x in ([], (), range(1), "", b"")})   # reduce: (iter, (seq,), index)


def _iterator_state(it, depth: int = 0):
    """Where an iterator stands, where that can be told for sure: a list's, tuple's, range's or
    string's iterator by its index, itertools.count by its value, itertools.cycle by its source and
    what it saved; else None (generators sit at the same `yield` after each next(), a callable's
    iterator or a map keep no position: review50r5), where the name alone decides. A refusal only
    where it moved (review50r4: a schedule read in training only)."""
    try:
        with warnings.catch_warnings():   # (Python 3.12 deprecates pickling itertools: a warning)
            warnings.simplefilter("ignore")
            if isinstance(it, SEQUENCE_ITERATORS):
                state = it.__reduce__()
                return (id(state[1][0]), state[2]) if len(state) > 2 else ("exhausted",)
            if type(it) is itertools.count:
                return repr(it)
            if type(it) is itertools.cycle and depth < 3:
                source, saved = it.__reduce__()[1][0], it.__reduce__()[2]
                return (_iterator_state(source, depth + 1), len(saved[0]), saved[1]) \
                    if _iterator_state(source, depth + 1) is not None else None
    except Exception:  # noqa: BLE001 -- another Python's reduce format: the name decides
        return None
    return None


def refuse_iterators_read(iterators: list, names) -> None:
    """Refuse where the code that ran names a held iterator (held_iterators); names None: every one."""
    from .errors import UnsupportedError
    for label, keys, it, before in iterators:
        if (names is None or keys <= names) and (before is None or _iterator_state(it) != before):
            raise UnsupportedError(f"forward() may take values from {label}, an iterator ({type(it).__name__}): "
                                   "each eager call takes its next value, a traced graph would hold one fixed (the "
                                   "trace may have taken one); the original module runs")
