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


def hook_loads(model, hook, handles: list, hooked) -> None:
    """`hook` on every submodule that has none yet (`hooked`, a WeakSet): a load into any drops the
    builds, also into one assigned since optimize, whose inference tensors have no version counter
    to tell (fuzz45c). A TorchScript child gets none: its parent's hook sees its load."""
    for m in model.modules():
        if m not in hooked and not isinstance(m, torch.jit.ScriptModule):
            handles.append(m.register_load_state_dict_post_hook(hook))
            hooked.add(m)


def remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def load_drops_specializations(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                               error_msgs) -> None:
    """opt.load_state_dict (or a parent's): drop the specializations (built from the old weights)
    and read the model's own keys as the original child's (state_dict_as_original).

    A state_dict saved by fxfuse before stop 36 names them "original.x" (as named_parameters()
    does): taken as they are where that reading names more of the model's keys than the plain
    one (a model may have a child called `original`: review36, review36b). An older fxfuse's "specialization_N." keys are
    dropped unless the model has such keys itself (review36: its own were deleted)."""
    module.drop_specializations("load_state_dict")
    module.__dict__["_load_prefix"] = prefix   # the names the post hook gives back
    module.__dict__["_absent"] = []
    own = _own_keys(module.original)
    ours = [k for k in state_dict if k.startswith(prefix)]
    for key in [k for k in ours if k[len(prefix):].startswith("specialization_") and k[len(prefix):] not in own]:
        del state_dict[key]
    ours = [k for k in ours if k in state_dict]
    inner = prefix + "original."
    if not ours or _named_as_older(own, [k[len(prefix):] for k in ours]):
        return
    if sensitive := version_sensitive(module.original):
        # torch looks each submodule's state version up by its full name, here "original."-prefixed,
        # which the checkpoint does not file: a module that converts old checkpoints by version
        # would convert this one again (review36: silently wrong weights). Raised here: such a
        # module may read its keys before torch reports errors (review36c: a KeyError)
        raise RuntimeError(f"fxfuse: {sensitive} loads by its state version, which a checkpoint of the model's "
                           f"own keys cannot pass through the optimized module at '{prefix[:-1] or 'the root'}': "
                           "load it into the model (opt.original) instead")
    # BatchNorm, finding no version for the prefixed name, fills a missing num_batches_tracked in:
    # the post hook reports it missing where eager would, the checkpoint filing BatchNorm's
    # version 2 (review36c); not for a dict without versions, which eager fills in too (review36d)
    metadata = getattr(state_dict, "_metadata", None) or {}
    module.__dict__["_absent"] = [
        prefix + k for k in own if k.endswith("num_batches_tracked") and prefix + k not in state_dict
        and metadata.get((prefix + k)[:-len("num_batches_tracked")].rstrip("."), {}).get("version", 1) >= 2]
    items = [(key, state_dict.pop(key)) for key in ours]   # all out first: "w" and "original.w" may both
    for key, value in items:                               # be the model's (a child called original)
        state_dict[inner + key[len(prefix):]] = value


def _own_keys(model) -> set:
    """The names of the model's parameters and buffers, as its state_dict() keys them (not asked of its
    state_dict(): a class may narrow its signature, review49r2)."""
    return {name for name, _ in (*torch.nn.Module.named_parameters(model, remove_duplicate=False),   # (torch's own:
                                 *torch.nn.Module.named_buffers(model, remove_duplicate=False))}   # a class may
    #                                                                        narrow these too, review49r4)


def _named_as_older(own: set, keys: list) -> bool:
    """Whether a checkpoint's keys name the model's tensors as "original.x" (an fxfuse before stop 36): where
    the two readings overlap (a root "w" and a child original's "w"), the one that names more of them."""
    return sum(k.startswith("original.") and k[len("original."):] in own for k in keys) > sum(k in own for k in keys)


def as_the_models_keys(model, state_dict):
    """opt.load_state_dict's checkpoint as the model's own load_state_dict takes it: an older fxfuse's
    "original.x" keys (and the metadata filed under them) as "x", its "specialization_N." keys dropped
    there unless the model has such keys itself. Loaded straight into the model, its own load hooks see the
    names and prefix they see without fxfuse (fuzz49f: a post hook that accepts a checkpoint missing an
    optional key saw "original.l2.bias", and the load raised where eager's loads)."""
    own = _own_keys(model)
    if not _named_as_older(own, list(state_dict)):   # (then a "specialization_" key is unexpected: review49r2)
        return state_dict
    inner = "original."
    out = type(state_dict)() if isinstance(state_dict, dict) else dict()
    for key, value in state_dict.items():
        if not key.startswith("specialization_") or key in own:
            out[key[len(inner):] if key.startswith(inner) else key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = type(metadata)((name[len(inner):] if name.startswith(inner) else "" if name == inner[:-1]
                                        else name, value) for name, value in metadata.items())
    return out


def version_sensitive(model) -> str | None:
    """The first submodule whose class has a state version above 1 (its loading, or a load hook,
    may convert older checkpoints by it), BatchNorm's and InstanceNorm's aside (their version 1
    paths only add a missing num_batches_tracked or drop running stats no current checkpoint
    holds), else None."""
    from torch.nn.modules.batchnorm import _NormBase
    for name, m in model.named_modules():
        if getattr(type(m), "_version", 1) > 1 and not isinstance(m, _NormBase):
            return f"{name or 'the model'} ({type(m).__name__})"
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
    absent = module.__dict__.pop("_absent", [])
    incompatible_keys.missing_keys.extend(k for k in absent if k not in incompatible_keys.missing_keys)


def state_dict_as_original(module, state_dict, prefix, local_metadata) -> None:
    """opt.state_dict() holds the model's keys, not "original."-prefixed ones: a parent whose
    child was swapped for its optimized version (`model.block = fxfuse.optimize(model.block, x)`)
    saves checkpoints that load into the plain model, and loads the ones saved before the swap
    (fuzz36e: both failed, and a `strict=False` load loaded nothing). The keys are ours, the
    last ones in the dict: popped and put back, they keep their order. Each submodule's metadata
    (its state version) is filed under the plain name too, the model's own in place of the
    OptimizedModule's (review36); named_parameters() is unchanged."""
    inner = prefix + "original."
    if version_sensitive(module.original):   # kept prefixed, so a load finds each version under its name
        return                                # (review36c: opt.load_state_dict(opt.state_dict()) failed)
    items = [(key, state_dict.pop(key)) for key in [k for k in state_dict if k.startswith(inner)]]
    for key, value in items:
        state_dict[prefix + key[len(inner):]] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for name in [n for n in metadata if n == inner[:-1] or n.startswith(inner)]:
            plain = (prefix + name[len(inner):]) if name != inner[:-1] else prefix[:-1]
            if name == inner[:-1]:
                metadata[plain] = metadata[name]
            else:
                metadata.setdefault(plain, metadata[name])
