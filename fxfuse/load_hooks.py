"""load_state_dict hooks of an OptimizedModule: a load drops the specializations, whose weight
copies (folded BatchNorm, packed MLP weights, Strassen's blocks) it leaves stale."""
import functools
import operator
import weakref

import torch


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


def load_drops_specializations(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                               error_msgs) -> None:
    """opt.load_state_dict (or a parent's): drop the specializations (built from the old weights)
    and read the model's own keys as the original child's (state_dict_as_original).

    A state_dict saved by fxfuse before stop 36 names them "original.x" (as named_parameters()
    does): taken as they are where none of them is one of the model's own keys (a model may
    have a child called `original`: review36). An older fxfuse's "specialization_N." keys are
    dropped unless the model has such keys itself (review36: its own were deleted)."""
    module.drop_specializations("load_state_dict")
    module.__dict__["_load_prefix"] = prefix   # the names the post hook gives back
    own = set(module.original.state_dict(keep_vars=True))
    ours = [k for k in state_dict if k.startswith(prefix)]
    for key in [k for k in ours if k[len(prefix):].startswith("specialization_") and k[len(prefix):] not in own]:
        del state_dict[key]
    ours = [k for k in ours if k in state_dict]
    inner = prefix + "original."
    if all(k.startswith(inner) for k in ours) and not any(k[len(prefix):] in own for k in ours):
        return   # the older form ("original."-prefixed), or nothing of ours
    for key in ours:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)   # each submodule's state version, filed by its
    if metadata is not None:                            # plain name: the lookups go by the prefixed one
        for name in [n for n in metadata if n == prefix[:-1] or n.startswith(prefix) and not n.startswith(inner)]:
            metadata.setdefault(inner[:-1] + ("." + name[len(prefix):] if name != prefix[:-1] else ""), metadata[name])
    elif sensitive := version_sensitive(module.original):
        # a parent's load: torch looks each child's version up by its full name in metadata this
        # hook cannot reach, so a module that converts old checkpoints by version would convert
        # this one again (review36: silently wrong weights)
        error_msgs.append(f"fxfuse: {sensitive} loads by its state version, which a parent's load_state_dict "
                          f"cannot pass through the optimized module at '{prefix[:-1]}' for keys without "
                          "'original.': call load_state_dict on the optimized module itself, or load the "
                          "model before optimizing it")


def version_sensitive(model) -> str | None:
    """The first submodule whose own loading reads its state version (a `_version` above 1 and
    its own _load_from_state_dict), BatchNorm's aside (its version 1 path only adds a missing
    num_batches_tracked), else None."""
    from torch.nn.modules.batchnorm import _NormBase
    for name, m in model.named_modules():
        cls = type(m)
        if getattr(cls, "_version", 1) > 1 and cls._load_from_state_dict is not torch.nn.Module._load_from_state_dict \
                and cls._load_from_state_dict is not _NormBase._load_from_state_dict:
            return f"{name or 'the model'} ({cls.__name__})"
    return None


def keys_named_as_saved(module, incompatible_keys) -> None:
    """load_state_dict's missing and unexpected keys by the names opt.state_dict() uses (review36:
    "original.fc.bias" was reported for a key saved as "fc.bias")."""
    prefix = module.__dict__.get("_load_prefix")
    if prefix is None:
        return
    inner = prefix + "original."
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [prefix + k[len(inner):] if k.startswith(inner) else k for k in keys]


def state_dict_as_original(module, state_dict, prefix, local_metadata) -> None:
    """opt.state_dict() holds the model's keys, not "original."-prefixed ones: a parent whose
    child was swapped for its optimized version (`model.block = fxfuse.optimize(model.block, x)`)
    saves checkpoints that load into the plain model, and loads the ones saved before the swap
    (fuzz36e: both failed, and a `strict=False` load loaded nothing). The keys are ours, the
    last ones in the dict: popped and put back, they keep their order. Each submodule's metadata
    (its state version) is filed under the plain name too, the model's own in place of the
    OptimizedModule's (review36); named_parameters() is unchanged."""
    inner = prefix + "original."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for name in [n for n in metadata if n == inner[:-1] or n.startswith(inner)]:
            plain = (prefix + name[len(inner):]) if name != inner[:-1] else prefix[:-1]
            if name == inner[:-1]:
                metadata[plain] = metadata[name]
            else:
                metadata.setdefault(plain, metadata[name])
