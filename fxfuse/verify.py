"""The check of a fresh specialization against the original module on its example input:
outputs within each dtype's tolerance (or at least as accurate as eager against a float64
run), the inputs written as eager writes them, both runs from one torch random state."""
import collections
import copy
import dataclasses
import reprlib
import threading

import torch

from .errors import FxfuseError, UnsupportedError
from .graph_launch import draws_random_numbers
from .log import logger
from .module_state import same_value, share_memory
from .specialization import writes_an_input
from .shape_propagation import like_the_callers
from .tracing import _first_line, clone_args


# relative error (norm-wise) allowed between a fresh specialization and eager, per dtype
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _verify(model, gm, args, rewind) -> list:
    """Each side runs on its own copy of args: a model that mutates its input (`x.add_(1)`)
    would otherwise feed the rewritten graph an input eager has already changed. The inputs
    are compared afterwards too, since eager semantics include those writes. Returns eager's
    flattened outputs. Both sides start from the same random streams, so torch's random ops
    (a VAE's `randn_like`, dropout in a model's own eval branch) draw the same numbers."""
    eager_args, graph_args = clone_args(args), clone_args(args)
    rewind()
    try:
        eager_out = model(*eager_args)
    except Exception as e:   # the trace went through (the raising op was dead code): the model's own error
        raise UnsupportedError(f"{type(model).__name__} itself raises on the example input ({type(e).__name__}: "
                               f"{_first_line(e)}). Check the example input's shapes and dtypes against the "
                               "model") from e   # (fuzz43d: "internal error")
    rewind()
    graph_out = gm(*graph_args)
    expected, expected_spec = flatten_output(eager_out)
    got, got_spec = flatten_output(graph_out)
    retyped = _retyped_container(eager_out, graph_out)
    if retyped:   # a tuple / list subclass, a torch.Size inside a NamedTuple: flatten_output's plain
        raise UnsupportedError(retyped)   # containers would not tell (fuzz40b)
    if expected_spec != got_spec:
        if type(eager_out).__qualname__ == type(graph_out).__qualname__ and type(eager_out) is not type(graph_out):
            raise UnsupportedError(f"the model returns a {type(eager_out).__name__}, a class forward() makes anew "
                                   "on each call (each call's is another class): define it once, outside forward()")
        if type(eager_out) is not type(graph_out):   # a dict subclass torch.fx rebuilds as a dict
            raise UnsupportedError(f"the model returns a {type(eager_out).__name__}, which the traced graph "
                                   f"rebuilds as a {type(graph_out).__name__}: return a dict, tuple, "
                                   "OrderedDict or dataclass instead")
        raise FxfuseError(f"the rewritten graph returns {got_spec}, the model {expected_spec}")
    floor = _loosest_tolerance(gm)
    for k, (e, g) in enumerate(zip(eager_args, graph_args)):
        problem = _mismatch(e, g, floor)
        if problem:  # the graph lost a write into an input (a tracer that does not record it)
            raise UnsupportedError(f"input {k} after the call: {problem}; the model writes into its input "
                                   "in a way the traced graph does not reproduce: write the update "
                                   "out of place (x = x + 1) or as an explicit in-place op (x.add_(1))")
    for k, (e, g) in enumerate(zip(expected, got)):
        if not isinstance(e, (torch.Tensor, torch.fx.Proxy)) and not isinstance(g, torch.fx.Proxy):
            if type(e).__module__.split(".")[0] == "numpy" and getattr(e, "ndim", 0) > 0:   # (fuzz49j: "ndarray X
                raise UnsupportedError(f"output {k} is a numpy {type(e).__name__}, which fxfuse does not compare "
                                       "or rebuild: return tensors, or Python numbers and sizes")   # where ... X")
            if _differs_at_all(e, g):   # review36d: a returned np.float64 came back a float (1 / 0 then raised)
                raise UnsupportedError(f"output {k} is {type(e).__name__} {_SHORT.repr(e)} where the rewritten graph "
                                       f"returns {type(g).__name__} {_SHORT.repr(g)}: "
                                       "return tensors, or Python numbers and sizes")
        problem = _mismatch(e, g, floor)
        if problem:
            rewind()
            again = flatten_output(model(*clone_args(args)))[0]
            if any(_mismatch(a, b) for a, b in zip(expected, again)):
                raise UnsupportedError(
                    f"output {k} differs between two eager runs of the model on the same input: it is not "
                    "deterministic (random ops in forward, such as F.dropout with its default "
                    "training=True), so fxfuse can neither check nor reproduce it")
            if not _as_accurate_as_eager(model, args, k, e, g):
                if _eager_overflows(e, g):
                    raise UnsupportedError(
                        f"output {k}: eager overflows to inf or NaN on the example input where the rewritten "
                        "graph stays finite (fused kernels keep intermediates in fp32); fxfuse cannot check "
                        "the rewrite on it: optimize with an example input whose eager result is finite")
                compiling = ("; here: torch.compiler.is_compiling(), which the graph was traced with True "
                             "(explain)") if gm.meta.get("fxfuse_traced_as_compiling") else _traced_type_test(gm)
                if share_memory(args) and writes_an_input(gm):   # (x, x) as the example of a forward()
                    #                                                   writing one of them (fuzz39e)
                    raise UnsupportedError(f"output {k}: {problem}; the example's inputs share memory and "
                                           "forward() writes one in place (fusion assumes distinct inputs "
                                           "there): optimize with distinct tensors")
                raise FxfuseError(f"output {k}: {problem}. Either forward() depends on something its trace fixed "
                                  "(control flow on requires_grad, is_contiguous() or a global flag"
                                  f"{compiling}), or the output turns a last-bit rounding difference into a large "
                                  "one (sin of large values, a comparison or an integer cast of an intermediate), or "
                                  "this is a bug in fxfuse: please report it with explain()")
    restore_eager_layouts(gm, model, expected, got, graph_args)
    return expected


def _traced_type_test(gm) -> str:
    """The likely trace-fixed branch, from the names forward()'s code reads (fuzz46g): an exact type
    test (`type(x) is torch.Tensor`), which the tracers answer with their own types (a Proxy, a
    FakeTensor), or torch.fx's own is-tracing question."""
    reads = gm.meta.get("fxfuse_trace", {}).get("attribute_reads", {})
    names = set(reads.get("code_names", ()) or reads.get("names", ()) or ())
    if names & {"is_fx_tracing", "Proxy"}:
        return "; here maybe torch.fx's is_fx_tracing() or an isinstance() test for a Proxy, true while tracing"
    if names & {"type", "__class__"} and "Tensor" in names:
        return ("; here maybe an exact type test (`type(x) is torch.Tensor`, `x.__class__`), which the tracers answer "
                "with their own tensor types: `isinstance(x, torch.Tensor)` is answered as eager answers it")
    return ""


def restore_eager_layouts(gm, model, expected, got, graph_args) -> None:
    """Outputs the graph lays out otherwise than eager does (fresh tensors, dense in both): the
    graph returns as_layout(out, eager's strides) instead, a copy where they differ. The rewrites
    keep eager's layouts themselves (ops.keep_eager_layout); a trace can differ though: torch.export
    records MultiheadAttention's slow path, whose batch_first result is a transposed view where
    eager's fast path returns it contiguous (fuzz45f: `opt(x).view(-1)` raised, eager's worked)."""
    from .ops import as_layout
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, spec = torch.utils._pytree.tree_flatten(output.args[0])
    if len(leaves) != len(expected) or len(got) != len(expected):
        return
    held = {t.untyped_storage().data_ptr() for t in (*graph_args, *model.parameters(), *model.buffers())
            if isinstance(t, torch.Tensor) and t.layout is torch.strided}
    returned = collections.Counter(t.untyped_storage().data_ptr() for t in got
                                   if type(t) is torch.Tensor and t.layout is torch.strided)
    held |= {ptr for ptr, n in returned.items() if n > 1}   # outputs sharing memory (`o, o, o[0]`): a copy
    #                                                         of one would part them (review45i)
    changed = False
    for k, (leaf, e, g) in enumerate(zip(leaves, expected, got)):
        if not (isinstance(leaf, torch.fx.Node) and type(e) is torch.Tensor and type(g) is torch.Tensor
                and e.layout is g.layout is torch.strided and e.shape == g.shape and e.numel() > 1
                and _dense(e) and _dense(g)) or _strides_that_matter(e) == _strides_that_matter(g) \
                or g.untyped_storage().data_ptr() in held:
            continue
        with gm.graph.inserting_before(output):
            fixed = gm.graph.call_function(as_layout, (leaf, tuple(e.stride())))
        meta = leaf.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "_replace"):
            fixed.meta["tensor_meta"] = meta._replace(stride=tuple(e.stride()))
        fixed.meta.setdefault("fxfuse", {})["note"] = "eager's layout of this output restored (the trace's differs)"
        leaves[k], changed = fixed, True
    if changed:
        output.args = (torch.utils._pytree.tree_unflatten(leaves, spec),)
        gm.recompile()


def _strides_that_matter(t) -> tuple:
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def _dense(t) -> bool:
    """No gaps, no overlaps (no expanded dim): a copy with its strides is a plain tensor."""
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda p: p[1]):
        if st != expected:
            return False
        expected *= n
    return True


def _torch_random_state(gm: torch.fx.GraphModule):
    """A function that puts torch's CPU and CUDA generators back to their state now. Not
    random_streams.RandomStreams, which does nothing while other threads run (on the H100 host
    pytest's process had one): verify needs both runs to draw the same numbers. With other
    threads running, only where the graph draws: the generators are the process's, and a
    rewind repeats the numbers other threads drew meanwhile (fuzz38f: thousands of repeated
    draws in a thread beside the build of a model that draws none)."""
    if threading.active_count() > 1 and not draws_random_numbers(gm):
        return lambda: None
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def rewind():
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
    return rewind


def _differs_at_all(e, g) -> bool:
    """Any difference, NaN equal to NaN: eager against eager in another mode (a branch on the
    mode may change the result by less than the verification's tolerance), and what forward()
    received or returned against what the call passed or got."""
    if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor):
        return not same_value(e, g)
    try:
        nans = isinstance(e, (float, complex)) and e != e and g != g
        return type(e) is not type(g) or bool(e != g) and not nans
    except Exception:  # noqa: BLE001 -- values that cannot be compared
        return True


def _differs_beyond_rounding(e, g) -> bool:
    """_differs_at_all, but float tensors of one shape and dtype compared within the verification's
    tolerance: eager against eager in another mode, where torch's own code takes another kernel
    path (fuzz47g: an LSTM and MultiheadAttention differ by 2e-8 under inference_mode, and every
    such call ran the original). forward()'s own reads of the mode are seen by name (mode_watch)."""
    if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and e.is_floating_point() \
            and e.dtype == g.dtype and e.shape == g.shape:
        return _mismatch(e, g) is not None
    return _differs_at_all(e, g)


_SHORT = reprlib.Repr()   # a message names a value, it does not print a tensor (keywords: Python 3.12+)
_SHORT.maxstring = _SHORT.maxother = 80


def _retyped_container(eager, graph, where: str = "the output") -> str | None:
    """What the traced graph returns in a container of another type than eager's (a tuple
    subclass of the user's comes back a plain tuple, a torch.Size inside a NamedTuple a tuple),
    else None."""
    a, b = type(eager), type(graph)   # a NamedTuple class made in forward() is another class each call
    if (a.__module__, a.__qualname__) != (b.__module__, b.__qualname__) \
            and (isinstance(eager, (list, tuple, dict)) or dataclasses.is_dataclass(eager)):
        advice = ("return it at the top level or in a plain tuple, list or dict, or as tuple(x.shape)"
                  if isinstance(eager, torch.Size) else "return a tuple, list, dict, NamedTuple or dataclass instead")
        return f"{where} is a {a.__name__}, which the traced graph rebuilds as a {b.__name__}: {advice}"
    if isinstance(eager, dict) and isinstance(graph, dict):
        pairs = [(f"{where}[{k!r}]", v, graph.get(k)) for k, v in eager.items()]
    elif isinstance(eager, (list, tuple)) and isinstance(graph, (list, tuple)):
        names = eager._fields if hasattr(eager, "_fields") else None   # a NamedTuple's fields by name
        pairs = [(f"{where}.{names[k]}" if names else f"{where}[{k}]", v, g)
                 for k, (v, g) in enumerate(zip(eager, graph))]
    elif dataclasses.is_dataclass(eager) and not isinstance(eager, type):
        pairs = [(f"{where}.{f.name}", getattr(eager, f.name), getattr(graph, f.name, None))
                 for f in dataclasses.fields(eager)]
    else:
        return None
    return next((r for r in (_retyped_container(*p[1:], p[0]) for p in pairs) if r), None)


def flatten_output(out) -> tuple:
    """Leaves and structure of an output, a dataclass's fields included: torch's pytree leaves an
    unregistered dataclass (research code's ModelOutput) one opaque leaf, compared as a whole
    and refused (fuzz37f)."""
    def plain(o):   # containers opened all the way down, leaves as torch's pytree orders them ("output k")
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {f.name: plain(getattr(o, f.name)) for f in dataclasses.fields(o)}
        if isinstance(o, (list, tuple)):   # a NamedTuple too (review37b: one holding a dataclass)
            return type(o)(*map(plain, o)) if hasattr(o, "_fields") else \
                (tuple if isinstance(o, tuple) else list)(map(plain, o))
        if isinstance(o, dict):   # an OrderedDict stays one; other dict subclasses: the caller compares types
            return (collections.OrderedDict if isinstance(o, collections.OrderedDict) else dict)(
                (k, plain(v)) for k, v in o.items())
        return o
    return torch.utils._pytree.tree_flatten(plain(out))


def _as_accurate_as_eager(model, args, k: int, e, g) -> bool:
    """Whether output k of the graph (g) is within 4x eager's (e) error against a float64 run of
    the model. A tolerance relative to the output's size trips where the output is a small
    difference of large terms (gelu(h, "tanh") - gelu(h)): there eager's own rounding is of that
    order too. Only on a mismatch (the float64 copy of the model costs its memory twice over)."""
    if not (isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and e.is_floating_point()
            and e.dtype != torch.float64 and e.dtype == g.dtype and e.shape == g.shape):
        return False     # only numbers are excused, never another dtype or shape
    try:
        model64 = copy.deepcopy(model).double()
        wide = {}   # one float64 copy per tensor object: `f(a, a)` stays the same tensor twice
        copies = clone_args(args)
        for a in copies:
            if isinstance(a, torch.Tensor) and a.is_floating_point() and id(a) not in wide:
                wide[id(a)] = like_the_callers(a.detach().double(), a)
        args64 = [wide.get(id(a), a) for a in copies]
        ref = flatten_output(model64(*args64))[0][k].double()
    except Exception as err:  # noqa: BLE001 -- no float64 run (memory, ops without fp64): no excuse either
        logger.info("no float64 reference for the verification: %s", err)
        return False
    if ref.shape != e.shape or not (torch.isfinite(ref).all() and torch.isfinite(e).all() and torch.isfinite(g).all()):
        return False   # where eager overflows its error says nothing: no excuse
    scale = ref.norm() + 1e-30
    err_e, err_g = ((e.double() - ref).norm() / scale).item(), ((g.double() - ref).norm() / scale).item()
    logger.info("verify: output %d off eager, against float64 %.2e (eager %.2e)", k, err_g, err_e)
    # a graph within its dtype's tolerance of float64 is right whatever eager's error (an fp16
    # chain where eager is 1.2% off and the fused kernel, accumulating in fp32, 0.02%); beyond
    # that only a modest eager error excuses it: (x + 1e4) - 1e4 in fp32 is 50% off already,
    # and a graph returning zeros must not pass as "4x that"; up to 10% off, a graph no further
    # from float64 than eager passes (fp16, eager 2.2% off, the fused MLP 1.8%: fuzz27) if no
    # element is much further off than eager's worst: eager's error is spread over every value,
    # a wrong rewrite's sits in a few (one zeroed column of 4096 is only 1.5% off in norm: review27)
    tolerance = VERIFY_TOLERANCE.get(e.dtype, 1e-4)
    if err_g <= tolerance or (err_e < 0.01 and err_g <= 4 * err_e):
        return True
    worst_e, worst_g = (e.double() - ref).abs().max().item(), (g.double() - ref).abs().max().item()
    return err_e < 0.1 and err_g <= err_e and worst_g <= 2 * worst_e + tolerance * ref.abs().max().item()


def _eager_overflows(e, g) -> bool:
    """Eager's output has inf or NaN where the graph's is finite, not the reverse, and no
    position has infs of opposite signs (that is the graph's error, not an overflow; eager's NaN
    against the graph's inf is one)."""
    if not (isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and e.is_floating_point()
            and e.shape == g.shape):
        return False
    bad_e, bad_g = ~torch.isfinite(e), ~torch.isfinite(g)
    opposite = bool((e.isinf() & g.isinf() & (e != g)).any())
    return bool((bad_e & ~bad_g).any()) and not bool((bad_g & ~bad_e).any()) and not opposite


def _loosest_tolerance(gm) -> float:
    """The tolerance of the least precise float dtype the graph computes in: `(lin(x) + 1).double()`
    returns float64, but its GEMM ran in fp32, where a rewrite may differ from eager by ~1e-7."""
    dtypes = {m.dtype for n in gm.graph.nodes for m in [n.meta.get("tensor_meta")]
              if hasattr(m, "dtype") and m.dtype.is_floating_point}
    return max((VERIFY_TOLERANCE.get(d, 1e-4) for d in dtypes), default=0.0)


def _mismatch(e, g, floor: float = 0.0) -> str | None:
    """How g differs from eager's e (exactly for non-floats, else within the tolerance of e's
    dtype, at least `floor`), or None."""
    if not isinstance(e, torch.Tensor):
        return None
    if not isinstance(g, torch.Tensor) or e.shape != g.shape or e.dtype != g.dtype:
        return f"the rewritten graph gives {_desc(g)}, the model {_desc(e)}"
    if e.is_floating_point() and e.element_size() == 1:   # float8: torch has no isnan/isinf there (fuzz34k)
        return _mismatch(e.float(), g.float(), max(floor, VERIFY_TOLERANCE.get(torch.float16, 1e-2)))
    if e.is_complex():   # its parts, as floats (fuzz34b: a modReLU net, right to an ulp, was refused)
        return _mismatch(torch.view_as_real(e.resolve_conj()), torch.view_as_real(g.resolve_conj()), floor)
    if not e.is_floating_point():
        return None if torch.equal(e, g) else "differs from eager"
    if not torch.equal(torch.isnan(e), torch.isnan(g)):
        return "NaN where eager has none (or the reverse)"
    inf_e, inf_g = torch.isinf(e), torch.isinf(g)
    # at the overflow boundary one side may round to inf and the other stay at the largest
    # floats (gelu(3e38): eager's x * cdf(x) overflows, the kernel's does not): not a mismatch
    big = torch.finfo(e.dtype).max / 2
    edge = (inf_e & ~inf_g & (g.abs() >= big)) | (inf_g & ~inf_e & (e.abs() >= big))
    both = inf_e & inf_g
    if not torch.equal(inf_e & ~edge, inf_g & ~edge) or not torch.equal(e[both], g[both]):
        return "inf where eager is finite, or an inf of the other sign (or the reverse)"
    finite = ~(inf_e | inf_g)
    e64 = torch.where(finite, e.double(), 0.0).nan_to_num(0)
    g64 = torch.where(finite, g.double(), 0.0).nan_to_num(0)
    err = (e64 - g64).norm() / (e64.norm() + 1e-30)
    tol = max(VERIFY_TOLERANCE.get(e.dtype, 1e-4), floor)
    logger.debug("verified: relative error %.2e", err)
    return f"relative error {err:.2e} against eager exceeds {tol:.0e}" if err > tol else None


def _desc(t) -> str:
    return f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
