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

Weights: a specialization holds copies of some weights (BatchNorm folded into Linear/Conv,
packed fused-MLP weights, Strassen's combined blocks), so new weights need a new build. A
load_state_dict on the model (or on the OptimizedModule, whose state_dict is the original's)
drops every specialization and the next call rebuilds; in-place edits of parameters
(`w.data.mul_()`, an optimizer step) are not seen: call fxfuse.optimize again.
"""
import inspect
import time
import weakref
from collections import Counter, OrderedDict

import torch
import torch.fx
from torch.utils.hooks import RemovableHandle

from .errors import FxfuseWarning, GuardError, as_fxfuse_error, warn  # noqa: F401  (FxfuseWarning re-exported)
from .graph_launch import GraphLauncher, draws_random_numbers, generator_offset
from .handout import HANDOUT_SLOTS, SlotChoice, inside, own_pool_fits, pool_segments
from .input_copy import GraphInputs, can_bind, new_graph
from .kernel import FusedKernel
from .log import logger
from .module_state import GLOBAL_HOOKS, MODE_FREE, forward_hook_owner, share_memory, version


def signature(args) -> tuple:
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.dtype, a.device, tuple(a.stride()), a.requires_grad))
        else:
            sig.append(("const", type(a).__name__, repr(a)))
    return tuple(sig)


def describe_mismatch(expected: tuple, got: tuple) -> str:
    if len(expected) != len(got):
        return f"expected {len(expected)} inputs, got {len(got)}"
    fields = ("shape", "dtype", "device", "stride", "requires_grad")
    for k, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            if e[0] == "const" or g[0] == "const":
                return f"input {k}: expected {e[-1]}, got {g[-1]}"
            for name, ev, gv in zip(fields, e, g):
                if ev != gv:
                    return f"input {k}: {name} {gv} where the specialization has {ev}"
    return "no difference"


class Specialization(SlotChoice):
    """One rewritten graph for one input signature, run directly or through a CUDA graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_args: tuple, options, build_ms: float):
        self.gm = gm
        self.options = options
        self.build_ms = build_ms
        self.signature = signature(example_args)
        self.tensor_positions = [k for k, a in enumerate(example_args) if isinstance(a, torch.Tensor)]
        self.all_tensors = len(self.tensor_positions) == len(example_args)   # args are the tensors
        self.graph = None
        self.cuda_graph_note = "not on CUDA"
        self.handout = None                # list of OutputSlots once captured; None: always clone
        self.handout_note = "outputs returned directly (no CUDA graph)"
        self.calls = self.handed_out = self.cloned = 0
        devices = {a.device for a in example_args if isinstance(a, torch.Tensor)}
        if options.cuda_graphs and devices and all(d.type == "cuda" for d in devices):
            self._capture(example_args)
        elif not options.cuda_graphs:
            self.cuda_graph_note = "off (cuda_graphs=False)"

    def _tensor_args(self, args):
        return [args[k] for k in self.tensor_positions]

    def _with_static(self, args) -> list:
        """args with each tensor replaced by its static buffer (scalars are guarded constants)."""
        full = list(args)
        for k, s in zip(self.tensor_positions, self.static_in):
            full[k] = s
        return full

    def _capture(self, example_args):
        if self.gm.meta.get("fxfuse_inplace_kept"):
            self.cuda_graph_note = "off: the model mutates a tensor in place that may be an input"
            return
        try:
            with torch.inference_mode(False), torch.no_grad():   # plain tensors: later calls may run outside it
                static_in = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                             for a in self._tensor_args(example_args)]
                for s, a in zip(static_in, self._tensor_args(example_args)):
                    s.copy_(a)
                # inputs that come in through a memcpy node of the graph (input_copy.py) and the rest
                self.bound_in = [(k, s.clone()) for k, s in enumerate(static_in) if can_bind(s)]
            self.static_in = static_in
            self.copied_in = [(k, s) for k, s in enumerate(static_in) if not can_bind(s)]
            self.const_args = tuple(None if isinstance(a, torch.Tensor) else a for a in example_args)
            static_args = self._with_static(example_args)
            self._set_pdl(True)     # before the warm-up: it compiles the kernels the graph launches
            self.device_index = static_in[0].device.index if static_in else torch.cuda.current_device()
            offset = generator_offset(self.device_index)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):  # compiles kernels, creates library handles
                    self.gm(*static_args)
            torch.cuda.current_stream().wait_stream(stream)
            self.draws_random = offset is None or generator_offset(self.device_index) != offset \
                or draws_random_numbers(self.gm)
            self.graph, self.static_out, self.inputs = self._capture_one(static_args)
            self.launcher = GraphLauncher(self.graph, self.device_index, self.draws_random)
            self.own_pool_slots = own_pool_fits(self.graph.pool())
            self.cuda_graph_note = "captured: one CUDA graph replay per call"
        except Exception as e:  # noqa: BLE001 -- capture is an optimization; run directly instead
            torch.cuda.synchronize()
            self._set_pdl(False)
            self.graph = None
            self.cuda_graph_note = f"off: capture failed ({type(e).__name__}: {str(e)[:200]})"
            logger.info("CUDA graph capture failed, running without: %s", e)
            return
        self.handout_note = f"outputs handed out from up to {HANDOUT_SLOTS} graph copies while not held, else cloned"
        self.handout, self.slot_at = [], {}
        self._choose_affinity()

    def _set_pdl(self, on: bool) -> None:
        """Programmatic dependent launch for the generated GEMMs only while they run inside
        this specialization's CUDA graph (see EpilogueGemm.use_pdl)."""
        for module in self.gm.modules():
            if hasattr(module, "use_pdl"):
                module.use_pdl = on

    def _capture_one(self, static_args, pool=None, into=None) -> tuple:
        """(graph, its outputs, its GraphInputs); with `into` (tensors like the outputs, in
        flattened order) the graph ends by copying its outputs there."""
        graph, keeps_graph = new_graph(bool(self.bound_in))
        with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
            for k, source in self.bound_in:
                self.static_in[k].copy_(source)     # the memcpy node a call re-points at its input
            out = self.gm(*static_args)
            if into is not None:
                produced = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                for dst, src in zip(into, produced, strict=True):
                    dst.copy_(src)
        inputs = GraphInputs(graph, keeps_graph, self.copied_in, self.bound_in, dict(enumerate(self.static_in)))
        return graph, out, inputs

    def _capture_slot(self) -> tuple:
        """(graph, the buffers it hands out, its GraphInputs) of one more graph copy: with a pool
        of its own whose outputs are handed out as they are, or on the shared pool, copying its
        outputs into buffers outside it (module docstring)."""
        static_args = self._with_static(self.const_args)
        if self.own_pool_slots:
            try:
                with torch.inference_mode(False):
                    graph, out, inputs = self._capture_one(static_args)
                tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                segments = pool_segments(graph.pool())
                if segments is not None and inside(segments, tensors):
                    self.handout_note = (f"outputs handed out from up to {HANDOUT_SLOTS} graph copies with "
                                         "memory pools of their own while not held, else cloned")
                    return graph, out, inputs
                del graph, out, inputs    # an output is an input or a constant: copy it out instead
            except Exception as e:  # noqa: BLE001 -- the shared-pool copies below are the safe way
                torch.cuda.synchronize()
                logger.info("own-pool handout capture failed, copying outputs instead: %s", e)
            self.own_pool_slots = False
        with torch.inference_mode(False):   # plain tensors even if this call runs in inference mode
            buffers = torch.utils._pytree.tree_map(   # outside the pool: see the module docstring
                lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, self.static_out)
        into = [t for t in torch.utils._pytree.tree_leaves(buffers) if isinstance(t, torch.Tensor)]
        graph, _, inputs = self._capture_one(static_args, pool=self.graph.pool(), into=into)
        return graph, buffers, inputs

    def __call__(self, args):
        self.calls += 1
        if self.graph is None:
            with torch.no_grad():
                return self.gm(*args)
        tensors = args if self.all_tensors else [args[k] for k in self.tensor_positions]
        slot, settled = self._slot_for(tensors) if self.handout is not None else (None, True)
        launcher, inputs = (slot.launcher, slot.inputs) if slot is not None else (self.launcher, self.inputs)
        if not inputs.load(tensors):
            self.graph, self.handout, self.launcher, self.inputs = None, None, None, None   # frees the graphs
            self.cuda_graph_note = "off: a graph's input node could not be restored after a failed update"
            with torch.no_grad():
                return self.gm(*args)
        launcher.replay()
        if slot is not None:
            if not settled and self.affinity:
                self._settle(slot, tensors)
            self.handed_out += 1
            return slot.hand_out()
        self.cloned += 1
        return torch.utils._pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.static_out)


MAX_MISSES_KEPT = 32


def _same_default(value, default) -> bool:
    """A keyword-only argument the traced graph assumed: its default itself, or an equal number,
    string, bool or None (z=1.0 where the default is 1.0)."""
    return value is default or (type(value) is type(default) and isinstance(value, (int, float, str, type(None)))
                                and repr(value) == repr(default))   # repr: -0.0 is not 0.0


class _RebuildOnLoad:
    """load_state_dict post hook on every submodule of the original model: drops the
    OptimizedModule's specializations, whose weight copies are stale after the load.

    Holds only a weakref (the model must not keep the OptimizedModule alive), and pickles or
    deep-copies as a no-op hook: torch.save(model) and copy.deepcopy(model) keep working, and
    a copy of the model does not invalidate the OptimizedModule built from the original."""

    def __init__(self, owner):
        self._owner = weakref.ref(owner)

    def __call__(self, module, incompatible_keys) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            owner.drop_specializations(f"load_state_dict on {type(module).__name__}")

    def __getstate__(self):
        return {"_owner": None}


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def _without_specializations(module, state_dict, prefix, local_metadata) -> None:
    """opt.state_dict() is the original's, under "original.": a specialization's tensors are
    derived from it (and named per build), so they are neither saved nor expected on load."""
    for key in [k for k in state_dict if k.startswith(prefix + "specialization_")]:
        del state_dict[key]


def _load_drops_specializations(module, state_dict, prefix, *args) -> None:
    """opt.load_state_dict: drop the specializations before the children load (their keys
    would be missing), and ignore specialization keys a state_dict of an older fxfuse holds."""
    module.drop_specializations("load_state_dict")
    _without_specializations(module, state_dict, prefix, None)


class OptimizedModule(torch.nn.Module):
    """What fxfuse.optimize returns: the original module's behaviour, specialized and fused."""

    def __init__(self, model: torch.nn.Module, example_args: tuple, options, build):
        super().__init__()
        self.original = model
        self.options = options
        self._build = build                # (model, args, options) -> GraphModule
        self.specializations: dict = {}
        self.misses: list = []             # the first MAX_MISSES_KEPT guard misses (explain shows the count)
        self.miss_count, self.last_miss = 0, None
        self.original_calls = Counter()    # calls that ran the original module, by reason (explain)
        self._failed_builds: dict = {}     # signature -> why its build failed (not tried again)
        self._warned: set = set()
        self._built = 0                    # specialization_N names stay unique across rebuilds
        self._buffer_rebuilds = 0          # rebuilds because buffers moved (warned about at 3)
        self._hook_ids_seen = self._hook_ids_scanned = -1   # see _hook_added
        self._hooked = None
        self._writes_in_place = False      # a graph keeps an in-place op (its inputs must not alias)
        self.add_specialization(example_args)
        hook = _RebuildOnLoad(self)
        handles = [m.register_load_state_dict_post_hook(hook) for m in model.modules()]
        weakref.finalize(self, _remove_hooks, handles)
        self.register_state_dict_post_hook(_without_specializations)
        self.register_load_state_dict_pre_hook(_load_drops_specializations)

    @property
    def training(self) -> bool:
        """The original module's mode: forward() runs the optimized graphs only when it is in
        eval mode, so opt.training says the same even after model.train() or model.eval()."""
        original = self.__dict__.get("_modules", {}).get("original")
        return original.training if original is not None else False

    @training.setter
    def training(self, mode: bool) -> None:
        pass   # opt.train() / opt.eval() reach the original (and the specializations) as children

    def __reduce_ex__(self, protocol):
        raise TypeError("an fxfuse OptimizedModule cannot be pickled or copied: it holds compiled kernels and "
                        "CUDA graphs. Save opt.original (or its state_dict()) and call fxfuse.optimize "
                        "again after loading.")

    def _watch_state(self) -> None:
        """What forward() checks per call besides the guards, kept short for the hot path: the
        submodules whose mode may matter (all but the types below, whose forward ignores it)
        and each buffer's version counter (BatchNorm statistics move in place when the original
        runs in training mode, after which the folded copies are stale)."""
        model = self.original
        self._mode_modules = tuple(m for m in model.modules() if m is not model and type(m) not in MODE_FREE)
        self._buffer_versions = tuple((b, b._version) for b in model.buffers() if version(b) is not None)
        self._hook_dicts = tuple(d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)) \
            + tuple(GLOBAL_HOOKS[2:] if GLOBAL_HOOKS is not None else ())   # _hook_added: any() over them

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

    def _buffers_moved(self) -> bool:
        for b, seen in self._buffer_versions:
            if b._version != seen:
                return True
        return False

    def add_specialization(self, args) -> Specialization:
        start = time.perf_counter()
        first = not self.specializations
        gm = self._build(self.original, args, self.options)
        gm.train(self.original.training)   # a fresh GraphModule (and its kernels) says training
        spec = Specialization(gm, args, self.options, 1e3 * (time.perf_counter() - start))
        self._writes_in_place |= bool(gm.meta.get("fxfuse_inplace_kept"))
        self.specializations[spec.signature] = spec
        if first:
            self._watch_state()   # after the build: its checks run the original once
        self.add_module(f"specialization_{self._built}", gm)
        self._built += 1
        if gm.meta.get("fxfuse_warning"):   # once per OptimizedModule, not per specialization
            self._warn_once("no-cuda", gm.meta["fxfuse_warning"])
        return spec

    def _apply(self, fn, *args, **kwargs):
        """opt.half(), opt.to(device): the specializations hold weight copies (and CUDA graphs the
        addresses) of the old dtype and device; the next call builds from the converted original.
        A conversion that changes nothing (opt.float() of an fp32 model) keeps them."""
        def tensors():
            return [(t.data_ptr(), t.dtype, t.device) for t in (*self.original.parameters(), *self.original.buffers())]
        before = tensors()
        out = super()._apply(fn, *args, **kwargs)
        if tensors() != before:
            self.drop_specializations("the module was converted (.to(), .half(), .cuda(), ...)")
        return out

    def drop_specializations(self, reason: str) -> None:
        """Forget every specialization (the next call builds one from the current weights)."""
        self._failed_builds = {}   # the state changed: a build that failed may work now
        if not self.specializations:
            return
        logger.info("dropping %d specialization(s), the next call rebuilds: %s", len(self.specializations), reason)
        self.specializations, self.misses, self.miss_count, self.last_miss = {}, [], 0, None
        self._buffer_versions = ()   # watched again from the next build (_watch_state)
        # a new dict, not a deletion: opt.load_state_dict may be iterating over the old one
        self._modules = OrderedDict((k, m) for k, m in self._modules.items() if not k.startswith("specialization_"))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    def _needs_autograd(self, args) -> bool:
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return False
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return True
        return any(p.requires_grad for p in self.original.parameters())

    def _positional(self, args, kwargs):
        """args with keyword arguments bound into their positions of the original forward(), or
        None where that is impossible (keyword-only or **kwargs parameters)."""
        try:
            bound = inspect.signature(self.original.forward).bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()   # model(x, scale=3.0) past a defaulted y: model(x, None, 3.0)
        params = bound.signature.parameters
        if not all(name in params and _same_default(value, params[name].default)
                   for name, value in bound.kwargs.items()):   # **kwargs entries are not parameters
            return None           # a keyword-only parameter given a value the traced graph does not have
        return tuple(bound.args)  # keyword-only parameters at their defaults, as traced

    def __call__(self, *args, **kwargs):
        """nn.Module.__call__ minus two Python frames when nothing can hook the call (no hook on
        opt nor a global one, no TorchScript tracing, opt not torch.compile'd): a small model's
        call is bound by the host."""
        d = self.__dict__
        if (GLOBAL_HOOKS is None or d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                or d["_backward_pre_hooks"] or any(GLOBAL_HOOKS) or d.get("_compiled_call_impl") is not None
                or torch._C._get_tracing_state()):
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if kwargs:  # model(x, scale=3.0): the same call as model(x, 3.0), which is what was traced
            positional = self._positional(args, kwargs)
            if positional is None:
                return self._run_original(f"kwargs:{sorted(kwargs)}", f"arguments ({len(args)} positional, keyword "
                                          f"arguments {sorted(kwargs)}) do not bind to positional parameters of "
                                          f"{type(self.original).__name__}.forward (or set a keyword-only one to "
                                          "a value other than its default)", args, kwargs)
            args = positional
        if self._modules["original"].training or self._mode_modules and self._submodule_training():
            return self._run_original("train", "the module is in training mode; fxfuse's graphs are eval-mode "
                                      "graphs (Dropout removed, BatchNorm folded). Call .eval() to use them", args)
        if RemovableHandle.next_id != self._hook_ids_seen and self._hook_added():
            return self._run_original("hook", f"{self._hooked}, which the optimized graph would not run", args)
        if self._writes_in_place and share_memory(args):
            return self._run_original("aliased", "two inputs share memory and the graph writes one in place "
                                      "(fusion assumed distinct inputs)", args)
        if self._buffer_versions and self._buffers_moved():   # e.g. BatchNorm statistics after a training call
            self.drop_specializations("a buffer of the model changed in place since the build")
            self._buffer_rebuilds += 1
            if self._buffer_rebuilds == 3:
                self._warn_once("buffers", "fxfuse: buffers of the model keep changing in place between calls; "
                                "each change rebuilds the optimized graph (folded and packed copies would be "
                                "stale). Call the original module for such use.")
        if torch.is_grad_enabled() and self._needs_autograd(args):
            return self._run_original("grad", "this call would record autograd (grad mode on and parameters or "
                                      "inputs requiring grad); fxfuse runs inference only: call under "
                                      "torch.no_grad() or torch.inference_mode() to use the optimized graph", args)
        sig = signature(args)
        spec = self.specializations.get(sig)
        if spec is not None:
            return spec(args)
        if sig in self._failed_builds:
            return self._run_original("build:" + self._failed_builds[sig], self._failed_builds[sig], args)
        if not self.specializations:      # dropped (load_state_dict, buffers moved): build from the new state
            reason = "rebuilt from the model's current weights and buffers"
        else:
            reason = describe_mismatch(next(iter(self.specializations)), sig)
            self.miss_count, self.last_miss = self.miss_count + 1, reason
            if len(self.misses) < MAX_MISSES_KEPT:
                self.misses.append(reason)
        if len(self.specializations) >= self.options.max_specializations:
            return self._run_original("full", f"{reason}; all {self.options.max_specializations} specializations "
                                      "are in use (option max_specializations)", args)
        try:
            spec = self.add_specialization(args)
        except Exception as e:  # noqa: BLE001 -- as optimize(): internal errors fall back too
            e = as_fxfuse_error(e, "building a specialization")
            if self.options.strict:
                raise e
            message = f"no specialization for a new input ({reason}): {e}"
            if len(self._failed_builds) < MAX_MISSES_KEPT:   # not built again for the same signature
                self._failed_builds[sig] = message
            return self._run_original("build:" + message, message, args)
        logger.info("built specialization %d: %s", len(self.specializations), reason)
        return spec(args)

    def _run_original(self, key: str, reason: str, args, kwargs=None):
        """This call runs the original module: GuardError under strict=True, else one warning per
        kind of reason (`key`), and a count explain() shows."""
        if self.options.strict:
            raise GuardError(reason)
        self._warn_once(key, f"fxfuse: {reason}; running the original module")
        self.original_calls[key.split(":")[0]] += 1
        return self.original(*args, **(kwargs or {}))

    def fused_kernels(self):
        for spec in self.specializations.values():
            for mod in spec.gm.modules():
                if isinstance(mod, FusedKernel):
                    yield mod
