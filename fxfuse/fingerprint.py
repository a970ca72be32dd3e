"""What a value holds, compared between calls: fingerprints of forward()'s changeable defaults
(concrete_args.mutable_defaults) and of the Python state the model's code reads
(attribute_reads' per-call contents watch). Plain values by type and value, floats by repr,
tensors by identity (and version), small numpy arrays by their bytes, containers, objects,
partials and closures by what they hold, a few levels down.
"""
import collections
import collections.abc
import enum
import functools
import operator
import sys
import types

import torch

from .module_state import WEAK_PROXIES, dead, held_fields, library_class, plain_object, same_attr, version


def value_text(value) -> str:
    """repr, by the base type's for a subclass of a number or str (its own may hide the value:
    `class Scale(float): __repr__ = ...`, review39b, fuzz41c)."""
    base = next((b for b in (bool, float, int, str, complex) if isinstance(value, b)), None)
    return repr(value) if base is None or type(value) is base else f"{type(value).__name__}={base.__repr__(value)}"


MAX_FINGERPRINT_ITEMS = 256   # a longer container or object is watched by its length only
MAX_FINGERPRINT_BYTES = 1 << 16   # a numpy array up to this is watched by its bytes, a larger one by identity


class _Same:
    """An object in a fingerprint: equal only to itself, and held (an id alone is reused once the
    object is freed: review39d, a float field assigned twice between calls was missed)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def fingerprint(value, depth: int = 4, names=None, versions: bool = True):
    """What a default holds, four levels down (an object's attributes, a container's items, an
    object in a list: review39c), compared with ==: plain values by type and value (a field
    assigned the same value again rebuilds nothing; 2 is not 2.0 nor True: fuzz41f), floats by
    repr (-0.0, nan), tensors by identity and version (`versions`), small numpy arrays by their
    bytes, a function by its closure cells and defaults, anything else by identity. Attributes
    whose lookup raises count as absent. `names`: only the attributes of these names, on objects
    (attribute_reads: those the model's code may read), also where the object's class holds them."""
    kind = type(value)
    if kind in _SIMPLE:   # the usual leaf first: this runs per call on watched attributes
        return kind, value
    if isinstance(value, torch.Tensor):
        return ("tensor", _Same(value), version(value)) if versions else _Same(value)
    if isinstance(value, float):
        return "float", value_text(value)
    if isinstance(value, PLAIN_TYPES):
        return type(value), value
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return "array", _Same(value), value.nbytes <= MAX_FINGERPRINT_BYTES and value.tobytes()
    if depth == 0:
        return _Same(value)
    items = held_items(value, names)
    if items is None:
        return _Same(value)
    if len(items) > MAX_FINGERPRINT_ITEMS:
        return _Same(value), len(items)
    return _Same(value), tuple((fingerprint(k, 0), fingerprint(v, depth - 1, names, versions)) for k, v in items)


def held_items(value, names=None) -> list | None:
    """(key, item) for what a container, an object, a partial or a function holds (a closure's
    cells: `nonlocal c` rebound), else None. `names`: of an object, only those attributes."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return list(enumerate(value))
    if isinstance(value, collections.abc.Mapping):   # UserDict, ChainMap, MappingProxyType (fuzz41h)
        return list(value.items())
    if isinstance(value, collections.UserList):
        return list(enumerate(value))
    if isinstance(value, type):   # a class used as a config (`self.cfg = Config`): its own values
        return None if library_class(value) else _class_values(value, names)
    if isinstance(value, functools.partial):
        return [("func", value.func), ("args", value.args), ("keywords", value.keywords)]
    if isinstance(value, types.FunctionType):
        return [("defaults", value.__defaults__), ("kwdefaults", value.__kwdefaults__),
                *enumerate(_cell_contents(value))]
    if not _attributed(value):
        return None
    try:
        items = list(held_fields(value).items())
    except Exception:  # noqa: BLE001 -- a record whose attribute lookup raises (review39c)
        return None
    return [(k, v) for k, v in items if names is None or k in names] + _class_attributes(value, names)


def _cell_contents(fn) -> list:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:   # an empty cell
            cells.append(None)
    return cells


def _class_attributes(value, names) -> list:
    """The named attributes an object reads from its class (`Cfg.scale = 3.0` after optimize:
    fuzz41f), on the user's classes, where the instance does not shadow them."""
    own = vars(value) if isinstance(getattr(value, "__dict__", None), dict) else {}
    return [item for cls in type(value).__mro__ if cls is not object and not library_class(cls)
            for item in _class_values(cls, names, own)]


def _class_values(cls, names, shadowed=()) -> list:
    """A class's own values of `names` (all with None), not its methods and dunders."""
    return [(k, v) for k, v in vars(cls).items() if (names is None or k in names) and k not in shadowed
            and not k.startswith("__") and not isinstance(v, DESCRIPTORS)]


def _mutable(value) -> bool:
    if isinstance(value, tuple):
        return any(_mutable(v) for v in value)
    return isinstance(value, (list, dict, set, collections.deque)) or _attributed(value)


def _attributed(value) -> bool:
    """An object of the user's whose attributes may change (module_state.plain_object), also one
    with __slots__ and no __dict__."""
    return plain_object(value) or bool(getattr(type(value), "__slots__", ())) and not isinstance(
        value, (*PLAIN_TYPES, torch.Tensor)) and not library_class(type(value))


DESCRIPTORS = (types.FunctionType, property, classmethod, staticmethod)   # a class's methods: not its values
_SIMPLE = {int, bool, str, type(None)}
PLAIN_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format,
               torch.layout, type(Ellipsis), slice, enum.Enum)


# the per-call contents watch of attribute_reads.plain_attributes
MAX_WATCHED_ITEMS = 256


def _contents(value, names=None, deeper=None):
    """A snapshot of a container, a plain object or a function the model's code reads, else None:
    an item appended or an attribute set in place (peft's LoRA merge appends to
    `merged_adapters`, which forward() branches on: fuzz34g; `self.config.scale = 2`), a callable
    helper's attribute, a closure's cell, a numpy array's values (fuzz41f) rebuilds. Of objects
    only the attributes of `names` (review34: `state.step += 1` each call, never read by forward,
    rebuilt the graph per call). Its items are compared by identity or plain value; those that
    hold more and that the model's code names (`deeper`: a dict-backed config's `_data`, a config's
    `model` section), and a function's cells, one level further (fingerprint,
    fuzz41f). Checked per call, so no deeper, and no list's items (review41: 30-50x the shallow
    check's time for a list of lists, and rebuilds on every call for a stats dict the loop bumps)."""
    if type(value) in WEAK_PROXIES and dead(value) \
            or isinstance(value, (list, dict, set)) and len(value) > MAX_WATCHED_ITEMS:
        return None   # compared per call: a 10^5-entry dict cost 12-27 ms a call (fuzz34i); not watched
    if isinstance(value, set):
        return frozenset(value)
    if isinstance(value, types.MethodType):   # `self.fn = helper.apply`: the helper's attributes
        value = value.__self__
    if isinstance(value, (torch.nn.Module, torch.Tensor, types.ModuleType, types.BuiltinFunctionType)) \
            or isinstance(value, tuple) and not _mutable(value):   # a tuple of plain values: same_attr
        return None
    if _is_array(value):
        return fingerprint(value)
    items = held_items(value, names)
    if items is None or len(items) > MAX_WATCHED_ITEMS:
        return None
    function = isinstance(value, (types.FunctionType, functools.partial))
    keys, shallow = tuple(k for k, _ in items), tuple(v for _, v in items)
    return keys, shallow, tuple((i, _identities(v, names), fingerprint(v, 1, names, versions=False))
                                for i, (k, v) in enumerate(items) if _holds_more(v) and (
                                    function or isinstance(k, str) and (deeper is None or k in deeper)))


def _is_array(value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _identities(value, names) -> list | None:
    """What an item holds, as objects: the same objects again need no fingerprint (the usual
    case). None where that says nothing: a numpy array is edited in place (review41)."""
    if type(value) in (list, tuple):
        held = list(value)
    elif type(value) is dict:
        held = [*value.keys(), *value.values()]
    else:
        items = held_items(value, names)
        if items is None:
            return None
        held = [x for item in items for x in item]
    return None if any(map(_is_array, held)) else held


def _holds_more(value) -> bool:
    if type(value) in WEAK_PROXIES:   # isinstance() of a dead one raises
        return False
    return type(value) not in (int, float, bool, str, type(None)) and not isinstance(value, torch.Tensor) and (
        _mutable(value) or isinstance(value, (types.FunctionType, functools.partial)) or _is_array(value)
        or isinstance(value, type) and not library_class(value))


def _contents_changed(value, snap, names=(None, None)) -> bool:
    try:   # a weakref.proxy that died since (review42j: a live one's config is watched)
        return _changed(value, snap, names)
    except ReferenceError:
        return True


def _changed(value, snap, names) -> bool:
    names = names[0]
    if isinstance(value, set):
        return frozenset(value) != snap
    if isinstance(value, types.MethodType):
        value = value.__self__
    if snap[0] == "array":   # a numpy array
        return fingerprint(value) != snap
    keys, shallow, deep = snap
    items = held_items(value, names)
    # keys by identity first: a Proxy key left in a memo raises on != (fuzz41i)
    if items is None or len(items) != len(keys) or any(k is not j and not same_attr(k, j)
                                                       for (k, _), j in zip(items, keys)) \
            or not all(a is b or same_attr(a, b) for (_, a), b in zip(items, shallow)):
        return True
    for i, objects, saved in deep:
        now = _identities(items[i][1], names)
        if (now is None or objects is None or len(now) != len(objects) or not all(map(operator.is_, now, objects))) \
                and fingerprint(items[i][1], 1, names, versions=False) != saved:
            return True
    return False


def _tensors_in(snap) -> list:
    if isinstance(snap, frozenset):
        return [t for t in snap if isinstance(t, torch.Tensor)]
    if isinstance(snap, list):   # _identities: the same objects as the fingerprint beside it
        return []
    if isinstance(snap, _Same):
        return [snap.obj] if isinstance(snap.obj, torch.Tensor) else []
    if isinstance(snap, tuple):
        return [t for part in snap if type(part) not in WEAK_PROXIES   # isinstance() of a dead one raises
                for t in (_tensors_in(part) if not isinstance(part, torch.Tensor) else [part])]
    return []
