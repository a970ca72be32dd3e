"""OptimizedModule: guards, specializations and CUDA-graph replay around rewritten graphs.

The example input fixes shapes. Every call computes a signature of its inputs (shape, dtype,
device, strides, and whether autograd would record) and runs the specialization built for
exactly that signature. A miss builds another one (up to options.max_specializations), then
runs the original module with one warning, or raises GuardError under strict=True. A kernel
built for other shapes never runs.

On CUDA a specialization is captured once in a CUDA graph whose inputs are static buffers, and
each call replays it. A contiguous input gets there through a memcpy node at the start of the
graph, re-pointed at the caller's tensor before the replay (input_copy.py: no host-side copy
launch); any other input is copied with copy_. The pool itself is the memory plan: during
capture the caching allocator reuses an intermediate's block once it is dead.

Outputs: a tensor returned by one call is never overwritten by the next; handout.py says how
(graph copies whose outputs are handed out while nobody holds them, else a clone).

Weights: a specialization holds copies of some weights (folded BatchNorm, packed fused-MLP weights,
Strassen's blocks). A load_state_dict, an in-place change of a buffer or of a parameter a copy was
made from (version counters, read per call), a parameter, buffer or submodule replaced, or an
attribute forward() reads assigned drops every specialization; the next call rebuilds.

Calls that run the original module instead, with one warning (GuardError under strict=True):
training mode, a forward hook, autocast, torch.jit.trace, grad-recording calls, torch.func
transforms and forward-mode AD, inputs aliasing each other where the graph writes in place,
and specializations used up. torch.compile and torch.export of opt trace the original module.
"""
import re
import threading
import time
import weakref
from collections import Counter

import torch
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from .attribute_reads import contained_tensors, merge_reads, plain_attributes, reassigned, watched_values
from .call_context import (COMPILER, FORWARD_AD, FX_TRACE_STATE, autocast_off, dynamo_traces, functorch_active,
                           holds_proxy, trace_tensors, traced_in_this_thread, user_mode_active)
from .concrete_args import (UNBINDABLE, bind_positional, positional_names, without_trailing_defaults,
                            wrapper_reads_keywords)
from .delegation import PassesThroughToOriginal
from .errors import FxfuseWarning, GuardError, UnsupportedError, as_fxfuse_error, warn  # noqa: F401 (re-export)
from .kernel import FusedKernel
from .load_hooks import (RebuildOnLoad, keys_named_as_saved, load_drops_specializations, remove_hooks,
                         state_dict_as_original)
from .log import logger, model_warnings_once
from .mode_watch import (GRAD_REASON, GradRecording, held_elsewhere, training_key, training_reason,
                         training_submodule, watched_modules)
from .module_state import (GLOBAL_HOOKS, INFERENCE_COPIES, REGISTRATIONS, children_now, forward_hook_owner, moved,
                           overlapping, share_memory, storage_address, storages, structure_changed, version,
                           watch_entries)
from .node_meta import fetch_attr
from .precision import baked_settings, settings_changed
from .specialization import (Specialization, UnsupportedInput, closest_signature,  # noqa: F401 (re-export)
                             describe_mismatch, input_not_plain, reads_unit_strides, signature, unit_strides_alike,
                             writes_an_input)
from .state_watch import StateWatch
from .torch_hooks import (MODE_CHANGES, OPTIMIZED, PARAMETRIZE_CACHED, REPARAMETRIZING, SWAPPED, UNVERSIONED_STEPS,
                          swapped_now)
from .tracing import autocast_enabled, clone_args


_RebuildOnLoad = RebuildOnLoad   # the name models pickled with an older fxfuse's hook refer to

# One build at a time per process: symbolic tracing patches nn.Module.__call__ process-wide
# (another thread running modules meanwhile, e.g. a shape propagation, fails with "module is
# not installed as a submodule"), and the quiet-trace stdout redirect is process-wide too
BUILD_LOCK = threading.RLock()
RUNNING_ORIGINAL = [0]   # _run_original calls in progress (under BUILD_LOCK)
BUILDING = [0]   # builds in progress (under BUILD_LOCK: the thread that owns it is the one building)
ALIASED = ("two inputs share memory, or an input is (a view of) a parameter or buffer of the model or a tensor it "
           "holds, and the graph writes an input in place (fusion assumed distinct tensors)")
MAX_MISSES_KEPT = 32


class OptimizedModule(StateWatch, PassesThroughToOriginal, torch.nn.Module):
    """What fxfuse.optimize returns: the original module's behaviour, specialized and fused."""

    fxfuse_runtime = True   # module_state: its call counters are bookkeeping, not model state

    def __init__(self, model: torch.nn.Module, example_args: tuple, options, build):
        super().__init__()
        self.original = model
        self._options, self._build = options, build   # build: (model, args, options) -> GraphModule
        self._specializations: dict = {}
        self._misses: list = []             # the first MAX_MISSES_KEPT guard misses (explain shows the count)
        self._miss_count, self._last_miss, self._warned = 0, None, set()
        self._original_calls = Counter()    # calls that ran the original module, by reason (explain)
        self._failed_builds: dict = {}     # signature -> why its build failed (not tried again)
        self._trimmed: dict = {}           # signature with trailing defaults -> (its trimmed one, its length)
        self._state_rebuilds = 0           # rebuilds because buffers moved or attributes were assigned (warned at REBUILD_WARN_AFTER)
        self._dropped = (0, 0, 0, None)     # rebuilds so far, their kernels' launches and fallbacks, the last reason
        self._buffer_versions = self._attributes = ()   # (_watch_state and add_specialization, after a build)
        self._attribute_reads = {}         # what the builds' traces read of the model's plain attributes
        self._written_attributes = {}      # (id(module), name) -> label: what the graphs write back (attribute_writes)
        self._structure, self._registrations_seen = [], REGISTRATIONS[0]
        self._modes, self._modes_seen = (), MODE_CHANGES[0]   # every module's training flag at the build
        self._children, self._child_list = (), []   # submodule dicts: a deletion fires no hook (_watch_state)
        self._hook_ids_seen = self._hook_ids_scanned = -1   # see _hook_added
        self._hooked = None
        self._writes_in_place = False      # a graph keeps an in-place op (its inputs must not alias)
        self._model_storages = self._read_storages = frozenset()   # the aliasing guard's (add_specialization)
        self._computed_from = frozenset()  # storages the builds' traces computed constants from (_watch_state)
        self._plain_tensors = []           # tensor attributes the traces read (add_specialization); a list
        self._grad = GradRecording(model, self._plain_tensors)   # what the builds' probes found about autograd,
        #                                     and the rule; the list shared, not a closure: no cycle through self
        self._mutable_defaults = ()        # forward()'s changeable defaults, fingerprinted (_watch_state)
        # the example's trailing defaults left out, as a call's (`optimize(m, (x, 1.0))` for alpha=1.0,
        # then `opt(x)`: a second build of the same graph otherwise, or the original: fuzz41c)
        self._load_hook, self._load_handles, self._load_hooked = RebuildOnLoad(self), [], weakref.WeakSet()
        weakref.finalize(self, remove_hooks, self._load_handles)
        OPTIMIZED.add(self)   # (functional_call renames keys only where one lives: torch_hooks)
        self.add_specialization(without_trailing_defaults(model.forward, example_args))
        self.register_load_state_dict_pre_hook(load_drops_specializations)
        self.register_state_dict_post_hook(state_dict_as_original)
        self.register_load_state_dict_post_hook(keys_named_as_saved)
        self._passing_through = True   # from here, a write of the original's names is the original's

    def _state_edited(self) -> None:
        """Drop the specializations if the model changed since the build in a way they baked in:
        a buffer written in place (BatchNorm statistics after a training call), a parameter,
        buffer or submodule replaced (`model.lin = nn.Linear(...)`), a plain attribute assigned
        (`model.scale = 2.0`). REGISTRATIONS moves for any module of the process: then only
        the identities are compared. Under BUILD_LOCK: a build in another thread finishes (and
        is dropped) first, or it would install a graph of the old state after the drop."""
        with BUILD_LOCK:
            self._drop_if_edited()

    def add_specialization(self, args) -> Specialization:
        start = time.perf_counter()
        first = not self._specializations
        self._flags = baked_settings()
        with BUILD_LOCK, autocast_off(), model_warnings_once():   # model dtypes (autocast: the original)
            BUILDING[0] += 1
            try:
                gm = self._build(self.original, args, self._options)
            finally:
                BUILDING[0] -= 1
        written = {(id(m), k): label for m, k, label in gm.meta.get("fxfuse_attribute_writes", ())}
        if not first and set(written) != set(self._written_attributes):   # (review41b: RevIN called with
            names = ", ".join(sorted({*written.values(), *self._written_attributes.values()}))   # 'denorm' folded
            raise UnsupportedError(                                          # the 'norm' call's mean)
                f"forward() assigns module attributes ({names}) for some inputs and not for others: a graph "
                "that reads one would keep the value it saw")
        self._written_attributes = written
        own = {id(m) for m in self.original.modules()}   # a fresh GraphModule (and its kernels) says training;
        for m in gm.modules():                            # the model's own submodules keep theirs (fuzz34i:
            if id(m) not in own:                          # gm.train() switched a child the user had put in
                m.training = self.original.training       # training mode back to eval)
        spec = Specialization(gm, args, self._options, 1e3 * (time.perf_counter() - start),
                              tuple(self.original.parameters()) + tuple(self.original.buffers()))
        # the aliasing guard's: a kept in-place op that may write an input or a model tensor (a write into a
        # tensor forward() made cannot reach them: fuzz39e, `opt(x, x)` of a mask filled in place was refused)
        self._writes_in_place |= writes_an_input(gm, ("placeholder", "get_attr"))
        self._specializations[spec.signature] = spec
        # plain attributes the traces read: assigned anew after optimize() (or a tensor one
        # written in place) they rebuild, and so do the model tensors only copies of are read
        self._attribute_reads = merge_reads(self._attribute_reads,
                                            gm.meta.get("fxfuse_trace", {}).get("attribute_reads", {"all": True}))
        self._attributes = plain_attributes(self.original, self._attribute_reads, frozenset(self._written_attributes))
        plain_tensors = [v for v in watched_values(self._attributes) if isinstance(v, torch.Tensor)]
        self._plain_tensors[:] = plain_tensors + contained_tensors(self._attributes)
        elsewhere = held_elsewhere(self.original)
        spec.model_tensors += tuple(self._plain_tensors) + elsewhere   # returned as themselves,
        #   as eager does (fuzz38f; a module-level tensor or an unregistered module's weight: fuzz44c)
        own = storages((*self.original.parameters(), *self.original.buffers(), *self._plain_tensors))
        self._read_storages |= gm.meta.get("fxfuse_read_storages", frozenset())
        # the aliasing guard's: an input that is one of them must not be written under a copy's reader (a
        # plain tensor attribute too: review38; a module-level tensor, an unregistered weight: review38c)
        self._model_storages = own | self._read_storages | storages(elsewhere)
        # watched after the build (its checks run the original once): with the modules held unregistered that a
        # graph reads or computed from (fuzz48d), again where a later build reads more (review48r1)
        self._computed_from |= storages(gm.meta.get("fxfuse_fold_sources", ()))
        modules = watched_modules(self.original, self._read_storages | self._computed_from)
        if first or {id(m) for m in modules} != {id(m) for m, *_ in self._structure}:
            kept = self._buffer_versions   # the earlier builds' copies: unchanged, this call checked them
            self._watch_state(modules)
            seen = {id(t) for t, *_ in self._buffer_versions}
            self._buffer_versions += tuple(e for e in kept if id(e[0]) not in seen)
        self._grad.note_build(gm.meta.get("fxfuse_trace", {}), any(
            getattr(fetch_attr(gm, n.target), "requires_grad", False) for n in gm.graph.nodes if n.op == "get_attr"),
            self._read_storages, args)
        watched = {id(t) for t, *_ in self._buffer_versions}
        copied = gm.meta.get("fxfuse_copied", ())
        self._buffer_versions += watch_entries(self.original, (t for t in dict.fromkeys(
            (*copied, *plain_tensors, *overlapping(copied, (*self.original.parameters(), *self.original.buffers(),
                                                            *self._plain_tensors, *elsewhere))))
            if id(t) not in watched))   # (an alias with a counter of its own: `self.pd = self.p.data`, fuzz48d)
        # not a child module: a GraphModule shares the original's submodules, and every parameter
        # under two names reads as tied weights to torch.func.functional_call, which then leaves
        # the temporary tensors in the model after the call
        if any(version(t) is None and storage_address(t) in own   # the model's, not trace-time constants
               for t in gm.meta.get("fxfuse_copied", ())):     # (fuzz38f)
            self._warn_once("inference-copies", INFERENCE_COPIES)
        if gm.meta.get("fxfuse_warning"):   # once per OptimizedModule, not per specialization
            self._warn_once("no-cuda", gm.meta["fxfuse_warning"])
        return spec

    def _apply(self, fn, *args, **kwargs):
        """opt.half(), opt.to(device): the specializations hold weight copies (and CUDA graphs the
        addresses) of the old dtype and device; the next call builds from the converted original.
        A conversion that changes nothing (opt.float() of an fp32 model) keeps them."""
        return self._converted(lambda: super(OptimizedModule, self)._apply(fn, *args, **kwargs))

    def _converted(self, convert):
        """Run a conversion; drop the specializations if it moved or converted a weight."""
        def tensors():
            return [(t.data_ptr(), t.dtype, t.device) for t in (*self.original.parameters(), *self.original.buffers())]
        before = tensors()
        out = convert()
        if tensors() != before:
            self.drop_specializations("the module was converted (.to(), .half(), .cuda(), ...)")
        return out

    def drop_specializations(self, reason: str) -> None:
        """Forget every specialization (the next call builds one from the current weights)."""
        self._failed_builds = {}   # the state changed: a build that failed may work now
        self._trimmed = {}
        if not self._specializations:
            return
        logger.info("dropping %d specialization(s), the next call rebuilds: %s", len(self._specializations), reason)
        kernels = list(self.fused_kernels())   # stats() and explain() count them on (review42e)
        self._dropped = (self._dropped[0] + 1, self._dropped[1] + sum(k.launches for k in kernels),
                        self._dropped[2] + sum(k.fallbacks for k in kernels), reason)
        self._specializations, self._misses, self._miss_count, self._last_miss = {}, [], 0, None
        self._grad.forget_builds()   # found again by the next build's probes
        self._read_storages = self._computed_from = frozenset()
        self._buffer_versions, self._attributes, self._attribute_reads = (), (), {}   # watched again from the
        self._structure, self._children, self._child_list = [], (), []                 # next build (_watch_state)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and not RUNNING_ORIGINAL[0]:   # inside an optimized parent's original
            # run, whose one warning told the cause (fuzz34h: a child in training mode warned twice)
            self._warned.add(key)
            warn(message)

    def __call__(self, *args, **kwargs):
        """nn.Module.__call__ minus two Python frames when nothing can hook the call (no hook on opt,
        no TorchScript tracing, opt not torch.compile'd): a small model's call is bound by the host.
        Not global hooks: with one set, the original runs, and runs them as eager does (fuzz45c)."""
        d = self.__dict__
        if torch._C._get_tracing_state():   # the guards would read traced sizes: trace the original
            return self._run_original("jit", "torch.jit.trace records the original module (the optimized "
                                      "graph's kernels and CUDA graph are not TorchScript)", args, kwargs)
        if (GLOBAL_HOOKS is None or d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                or d["_backward_pre_hooks"] or d.get("_compiled_call_impl") is not None):
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        # torch.compile and torch.export trace the original (fxfuse's runtime is no graph: Triton's launcher,
        # CUDA graphs); so do optimize() of a model that holds opt and the user's torch.fx trace of one (the
        # guards cannot read proxies; another thread's trace: the call waits). Here, not in __call__:
        # opt.compile(), torch.compile(opt.forward), a parent calling opt.forward and opt's own hooks come
        # through forward too. Inside a build in this thread (a parent's verify and grad probes): the
        # original too, so a parent's builds spend none of opt's specializations or warnings
        if dynamo_traces() or COMPILER._is_compiling_flag and trace_tensors(args, kwargs) or BUILDING[0] \
                and BUILD_LOCK._is_owned() or FX_TRACE_STATE._is_fx_tracing_flag and (holds_proxy(args, kwargs) or traced_in_this_thread()):
            return self.original(*args, **kwargs)
        given = (args, kwargs)   # the call as made: what the original gets where it runs (fuzz45c: a
        if kwargs:               # with_kwargs hook saw the keywords as positions); model(x, scale=3.0) is
            #                      the same call as model(x, 3.0), which is what was traced
            if (why := wrapper_reads_keywords(self.original, args, kwargs)) is not None:
                return self._run_original("kwargs:wrapper", why, *given)
            positional = bind_positional(self.original.forward, args, kwargs)
            if positional is UNBINDABLE:   # an unknown keyword, a parameter given twice: eager's TypeError
                return self.original(*args, **kwargs)
            if positional is None:
                return self._run_original("kwargs", f"keyword arguments {sorted(kwargs)}: fxfuse binds keywords to "
                                          "positions and specializes on their values, and this call sets a "
                                          "keyword-only or **kwargs parameter of "
                                          f"{type(self.original).__name__}.forward to a value other than its "
                                          "default, or would fill in a default before them that is not a plain "
                                          "value (a function, a module, a tensor, NaN)", *given)
            args = positional
        if self._modules["original"].training or self._mode_modules and self._submodule_training():
            return self._run_original(training_key(self.original), training_reason(self.original), *given)
        if REPARAMETRIZING[0] and swapped_now(self, self.original):   # inside torch.func.functional_call
            return self._run_original("swapped", SWAPPED, *given)
        if parametrize._cache_enabled and any(map(parametrize.is_parametrized, self.original.modules())):   # fuzz48c
            return self._run_original("parametrize", PARAMETRIZE_CACHED, *given)
        if autocast_enabled():
            return self._run_original("autocast", "torch.autocast is on; the optimized graph computes in the "
                                      "dtypes it was built with, autocast would change them", *given)
        if RemovableHandle.next_id != self._hook_ids_seen and self._hook_added():
            return self._run_original("hook", f"{self._hooked}, which the optimized graph would not run", *given)
        if self._writes_in_place and share_memory(args, self._model_storages):
            return self._run_original("aliased", ALIASED, *given)
        if (self._buffer_versions and moved(self._buffer_versions) or REGISTRATIONS[0] != self._registrations_seen
                or MODE_CHANGES[0] != self._modes_seen
                or UNVERSIONED_STEPS[0] != self._steps_seen
                or children_now(self._children) != self._child_list   # a deletion, `m._modules[k] = new` (no hook)
                or self._attributes and reassigned(self._attributes) or settings_changed(self._flags)
                or self._mutable_defaults and self._defaults_moved()):
            self._state_edited()
        if (torch.is_grad_enabled() or self._grad.enables_grad) and self._grad.records(args):
            return self._run_original("grad", GRAD_REASON, *given)
        if (self._grad.traced_inference is not None or self._grad.input_inference is not None) \
                and (why := self._grad.inference_reason(args)):
            return self._run_original("inference", why, *given)
        if user_mode_active():
            return self._run_original("mode", "a TorchFunctionMode or TorchDispatchMode is active; eager runs every "
                                      "op through it, the optimized graph's fused kernels would not", *given)
        if functorch_active() or FORWARD_AD._current_level >= 0:
            return self._run_original("transform", "a torch.func transform (vmap, jvp, jacfwd) or forward-mode AD "
                                      "(torch.autograd.forward_ad) is active; the optimized graph's kernels take "
                                      "plain tensors and would drop batching and tangents", *given)
        try:
            sig = signature(args)
        except UnsupportedInput as e:   # sparse, nested, a tensor subclass: no kernel was built for it
            return self._run_original("layout", f"{e}; fxfuse's kernels take plain strided tensors", *given)
        # threads: one call or build at a time. While one thread traces, torch.fx patches nn.Module.__call__
        # process-wide, and a graph's module calls in another thread would be recorded into that trace; a
        # CUDA graph's input binding and replay are one step; and another thread may have built this
        # signature, or taken the last slot, meanwhile
        with BUILD_LOCK:
            spec = self._specializations.get(sig)
            if spec is None and sig in self._trimmed:   # model(x, 1.0) with 1.0 forward()'s default
                short, length = self._trimmed[sig]
                if short in self._specializations:
                    return self._run(self._specializations[short], args[:length])
            return self._run(spec, args) if spec is not None else self._miss(sig, args)

    def _run(self, spec, args):
        try:
            if torch.is_grad_enabled():   # forward() records nothing itself (@torch.no_grad()): nor may the
                with torch.no_grad():     # graph's library calls (not entered per call otherwise: host time)
                    return spec(args)
            return spec(args)
        except Exception:
            # `lin.register_parameter("bias", None)` fires no registration hook: a graph without a
            # CUDA graph then fails on the missing tensor. Compared only here, where it costs nothing
            if not self._specializations or not structure_changed(self._structure):
                raise
        self._drop_if_edited()
        return self._miss(signature(args), args)

    def _miss(self, sig, args):
        """A call whose signature has no specialization: build one, or run the original."""
        if sig in self._failed_builds:
            return self._run_original(*self._failed_builds[sig], args)
        if why := input_not_plain(args):   # a quantized tensor passes signature()'s short way
            return self._run_original("layout", f"{why}; fxfuse's kernels take plain strided tensors", args)
        if bind_positional(self.original.forward, args, {}) is UNBINDABLE:   # o() or o(x, x) for forward(x): eager's TypeError,
            return self.original(*args)               # not a guard miss (nor its one warning)
        trimmed, full = without_trailing_defaults(self.original.forward, args), sig
        if len(trimmed) < len(args):   # model(x, y, 1.0) with alpha=1.0 the default: model(x, y), and the
            args, sig, dropped = trimmed, signature(trimmed), args[len(trimmed):]
            if len(self._trimmed) < MAX_MISSES_KEPT and all(   # next such call finds it in forward; not
                    isinstance(a, (bool, int, float, str, type(None))) for a in dropped):   # a tensor default:
                self._trimmed[full] = (sig, len(trimmed))   # another tensor of its shape has the same signature
            if sig in self._specializations:
                return self._run(self._specializations[sig], args)
            if sig in self._failed_builds:
                return self._run_original(*self._failed_builds[sig], args)
        alike = unit_strides_alike(sig, {s: spec for s, spec in self._specializations.items()
                                         if not reads_unit_strides(spec)})
        if alike is not None:   # a batch-1 row made as `col.T`: strides (1, 1) where the build had (8, 1)
            if len(self._trimmed) < MAX_MISSES_KEPT:   # (fuzz41c: a second build of the same graph, or the
                self._trimmed[full] = (alike, len(args))   # original once the slots were used up)
            return self._run(self._specializations[alike], args)
        if len(self._failed_builds) >= MAX_MISSES_KEPT:   # each new one would run a whole failing build
            return self._run_original("build:limit", f"{MAX_MISSES_KEPT} input signatures failed to build; new "
                                      "ones run the original module without trying", args)
        rebuild = not self._specializations
        if rebuild:      # dropped (load_state_dict, buffers moved): build from the new state
            reason = "rebuilt from the model's current weights and buffers"
        else:
            told = min((sig, full), key=lambda s: closest_signature(list(self._specializations), s, count=True))
            reason = describe_mismatch(closest_signature(list(self._specializations), told), told,   # a default
                                       positional_names(self.original.forward))   # spelled out: review39b
            self._miss_count, self._last_miss = self._miss_count + 1, reason
            if len(self._misses) < MAX_MISSES_KEPT:
                self._misses.append(reason)
        if len(self._specializations) >= self._options.max_specializations:
            n = self._options.max_specializations
            held = f"all {n} specializations are" if n != 1 else "the one specialization is"
            return self._run_original("full", f"{reason}; {held} in use (option max_specializations)", args)
        if rebuild and (hooked := forward_hook_owner(self.original)):   # a module assigned since, with its hook:
            return self._run_original("hook", f"{hooked}, which the optimized graph would not run", args)   # fuzz33e
        if training_submodule(self.original) is not None:   # a module assigned since: its training branch
            return self._run_original(training_key(self.original), training_reason(self.original), args)   # must not be traced
        try:
            spec = self.add_specialization(args)
        except Exception as e:  # noqa: BLE001 -- as optimize(): internal errors fall back too
            # the original runs first: an input the model itself rejects (an index out of
            # range, a wrong feature size) gets the model's own error, and the signature is
            # not marked as failed, so valid inputs of the same shapes are built later
            result = self.original(*(clone_args(args) if self._options.strict else args))   # strict raises:
            e = as_fxfuse_error(e, "building a specialization")   # the caller's tensors must stay unwritten
            if self._options.strict:                                 # (fuzz34k: x was written, then the retry
                raise e                                             # wrote it again)
            message = (f"no specialization for a new input ({reason}): {e}" if not rebuild else
                       f"rebuilding after a change to the model (weights, buffers, attributes) failed: {e}")
            key = "build:" + re.sub(r"\d+", "#", str(e).splitlines()[0] if str(e) else type(e).__name__)
            self._failed_builds[sig] = (key, message)   # not built again; one warning per cause, not per shape
            self._count_original(key, message)
            return result
        logger.info("built specialization %d: %s", len(self._specializations), reason)
        if self._grad.records(args):   # the build's probes found that it records now
            return self._run_original("grad", GRAD_REASON, args)
        if self._writes_in_place and share_memory(args, self._model_storages):   # the rebuilt model's tensors: a
            return self._run_original("aliased", ALIASED, args)   # table reassigned, then passed in (review38b)
        return self._run(spec, args)

    def _run_original(self, key: str, reason: str, args, kwargs=None):
        """This call runs the original module: GuardError under strict=True, else one warning per
        kind of reason (`key`), and a count explain() shows."""
        if self._options.strict:
            raise GuardError(reason)
        self._count_original(key, reason)
        with BUILD_LOCK:   # not while another thread traces (see forward)
            RUNNING_ORIGINAL[0] += 1
            try:
                return self.original(*args, **(kwargs or {}))
            finally:
                RUNNING_ORIGINAL[0] -= 1

    def _count_original(self, key: str, reason: str) -> None:
        self._warn_once(key, f"fxfuse: {reason}; running the original module")
        self._original_calls[key.split(":")[0]] += 1

    def fused_kernels(self):   # a copy of the dict: another thread may be building (fuzz38f)
        return (m for spec in list(self._specializations.values()) for m in spec.gm.modules()
                if isinstance(m, FusedKernel))
