"""Tensors forward() makes from constants and then writes in place: symbolic_trace makes such a
tensor a constant of the graph and runs the write on it once while tracing, so the graph would
start from the written values (review34b). A tensor the model holds (its attributes, the
module-level values its code reads) is told apart by its version before the trace: the user may
have written it before optimize(), and the graph reads it, not a copy."""
import functools
import types

import torch
import torch.fx

from .code_walk import globals_read, globals_read_by, plain_functions
from .errors import UnsupportedError
from .module_state import WEAK_PROXIES, storage_address


def refuse_written_constants(gm: torch.fx.GraphModule, held: dict, attributes: bool = False) -> None:
    """`t = torch.tensor([1., 2.]); ...; t.mul_(3)`: symbolic_trace makes t a constant of the graph
    and runs the write on it once while tracing, so the graph would start from the written values
    (review34b: with verify=False, silently). Such a constant's version counter has moved. A
    tensor the model holds (`held`: held_tensor_versions before the trace) counts only where its
    version moved during the trace: the user may have written it before (`cfg["scale"].mul_(2)`,
    fuzz35d; a module-level table, review35b), and the graph reads it, not a copy."""
    node = written_constant(gm, held, attributes)
    if node is not None:
        raise UnsupportedError(f"forward() writes in place into a tensor it makes from constants (node "
                               f"{node}): the trace ran that write once, so the graph would start from "
                               "the written values. Write it out of place (t = t * 3) instead")


def written_constant(gm: torch.fx.GraphModule, held: dict, attributes: bool = False) -> str | None:
    """The name of a constant of the graph written during the trace (refuse_written_constants), or
    with `attributes`, of a plain tensor attribute (not a parameter or buffer) the trace wrote: symbolic_trace ran
    the writes without a traced operand (`self.scratch.zero_()`) once, and folded what forward()
    read from it afterwards into constants (review43c: a scratch attribute, 100 % off)."""
    registered = held.get("registered", ())   # (torch.fx registers a plain tensor attribute as a buffer of gm)
    for node in gm.graph.nodes:
        value = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if node.op == "get_attr" and (node.target.startswith("_tensor_constant") or attributes and id(value) in held
                                      and id(value) not in registered):   # (torch.export records such writes)
            if isinstance(value, torch.Tensor) and not value.is_inference() and value._version \
                    and held.get(id(value), held.get(("storage", storage_address(value)))) != value._version:
                return node.name
    return None


def held_tensor_versions(model) -> dict:
    """id -> version of each tensor the model holds (held_tensors), before a trace; and the same
    by storage: a view or detach() of one made at trace time (`self.pe[:6]` of a table filled by
    slice assignments, `GT.chunk(2)[0]`) shares its version counter (fuzz37h: refused as written).
    Under "registered": the ids of its parameters and buffers."""
    held = {"registered": {id(t) for t in (*model.parameters(), *model.buffers())}}
    for t in held_tensors(model):
        if not t.is_inference():
            held[id(t)] = t._version
            if storage_address(t) is not None:   # not an empty, meta or sparse tensor
                held[("storage", storage_address(t))] = t._version
    return held


MAX_HELD_VISITS = 1 << 16


def held_tensors(model) -> list:
    """The tensors the model holds: in its modules' plain attributes, three levels into lists,
    tuples, dicts and plain objects (`self.cfg.scales[0]`, `self.cfg["a"]["b"]["c"]`), and in the
    module-level values its classes' code names, two levels in (`S = torch.ones(3).mul_(2)` at
    import: review35b; `TABLES["a"]["b"]`: review39c); at most MAX_HELD_VISITS values looked at."""
    held, visits, walked = {}, [0], {}

    def visit(value, depth):
        if walked.get(id(value), -1) >= depth:   # each object once at its deepest depth: 60 blocks reading
            return                               # one 250-item global walked it 60 times (review39d)
        walked[id(value)] = depth
        visits[0] += 1
        if visits[0] > MAX_HELD_VISITS:
            return
        try:
            walk(value, depth)
        except Exception:  # noqa: BLE001 -- a __getattr__ that raises, __slots__ (review35c): not walked
            pass

    def walk(value, depth):
        if isinstance(value, torch.Tensor):
            held[id(value)] = value
        elif depth and isinstance(value, (list, tuple, dict)) and len(value) <= 256:
            for item in (value.values() if isinstance(value, dict) else value):
                visit(item, depth - 1)
        elif depth and type(getattr(value, "__dict__", None)) is dict and not isinstance(
                value, (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType,
                        functools.partial)):   # a callable object's attributes too (review45i)
            for item in list(vars(value).values())[:256]:
                visit(item, depth - 1)

    def read_by_code(pairs):
        for _, value in pairs:
            visit(value, 2)
            for bound in _bound_values(value):   # a helper function's tensor default
                visit(bound, 1)

    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    for m in modules:
        for value in vars(m).values():
            visit(value, 3)
    for cls in dict.fromkeys(type(m) for m in modules):   # each class once (60 blocks of one class: review39d)
        for klass in cls.__mro__[:-1]:   # a tensor held as a class attribute (`T = torch.tensor(..)`)
            for value in vars(klass).values():
                if type(value) not in WEAK_PROXIES and isinstance(value, torch.Tensor):   # (a dead proxy: review50r2)
                    visit(value, 0)
        # the class's functions, decorated (`@torch.no_grad()`), static and properties too (review38e)
        for fn in [f for attr in list(vars(cls).values()) for f in plain_functions(attr)]:
            for value in _bound_values(fn):   # a tensor default or a closure's tensor (fuzz37j)
                visit(value, 1)
        read_by_code(globals_read(cls))   # what its code and the module-level helpers it calls read
    # functions the modules hold (`self.fn = add_positions`, a partial of one): what they read too (fuzz45d)
    read_by_code(globals_read_by([fn for m in modules for value in vars(m).values() for fn in _held_code(value)]))
    return list(held.values())


def _held_code(value) -> list:
    """The functions a value held on a module runs when called: a function, a bound method, a
    partial's function, a callable object's `__call__` (review45h). type(), not isinstance: a dead
    weakref.proxy raises on any use."""
    kind = type(value)
    if issubclass(kind, functools.partial):
        return plain_functions(value.func)
    if kind in (types.FunctionType, types.MethodType):
        return plain_functions(value)
    if issubclass(kind, (torch.nn.Module, type, types.ModuleType)):   # (walked as modules and classes)
        return []
    call = getattr(kind, "__call__", None)   # (its own or a base class's)
    return plain_functions(call) if isinstance(call, types.FunctionType) else []


def _bound_values(fn) -> list:
    """The default values and closure contents of a function (nothing for anything else)."""
    if not isinstance(fn, types.FunctionType):
        return []
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:   # an empty cell
            pass
    return [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values(), *cells]
