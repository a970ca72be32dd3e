"""load_state_dict hooks of an OptimizedModule: a load drops the specializations, whose weight
copies (folded BatchNorm, packed MLP weights, Strassen's blocks) it leaves stale."""
import functools
import operator
import weakref


class RebuildOnLoad:
    """load_state_dict post hook on every submodule of the original model: drops the
    OptimizedModule's specializations, whose weight copies are stale after the load.

    Holds only a weakref (the model must not keep the OptimizedModule alive), and pickles or
    deep-copies as a no-op hook that needs no fxfuse: torch.save(model) and copy.deepcopy(model)
    keep working, and a copy of the model does not invalidate the OptimizedModule built from
    the original."""

    def __init__(self, owner):
        self._owner = weakref.ref(owner)

    def __call__(self, module, incompatible_keys) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            owner.drop_specializations(f"load_state_dict on {type(module).__name__}")

    def __reduce__(self):
        # a no-op hook made of builtins only (it files the load's result in a dict of its own):
        # a model saved with torch.save while an OptimizedModule watches it loads where fxfuse is
        # not installed (fuzz35d), and a copy's loads do not reach the original's OptimizedModule
        return functools.partial, (operator.setitem, {})


def remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def load_drops_specializations(module, state_dict, prefix, *args) -> None:
    """opt.load_state_dict: drop the specializations (built from the old weights), and ignore
    the "specialization_N." keys that a state_dict of an older fxfuse holds. opt.state_dict()
    is the original's, under "original." (the specializations are not child modules)."""
    module.drop_specializations("load_state_dict")
    for key in [k for k in state_dict if k.startswith(prefix + "specialization_")]:
        del state_dict[key]
