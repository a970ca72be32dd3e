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
    the "specialization_N." keys that a state_dict of an older fxfuse holds. The model's own
    keys are read as the original child's (state_dict_as_original); "original."-prefixed ones
    (saved by fxfuse before stop 36) are taken as they are."""
    module.drop_specializations("load_state_dict")
    for key in [k for k in state_dict if k.startswith(prefix + "specialization_")]:
        del state_dict[key]
    inner = prefix + "original."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def state_dict_as_original(module, state_dict, prefix, local_metadata) -> None:
    """opt.state_dict() holds the model's keys, not "original."-prefixed ones: a parent whose
    child was swapped for its optimized version (`model.block = fxfuse.optimize(model.block, x)`)
    saves checkpoints that load into the plain model, and loads the ones saved before the swap
    (fuzz36e: both failed, and a `strict=False` load loaded nothing). The keys are ours, the
    last ones in the dict: popped and put back, they keep their order. Each submodule's metadata
    (its state version) is filed under the plain name too; named_parameters() is unchanged."""
    inner = prefix + "original."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for name in [n for n in metadata if n == inner[:-1] or n.startswith(inner)]:
            plain = (prefix + name[len(inner):]) if name != inner[:-1] else prefix[:-1]
            metadata.setdefault(plain, metadata[name])
