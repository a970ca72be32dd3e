"""What an OptimizedModule passes through to its original module: attribute reads and writes
of the model's own names, indexing, length and iteration of a container, the training flag,
and the nn.Module methods the model's class overrides (load_state_dict, eval, to and the other
conversions); and what it refuses (replacing its original, pickling).

Why: `model.encoder = fxfuse.optimize(model.encoder, x)` swaps a child for its optimized
version, and the parent's code goes on reading that child: `self.encoder.config`,
`self.blocks[0]`, `len(self.blocks)` (fuzz34h: each raised AttributeError or TypeError).
torch.compile's wrapper passes them through as well. Not the original's own parameters and
buffers: the wrapper is one of the parent's modules() too, and a loop asking each module
`hasattr(m, "weight")` would meet that tensor twice (review34); `opt.original.weight` reads it.
Names with a leading underscore stay the wrapper's own (torch's internals probe modules for
them); the wrapper's own state (its specializations, options and counters) has such names only,
so a model's `options`, `miss_count` or `dropped` is read and written as the model's (review44g:
fxfuse's counters overwrote them, and a parent read fxfuse's values)."""
import torch

from .errors import warn
from .load_hooks import as_the_models_keys


NOT_PASSED = {"parametrizations"}   # torch.nn.utils.parametrize takes a module holding it for parametrized
CONVERSIONS = ("to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type")


def overrides(module: torch.nn.Module, name: str) -> bool:
    """Whether the module's class has its own version of nn.Module's method `name`."""
    return getattr(type(module), name, None) is not getattr(torch.nn.Module, name)


def _conversion(name: str):
    def convert(self, *args, **kwargs):
        """The original's own version where its class has one (a to() that also moves a plain
        tensor attribute: fuzz39d), through _converted (stale specializations dropped)."""
        original = self._modules["original"]
        if not overrides(original, name):
            return getattr(torch.nn.Module, name)(self, *args, **kwargs)
        result = self._converted(lambda: getattr(original, name)(*args, **kwargs))
        if isinstance(result, torch.nn.Module) and result is not original:   # a new module, not optimized:
            warn(f"fxfuse: {type(original).__name__}.{name}() returned a new module; returning it as it is "   # opt
                 "(not optimized): call fxfuse.optimize on it")   # would go on wrapping the old one (review39c)
            return result
        return self
    convert.__name__ = name
    return convert


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
        wrapper that forward() never reads. A new public name the original lacks is the wrapper's."""
        d = self.__dict__
        if not d.get("_passing_through") or name.startswith("_") or hasattr(type(self), name) \
                or name == "original" or any(name in d.get(k, {}) for k in ("_parameters", "_buffers", "_modules")):
            return False
        return name not in d or name in vars(d["_modules"]["original"])

    # nn.Module's methods a model's class may override, run as the original's (fuzz39d: a load_state_dict
    # override that renames an old checkpoint's keys, loaded nothing with strict=False)
    def load_state_dict(self, state_dict, *args, **kwargs):
        """Straight into the model, its keys as its own (fuzz49f: through the wrapper, the model's load hooks saw
        "original."-prefixed keys; review36: its submodules' state versions were looked up by those names).
        Every submodule's load post hook (load_hooks.RebuildOnLoad) drops the specializations."""
        original = self._modules["original"]
        return original.load_state_dict(as_the_models_keys(original, state_dict), *args, **kwargs)

    def eval(self):
        original = self._modules["original"]
        if overrides(original, "eval"):
            original.eval()
            return self
        return torch.nn.Module.eval(self)

    def __getitem__(self, index):
        return self._modules["original"][index]

    def __len__(self) -> int:
        return len(self._modules["original"])

    def __iter__(self):
        return iter(self._modules["original"])

    def __bool__(self) -> bool:   # with __len__ defined, bool() would ask it (a non-container raises)
        return bool(self._modules["original"])

    @property
    def training(self) -> bool:
        """The original module's mode: forward() runs the optimized graphs only when it is in
        eval mode, so opt.training says the same even after model.train() or model.eval()."""
        original = self.__dict__.get("_modules", {}).get("original")
        return original.training if original is not None else False

    @training.setter
    def training(self, mode: bool) -> None:   # opt.train() / opt.eval() reach the original as a child too;
        original = self.__dict__.get("_modules", {}).get("original")   # `opt.training = True` was dropped
        if original is not None:                                        # (fuzz34i)
            original.training = mode

    def __setattr__(self, name, value) -> None:
        self._refuse_replacing(name)
        if self._passes_write(name):   # delegation.py
            return setattr(self.original, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name) -> None:
        self._refuse_replacing(name)
        if self._passes_write(name) and name not in self.__dict__:   # delegation.py: the original's name
            return delattr(self.original, name)
        super().__delattr__(name)

    def add_module(self, name, module) -> None:   # (register_module calls it) the original's, as a write
        self._refuse_replacing(name)                # of the name (fuzz40f: a KeyError where eager replaced)
        if self._passes_write(name):
            return self.original.add_module(name, module)
        super().add_module(name, module)

    def register_buffer(self, name, tensor, persistent: bool = True) -> None:   # the original's too (fuzz40f:
        if self._passes_write(name):        # it landed on the wrapper, and the graphs kept the old tensor)
            return self.original.register_buffer(name, tensor, persistent)
        super().register_buffer(name, tensor, persistent)

    def register_parameter(self, name, param) -> None:
        if self._passes_write(name):
            return self.original.register_parameter(name, param)
        super().register_parameter(name, param)

    def _refuse_replacing(self, name) -> None:
        if name == "original" and "original" in self.__dict__.get("_modules", {}):
            raise AttributeError("an fxfuse OptimizedModule's original module cannot be replaced or deleted: its "
                                 "graphs were built from that model. Call fxfuse.optimize(new_model, "
                                 "example_input) instead.")

    def __reduce_ex__(self, protocol):
        raise TypeError("an fxfuse OptimizedModule cannot be pickled or copied: it holds compiled kernels and "
                        "CUDA graphs. Save opt.original (or its state_dict()) and call fxfuse.optimize "
                        "again after loading.")


for _name in CONVERSIONS:   # to(), half(), cuda(), ...: the model's own where its class has one
    setattr(PassesThroughToOriginal, _name, _conversion(_name))
