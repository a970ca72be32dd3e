"""The Python functions a class attribute runs and the code objects under them, asked safely.

Why one place: the runtime's checks read the model's own code (attribute_reads.class_code: which
code is the model's; mode_watch: the module-level tensors its methods load; trace_leftovers: the
globals one function assigns together), and each had its own walk, each missing a case another
handled (a decorated method, a static method, a class attribute whose __getattr__ raises).
"""
import dis
import inspect
import types


def plain_functions(attr) -> list:
    """The functions a class attribute runs: a method, a static or class method's function, a
    property's getter and setter, each under its decorators (`@torch.no_grad()`); [] for anything
    else, also for an object whose attribute lookup raises (a dict-backed record: review38d)."""
    try:
        found = [attr.fget, attr.fset] if isinstance(attr, property) else [getattr(attr, "__func__", attr)]
        found = [inspect.unwrap(fn) for fn in found if callable(fn)]
    except Exception:  # noqa: BLE001 -- a lazy proxy or record whose attributes raise: not a method
        return []
    return [fn for fn in found if isinstance(fn, types.FunctionType)]


def nested_code(code: types.CodeType):
    """code and the code objects inside it (lambdas, inner functions, comprehensions)."""
    stack = [code]
    while stack:
        c = stack.pop()
        yield c
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]


def global_names(code: types.CodeType, opname: str) -> set:
    """The global names code (not its nested code) loads (LOAD_GLOBAL) or assigns (STORE_GLOBAL)."""
    return {ins.argval for ins in dis.get_instructions(code) if ins.opname == opname}
