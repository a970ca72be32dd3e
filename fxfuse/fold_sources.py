"""The tensors a symbolic trace computed from at trace time, so the runtime can watch them.

torch.fx proxies forward()'s inputs and the module's parameters (and, where asked, buffers);
every other tensor forward() reaches is real, and torch ops on it run once, while tracing:
`self.cfg["w"].exp()`, `self.tables[0] * 2`, `next(self.parameters()).exp()`, a closure's tensor,
`held.item()`. Their results enter the graph as constants. An in-place edit of the source
after optimize() (an optimizer step, `w.mul_(-1)` under no_grad) then left the graph on the old
value with no warning (fuzz47g). This mode records, during the trace, the real tensors that
such ops read and that the trace did not make itself; the runtime watches their version counters
as it does the tensors the passes folded copies of, and rebuilds when one moves.
"""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class FoldSources(TorchFunctionMode):
    """`with FoldSources() as folds: tracer.trace(...)`; then `folds.sources()`."""

    def __init__(self):
        super().__init__()
        self._read = {}    # id -> tensor: read by an op that ran at trace time
        self._made = {}    # id -> tensor: made by one (held, so no id is reused while tracing)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, torch.fx.Proxy) for a in leaves) or isinstance(out, torch.fx.Proxy):
            return out     # a graph node, computed on every call
        for a in leaves:
            if isinstance(a, torch.Tensor) and id(a) not in self._made and id(a) not in self._read:
                self._read[id(a)] = a
        for o in tree_leaves(out) if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and id(o) not in self._read:
                self._made[id(o)] = o
        return out

    def sources(self) -> tuple:
        return tuple(t for t in self._read.values() if not isinstance(t, torch.fx.Proxy))
