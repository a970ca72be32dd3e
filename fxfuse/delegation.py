"""What an OptimizedModule passes through to its original module: attribute reads and writes
of the model's own names, and indexing, length and iteration of a container.

Why: `model.encoder = fxfuse.optimize(model.encoder, x)` swaps a child for its optimized
version, and the parent's code goes on reading that child: `self.encoder.config`,
`self.blocks[0]`, `len(self.blocks)` (fuzz34h: each raised AttributeError or TypeError).
torch.compile's wrapper passes them through as well. Not the original's own parameters and
buffers: the wrapper is one of the parent's modules() too, and a loop asking each module
`hasattr(m, "weight")` would meet that tensor twice (review34); `opt.original.weight` reads it.
Names with a leading underscore stay the wrapper's own (torch's internals probe modules for
them), and so do the wrapper's attributes (specializations, options, the counters)."""
import torch


NOT_PASSED = {"parametrizations"}   # torch.nn.utils.parametrize takes a module holding it for parametrized


class PassesThroughToOriginal:
    """A mixin for OptimizedModule (before torch.nn.Module in its bases)."""

    def __getattr__(self, name):
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            original = self.__dict__.get("_modules", {}).get("original")
            if original is None or name.startswith("_") or name in NOT_PASSED:
                raise
            if name in original._parameters or name in original._buffers:   # review34: opt is one of the
                raise AttributeError(   # parent's modules() too, so `hasattr(m, "weight")` loops (apply, init,
                    f"an fxfuse OptimizedModule has no {name!r} of its own: the original module's is "   # param
                    f"opt.original.{name}") from None   # groups) met the same tensor twice
            return getattr(original, name)

    def _passes_write(self, name) -> bool:
        """A write of a public name (after __init__) is the original's, which the graphs follow
        (`opt.scale = 3.0` rebuilds as `model.scale = 3.0` does; a name the original's forward
        looks up with getattr(self, "temperature", 1.0) too: fuzz34i), not a new attribute of the
        wrapper that forward() never reads. The wrapper's own names stay its own, unless the
        original has that name too (a parent writing `block.options` replaced fxfuse's options)."""
        d = self.__dict__
        if not d.get("_passing_through") or name.startswith("_") or hasattr(type(self), name) \
                or name == "original" or any(name in d.get(k, {}) for k in ("_parameters", "_buffers", "_modules")):
            return False
        return name not in d or name in vars(d["_modules"]["original"])

    def __getitem__(self, index):
        return self._modules["original"][index]

    def __len__(self) -> int:
        return len(self._modules["original"])

    def __iter__(self):
        return iter(self._modules["original"])

    def __bool__(self) -> bool:   # with __len__ defined, bool() would ask it (a non-container raises)
        return bool(self._modules["original"])
