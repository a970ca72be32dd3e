"""The tensors a symbolic trace computed from at trace time, so the runtime can watch them.

torch.fx proxies forward()'s inputs and the module's parameters (and, where asked, buffers);
every other tensor forward() reaches is real, and torch ops on it run once, while tracing:
`self.cfg["w"].exp()`, `self.tables[0] * 2`, `next(self.parameters()).exp()`, a closure's tensor,
`held.item()`. Their results enter the graph as constants. An in-place edit of the source
after optimize() (an optimizer step, `w.mul_(-1)` under no_grad) then left the graph on the old
value with no warning (fuzz47g). This mode records, during the trace, the real tensors whose
values such ops read and that the trace did not make itself; the runtime watches their version
counters as it does the tensors the passes folded copies of, and rebuilds when one moves.

Only value reads count: a result that is no alias of the input, or one that is no tensor (`.item()`,
`torch.equal`, `f"{t:.4f}"`, `t in s`). An op whose result shares its input's memory (a slice,
`.float()` of an fp32 tensor, `.detach()`) is an alias the graph reads live, and a metadata read
(`.dtype`, `.shape`, `.dim()`: transformers' `next(self.parameters()).dtype`) or a factory shaped like
a tensor (`zeros_like`) reads no value; watching those rebuilt on every in-place update of a tensor read
live (review47r2, review47r4: an EMA model).
"""
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

# what reads no value: metadata (a result that is no tensor) and factories shaped like a tensor
METADATA = {"dtype", "shape", "device", "layout", "dim", "ndim", "ndimension", "size", "numel", "nelement", "stride",
            "is_contiguous", "requires_grad", "is_leaf", "element_size", "storage_offset", "is_floating_point",
            "is_complex", "is_signed", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_inference",
            "get_device", "names", "grad_fn", "__len__", "data_ptr", "untyped_storage", "_version", "itemsize",
            "nbytes", "is_nested", "is_mkldnn", "__hash__", "output_nr", "type", "_base", "dim_order", "result_type",
            "__dlpack_device__", "can_cast", "promote_types", "grad"}   # (a .grad read is refused apart: grad_read;
#                                                                   torch.export's own reads of it are none: review48r1)
NOT_WRITES = {"requires_grad_", "detach_", "share_memory_", "retain_grad", "rename_"}   # autograd or naming state
TEMPLATES = {"to", "type_as", "view_as", "expand_as", "reshape_as"}   # the first tensor shaped or typed like the
#                                                                      second, whose values they do not read
PER_INPUT_VIEWS = {"broadcast_tensors", "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d"}   # a view of each
#                                                                      input, reading no other (review48r3)
LIKE_FACTORIES = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
                  "new_zeros", "new_ones", "new_empty", "new_full"}


def _name(func) -> str:
    name = getattr(func, "__name__", "")   # (an aten overload's is "mul_.Tensor": review47r6)
    name = getattr(getattr(func, "__self__", None), "__name__", name) if name in ("__get__", "__set__") else name
    return name.split(".")[0]


def _unwrapped(t):
    """The tensor under torch.func's wrappers (vmap's batched tensors, grad's): the held one (review47r4)."""
    functorch = getattr(torch._C, "_functorch", None)
    while functorch is not None and isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def _traced(a) -> bool:
    """A graph value: symbolic_trace's Proxy, or torch.export's fake (and functional) tensors."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(a, (torch.fx.Proxy, FakeTensor, FunctionalTensor))


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # sparse and other storage-less layouts
        return None


AUGMENTED = {f"__i{name}__" for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
                                           "lshift", "rshift", "matmul")}


def _written(func, args, kwargs) -> list:
    """The tensors func writes: an in-place op's first argument (every tensor of a _foreach_ op's list), an
    `out=`, `t[i] = v`, `t.data = v` (review47r5)."""
    name, raw = _name(func), getattr(func, "__name__", "")
    targets = list(tree_leaves(kwargs.get("out"))) if kwargs.get("out") is not None else []
    first = args[0] if args else kwargs.get("input", kwargs.get("self", kwargs.get("tensor")))
    if first is not None and (name.endswith("_") and not name.endswith("__") and name not in NOT_WRITES
                              or name in AUGMENTED or raw == "__setitem__" or raw == "__set__" and name == "data"):
        targets += tree_leaves(first)   # (not `p.requires_grad = False`; `torch.neg_(input=p)`: review47r6)
    return [t for t in targets if isinstance(t, torch.Tensor)]


def _is_metadata(name: str) -> bool:   # (`_is_view`: torch.export's lift_constants_pass asks; review48r1)
    return name in METADATA or name.startswith(("is_", "_is_")) and name != "is_nonzero"


CONVERSIONS = {getattr(torch.nn.Module, name).__code__ for name in (
    "to", "half", "float", "double", "bfloat16", "cuda", "cpu", "type", "share_memory") if hasattr(torch.nn.Module, name)}


def _in_module_apply() -> bool:
    """Whether a conversion (`module.half()`, `.to(dtype)`: nn.Module._apply, which converts each parameter's
    .grad too) is running; not `_apply(fn)` called with a function of forward()'s own (review49r4)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is torch.nn.Module._apply.__code__:
            return frame.f_back is not None and frame.f_back.f_code in CONVERSIONS
        frame = frame.f_back
    return False


class FoldSources(TorchFunctionMode):
    """`with FoldSources() as folds: tracer.trace(...)`; then `folds.sources()`. Also notes the
    parameters an op wrote in place while tracing (`for p in self.parameters(): p.data.mul_(0.5)`: no
    graph node, no version counter through `.data`; fuzz47j): `restore()` puts their values back."""

    def __init__(self, numbers_only_apart_from=None):
        """`numbers_only_apart_from`: for torch.export, which runs forward() on fake tensors but also touches
        the real example inputs, parameters and buffers itself (these are its tensors; pass them) and
        keeps a held tensor a torch op reads as a constant the graph reads live: only reads that make a
        Python number (`w.tolist()`, `float(w)`) of another held tensor count, and no writes."""
        super().__init__()
        self._numbers_only = numbers_only_apart_from is not None
        self._made = {id(t) for t in numbers_only_apart_from or ()}
        self.written = {}    # id -> (parameter, its value before the trace's first write, the op's name)
        self.grad_read = False
        self._read = {}      # id -> tensor: a held tensor whose value an op read at trace time
        # self._made: ids of the tensors ops made (ids only: temporaries are not kept alive;
        #             a tensor alive before the trace cannot share an id with one made during it)
        self._alias = {}     # id -> the held tensors an op's result is a view or the same tensor of

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, (torch.Tensor, torch.fx.Proxy))]
        if not leaves or any(_traced(a) for a in leaves):
            out = func(*args, **kwargs)
            self._note_made(out, ())
            return out       # a factory, or a graph node computed on every call
        held = [t for a in leaves for t in self._held(a)]
        written = _written(func, args, kwargs) if not self._numbers_only else []
        if written and _name(func) == "data" and _in_module_apply():   # a conversion's `param.data = ...` (or a
            written = []   # no-op one's: review49r2): told by the data it changes (snapshot.data_put_back)
        for target in written:
            for t in self._held(target):
                if isinstance(t, torch.nn.Parameter) and id(t) not in self.written:
                    self.written[id(t)] = (t, t.detach().clone(), _name(func))
        out = func(*args, **kwargs)
        if isinstance(out, torch.fx.Proxy):
            return out
        results = [o for o in (tree_leaves(out) if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(o, torch.Tensor)]
        storages = {_storage(a) for a in leaves} - {None}
        aliases = {id(o) for o in results if _storage(o) in storages}   # (by identity: `in` on tensors compares)
        name = _name(func)
        if name == "new_tensor" or name in LIKE_FACTORIES:   # self's shape only; a fill value's value (review47r6)
            held = [t for a in tree_leaves((args[1:], kwargs)) if isinstance(a, torch.Tensor) for t in self._held(a)]
        elif name in TEMPLATES and args:   # `a.to(b)` of another dtype computes from a alone (review48r3)
            held = self._held(args[0]) if isinstance(args[0], torch.Tensor) else []
        if name == "grad" and not _in_module_apply():   # a gradient changes with no version counter: refused
            self.grad_read = True   # (review47r4); nn.Module._apply's (a conversion) is told by the data it changes
        computed = any(id(o) not in aliases for o in results) and not self._numbers_only
        if computed or not results and not _is_metadata(name):
            for t in held:   # a value computed from them (or read as a number) becomes a constant
                self._read.setdefault(id(t), t)
        for o in results:   # a view carries the held tensors it shares memory with; a write, all it read
            if id(o) not in aliases or written:
                self._note_made(o, held if id(o) in aliases else ())
                continue
            own = [t for t in held if _storage(t) == _storage(o)]
            if name not in TEMPLATES | PER_INPUT_VIEWS:   # the others picked the view: `t[k]`, `t.narrow(0, k, 2)`
                #                                               (review48r1)
                for t in held:
                    if all(t is not u for u in own):
                        self._read.setdefault(id(t), t)
            self._note_made(o, own)   # (a template gives only its shape or dtype: `ones(6).to(t)`, fuzz48d)
        return out

    def _held(self, a) -> list:
        """The held tensors a is (or is an alias of); none for what the trace made."""
        if id(a) in self._alias:
            return self._alias[id(a)]
        return [] if id(a) in self._made else [_unwrapped(a)]

    def _note_made(self, out, held) -> None:
        for o in tree_leaves(out) if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                if held:
                    self._alias[id(o)] = list(held)
                    self._made.discard(id(o))
                else:
                    self._made.add(id(o))
                    self._alias.pop(id(o), None)

    def sources(self) -> tuple:
        return tuple(self._read.values())

    def restore(self) -> None:
        with torch.no_grad():
            for t, value, _ in self.written.values():
                t.data.copy_(value)
