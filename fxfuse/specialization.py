"""Specialization: one rewritten graph for one input signature, run directly or replayed from a
CUDA graph (runtime.OptimizedModule chooses which one a call runs; its docstring tells the
whole story: static inputs, memcpy nodes, the memory pool as the plan, output handout).
"""
import itertools

import torch
import torch.fx

from .attribute_writes import writes_attributes
from .data_dependent import reads_to_the_host
from .errors import UnsupportedError
from .fingerprint import value_text
from .graph_launch import (GraphLauncher, _current_stream, clear_cublas_workspaces, draws_random_numbers,
                           generator_offset)
from .handout import (HANDOUT_SLOTS, SlotChoice, copies_keeping_aliases, fresh_constants, inside,
                      own_pool_fits, pool_segments)
from .input_copy import GraphInputs, can_bind, new_graph
from .log import logger, quiet_this_thread
from .module_state import storage_address

CALL_ORDER = itertools.count()   # the order of calls over all specializations

def signature(args) -> tuple:
    """What a specialization is built for, per argument: a tensor's shape, dtype, device,
    strides and requires_grad, or a constant's type and repr. Every call computes it, so the
    one-tensor call takes a short way (0.4 us less host time per call; torch.Size hashes and
    compares as the tuple of its sizes, so no conversion is needed). UnsupportedInput for a
    tensor the kernels cannot take in place of a plain one (not_plain_tensor)."""
    try:
        if len(args) == 1 and type(args[0]) is torch.Tensor and args[0].layout is torch.strided:
            a = args[0]
            return ((a.shape, a.dtype, a.device, a.stride(), a.requires_grad),)
        for k, a in enumerate(args):   # a plain tensor costs two checks here (a nested one fails at stride())
            if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or a.layout is not torch.strided) \
                    and (why := not_plain_tensor(a)):
                raise UnsupportedInput(f"input {k} {why}")
        first = {}   # a tensor passed twice (`f(a, a)`): forward() may test `key is query`, which the trace
        #              cannot see, so identity is part of the signature (fuzz31h)
        return tuple([((a.shape, a.dtype, a.device, a.stride(), a.requires_grad)
                       + ((j,) if (j := first.setdefault(id(a), k)) != k else ())
                       + (("Parameter",) if type(a) is torch.nn.Parameter else ()))   # (isinstance(x, nn.Parameter))
                      if isinstance(a, torch.Tensor) else ("const", type(a).__name__, const_text(a))
                      for k, a in enumerate(args)])
    except UnsupportedInput:
        raise
    except RuntimeError as e:      # a tensor without strides (a nested tensor): say which and why
        raise UnsupportedInput(input_not_plain(args) or f"an input has no strides ({e})") from e


def input_not_plain(args) -> str | None:
    """Which input is no plain strided tensor and why (not_plain_tensor), else None."""
    return next((f"input {k} {w}" for k, a in enumerate(args)
                 if isinstance(a, torch.Tensor) and (w := not_plain_tensor(a))), None)


def unit_strides_alike(sig: tuple, built) -> tuple | None:
    """The signature among `built` that differs from sig only in the strides of size-1 dims, which
    torch ignores (is_contiguous, contiguous(), the kernels' own checks: FusedKernel._matches, and
    a CUDA graph's input copy of the same dense bytes), else None. On a miss only: no hot-path cost."""
    def canonical(s):   # not for 4-D and 5-D inputs: a conv or pooling picks its output's memory format
        #                 from the channel's stride even where the channel has size 1 (fuzz41i)
        return tuple((e[0], e[1], e[2], tuple(None if n == 1 else d for n, d in zip(e[0], e[3])), *e[4:])
                     if isinstance(e[0], torch.Size) and len(e[0]) < 4 else e for e in s)
    wanted = canonical(sig)
    return next((s for s in built if len(s) == len(sig) and canonical(s) == wanted), None)


LAYOUT_WORDS = ("conv", "pool", "interpolate", "upsample", "norm", "pixel_", "grid_sample", "fold", "pad", "roll")
#                                                   (pad and roll keep a channels_last input so: fuzz47g)


def reads_unit_strides(spec) -> bool:
    """Whether a specialization may depend on the strides of size-1 dims: torch.export specializes on a
    stride forward() reads (review41b: `if x.stride(0) == 1`), symbolic_trace folds `x.stride(0)`, a conv
    picks its output's layout from them (fuzz46l: a [1, L, C] input unsqueezed to 4-D)."""
    trace = spec.gm.meta.get("fxfuse_trace", {})
    names = trace.get("attribute_reads", {}).get("code_names", {"stride"})
    return trace.get("tracer") != "torch.fx.symbolic_trace" or bool({"stride", "is_contiguous"} & names) \
        or picks_layouts(spec.gm)


def picks_layouts(gm) -> bool:
    """Whether a graph holds an op that picks its output's memory format from its input's strides,
    those of size-1 dims included (a conv, pooling, a normalization), by name: conservative."""
    for node in gm.graph.nodes:
        target = type(gm.get_submodule(node.target)).__name__ if node.op == "call_module" else \
            node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if node.op in ("call_function", "call_method", "call_module") and any(
                word in target.lower() for word in LAYOUT_WORDS):
            return True
    return False


def const_text(a) -> str:
    """A constant argument's repr, and its value where its type subclasses a number or str: such a
    subclass's repr may not show the value (`class Scale(float): __repr__ = ...`: review39b)."""
    kind = type(a)
    if kind is tuple or kind is list:   # their repr shows the items' reprs (fuzz41c: a Scale inside a tuple)
        return f"{kind.__name__}({', '.join(map(const_text, a))})"
    if kind is dict:
        return f"dict({', '.join(f'{const_text(k)}: {const_text(v)}' for k, v in a.items())})"
    return value_text(a)


class UnsupportedInput(UnsupportedError, RuntimeError):
    """An input tensor no specialization can take: the call runs the original module."""


def not_plain_tensor(a: torch.Tensor) -> str | None:
    """Why a tensor is not what the generated kernels read (None: it is): a layout other than
    strided (sparse COO reports strides (0, 0), like an expanded dense tensor), a nested tensor
    (strided layout, no sizes), or a subclass of
    torch.Tensor other than nn.Parameter, whose __torch_function__ / __torch_dispatch__ eager
    runs and the rewritten graph would skip (a silently different answer, a plain Tensor out)."""
    if a.layout is not torch.strided:
        return f"has layout {a.layout}"
    if a.is_nested:
        return "is a nested tensor"
    if a.is_quantized:   # (strided, a torch.Tensor: its scale and zero point are no part of the kernels' inputs)
        return "is a quantized tensor"
    if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
        return f"is a {type(a).__name__}, a torch.Tensor subclass"
    return None


def describe_mismatch(expected: tuple, got: tuple, names=()) -> str:
    """The first difference between two signatures in words; `names` are forward()'s
    positional parameter names, for an argument one side lacks."""
    if len(expected) != len(got):
        k = min(len(expected), len(got))
        name = f" ({names[k]})" if k < len(names) else ""
        if len(got) > len(expected):   # each one given: the first may be a default spelled out (fuzz35c)
            given = ", ".join(f"input {j}{f' ({names[j]})' if j < len(names) else ''} is {_described(got[j])}"
                              for j in range(k, len(got)))
            return f"{given}, where the specialization was built without {'it' if len(got) == k + 1 else 'them'} " \
                "(forward()'s defaults)"
        return f"input {k}{name} is not given where the specialization has {_described(expected[k])}"
    fields = ("shape", "dtype", "device", "stride", "requires_grad")
    for k, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            which = f"input {k}{f' ({names[k]})' if k < len(names) else ''}"   # by name too (fuzz38f)
            if e[0] == "const" or g[0] == "const":
                return f"{which}: {_described(g)} where the specialization has {_described(e)}"
            for name, ev, gv in zip(fields, e, g):
                if ev != gv:
                    ev, gv = (tuple(v) if isinstance(v, torch.Size) else v for v in (ev, gv))
                    return f"{which}: {name} {gv} where the specialization has {ev}"
            kind = lambda entry: "an nn.Parameter" if entry[-1] == "Parameter" else "a plain tensor"  # noqa: E731
            if kind(e) != kind(g):
                return f"{which}: {kind(g)} where the specialization has {kind(e)}"
            same = lambda entry: f"input {entry[5]}'s tensor" if len(entry) > 5 and type(entry[5]) is int \
                else "a tensor of its own"  # noqa: E731
            return f"{which}: {same(g)} where the specialization has {same(e)}"
    return "no difference"


def closest_signature(built, sig: tuple, count: bool = False):
    """The built signature with the fewest differences from sig: a miss is told against it (the
    first one built named a shape another specialization has, not the dtype that differed;
    fuzz38f); with count, the number of those differences."""
    def differences(b):
        return 8 * abs(len(b) - len(sig)) + sum(x != y for e, g in zip(b, sig) for x, y in zip(e, g))
    return min(map(differences, built)) if count else min(built, key=differences)


def _described(entry: tuple) -> str:
    """One argument of a signature in words: a tensor's shape and dtype, or a value (its repr,
    cut short: a list of tensors would print their values)."""
    if entry[0] != "const":
        return f"a tensor {tuple(entry[0])} {entry[1]}"
    if "tensor(" in entry[2]:
        return f"a {entry[1]} holding tensors"
    text = entry[2] if len(entry[2]) <= 60 else entry[2][:57] + "..."
    return f"the {entry[1]} {text}"


class Specialization(SlotChoice):
    """One rewritten graph for one input signature, run directly or through a CUDA graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_args: tuple, options, build_ms: float,
                 model_tensors: tuple = ()):
        self.gm = gm
        self.model_tensors = model_tensors   # the model's parameters, buffers and tensor attributes (_run_directly)
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
        self.last_call = -1                # CALL_ORDER at its latest call: stats() describes that one
        self._constant_storages = None     # (_run_directly)
        devices = {a.device for a in example_args if isinstance(a, torch.Tensor)}
        cuda = next((d for d in devices if d.type == "cuda"), None)   # one stream at a time (_follow_stream)
        self.stream_device = None if cuda is None else cuda.index if cuda.index is not None \
            else torch.cuda.current_device()
        self._stream = None
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
        if self.gm.meta.get("fxfuse_inplace_kept") and writes_an_input(self.gm):
            self.cuda_graph_note = "off: the model mutates a tensor in place that may be an input"
            return
        if writes_attributes(self.gm):
            self.cuda_graph_note = "off: forward() assigns a module attribute on each call, which a replay would not"
            return
        if (sync := reads_to_the_host(self.gm)) is not None:
            self.cuda_graph_note = f"off: {sync.name} reads a tensor's value on the host, which a CUDA graph cannot"
            return
        try:   # quietly: a failing capture's GraphModule prints its traceback to stderr, unasked (fuzz34b)
            with quiet_this_thread(stdout=False):
                self._capture_graph(example_args)
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
        self._choose_direct(example_args)

    def _capture_graph(self, example_args) -> None:
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
        clear_cublas_workspaces()   # the workspace of a library GEMM in this graph: in its own pool
        try:
            with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
                for k, source in self.bound_in:
                    self.static_in[k].copy_(source)     # the memcpy node a call re-points at its input
                out = self.gm(*static_args)
                if into is not None:
                    produced = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                    for dst, src in zip(into, produced, strict=True):
                        dst.copy_(src)
        finally:
            clear_cublas_workspaces()   # and no later capture inherits it
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
            buffers = copies_keeping_aliases(self.static_out, fill=False)   # outside the pool: module docstring
        into = [t for t in torch.utils._pytree.tree_leaves(buffers) if isinstance(t, torch.Tensor)]
        graph, _, inputs = self._capture_one(static_args, pool=self.graph.pool(), into=into)
        return graph, buffers, inputs

    def _run_directly(self, args):
        """The graph without a CUDA graph. gm.forward, not gm(): torch.fx's call wrapper prints
        a traceback of the generated code to stderr on any exception (an index out of range in
        the model's own op). Outputs that share memory with a constant of the graph (`return
        torch.zeros(3)`, folded into an attribute) are copied: eager returns a fresh tensor
        each call, and a caller writing into one must not change the next call's answer."""
        with torch.no_grad():
            out = self.gm.forward(*args)
        if self._constant_storages is None:
            self._constant_storages = _constant_storages(self.gm, self.model_tensors)
        if not self._constant_storages:
            return out
        return fresh_constants(out, self._constant_storages, constant_address)

    def __call__(self, args):
        self.calls += 1
        self.last_call = next(CALL_ORDER)
        if self.stream_device is not None and _current_stream(self.stream_device) != self._stream:
            self._follow_stream()
        if self.graph is None:
            return self._run_directly(args)
        return self._replay(args)

    def _follow_stream(self) -> None:
        """A call on another CUDA stream than the last one waits for everything queued on that one so
        far: the graph copies share their static inputs, pools and handed-out outputs, and a split-K
        GEMM its workspace, so two streams replaying at once raced (review38). Eager is safe there
        (the caching allocator keeps each stream's blocks apart); here it costs one event per switch."""
        current = _current_stream(self.stream_device)
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.ExternalStream(self._stream, device=self.stream_device))
            torch.cuda.ExternalStream(current, device=self.stream_device).wait_event(event)
        self._stream = current

    def _replay(self, args):
        """Inputs into the graph, one replay, the outputs handed out: one step per call, which
        the caller keeps whole across threads (runtime.BUILD_LOCK: the driver calls release the
        GIL, and another thread's input could be bound between this call's binding and its replay)."""
        tensors = args if self.all_tensors else [args[k] for k in self.tensor_positions]
        slot, settled = self._slot_for(tensors) if self.handout is not None else (None, True)
        launcher, inputs = (slot.launcher, slot.inputs) if slot is not None else (self.launcher, self.inputs)
        if not inputs.load(tensors):
            self.graph, self.handout, self.launcher, self.inputs = None, None, None, None   # frees the graphs
            self.cuda_graph_note = "off: a graph's input node could not be restored after a failed update"
            return self._run_directly(args)
        launcher.replay()
        if slot is not None:
            if not settled and self.affinity:
                self._settle(slot, tensors)
            self.handed_out += 1
            return slot.hand_out()
        self.cloned += 1
        return copies_keeping_aliases(self.static_out, fill=True)


def _constant_storages(gm, model_tensors: tuple) -> set:
    """Storage addresses of the graph's tensor constants that are not the model's own
    parameters or buffers (returning one of those, or a view of it, is what eager does too):
    fx's `_tensor_constant`s and what fxfuse folded or packed."""
    own = {constant_address(t) for t in model_tensors}
    found = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                found.add(constant_address(value))
    return found - own - {None}


def constant_address(t: torch.Tensor):
    """storage_address, or for an empty tensor its storage object (`return torch.zeros(0)`: a
    constant like any other, returned as one object every call otherwise; fuzz41c)."""
    address = storage_address(t)
    if address is None and t.layout == torch.strided and t.device.type != "meta" \
            and not isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        return "empty", t.untyped_storage()._cdata
    return address


def writes_an_input(gm, kinds=("placeholder",)) -> bool:
    """Whether an in-place op normalize kept may write into an input (or a view of one): a CUDA
    graph writes its static copy, not the caller's tensor, so such a graph is not captured. A
    write into a tensor forward() made itself (`torch.zeros(...).index_add_`, `clone().clamp_`,
    HF's position ids `masked_fill_` on a cumsum) turned capture off too (fuzz34b). With kinds
    ("placeholder", "get_attr"): into an input or a tensor of the model (the aliasing guard's)."""
    if not gm.meta.get("fxfuse_inplace_kept"):
        return False
    from fxfuse.passes.fuse_pointwise import write_aliases   # passes import this module: import late
    return any(n.op in kinds for written in write_aliases(gm).values() for n in written)
