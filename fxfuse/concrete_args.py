"""Non-tensor arguments of forward(): the values a graph is specialized on (torch.fx's
concrete_args), and the placeholders torch.fx makes for them.

A call's non-tensor arguments are checked by value on every call (runtime.OptimizedModule's
signature), so the traced graph may treat them as constants: the example's values, and the
defaults of the parameters the example leaves out (as the call binds them).
"""
import functools
import inspect
import operator
import sys

import torch
import torch.fx

from .errors import TraceError, UnsupportedError
from .fingerprint import PLAIN_TYPES, _mutable, fingerprint, value_text


def split_concrete(model: torch.nn.Module, example_args: tuple):
    """(concrete_args, tensor args, whether an example argument itself is a plain value).

    Non-tensor example arguments become concrete_args: the graph is specialized on them. So
    do the defaults of parameters the example leaves out, where they are plain values (a call
    that leaves them out binds them): traced as proxies, `idx=None` would make `if idx is None`
    false and the graph index with None."""
    for k, a in enumerate(example_args):
        if isinstance(a, torch.Tensor):
            continue
        if _holds_tensor(a):
            raise UnsupportedError(
                f"argument {k} is a {_type_name(a)} holding tensors; fxfuse takes tensors and "
                "plain values (numbers, None, tuples of them) as arguments. Pass the tensors as separate "
                "arguments (a wrapper module whose forward(x, y) calls the model with [x, y] does it)")
        if any(isinstance(v, (float, complex)) and v != v for v in torch.utils._pytree.tree_leaves(a)):
            raise UnsupportedError(
                f"argument {k} is (or holds) NaN; fxfuse specializes the graph on the values of "
                "non-tensor arguments and checks them on every call, and NaN never equals itself. Pass it "
                "as a tensor")
        odd = _not_plain(a)
        if odd is not None and _numpy_scalar(odd):   # refused (review36b): traced as a Python number it came
            raise UnsupportedError(                    # back as one, complex ones changed dtypes, export crashed
                f"argument {k} is (or holds) a {_type_name(odd)} scalar; fxfuse specializes on plain Python "
                "values: pass float(v) or int(v) (numpy's types and arithmetic are not Python's), or a tensor")
        if odd is not None:
            raise UnsupportedError(
                f"argument {k} is (or holds) a {_type_name(odd)} value; fxfuse takes tensors and plain "
                "values (numbers, strings, None, dtypes, devices, tuples/lists/dicts of them), on which the "
                "graph is specialized and each call is checked by value. An array or object argument could "
                "change (in place, or an attribute) without the check seeing it: pass it as a tensor")
    given_values = not all(isinstance(a, torch.Tensor) for a in example_args)
    try:
        signature = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        signature = {}
    params = [n for n, p in signature.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < len(example_args):
        if given_values:
            raise TraceError("non-tensor example arguments need forward() parameters that take them by "
                             "position (not *args)")
        return None, example_args, False
    concrete = {params[k]: a for k, a in enumerate(example_args) if not isinstance(a, torch.Tensor)}
    given = set(params[:len(example_args)])
    if keyword_changing_wrapper(model.forward) is not None:   # the call binds the wrapper's own defaults
        own = inspect.signature(model.forward, follow_wrapped=False).parameters   # (review45i: `scale=-0.0`
        signature = {n: own[n] if n in own and own[n].default is not inspect.Parameter.empty else p   # around
                     for n, p in signature.items()}                                                # scale=0.0)
    for name, p in signature.items():   # left out: their defaults, as the call binds them
        if name not in given and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
                and p.default is not inspect.Parameter.empty and constant_default(p.default):
            concrete[name] = p.default
    tensors = tuple(a for a in example_args if isinstance(a, torch.Tensor))
    return concrete or None, tensors, given_values


def constant_default(value) -> bool:
    """A default the graph may be specialized on: a plain value or a tuple of them, no NaN.
    Not a list, dict or set: Python passes the same object on every call, and a forward() (or
    its caller) may change it, which the per-call check of passed arguments would not see."""
    if isinstance(value, tuple):
        return all(constant_default(v) for v in value)
    if isinstance(value, (float, complex)) and value != value:
        return False
    return isinstance(value, PLAIN_TYPES)


def same_default(value, default) -> bool:
    """A keyword-only argument the traced graph assumed: its default itself, or an equal number,
    string, bool or None (z=1.0 where the default is 1.0)."""
    return value is default or (type(value) is type(default) and isinstance(value, (int, float, str, type(None)))
                                and value_text(value) == value_text(default))   # repr: -0.0 is not 0.0


def mutable_defaults(model) -> tuple:
    """(default, its fingerprint) for each default of forward() that can change in place: a list,
    dict or set (or a tuple holding one), or an object with attributes (`cfg=DEFAULT_CFG`, a
    dataclass or namespace: review39b). Python passes the same object on every call, so a change
    to it between calls changes what eager computes, while the traced graph holds the contents it
    saw. The runtime compares the fingerprints on each call (runtime.forward); a change rebuilds.
    The submodules' forward()s too: a child called as `self.child(x)` takes its defaults (fuzz41f)."""
    found = {}
    for forward in dict.fromkeys(getattr(type(m), "forward", None) for m in model.modules()):
        try:
            params = inspect.signature(forward).parameters.values()
        except (TypeError, ValueError):
            continue
        found.update((id(p.default), p.default) for p in params if _mutable(p.default))
    return tuple((d, fingerprint(d)) for d in found.values())


def _type_name(value) -> str:
    """`numpy.ndarray`, `list`: where the argument's type comes from (the example's, or that of a
    call that needed a new specialization: "example argument 1 is a int64" said neither; fuzz36e)."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _not_plain(value):
    """The first leaf of value that is not a plain value (its repr says all of it), else None."""
    for leaf in torch.utils._pytree.tree_leaves(value):
        if not isinstance(leaf, PLAIN_TYPES):
            return leaf
    return None


def _numpy_scalar(value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic)


def numpy_number(value) -> bool:
    """A numpy int, float or complex scalar that a Python number holds exactly (not a long
    double), which torch's ops read as that number: a graph records it as one, since its repr
    (numpy 2: `np.float64(0.5)`) is no literal in the generated code (review36c, review36d).
    np.bool_ is not one: torch reads it as a float, Python's bool as an integer."""
    return _numpy_scalar(value) and value.dtype.kind in "iufc" and value.dtype.itemsize <= (
        16 if value.dtype.kind == "c" else 8)


def _holds_tensor(value) -> bool:
    """A list, tuple or dict with a tensor inside: as a concrete argument its tensors would be
    baked into the graph as constants, and the guard on its value could not see them change."""
    if isinstance(value, torch.Tensor):
        return False
    return any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(value))


def one_placeholder_per_parameter(graph: torch.fx.Graph, model, concrete: dict) -> None:
    """A tuple, list or dict among concrete_args makes torch.fx flatten the arguments (one
    placeholder per leaf, each checked by an assert) and generate code through pytree, which
    cannot compile once a placeholder has a default (`x, dims_1 = (1,), = ...`: a SyntaxError,
    torch 2.11-2.13). The values are constants in the graph already, and the runtime checks
    each call's non-tensor arguments by value, so: one placeholder per forward() parameter
    again (the container's own, unused), the leaf asserts dropped, plain code generation."""
    info = graph._codegen.pytree_info
    signature = inspect.signature(model.forward).parameters
    old = iter([n for n in graph.nodes if n.op == "placeholder"])
    prev = None
    for name, param in signature.items():
        if name not in concrete:
            prev = next(old)
            continue
        for _ in torch.utils._pytree.tree_leaves(concrete[name]):
            _drop_leaf_placeholder(next(old), name)
        where = graph.inserting_after(prev) if prev is not None else graph.inserting_before(next(iter(graph.nodes)))
        with where:
            default = () if param.default is inspect.Parameter.empty else (param.default,)
            prev = graph.create_node("placeholder", name, default, name=name)
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    if info.out_spec is not None:
        out.args = (torch.utils._pytree.tree_unflatten(list(out.args[0]), info.out_spec),)
    graph._codegen = torch.fx.graph.CodeGen()
    graph.lint()


def drop_value_checks(graph: torch.fx.Graph) -> None:
    """torch.fx checks each concrete number or string argument in the graph (`eq(scale, 2.0)`,
    then `torch._assert`); the runtime checks it already, by value, in the call's signature. The
    two nodes ran on every call outside a CUDA graph and were counted and explained as library
    calls (fuzz33g)."""
    for check in [n for n in graph.nodes if n.op == "call_function" and n.target is torch._assert]:
        cond, message = (check.args + (None, None))[:2]
        if isinstance(cond, torch.fx.Node) and isinstance(message, str) and "has been specialized to have value" \
                in message and cond.target is operator.eq and len(cond.users) == 1 \
                and isinstance(cond.args[0], torch.fx.Node) and cond.args[0].op == "placeholder":
            graph.erase_node(check)
            graph.erase_node(cond)


def _drop_leaf_placeholder(leaf: torch.fx.Node, name: str) -> None:
    """One of fx's per-leaf placeholders of a concrete argument, with its `leaf == value` assert."""
    if leaf.op != "placeholder" or not leaf.name.startswith(name):
        raise TraceError(f"unexpected placeholder {leaf.name} for the concrete argument {name!r}")
    for check in list(leaf.users):
        for user in list(check.users):
            if user.target is not torch._assert or user.users:
                raise TraceError(f"the concrete argument {name!r} is read by {user.name} beyond its check")
            user.graph.erase_node(user)
        if check.users:
            raise TraceError(f"the concrete argument {name!r} is read by {check.name}")
        check.graph.erase_node(check)
    leaf.graph.erase_node(leaf)


UNBINDABLE = object()   # bind_positional: the arguments do not bind to forward()
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def positional_names(forward) -> list:
    """forward()'s positional parameter names (for messages naming an argument)."""
    try:
        return [p.name for p in inspect.signature(forward).parameters.values() if p.kind in POSITIONAL]
    except (TypeError, ValueError):
        return []


def without_trailing_defaults(forward, args: tuple) -> tuple:
    """args without the trailing ones equal to forward()'s defaults (as bind_positional trims
    keyword calls); the runtime calls it only on a miss, never on the hot path."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return args
    if keyword_changing_wrapper(forward) is not None:   # the defaults that count are the wrapper's (review45h)
        return args
    args = list(args)
    while args and len(args) <= len(params) and params[len(args) - 1].kind in POSITIONAL \
            and params[len(args) - 1].default is not inspect.Parameter.empty \
            and same_default(args[-1], params[len(args) - 1].default):
        args.pop()
    return tuple(args)


def wrapper_reads_keywords(model, args, kwargs) -> str | None:
    """Why a call with `kwargs` runs the original module (keyword_changing_wrapper), else None
    (also where the wrapper cannot take the call: bind_positional then finds eager's TypeError)."""
    wrapper = keyword_changing_wrapper(model.forward)
    if wrapper is None:
        return None
    try:
        inspect.signature(model.forward, follow_wrapped=False).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return (f"keyword arguments {sorted(kwargs)}: {type(model).__name__}.forward is wrapped by {wrapper}, whose own "
            "signature takes them otherwise than the function it wraps; fxfuse binds keywords to positions, a call "
            "the wrapper may treat differently: pass them by position to use the optimized graph")


def keyword_changing_wrapper(forward) -> str | None:
    """The name of a decorator around forward() (functools.wraps) whose own signature is not the
    function's it wraps (`def w(self, *args, **kw)` that reads or rescales `kw["scale"]`): fxfuse
    passes keywords by position, and such a wrapper sees another call than eager's (fuzz45c: a
    silent wrong answer). None where there is none, and for torch's own decorators
    (`@torch.no_grad()`, `@torch.inference_mode()`), which pass a call on as it comes."""
    fn = getattr(forward, "__func__", forward)
    try:
        return _cached_wrapper(fn)
    except TypeError:   # an unhashable callable (review45h: the cache raised)
        return _keyword_changing_wrapper(fn)


def _keyword_changing_wrapper(fn) -> str | None:
    from .log import inside_packages
    while hasattr(fn, "__wrapped__"):
        code = getattr(fn, "__code__", None)
        try:
            own, inner = inspect.signature(fn, follow_wrapped=False), inspect.signature(fn.__wrapped__)
        except (TypeError, ValueError):
            return getattr(fn, "__qualname__", type(fn).__name__)
        if (code is None or not inside_packages(code.co_filename, ("torch",))) and \
                [_described(p) for p in own.parameters.values()] != [_described(p) for p in inner.parameters.values()]:
            return f"{getattr(code, 'co_name', '?')} ({code.co_filename}:{code.co_firstlineno})" if code else repr(fn)
        fn = fn.__wrapped__
    return None


_cached_wrapper = functools.lru_cache(maxsize=256)(_keyword_changing_wrapper)


def _described(p):   # name, kind and default (review45h: `scale=2.0` around `scale=1.0` was taken as the same)
    plain = isinstance(p.default, (bool, int, float, str, type(None)))   # repr: -0.0 is not 0.0 (review45i)
    return p.name, p.kind, type(p.default), repr(p.default) if plain else id(p.default)


def bind_positional(forward, args, kwargs):
    """args with keyword arguments bound into their positions of forward(), None where that is
    impossible (keyword-only or **kwargs parameters), or UNBINDABLE where the call does not fit
    forward() at all (eager raises its TypeError)."""
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs)
        if keyword_changing_wrapper(forward) is not None:   # a wrapper's own signature may take fewer
            inspect.signature(forward, follow_wrapped=False).bind(*args, **kwargs)   # (review45h)
    except TypeError:
        return UNBINDABLE
    given = set(bound.arguments)
    bound.apply_defaults()   # model(x, scale=3.0) past a defaulted y: model(x, None, 3.0)
    params = bound.signature.parameters
    order = [name for name in bound.arguments if params[name].kind in POSITIONAL]
    last = max((k for k, name in enumerate(order) if name in given), default=-1)   # (fuzz46g: not those after
    if not all(name in given or constant_default(bound.arguments[name]) for name in order[:last + 1]):   # it,
        return None           # nor *args') a default filled in before a keyword is not a constant (a function, a tensor)
    if not all(name in params and same_default(value, params[name].default)
               for name, value in bound.kwargs.items()):   # **kwargs entries are not parameters
        return None           # a keyword-only parameter given a value the traced graph does not have
    positional = list(bound.args)   # keyword-only parameters at their defaults, as traced
    names = [n for n in params if params[n].kind in POSITIONAL]
    while len(positional) > len(args) and same_default(positional[-1], params[names[len(positional) - 1]].default):
        positional.pop()      # model(x, scale=2.0) with the default 2.0 is model(x): the same specialization
    return tuple(positional)


def inline_disabled_autocast(gm: torch.fx.GraphModule) -> None:
    """torch.export records `with torch.autocast(..., enabled=False):` (HF's LlamaRotaryEmbedding,
    copied into most rotary models, forces fp32 so) as a wrap_with_autocast node around a
    subgraph, which tracing refuses as autocast. Disabled, the region computes what its body
    computes (a call under an outer autocast runs the original module anyway): its body's nodes
    take its place (fuzz34j). An enabled region stays, and is refused."""
    hop = getattr(getattr(torch.ops, "higher_order", None), "wrap_with_autocast", None)
    while (node := next((n for n in gm.graph.nodes if hop is not None and n.target is hop and n.args[2] is False
                         and n.args[4].op == "get_attr" and all(u.target is operator.getitem for u in n.users)),
                        None)) is not None:   # nested regions: one level a pass
        _, _, enabled, _, body_ref, *operands = node.args
        body = getattr(gm, body_ref.target)
        env = dict(zip([p for p in body.graph.nodes if p.op == "placeholder"], operands))
        with gm.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "output":
                    results = inner.args[0]
                elif inner.op == "get_attr":   # a constant or a nested region's body: on gm under a new name
                    name, value = f"{body_ref.target}_{inner.target}".replace(".", "_"), getattr(body, inner.target)
                    if isinstance(value, torch.nn.Module):
                        gm.add_submodule(name, value)
                    else:
                        gm.register_buffer(name, value, persistent=False)
                    env[inner] = gm.graph.get_attr(name)
                elif inner.op != "placeholder":
                    env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
        results = torch.fx.node.map_arg(results, lambda n: env[n])
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)   # (a region's results are read through getitem only)
    gm.graph.eliminate_dead_code()
    gm.recompile()


class ReturnedSize:
    """Stands for torch.Size in a graph's output spec: torch's pytree unflattens a Size as a
    tuple, so a model returning `x.shape[1:]` or `torch.Size((n, 4))` next to a tensor got a
    tuple back from export's graph and was refused by the output check (fuzz36e)."""


torch.utils._pytree.register_pytree_node(ReturnedSize, lambda size: (list(size), None),
                                         lambda sizes, _: torch.Size(sizes),
                                         serialized_type_name="fxfuse.concrete_args.ReturnedSize")


def sizes_returned_as_sizes(gm: torch.fx.GraphModule) -> None:
    """Where a pytree-generated graph returns a torch.Size, its output spec builds one."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(info, "out_spec", None)

    def rebuilt(node):
        children = [rebuilt(child) for child in _children(node)]
        if node.type is torch.Size:
            return torch.utils._pytree.TreeSpec(ReturnedSize, None, children)
        return torch.utils._pytree.TreeSpec(node.type, node.context, children) if children else node

    if spec is not None and any(s.type is torch.Size for s in _spec_nodes(spec)):
        gm.graph._codegen.pytree_info = info._replace(out_spec=rebuilt(spec))
        gm.recompile()


def _spec_nodes(spec):
    yield spec
    for child in _children(spec):
        yield from _spec_nodes(child)


def _children(spec) -> list:
    """A TreeSpec's children: children() from torch 2.13 (children_specs warns there), else the field."""
    return list(spec.children()) if callable(getattr(spec, "children", None)) else list(spec.children_specs)


TRANSFORM_MARKERS = {"_vmap_increment_nesting": "torch.vmap", "_jvp_increment_nesting": "torch.func.jvp",
                     "_grad_increment_nesting": "torch.func.grad", "_enter_dual_level": "forward-mode AD (dual_level)",
                     "_make_dual": "forward-mode AD (make_dual)"}
# ^ torch.export's nodes for them; running such a graph outside the transform failed inside it and
# left functorch's level pushed for the process (fuzz41a: every later backward() raised)


def check_exported(gm: torch.fx.GraphModule) -> None:
    """What torch.export's graph may hold that the passes cannot take.

    torch.vmap (and jvp, forward-mode AD: TRANSFORM_MARKERS) is recorded as batching-level nodes
    whose results nothing reads: dead code elimination dropped them and shape propagation then
    failed with a message about the example's shapes (fuzz36c); keeping them, vmap's own checks
    failed inside the passes.
    A numpy float (np.float64 is a float) is written into the generated code by its repr,
    `np.float64(0.5)`, a NameError there (review36d): an op's becomes the Python number, as
    torch reads it; a returned one is refused (it would come back as a float)."""
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        transform = next((t for marker, t in TRANSFORM_MARKERS.items() if marker in name), None)
        if transform:
            raise UnsupportedError(f"forward() calls {transform} (node {node.name}): fxfuse does not rewrite "
                                   "code under a function transform or forward-mode AD")
    for node in gm.graph.nodes:
        numpy = [v for v in torch.utils._pytree.tree_leaves((node.args, node.kwargs)) if _numpy_scalar(v)]
        if numpy and (node.op == "output" or not all(map(numpy_number, numpy))):
            raise UnsupportedError(f"forward() {'returns' if node.op == 'output' else 'passes an op'} a numpy "
                                   f"{type(numpy[0]).__name__}: use a Python number or a tensor")
        if numpy:
            node.args, node.kwargs = torch.fx.node.map_aggregate(
                (node.args, node.kwargs), lambda v: v.item() if numpy_number(v) else v)
    gm.recompile()


def watch_argument_containers(args) -> list:
    """(container, a shallow copy) of each list, dict or set among the arguments, two levels deep:
    forward() writing into one (`state["pos"] += T`, `feats.append(h)`) changes the caller's
    object in eager, which no graph repeats (fuzz37j: silent wrong outputs from the second call)."""
    found = []

    def visit(v, depth):
        if isinstance(v, (list, dict, set)):
            found.append((v, dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else set(v)))
        if depth and isinstance(v, (list, tuple, dict)):
            for item in list(v.values() if isinstance(v, dict) else v)[:256]:
                visit(item, depth - 1)
    for a in args:
        visit(a, 2)
    return found


def restore_argument_containers(found) -> bool:
    """Put each watched container back as it was; whether any had changed."""
    changed = False
    for container, saved in found:
        if isinstance(container, dict):   # the keys' order too (review37c)
            same = list(container) == list(saved) and all(container[k] is saved[k] for k in saved)
        elif isinstance(container, list):
            same = len(container) == len(saved) and all(a is b for a, b in zip(container, saved))
        else:
            same = container == saved
        if not same:
            changed = True
            if isinstance(container, list):
                container[:] = saved
            else:
                container.clear()
                container.update(saved)
    return changed
