"""The Python functions a class attribute runs and the code objects under them, asked safely.

Why one place: the runtime's checks read the model's own code (attribute_reads.class_code: which
code is the model's; mode_watch: the module-level tensors its methods load; trace_leftovers: the
globals one function assigns together), and each had its own walk, each missing a case another
handled (a decorated method, a static method, a class attribute whose __getattr__ raises).
"""
import dis
import inspect
import sys
import types
import weakref


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


def user_classes(cls) -> list:
    """cls and its base classes that are not torch's or Python's own (their methods are the model's code)."""
    return [k for k in cls.__mro__ if not (k.__module__ or "").startswith(("torch.", "builtins"))]


LIBRARIES = ("torch", "fxfuse", "triton", "numpy", "builtins")


def user_module(name: str) -> bool:
    """Whether a module of this name is the user's code: not the standard library's (nor a private
    C module such as _operator), torch's, fxfuse's or the libraries torch brings."""
    top = (name or "").partition(".")[0]
    return not (top in sys.stdlib_module_names or top in LIBRARIES or top.startswith("_") and top != "__main__")


def _attributes_named(path: str, value, names: set, depth: int) -> list:
    """(dotted path, value) for the attributes of a user's module or class that the code names, and
    theirs, `depth` levels down (`pkg.sub.tables.TABLE`, `Consts.T`: review39c)."""
    if depth == 0 or not (isinstance(value, types.ModuleType) and user_module(value.__name__)
                          or isinstance(value, type) and user_module(value.__module__)):
        return []
    found = []
    for attr in names & set(vars(value)):
        inner = vars(value)[attr]
        if isinstance(inner, (staticmethod, classmethod)):   # its function (not getattr: a record's
            inner = inner.__func__                           # __getattr__ may raise anything: review39d)
        found.append((f"{path}.{attr}", inner))
        found += _attributes_named(f"{path}.{attr}", inner, names, depth - 1)
    return found


def globals_read(cls, levels: int = 2) -> list:
    """(name, value) for each module-level value the methods of cls (and its user base classes,
    their lambdas and inner functions) read, and what the module-level helpers they call read,
    `levels` calls deep (review38d, review39c): global names (LOAD_GLOBAL), and the attributes of a
    user's module or class the same code names (`helpers.TABLE`, `helpers.scale(x)`, `Consts.T`).
    Such an attribute is looked up by the names the code uses, so a name used on another object
    too may add a value the code never reads: callers use this to know more, never less."""
    return globals_read_by([fn for klass in user_classes(cls) for attr in list(vars(klass).values())
                            for fn in plain_functions(attr)], levels)


def globals_read_by(functions, levels: int = 2) -> list:
    """globals_read's (name, value) pairs for these functions and the helpers they call."""
    queue = [(fn, 0) for fn in functions]
    found, done = [], set()
    while queue:
        fn, level = queue.pop()
        if id(fn) in done:
            continue
        done.add(id(fn))
        scope, own = fn.__globals__, []
        for code in nested_code(fn.__code__):
            for name in global_names(code, "LOAD_GLOBAL"):
                value = scope.get(name)
                if type(value) in weakref.ProxyTypes:   # a dead one raises on any use (review42f)
                    continue
                own.append((name, value))
                own += _attributes_named(name, value, set(code.co_names), 3)
        found += own
        if level < levels:
            queue += [(value, level + 1) for _, value in own
                      if isinstance(value, types.FunctionType) and user_module(value.__module__)]
    return found
