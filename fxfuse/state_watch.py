"""The model's state an OptimizedModule watches between calls, kept apart from the call path in runtime.py:
what a build baked in (buffer versions, the structure, modes, attributes forward() reads, mutable defaults,
torch's settings), and the per-call checks that tell an edit since (a mixin of OptimizedModule)."""
from torch.utils.hooks import RemovableHandle

from .attribute_reads import reassigned
from .concrete_args import mutable_defaults
from .fingerprint import fingerprint
from .load_hooks import hook_loads
from .module_state import (GLOBAL_HOOKS, REGISTRATIONS, children_now, forward_hook_owner, mode_free, moved, structure,
                           structure_changed, swapped, watch_entries)
from .precision import baked_settings
from .torch_hooks import MODE_CHANGES, UNVERSIONED_STEPS

REBUILD_SERVED_CALLS = 8   # a rebuild after fewer calls than this counts towards the "keep changing" warning,
REBUILD_WARN_AFTER = 8     # given at this many such rebuilds in a row (a change per call; a few edits by hand
#                            between calls, as when tuning a model interactively, are no reason to warn)


class StateWatch:
    """The part of OptimizedModule that records the model's state after a build and tells an edit since.

    It uses the module's original, _specializations, _attributes, _flags, _load_hook/_load_handles/_load_hooked,
    drop_specializations() and _warn_once()."""

    def _watch_state(self, modules: tuple) -> None:
        """What forward() checks per call besides the guards, kept short for the hot path: the
        submodules whose mode may matter (all but the types below, whose forward ignores it)
        and each buffer's version counter (BatchNorm statistics move in place when the original
        runs in training mode, after which the folded copies are stale)."""
        model = self.original
        self._mode_modules = tuple(m for m in modules if m is not model and not mode_free(m))
        self._buffer_versions = watch_entries(model, dict.fromkeys(b for m in modules for b in m.buffers(recurse=False)))
        self._structure, self._registrations_seen = structure(modules), REGISTRATIONS[0]
        self._modes, self._modes_seen = tuple((m, m.training) for m in modules), MODE_CHANGES[0]
        self._steps_seen = UNVERSIONED_STEPS[0]
        self._mutable_defaults = mutable_defaults(model)
        self._children = tuple(m._modules for m, _, _, children, _ in self._structure if children)   # live dicts
        self._child_list = children_now(self._children)
        self._hook_dicts = tuple(d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)) \
            + tuple(GLOBAL_HOOKS[2:] if GLOBAL_HOOKS is not None else ())   # _hook_added: any() over them
        hook_loads(model, self._load_hook, self._load_handles, self._load_hooked)

    def _drop_if_edited(self) -> None:
        now = children_now(self._children)   # the structure is walked only after a registration, a deletion or
        registered = REGISTRATIONS[0] != self._registrations_seen or now != self._child_list   # a _modules write
        self._registrations_seen, self._child_list, self._modes_seen = REGISTRATIONS[0], now, MODE_CHANGES[0]
        since, self._steps_seen = self._steps_seen, UNVERSIONED_STEPS[0]   # steps after `since` wrote what?
        if self._buffer_versions and moved(self._buffer_versions):
            reason = ("a buffer, tensor attribute or parameter the graph holds a copy of changed in place (or "
                      "was replaced in its module's _parameters / _buffers) since the build")
        elif since != self._steps_seen and any(UNVERSIONED_STEPS[1].get(id(t), 0) > since
                                               for t, *_ in self._buffer_versions):
            reason = ("a fused optimizer step (fused=True: no version counter sees its writes) changed a parameter "
                      "the graph holds a copy of")
        elif registered and (structure_changed(self._structure) or swapped(self._buffer_versions)):
            reason = "a parameter, buffer or submodule of the model was replaced since the build"
        elif any(m.training != flag for m, flag in self._modes):
            reason = "a submodule's training flag changed since the build (forward() may read it)"
        elif name := reassigned(self._attributes):
            reason = f"attribute {name!r} of the model was assigned, deleted or changed in place since the build"
        elif self._mutable_defaults and self._defaults_moved():   # fingerprinted again by the next build
            reason = "a list, dict, set or object default of forward() changed since the build"
        elif baked_settings() != self._flags:   # factories and promotion follow the default dtype, and
            # the fp32 precision is baked into the kernels and the CUDA graph's library calls
            reason = ("torch's default dtype or device, fp32 precision (TF32) or reduced-precision fp16/bf16 "
                      "reduction setting changed since the build")
        else:
            return
        served = sum(spec.calls for spec in self._specializations.values())
        self.drop_specializations(reason)
        # counted while the builds serve few calls each: a change per epoch (train, then
        # evaluate) is the usual case, a change per call the one worth a warning
        self._state_rebuilds = self._state_rebuilds + 1 if served < REBUILD_SERVED_CALLS else 1
        if self._state_rebuilds == REBUILD_WARN_AFTER:
            self._warn_once("buffers", f"fxfuse: the model's state or torch's settings keep changing between calls "
                            f"({reason}); each change rebuilds the optimized graph (folded and packed copies "
                            "would be stale). Call the original module for such use.")

    def _defaults_moved(self) -> bool:
        return any(fingerprint(d) != seen for d, seen in self._mutable_defaults)

    def _submodule_training(self) -> bool:
        for m in self._mode_modules:
            if m.training:
                return True
        return False

    def _hook_added(self) -> str | None:
        """Where a forward hook sits on the original (forward_hook_owner), else None. Any new hook
        anywhere bumps torch's handle counter, so forward() searches the modules again only then
        (or while a hook is there, to see it go): one integer compare per call otherwise."""
        now = RemovableHandle.next_id
        self._hooked = forward_hook_owner(self.original) if any(self._hook_dicts) else None
        # settled after two scans at the same count (register_forward_hook counts before it
        # inserts: a call in between must not settle on "no hook"); never while a hook is there
        self._hook_ids_seen = now if now == self._hook_ids_scanned and not self._hooked else -1
        self._hook_ids_scanned = now
        return self._hooked

