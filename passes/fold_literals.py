"""Tensors forward() builds from Python numbers become constants of the graph.

`scores / torch.sqrt(torch.tensor(d_k, dtype=torch.float32, device=x.device))`,
`h * torch.tensor(0.5, device=h.device)`, `x.new_tensor(1.0)`: each call copied a number from
the host to the device, a copy no CUDA graph can capture (the capture failed and the whole model
ran without its graph: fuzz34b), and the pointwise kernel reading it waited for a library call.
Shape propagation has folded sizes and devices to constants by now, so such a node's value is
known at optimize time: it becomes a buffer of the graph (made once; eager makes it anew each
call, so only where nothing can see the difference: no reader writes it or keeps a view of it,
and forward() does not return it).
"""
import functools
import math
import operator

import torch
import torch.fx

from fxfuse.data_dependent import op_name
from fxfuse.node_meta import fxfuse_meta, single_tensor_meta
from fxfuse.state_writes import _writes_in_place

from .normalize_layers import only_unit_indices, register_constant

FACTORIES = {torch.tensor, torch.as_tensor, torch.scalar_tensor}
DETACHES = {torch.ops.aten.detach_.default, torch.ops.aten.detach.default}
MAX_ELEMENTS = 256
LITERAL_STEM = "literal"
LITERAL_PREFIX = "fxfuse_" + LITERAL_STEM   # register_constant's names: api.tensors_read knows them for no model copy


def _numbers(data) -> bool:
    if isinstance(data, (list, tuple)):
        return all(map(_numbers, data))
    return isinstance(data, (bool, int, float))


def _lifted_literal(node) -> torch.Tensor | None:
    """The constant of torch.export's `lift_fresh_copy(lifted_tensor_k)`, its spelling of a
    tensor forward() builds from numbers (review37: left a library copy on every call)."""
    if node.op != "call_function" or node.target is not torch.ops.aten.lift_fresh_copy.default \
            or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], torch.fx.Node) \
            or node.args[0].op != "get_attr":
        return None
    value = getattr(node.graph.owning_module, node.args[0].target, None)
    return value if isinstance(value, torch.Tensor) and value.numel() <= MAX_ELEMENTS else None


def fold_literal_tensor(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target in FACTORIES and len(node.args) == 1:
        data = node.args[0]
    elif node.op == "call_method" and node.target == "new_tensor" and len(node.args) == 2:
        data = node.args[1]
    elif _lifted_literal(node) is not None:   # torch.export's torch.tensor(..): a fresh copy of a constant
        data = _lifted_literal(node).tolist()
    else:
        return False
    meta, device = single_tensor_meta(node), fxfuse_meta(node).get("device")
    if not _numbers(data) or set(node.kwargs) - {"dtype", "device", "requires_grad"} or node.kwargs.get(
            "requires_grad") or meta is None or device is None or math.prod(meta.shape) > MAX_ELEMENTS:
        return False
    made = [node]   # and torch.export's detach_ of it (torch.tensor's result is a leaf): the same value
    while len(made[-1].users) == 1 and next(iter(made[-1].users)).target in DETACHES \
            and next(iter(made[-1].users)).args == (made[-1],):
        made.append(next(iter(made[-1].users)))
    last = made[-1]
    if not _only_read(gm, last):
        return False
    value = torch.tensor(data, dtype=meta.dtype, device=device)
    if tuple(value.shape) != tuple(meta.shape):
        return False
    _replace_by_literal(gm, made, value)
    return True


def _only_read(gm, node, depth: int = 0) -> bool:
    """Whether node's value may become a constant made once: read, and by nothing that returns it, writes it
    (also a module with inplace=True: review49r3) or keeps a view of it (eager makes it anew each call, so
    nothing must see the difference); a dense view of it that is itself only read counts as a read
    (fold_view_of_literal), a few views deep."""
    from .normalize import _reads_without_alias   # normalize calls this: import late
    return bool(node.users) and all(
        u.op != "output" and _writes_in_place(u) is None
        and not (u.op == "call_module" and getattr(gm.get_submodule(u.target), "inplace", False) is True)
        and (_reads_without_alias(gm, u) or depth < 8 and _dense_view_of(u, node) and _only_read(gm, u, depth + 1))
        for u in node.users)


DENSE_VIEWS = {"unsqueeze", "view", "reshape", "flatten", "squeeze"}   # of a row-major tensor: row-major


def _dense_view_of(node, source) -> bool:
    """node views all of `source` in its order: unsqueeze / view / reshape / flatten / squeeze, or an index of
    None, ... and whole slices (`t[:, None]`), with numbers for arguments."""
    if node.op not in ("call_function", "call_method") or not node.args or node.args[0] is not source \
            or any(isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        return len(node.args) == 2 and only_unit_indices(node.args[1])
    return op_name(node) in DENSE_VIEWS


def fold_view_of_literal(gm, node) -> bool:
    """A dense view of a literal this pass folded (`torch.arange(T)[:, None]`, `(c + 1).view(T, 1)`), read
    only, is a literal too: the pointwise op reading it then folds (fuzz49i: `arange(T)[None, :] <=
    arange(T)[:, None]`, a causal mask, cost 3 library calls on every call)."""
    source = node.args[0] if node.op in ("call_function", "call_method") and node.args else None
    literal = _literal(source)
    if literal is None or not source.target.startswith(LITERAL_PREFIX) or not _dense_view_of(node, source) \
            or not _only_read(gm, node):
        return False
    meta = single_tensor_meta(node)
    try:
        view = getattr(literal, node.target) if node.op == "call_method" else functools.partial(node.target, literal)
        value = view(*node.args[1:], **node.kwargs)
    except Exception:  # noqa: BLE001 -- what eager would raise, it raises at run time: left as it is
        return False
    if not isinstance(value, torch.Tensor) or meta is None or value.dtype != meta.dtype \
            or tuple(value.shape) != tuple(meta.shape):
        return False
    _replace_by_literal(gm, [node], value.clone())   # (dense: clone keeps the view's strides)
    return True


def _replace_by_literal(gm, made: list, value: torch.Tensor) -> None:
    """The nodes `made` (each read only by the next) become one constant of the graph, `value`."""
    name = register_constant(gm, LITERAL_STEM, value)
    with gm.graph.inserting_before(made[0]):
        constant = gm.graph.get_attr(name)
    constant.meta = dict(made[0].meta)
    made[-1].replace_all_uses_with(constant)
    for n in reversed(made):
        gm.graph.erase_node(n)


def _literal(node) -> torch.Tensor | None:
    """The tensor of a literal this pass folded, or of one torch.fx made while tracing (a tensor
    forward() built from numbers alone: `torch.sqrt(torch.tensor(24.))` ran at trace time), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"
            and node.target.startswith((LITERAL_PREFIX, "_tensor_constant"))):
        return None
    return getattr(node.graph.owning_module, node.target, None)


def fold_pointwise_of_literals(gm: torch.fx.GraphModule, node: torch.fx.Node, pointwise: dict) -> bool:
    """A canonical pointwise op whose tensor operands are all folded literals
    (`torch.sqrt(torch.tensor(d_k))`) is one too: computed here once, on the literals' device,
    by the op eager runs on every call, so its value is eager's bit for bit."""
    if node.op != "call_function" or node.target not in pointwise:
        return False
    operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if not operands or any(_literal(a) is None for a in operands) or \
            any(isinstance(v, torch.fx.Node) for v in node.kwargs.values()) \
            or not _only_read(node.graph.owning_module, node):   # (a view kept and written: `m.view(-1).mul_(3)`
        return False                                            # edited the constant; review48r3)
    meta = single_tensor_meta(node)
    try:
        value = node.target(*[_literal(a) if isinstance(a, torch.fx.Node) else a for a in node.args], **node.kwargs)
    except Exception:  # noqa: BLE001 -- what eager would raise, it raises at run time: left as it is
        return False
    if not isinstance(value, torch.Tensor) or meta is None or value.dtype != meta.dtype \
            or tuple(value.shape) != tuple(meta.shape) or value.numel() > (
                FOLDED_MAX_ELEMENTS if all(a.target.startswith(LITERAL_PREFIX) for a in operands) else MAX_ELEMENTS):
        return False
    _note_snapshot(gm, operands)
    _replace_by_literal(gm, [node], value)
    return True


def _note_snapshot(gm, sources) -> None:
    """A value taken from a tensor torch.fx recorded while tracing: forward()'s own `torch.tensor(..)`,
    but also a tensor it reads from a global or a dict (review37: `x / torch.sqrt(SCALE)`), which
    may be edited in place later. The runtime then watches every tensor the trace read
    (api.build_graph: fxfuse_copied), as for a weight folded into a copy."""
    if any(not a.target.startswith(LITERAL_PREFIX) for a in sources):
        gm.meta["fxfuse_snapshots"] = True


def cpu_literal_as_number(node: torch.fx.Node, pointwise: dict) -> None:
    """A 0-dim CPU literal read by a pointwise op of CUDA tensors (`x / torch.sqrt(torch.tensor(24.))`
    made without device=): CUDA's kernels read a CPU scalar tensor as they read a Python number,
    unrounded, and the fused kernel could not take a CPU tensor (it ran its reference ops on every
    call, stop 37's GPU probe). Where the op's result dtype stays the same, the number is read."""
    if node.op != "call_function" or node.target not in pointwise:
        return
    nargs = pointwise[node.target].nargs
    operands = node.args[:nargs]
    others = [a for a in operands if isinstance(a, torch.fx.Node) and _literal(a) is None]
    if not others or any(getattr(fxfuse_meta(a).get("device"), "type", None) != "cuda" for a in others):
        return
    meta = single_tensor_meta(node)
    for a in operands:
        value = _literal(a)
        if value is None or value.dim() != 0 or value.device.type != "cpu" or meta is None or value.dtype == torch.bool:
            continue
        number = value.item()
        new_args = [number if b is a else b for b in node.args]
        fakes = [torch.empty((1,) * len(single_tensor_meta(b).shape), dtype=single_tensor_meta(b).dtype, device="meta")
                 if isinstance(b, torch.fx.Node) else b for b in new_args[:nargs]]
        try:
            same = torch.result_type(*fakes) == meta.dtype if len(fakes) == 2 else False
        except (RuntimeError, TypeError):
            same = False
        if same:
            _note_snapshot(node.graph.owning_module, [a])
            node.args = tuple(new_args)


def divide_as_cuda_does(node) -> bool:
    """`x / c` with c a number, in fp32/fp16/bf16 on CUDA: eager's kernel multiplies by 1/c, the
    reciprocal computed once (BinaryDivTrueKernel.cu: "if the second argument is a CPU scalar,
    compute a * reciprocal(b)"), which can differ from a true division in the last bit (fuzz33d;
    on an H100, x / 1e-3 and x / 2.5e-4 did). Written so, every kernel computes what eager
    computes. CPU eager divides (and so do the kernels there)."""
    if node.op != "call_function" or node.target is not operator.truediv or node.kwargs or len(node.args) != 2:
        return False
    x, c = node.args
    meta = single_tensor_meta(node)
    device = node.meta.get("fxfuse", {}).get("device")
    if not isinstance(x, torch.fx.Node) or type(c) not in (int, float) or meta is None \
            or meta.dtype not in (torch.float32, torch.float16, torch.bfloat16) or getattr(device, "type", None) != "cuda":
        return False
    try:   # 1/c in double, then rounded to fp32: what CUDA's eager matched, bit for bit, on an H100 (x / 1e-3,
        one_over = torch.tensor(1.0 / c, dtype=torch.float32, device="cpu").item()   # x / 2.5e-4); 1/fp32(c) did not
    except (OverflowError, ZeroDivisionError):   # x / 0 (inf, nan) and huge ints: left as they are
        return False
    node.target, node.args = operator.mul, (x, one_over)
    return True


LIKE_FACTORIES = {torch.zeros_like: 0, torch.ones_like: 1, torch.full_like: None}   # None: the value is given
NEW_FACTORIES = {"new_zeros": 0, "new_ones": 1, "new_full": None}


def factory_without_template(node) -> bool:
    """`torch.zeros_like(h)`, `full_like(h, v)`, `h.new_zeros(size)`, `h.new_full(size, v)`: only h's
    shape, dtype and device are read, which the specialization fixes; as `torch.full(shape, v, ...)`
    the node no longer reads h, so h need not be stored for it (fuzz44d: it split a kernel).
    Rewritten in place; True if it was. Not where h's strides would be kept (a non-row-major h)."""
    from fxfuse.ops import row_major   # (ops imports passes' helpers: late)
    if not node.args:   # (torch.zeros_like(input=h): left as it is; review44h)
        return False
    if node.op == "call_function" and node.target in LIKE_FACTORIES:
        value = LIKE_FACTORIES[node.target]
        rest = node.args[1:]
        if value is None:
            value, rest = (node.args[1], node.args[2:]) if len(node.args) > 1 else (node.kwargs.get("fill_value"), ())
    elif node.op == "call_method" and node.target in NEW_FACTORIES and len(node.args) >= 2:
        value, rest = NEW_FACTORIES[node.target], node.args[2:]
        if value is not None and all(type(a) is int for a in node.args[1:]):
            rest = ()   # h.new_ones(n, 1): the sizes one by one
        if value is None:
            value, rest = (rest[0], rest[1:]) if rest else (node.kwargs.get("fill_value"), ())
    else:
        return False
    template, meta, device = node.args[0], single_tensor_meta(node), fxfuse_meta(node).get("device")
    src = single_tensor_meta(template) if isinstance(template, torch.fx.Node) else None
    if rest or set(node.kwargs) - {"dtype", "fill_value"} or not isinstance(value, (int, float, bool)) \
            or meta is None or src is None or device is None or tuple(meta.stride) != row_major(meta.shape) \
            or node.op == "call_function" and tuple(src.stride) != row_major(src.shape):
        return False
    node.op, node.target = "call_function", torch.full
    node.args, node.kwargs = (tuple(meta.shape), value), {"dtype": meta.dtype, "device": device}
    return True


FULLS = {torch.full, torch.ops.aten.full.default}
# `torch.zeros(b, d)`, `torch.ones((n,))`: a scan's initial state (Mamba, RWKV; fuzz46a), sizes only
ZEROS_ONES = {torch.zeros: 0, torch.ones: 1, torch.ops.aten.zeros.default: 0, torch.ops.aten.ones.default: 1}


def full_as_expanded_literal(gm, node, is_pointwise_target) -> bool:
    """`torch.full(shape, v)`, `torch.zeros(shape)`, `torch.ones(shape)` (and zeros_like, ones_like,
    new_full ..., which factory_without_template made full) read only by pointwise ops: a one-element
    constant expanded to the shape, which the fused kernel reads as a number where it lies, instead of a
    library call that fills a tensor on every call (stop 44 left it: a launch each)."""
    from .identity_ops import read_as_broadcast_only
    if node.op != "call_function" or node.target not in FULLS and node.target not in ZEROS_ONES \
            or node.target in FULLS and (len(node.args) != 2 or not isinstance(node.args[1], (bool, int, float))) \
            or set(node.kwargs) - {"dtype", "device", "layout", "pin_memory", "requires_grad", "size"} \
            or node.kwargs.get("layout") not in (None, torch.strided) or node.kwargs.get("pin_memory") \
            or node.kwargs.get("requires_grad"):
        return False
    meta, device = single_tensor_meta(node), fxfuse_meta(node).get("device")
    if meta is None or device is None or not read_as_broadcast_only(node, is_pointwise_target):
        return False
    number = node.args[1] if node.target in FULLS else ZEROS_ONES[node.target]
    value = torch.full((), number, dtype=meta.dtype, device=device)   # eager's conversion of v
    name = register_constant(gm, LITERAL_STEM, value)
    with gm.graph.inserting_before(node):
        constant = gm.graph.get_attr(name)
    node.op, node.target, node.args, node.kwargs = "call_method", "expand", (constant, tuple(meta.shape)), {}
    return True



aten = torch.ops.aten
MASK_FACTORIES = {torch.full, torch.zeros, torch.ones, torch.arange, torch.eye, aten.full.default, aten.zeros.default,
                  aten.ones.default, aten.arange.default, aten.arange.start, aten.arange.start_step, aten.eye.default,
                  aten.eye.m}   # (torch.export's: review48r3)
TRIANGLES = {torch.triu, torch.tril, "triu", "tril", aten.triu.default, aten.tril.default}
FOLDED_MAX_ELEMENTS = 1 << 16   # a 256 x 256 mask: 256 KiB in fp32, kept with the graph


def fold_constant_mask(gm, node) -> bool:
    """A mask forward() builds from sizes and numbers alone (`torch.triu(torch.full((T, T), -inf), 1)`,
    `torch.ones(T, T).tril()`, then `.bool()`, `~m`): the specialization fixes T, so its value is known
    here and it becomes a constant of the graph, made once by the ops eager runs, instead of library calls
    on every call (fuzz48g: 2 per mask; HF's causal masks). fold_pointwise_of_literals takes the casts and
    pointwise ops after it. Only where nothing writes it, keeps a view of it or returns it."""
    target = node.target
    if node.op == "call_function" and target in MASK_FACTORIES:
        operands = ()
        if any(isinstance(a, torch.fx.Node) for a in (*node.args, *node.kwargs.values())) \
                or set(node.kwargs) - {"dtype", "device", "layout", "requires_grad", "size", "fill_value", "start",
                                       "end", "step", "n", "m", "pin_memory"} or node.kwargs.get("pin_memory") \
                or node.kwargs.get("requires_grad") or node.kwargs.get("layout") not in (None, torch.strided):
            return False
    elif node.op in ("call_function", "call_method") and target in TRIANGLES and node.args:
        operands = node.args[:1]
        if _literal(node.args[0]) is None or any(isinstance(a, torch.fx.Node)
                                                 for a in (*node.args[1:], *node.kwargs.values())):
            return False
    else:
        return False
    meta, device = single_tensor_meta(node), fxfuse_meta(node).get("device")
    if meta is None or device is None or math.prod(meta.shape) > FOLDED_MAX_ELEMENTS or not _only_read(gm, node):
        return False
    try:
        if operands:
            source = _literal(operands[0])
            call = getattr(source, target) if isinstance(target, str) else functools.partial(target, source)
            value = call(*node.args[1:], **node.kwargs)
        else:
            value = target(*node.args, **{**node.kwargs, "device": device})
    except Exception:  # noqa: BLE001 -- what eager would raise, it raises at run time: left as it is
        return False
    if not isinstance(value, torch.Tensor) or value.dtype != meta.dtype or tuple(value.shape) != tuple(meta.shape):
        return False
    if operands:
        _note_snapshot(gm, list(operands))
    _replace_by_literal(gm, [node], value)
    return True
