"""The tensors a symbolic trace computed from at trace time, so the runtime can watch them.

torch.fx proxies forward()'s inputs and the module's parameters (and, where asked, buffers);
every other tensor forward() reaches is real, and torch ops on it run once, while tracing:
`self.cfg["w"].exp()`, `self.tables[0] * 2`, `next(self.parameters()).exp()`, a closure's tensor,
`held.item()`. Their results enter the graph as constants. An in-place edit of the source
after optimize() (an optimizer step, `w.mul_(-1)` under no_grad) then left the graph on the old
value with no warning (fuzz47g). This mode records, during the trace, the real tensors whose
values such ops read and that the trace did not make itself; the runtime watches their version
counters as it does the tensors the passes folded copies of, and rebuilds when one moves.

Only value reads count: an op whose result shares its input's memory (a slice, `.float()` of an
fp32 tensor, `.detach()`) is an alias the graph reads live, and a metadata read (`.dtype`,
`.shape`, `.dim()`: transformers' `next(self.parameters()).dtype`) reads no value; watching
those rebuilt on every in-place update of a tensor read live (review47r2: an EMA model).
"""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

VALUE_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
               torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.numpy}


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # sparse and other storage-less layouts
        return None


AUGMENTED = {f"__i{name}__" for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
                                           "lshift", "rshift", "matmul")}


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name in AUGMENTED


class FoldSources(TorchFunctionMode):
    """`with FoldSources() as folds: tracer.trace(...)`; then `folds.sources()`. Also notes the
    parameters an op wrote in place while tracing (`for p in self.parameters(): p.data.mul_(0.5)`: no
    graph node, no version counter through `.data`; fuzz47j): `restore()` puts their values back."""

    def __init__(self):
        super().__init__()
        self.written = {}    # id -> (parameter, its value before the trace's first write, the op's name)
        self._read = {}      # id -> tensor: a held tensor whose value an op read at trace time
        self._made = set()   # ids of the tensors ops made (ids only: temporaries are not kept alive;
        #                      a tensor alive before the trace cannot share an id with one made during it)
        self._alias = {}     # id -> the held tensors an op's result is a view or the same tensor of

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, (torch.Tensor, torch.fx.Proxy))]
        if not leaves or any(isinstance(a, torch.fx.Proxy) for a in leaves):
            out = func(*args, **kwargs)
            self._note_made(out, ())
            return out       # a factory, or a graph node computed on every call
        held = [t for a in leaves for t in self._held(a)]
        if _in_place(func) and args and isinstance(args[0], torch.Tensor):
            for t in self._held(args[0]):
                if isinstance(t, torch.nn.Parameter) and id(t) not in self.written:
                    self.written[id(t)] = (t, t.detach().clone(), getattr(func, "__name__", "?"))
        out = func(*args, **kwargs)
        if isinstance(out, torch.fx.Proxy):
            return out
        results = [o for o in (tree_leaves(out) if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(o, torch.Tensor)]
        storages = {_storage(a) for a in leaves} - {None}
        aliases = [o for o in results if _storage(o) in storages]
        if func in VALUE_READS or any(o not in aliases for o in results):
            for t in held:   # a value computed from them (or read as a number) becomes a constant
                self._read.setdefault(id(t), t)
        for o in results:
            self._note_made(o, held if o in aliases else ())
        return out

    def _held(self, a) -> list:
        """The held tensors a is (or is an alias of); none for what the trace made."""
        if id(a) in self._alias:
            return self._alias[id(a)]
        return [] if id(a) in self._made else [a]

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
