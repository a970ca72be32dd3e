"""torch.fx's tracer as fxfuse runs it (tracing._quiet_symbolic_trace): augmented assignments
recorded, autocast regions noticed, OrderedDict outputs kept, parametrized layers traced
through, and the places where the trace could not follow a value noted, so a forward() that
catches the tracer's error is refused (fuzz40e)."""
import collections
import contextlib
import functools
import inspect
import math
import operator
import traceback

import torch
import torch.fx
from torch.nn.utils import parametrize

from .concrete_args import numpy_number
from .errors import UnsupportedError
from .log import inside_packages
from .node_meta import ancestors
from .state_writes import AUGMENTED_NAMES


class _AugmentedAssignmentProxy(torch.fx.Proxy):
    """A torch.fx Proxy that records `v += y` as operator.iadd(v, y).

    torch.fx's Proxy has no in-place operators, so Python runs `v += y` as `v = v + y`: the
    write disappears. Eager writes into v's memory, and when v is a view (`v = h[:, :4]`), an
    alias (`g = h`) or an input, others see the write (fuzzing: a silent wrong answer where
    the example input did not show it). operator.iadd is what Python runs for `+=`: in-place
    for a tensor, a rebinding for an int, and normalize turns it into the functional op where
    nothing else sees the memory (`out += identity` on a fresh tensor still fuses)."""


    def __getattr__(self, k):   # `t = v.T; t -= c`: torch.fx's Attribute proxy has no `-=` either (fuzz35a)
        if k in GRAD_ATTRIBUTES:
            return _grad_attribute(k, self.node)
        attribute = _AugmentedAttribute(self, k)
        if k in VIEW_ATTRIBUTES:   # recorded now: torch.fx records an attribute where it is first used, so
            attribute.node         # `v = h.data; h.t_(); v + 1` read h after its transpose (fuzz43h)
        return attribute

    def __hash__(self):
        """A size (or dtype, device) as a set member or dict key (`x.shape[0] in self.sizes`,
        `self.table.get(n)`, `x.dtype in HALF`, an lru_cache keyed by it): a Proxy hashes by
        identity, so the lookup missed for every size and the trace took the miss's way silently
        (fuzz42c). Refused like a branch on it; torch.export then traces with the example's
        sizes, which the guards keep."""
        refused = getattr(self.tracer, "_refused", None)
        if refused is not None and _is_plain_value(self.node):
            return refused(_hashed_plain_value, self)
        return object.__hash__(self)


_AugmentedAssignmentProxy.__name__ = _AugmentedAssignmentProxy.__qualname__ = "Proxy"   # as torch.fx's, in
#                                              the errors Python raises about one ("'Proxy' object cannot be ...")


VIEW_ATTRIBUTES = {"data", "T", "mT", "H", "mH", "real", "imag"}   # attributes that are tensors (views)
GRAD_ATTRIBUTES = {"grad_fn", "grad"}


def _grad_attribute(k, node):
    """A parameter's or buffer's grad_fn is None. Any other `.grad_fn`, and any `.grad`, is refused: a Proxy is
    never None, so `if h.grad_fn is not None` took the training way (fuzz47j); an input's depends on how the
    caller made it, also through `.float()` or a no-op `.to` (review47r5); a `.grad` changes with no version
    counter (zero_grad, a backward pass; review47r4: torch.export kept the build's)."""
    if k == "grad_fn" and node.op == "get_attr":
        return None
    raise UnsupportedError(GRAD_READ_REFUSAL.format(k))


GRAD_READ_REFUSAL = ("forward() reads a tensor's .{}, which depends on how the caller made or trained it (and a .grad "
                     "changes with no version counter: zero_grad, a backward pass): a traced graph would keep its value "
                     "at the build, so the original module runs")   # (also tracing's, for `.grad` of a held tensor)


class _AugmentedAttribute(torch.fx.proxy.Attribute):
    """torch.fx's proxy of an attribute (`v.T`, `v.mT`), recording augmented assignments too."""

    def __getattr__(self, k):
        return _grad_attribute(k, self.node) if k in GRAD_ATTRIBUTES else _AugmentedAttribute(self, k)   # (`y.T.grad_fn`)

    __hash__ = _AugmentedAssignmentProxy.__hash__   # `x.dtype in {...}` (torch.fx's own: by identity)


for _name in AUGMENTED_NAMES:
    def _augmented(self, other, _op=getattr(operator, f"i{_name}")):
        return self.tracer.create_proxy("call_function", _op, (self, other), {})
    for _cls in (_AugmentedAssignmentProxy, _AugmentedAttribute):
        setattr(_cls, f"__i{_name}__", _augmented)


def _hashed_plain_value(proxy):
    raise torch.fx.proxy.TraceError(f"a traced size, dtype or device ({proxy.node.name}) is looked up in a set or "
                                    "dict: a Proxy hashes by identity and would miss every key")


PLAIN_METHODS = ("size", "numel", "nelement", "dim", "ndimension", "item", "tolist", "stride", "get_device",
                 "is_contiguous", "is_floating_point", "is_complex", "element_size", "storage_offset", "is_signed",
                 "is_inference")
PLAIN_ATTRIBUTES = ("shape", "ndim", "dtype", "device", "layout", "is_cuda", "is_sparse", "is_meta",
                    "is_quantized", "requires_grad", "is_leaf")


def _is_plain_value(node) -> bool:
    """Whether node is a plain Python value while tracing, not a tensor: a size read (`x.shape`,
    `x.size(1)`, `len(x)`, `.item()`), a dtype or device (`x.device.type`), an item or attribute
    of one, or operator arithmetic on such values only (`x.shape[-1] // 2`; `x + 1` is
    operator.add too)."""
    base = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if node.op == "call_method":   # (x.type() names the type; x.type(dtype) casts; a size's or dtype's own
        return node.target in PLAIN_METHODS or node.target == "type" and len(node.args) == 1 and not node.kwargs \
            or base is not None and _is_plain_value(base)   # methods: x.shape.index(4), x.dtype.to_real(): review43f)
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return node.args[1:2] in (tuple([a]) for a in PLAIN_ATTRIBUTES) or base is not None and _is_plain_value(base)
    if node.target is len:
        return True
    if node.target is operator.getitem:
        return base is not None and _is_plain_value(base)
    if getattr(node.target, "__module__", None) in ("_operator", "operator", "math", "builtins"):
        return bool(node.all_input_nodes) and all(_is_plain_value(a) for a in node.all_input_nodes)
    return False


def number_to_the_power(base, exponent):
    """`base ** exponent` for a negative number base, which torch.fx would print as `-2 ** x`,
    that is -(2 ** x). A function of its own, not torch.pow: the exponent may be a size
    (`(-1) ** x.shape[-1]`, an int; review37), which torch.pow refuses."""
    return base ** exponent


def _negative_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.copysign(1.0, v) < 0


def _swallowed_refusal(where: str) -> UnsupportedError:
    return UnsupportedError(f"forward() catches the error symbolic_trace raised{where}, where it branches on or "
                            "iterates over a tensor's value: a traced graph would follow the example's way for every "
                            "input, so the original module runs")


SIZE_VARARG_FACTORIES = ("ones", "zeros", "empty", "rand", "randn")


@contextlib.contextmanager
def _sizes_packed():
    """torch.ones(T, T) with T = x.shape[1] fails under symbolic_trace (torch's argument parser
    takes no Proxy among separate sizes; `torch.ones((T, T))` works), and the model then went to
    torch.export, which refuses more (a causal mask beside nn.MultiheadAttention: fuzz41b). During
    the trace those factories take such sizes as one tuple; any other call is passed on as it is."""
    def packing(factory):
        @functools.wraps(factory)
        def call(*size, **kwargs):
            if len(size) > 1 and any(isinstance(s, torch.fx.Proxy) for s in size):
                return factory(size, **kwargs)
            return factory(*size, **kwargs)
        call.fxfuse_packs_sizes = True
        return call
    patched = {name: f for name in SIZE_VARARG_FACTORIES
               if not getattr(f := getattr(torch, name), "fxfuse_packs_sizes", False)}   # (another thread's trace)
    for name, factory in patched.items():
        setattr(torch, name, packing(factory))
    try:
        yield
    finally:
        for name, factory in patched.items():
            setattr(torch, name, factory)


@contextlib.contextmanager
def _sizes_stay_sizes():
    """torch.fx passes concrete_args through torch's pytree, which rebuilds a torch.Size as a tuple:
    forward() got `size=(2, 4)` for torch.Size([2, 4]), so `isinstance(size, torch.Size)` took the
    other branch and `size.numel()` failed (fuzz44c). During the trace a Size of numbers comes back
    a Size (the registry is process-wide; builds run one at a time and a Size is the truer answer)."""
    import torch.utils._pytree as pytree
    node = pytree.SUPPORTED_NODES.get(torch.Size)
    if node is None or getattr(node.unflatten_fn, "fxfuse_keeps_sizes", False):
        yield
        return

    def unflatten(values, context):
        values = list(values)
        return torch.Size(values) if all(type(v) is int for v in values) else node.unflatten_fn(values, context)
    unflatten.fxfuse_keeps_sizes = True
    pytree.SUPPORTED_NODES[torch.Size] = node._replace(unflatten_fn=unflatten)
    try:
        yield
    finally:
        pytree.SUPPORTED_NODES[torch.Size] = node


class _AutocastWatchingTracer(torch.fx.Tracer):
    """torch.fx.symbolic_trace's tracer, noting a node recorded while torch.autocast is on:
    the context manager runs at trace time and leaves no trace in the graph. Autocast state is
    per thread (the build runs with it off: runtime._autocast_off), so other threads cannot
    trip it. Its proxies record augmented assignments (_AugmentedAssignmentProxy)."""

    autocast_node = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refusals = []   # (error, where): each place the trace could not follow a value (a branch on it)

    def trace(self, root, concrete_args=None):
        with _sizes_packed(), _sizes_stay_sizes():
            return super().trace(root, concrete_args)

    def to_bool(self, obj):
        return self._refused(super().to_bool, obj)

    def iter(self, obj):
        return self._refused(super().iter, obj)

    def _refused(self, method, *args):
        """Note where the tracer raised: forward() may catch it (`try: if x.max() > 10: ... except
        Exception: pass`) and go on, and the trace then follows one branch for every input
        (fuzz40e: silently wrong)."""
        try:
            return method(*args)
        except Exception as e:
            from .trace_leftovers import reads_input_values   # (it imports module_state, which is heavy)
            on_value = reads_input_values(args[0]) or _size_of_a_value_sized(args[0])
            self.refusals.append((e, _failing_line(None) or " (in forward())", on_value))
            raise

    def swallowed(self, error: BaseException | None = None) -> tuple | None:
        """(where, whether on a value) of the first of the tracer's errors forward() caught and
        went on (the trace succeeded, or failed with another error: `error`), else None. On a
        size only (`try: if x.shape[0] > 2: ...`), torch.export follows the example's way and
        specializes on sizes, as eager runs it (review40)."""
        chain = []
        while error is not None and error not in chain:
            chain.append(error)
            error = error.__cause__ or error.__context__
        caught = [(where, on_value) for e, where, on_value in self.refusals if e not in chain]
        return next((c for c in caught if c[1]), caught[0] if caught else None)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        if node.op == "call_function" and node.target is operator.pow and _negative_number(node.args[0]):
            node.target = number_to_the_power   # torch.fx prints operator.pow(-2, x) as `-2 ** x` (fuzz37c)
        if self.autocast_node is None and node.op not in ("placeholder", "output") and autocast_enabled():
            self.autocast_node = node.name
        return node

    def proxy(self, node):
        return _AugmentedAssignmentProxy(node, self)

    def is_leaf_module(self, m, module_qualified_name) -> bool:
        """torch.nn's modules stay call_module nodes, except a parametrized Linear or
        convolution (weight_norm, spectral_norm, register_parametrization): traced through, it is
        an F.linear / conv whose weight the parametrization computes in the graph, and its bias
        and activation fuse like any layer's; kept whole, it was one opaque call that nothing
        fused into. Other parametrized modules stay whole (a weight-normed MultiheadAttention
        traced through was 26 library calls where it had been 2). A module whose forward was set
        on the instance is traced through too (fuzz31d: a patched Linear was rewritten as a plain
        one, silently)."""
        if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)) and parametrize.is_parametrized(m):
            return False
        if "forward" in vars(m):   # a forward set on the instance (a monkeypatch, a LoRA-style wrapper):
            return False           # a leaf would be rewritten by its type, so trace what the call runs
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        """nn.MultiheadAttention called with need_weights=False returns (output, None): a Proxy in place of
        the None took `if w is None` the other way (fuzz48g)."""
        out = super().call_module(m, forward, args, kwargs)
        if isinstance(m, torch.nn.MultiheadAttention) and isinstance(out, torch.fx.Proxy) \
                and type(m).forward is torch.nn.MultiheadAttention.forward:   # (a subclass's own: review48r1)
            try:
                bound = inspect.signature(m.forward).bind(*args, **kwargs)
            except TypeError:
                return out
            if bound.arguments.get("need_weights", True) is False:
                return out[0], None
        return out

    def create_arg(self, a):
        """torch.fx records an OrderedDict (torchvision's backbones return one) as a plain dict:
        the optimized module returned another type than the model, which the verification
        refused. Rebuilt as OrderedDict(dict) in the graph instead."""
        if numpy_number(a):   # recorded as the number torch's ops read (np.float64's repr is no literal)
            return a.item()
        if type(a) is torch.Size:   # torch.fx stores a Size as a tuple: `return y, torch.Size([3, 4])`
            return self.create_node("call_function", torch.Size, (super().create_arg(tuple(a)),), {})   # (review36)
        if type(a) is collections.OrderedDict:
            return self.create_node("call_function", collections.OrderedDict, (super().create_arg(dict(a)),), {})
        if isinstance(a, dict) and type(a) not in (dict, torch.fx.immutable_collections.immutable_dict):
            # fuzz33g: a Hugging Face ModelOutput, a defaultdict, a dataclass that is a dict came back
            # as a plain dict (with verify=False silently; a dict dataclass as an empty one)
            raise UnsupportedError(
                f"forward() returns a {type(a).__name__} (or passes one on), a subclass of dict, which torch.fx "
                "records as a plain dict: the optimized module would return another type. Return a plain dict, "
                "an OrderedDict or a tuple (a Hugging Face model: return_dict=False)")
        return super().create_arg(a)


autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: False)   # this thread's, one C call


class AutocastInForward(UnsupportedError):
    """forward() enters torch.autocast: no tracer here records it faithfully."""


def _failing_line(e: BaseException | None) -> str:
    """' at file:line in function (`source`)': the innermost frame of the error (None: of the
    current stack) outside torch.fx and fxfuse, where forward() (or a library it calls:
    torch.distributions' argument checks) did what the tracer cannot follow, such as branching
    on a tensor's value (fuzz37b)."""
    def inside_the_tracers(filename):
        return inside_packages(filename, ("fxfuse",)) or inside_packages(
            filename, ("torch",), except_for=("torch.distributions", "torch.nn"))
    stack = traceback.extract_tb(e.__traceback__) if e is not None else traceback.extract_stack()
    frames = [f for f in stack if not inside_the_tracers(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    source = f" (`{f.line.strip()[:120]}`)" if f.line else ""
    return f" at {f.filename}:{f.lineno} in {f.name}{source}"


def _size_of_a_value_sized(proxy) -> bool:
    """Whether a Proxy reads the size of a tensor whose shape depends on the input's values
    (`x[:n.item()].shape[0]`, `nonzero(m).shape[0]`, `torch.where(c)[0].shape[0]`, `x[mask]`):
    torch.export raises there too, and a forward() that catches it would take its except path
    for every input (review40b). Not for sizes a `.item()` only scales (`(x * s.item()).shape`),
    slices by sizes (`x[..., :x.shape[-1] // 2]`) or int repeats (review40c)."""
    from .data_dependent import (DATA_DEPENDENT_FUNCTIONS, DATA_DEPENDENT_METHODS, SIZE_FACTORIES, SIZE_TAKING,
                                 op_name)
    from .trace_leftovers import node_reads_input_values   # (it imports module_state, which is heavy)
    if not isinstance(proxy, torch.fx.Proxy):
        return False
    for n in ancestors([proxy.node]):
        name = op_name(n) if n.op in ("call_function", "call_method") else ""
        repeats = n.args[1:2] + tuple(v for k, v in n.kwargs.items() if k == "repeats")
        if (name in DATA_DEPENDENT_METHODS or n.target in DATA_DEPENDENT_FUNCTIONS) and (
                name != "repeat_interleave" or len(n.args) == 1 or any(isinstance(r, torch.fx.Node) for r in repeats)) \
                or n.target is torch.where and len(n.args) + len(n.kwargs) == 1 \
                or n.target in (operator.getitem, "__getitem__") and _picks_by_values(n) \
                or (name in SIZE_TAKING or name in SIZE_FACTORIES) and any(   # a size from a value: `.item()` or
                    _from_numbers(a) or node_reads_input_values(a)   # a tensor (`narrow(0, 0, n)`)
                    for a in n.all_input_nodes
                    if name in SIZE_FACTORIES or a is not (n.args[:1] or [None])[0]):
            return True
    return False


def _picks_by_values(n) -> bool:
    """A getitem whose index holds a value read from an input (a mask, ids, a bound from .item())."""
    from .trace_leftovers import node_reads_input_values
    index = n.args[1] if len(n.args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    bounds = [b for i in items if isinstance(i, slice) for b in (i.start, i.stop, i.step)]
    direct = [i for i in items if isinstance(i, torch.fx.Node)]
    return any(isinstance(b, torch.fx.Node) and (_from_numbers(b) or node_reads_input_values(b)) for b in bounds) \
        or any(map(node_reads_input_values, direct))   # (a bound that is a tensor: `x[:n]`, review40d)


def _from_numbers(node) -> bool:
    """Whether node is (arithmetic on) a number read from a tensor's values: .item() / .tolist()."""
    from .data_dependent import VALUE_METHODS
    return any(n.op == "call_method" and n.target in VALUE_METHODS for n in ancestors([node]))
