"""The two spellings the normalize pass decides from a node's metadata (passes/spellings.py holds
the tables): `x.masked_fill(mask, v)` as torch.where where both give x's dtype, and the pure
dtype conversions (x.float(), x.to(torch.half), y.type_as(x), torch.export's aten.to.dtype)."""
import inspect
import math
import operator
import typing
import warnings

import torch
import torch.fx

from fxfuse.node_meta import fxfuse_meta, single_tensor_meta

aten = torch.ops.aten
CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                "double": torch.float64, "bool": torch.bool}   # h.bool(): h != 0, NaN true (fuzz44b)


TENSOR_TYPE_NAMES = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
                     "BFloat16Tensor": torch.bfloat16, "BoolTensor": torch.bool}


def masked_fill_is_where(x, value) -> bool:
    """x.masked_fill(mask, value) is torch.where(mask, value, x) where both give x's dtype: a
    floating x with a number, or with a 0-d tensor of its own dtype (masked_fill never promotes;
    where would make an int x float for 1.5)."""
    meta = single_tensor_meta(x)
    if meta is None or not meta.dtype.is_floating_point:
        return False
    if isinstance(value, (bool, int, float)):
        return True
    vmeta = single_tensor_meta(value)
    return vmeta is not None and not vmeta.shape and vmeta.dtype == meta.dtype


def masked_fill_value_cast(x, value, node):
    """A cast node of a 0-d tensor value of another dtype to x's (fp16 scores filled with torch.tensor(-inf),
    fp32 ones with an fp64 or int64 0-d value), which masked_fill converts so: with it, the fill is a where
    like any other (fuzz48g: a library call between two kernels). None where that does not apply."""
    from fxfuse.ops import cast   # (ops imports passes' helpers: late)
    meta, vmeta = single_tensor_meta(x), single_tensor_meta(value)
    if meta is None or vmeta is None or vmeta.shape or not meta.dtype.is_floating_point \
            or vmeta.dtype in (torch.bool, meta.dtype) or vmeta.dtype.is_complex:
        return None
    with node.graph.inserting_before(node):
        new = node.graph.call_function(cast, (value, meta.dtype))
    new.meta = {**value.meta, "tensor_meta": vmeta._replace(dtype=meta.dtype),
                "fxfuse": dict(value.meta.get("fxfuse", {}))}
    return new


def cast_target(node):
    """dtype of a pure dtype conversion (x.float(), x.to(torch.half), x.type(dtype), y.type_as(x)
    on one device, and torch.export's aten.to.dtype and aten.type_as), else None."""
    type_as = node.target == "type_as" if node.op == "call_method" else node.target is aten.type_as.default
    if type_as and len(node.args) == 2 and not node.kwargs:   # LLaMA's RMSNorm: y.type_as(x)
        src, other = node.args
        meta = single_tensor_meta(other)
        devices = {fxfuse_meta(n).get("device") for n in (src, other) if isinstance(n, torch.fx.Node)}
        if meta is not None and len(devices) == 1 and None not in devices:
            return meta.dtype   # x.to(other's dtype and device): a cast where both are on one device
    if node.op == "call_function" and node.target in ATEN_TO or node.op == "call_method" and node.target == "to":
        return _conversion(node) if node.args else None
    if node.op != "call_method":
        return None
    if node.target in CAST_METHODS and len(node.args) == 1 and not node.kwargs:
        return CAST_METHODS[node.target]
    if node.target == "type" and len(node.args) + len(node.kwargs) == 2 and set(node.kwargs) <= {"dtype"}:
        dtype = node.args[1] if len(node.args) == 2 else node.kwargs["dtype"]   # h.type(dtype=...) (fuzz43b)
        if isinstance(dtype, torch.fx.Node) and dtype.op == "call_method" and dtype.target == "type" \
                and len(dtype.args) == 1 and not dtype.kwargs:   # m.type(x.type()): sparsemax's (fuzz47a)
            other, devices = dtype.args[0], {fxfuse_meta(n).get("device") for n in (node.args[0], dtype.args[0])
                                             if isinstance(n, torch.fx.Node)}
            meta = single_tensor_meta(other)
            return meta.dtype if meta is not None and len(devices) == 1 and None not in devices else None
        if isinstance(dtype, str):   # h.type("torch.HalfTensor") on the CPU, "torch.cuda.HalfTensor" on CUDA (fuzz44d)
            device = getattr(fxfuse_meta(node.args[0]).get("device"), "type", None) \
                if isinstance(node.args[0], torch.fx.Node) else None
            prefix, _, name = dtype.rpartition(".")
            dtype = TENSOR_TYPE_NAMES.get(name) if prefix == {"cpu": "torch", "cuda": "torch.cuda"}.get(device) else None
        return dtype if isinstance(dtype, torch.dtype) else None
    return None


KEYWORDS = ("dtype", "layout", "device", "pin_memory", "non_blocking", "copy", "memory_format")
ATEN_TO = {aten._to_copy.default: (), aten.to.dtype: ("dtype", "non_blocking", "copy", "memory_format"),
           aten.to.device: ("device", "dtype", "non_blocking", "copy", "memory_format"),
           aten.to.other: ("other", "non_blocking", "copy", "memory_format"), aten.to.dtype_layout: ()}


def _to_arguments(node):
    """(dtype, copies) of x.to(...) (and torch.export's aten.to overloads and _to_copy) where it
    converts the dtype on x's own device: x.to(dtype), .to(device, dtype), .to(device=, dtype=),
    .to(other), with non_blocking= or copy=; else None. fuzz42c: all but the first were library
    calls between two kernels."""
    src, rest = node.args[0], list(node.args[1:])
    if node.op == "call_method":   # Tensor.to's three signatures, told apart by the first argument's type
        names = ("other",) if rest and isinstance(rest[0], torch.fx.Node) else \
            ("device",) * bool(rest and isinstance(rest[0], (str, torch.device))) + ("dtype",)
        names += ("non_blocking", "copy", "memory_format")
    else:
        names = ATEN_TO[node.target]
    if len(rest) > len(names) or set(node.kwargs) - set(KEYWORDS):
        return None
    bound = dict(zip(names, rest))
    for key, value in node.kwargs.items():
        if key in bound:
            return None
        bound[key] = value
    if "other" in bound:   # x.to(other): its dtype and device
        meta = single_tensor_meta(bound["other"])
        if meta is None or fxfuse_meta(bound["other"]).get("device") is None:
            return None
        bound["dtype"], bound["device"] = meta.dtype, fxfuse_meta(bound.pop("other"))["device"]
    dtype, device, source = bound.get("dtype"), bound.get("device"), single_tensor_meta(src)
    if not isinstance(dtype, torch.dtype) or source is None or bound.get("pin_memory") \
            or bound.get("memory_format") not in (None, torch.preserve_format) \
            or bound.get("layout") not in (None, torch.strided):
        return None
    if device is not None:   # `cuda` without an index is the current device, which may not be x's
        here = fxfuse_meta(src).get("device")
        if here is None or not isinstance(device, (str, torch.device)) or torch.device(device) != torch.device(here):
            return None
    return dtype, node.target is aten._to_copy.default or bool(bound.get("copy"))


def _conversion(node):
    """The dtype of a conversion _to_arguments reads, unless it copies to x's own dtype (eager
    returns a new tensor: copy_to_own_dtype_as_clone reads it)."""
    found = _to_arguments(node)
    if found is None or found[1] and found[0] == single_tensor_meta(node.args[0]).dtype:
        return None
    return found[0]


def copy_to_own_dtype_as_clone(node) -> bool:
    """`h.to(h.dtype, copy=True)` (torch.export's _to_copy to h's dtype): a copy on h's device, which
    is `h.clone()` (eager's keeps h's strides too), as read_only_clone reads it (stop 44 left it: it
    split a kernel). Rewritten in place; True if it was."""
    if not (node.op == "call_function" and node.target in ATEN_TO or node.op == "call_method" and node.target == "to") \
            or not node.args:
        return False
    found = _to_arguments(node)
    if found is None or not found[1] or found[0] != single_tensor_meta(node.args[0]).dtype:
        return False
    node.op, node.target, node.args, node.kwargs = "call_function", torch.clone, (node.args[0],), {}
    return True


def overload_of(node):
    """The overload a call of an aten packet runs (`torch.ops.aten.cat([a, b], -1)`, no overload
    named: the tables hold overloads; fuzz43b), told from the arguments' kinds as the dispatcher
    tells it: the one schema they fit, else the one they fit exactly (`aten.split(x, 2, 1)` fits
    split.sizes too, an int taken as a list); None where that leaves several or none."""
    from torch.fx.operator_schemas import get_signature_for_torch_op, type_matches   # (torch.fx internals)
    packet = node.target
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None

    def kind(a):
        if isinstance(a, torch.fx.Node):
            return torch.Tensor if single_tensor_meta(a) is not None else a.meta.get("type")
        if isinstance(a, (list, tuple)) and a and all(isinstance(i, torch.fx.Node) for i in a):
            return typing.List[torch.Tensor]
        if isinstance(a, (list, tuple)) and all(type(i) is int for i in a):
            return typing.List[int]
        return int if isinstance(a, torch.dtype) else type(a)   # (a schema's ScalarType reads as int)
    try:
        with warnings.catch_warnings():   # torch.fx warns of schema types it cannot compare (review43f)
            warnings.simplefilter("ignore")
            signatures, schemas = get_signature_for_torch_op(packet, return_schemas=True)
            fits = []
            for signature, schema in zip(signatures or (), schemas or ()):
                if schema.overload_name.startswith("prim_"):   # TorchScript's own, not the dispatcher's
                    continue
                try:
                    bound = signature.bind(*node.args, **node.kwargs).arguments
                except TypeError:
                    continue
                kinds = {name: (signature.parameters[name].annotation, kind(v)) for name, v in bound.items()}
                if all(k is None or want is inspect.Parameter.empty or type_matches(want, k)
                       for want, k in kinds.values()):
                    exact = all(k is None or want in (k, typing.Optional[k]) for want, k in kinds.values())
                    fits.append((schema.overload_name or "default", exact))
    except Exception:  # noqa: BLE001 -- an op torch.fx cannot describe: left as it is
        return None
    exact = [name for name, is_exact in fits if is_exact]
    chosen = fits[0][0] if len(fits) == 1 else exact[0] if len(exact) == 1 else None
    return getattr(packet, chosen) if chosen is not None else None


GREATER = {operator.gt, operator.ge, torch.gt, torch.ge, torch.greater, torch.greater_equal, "gt", "ge",
           aten.gt.Scalar, aten.ge.Scalar}
MULTIPLY = {operator.mul, torch.mul, torch.multiply, "mul", aten.mul.Tensor, aten.mul.Scalar}
WHERES = {torch.where, aten.where.self}


def where_as_leaky_relu(node):
    """(h, slope) where node is `torch.where(h > 0, h, slope * h)` (also `>=`, `h * slope`): a
    LeakyReLU written by hand, which is F.leaky_relu bit for bit (h > 0 ? h : h * slope; NaN and
    -0.0 included) and which the fused MLP and GEMM epilogues take, a bool mask they do not
    (fuzz43j); else None."""
    if node.op != "call_function" or node.target not in WHERES or len(node.args) != 3 or node.kwargs:
        return None
    cond, h, other = node.args

    def call(n, targets):
        return isinstance(n, torch.fx.Node) and n.op in ("call_function", "call_method") \
            and n.target in targets and len(n.args) == 2 and not n.kwargs
    meta = single_tensor_meta(h)
    if not call(cond, GREATER) or cond.args[0] is not h or cond.args[1] not in (0, 0.0) or type(cond.args[1]) is bool \
            or not call(other, MULTIPLY) or meta is None or not meta.dtype.is_floating_point:
        return None
    slope = other.args[1] if other.args[0] is h else other.args[0] if other.args[1] is h else None
    if type(slope) is not float or not math.isfinite(slope) or single_tensor_meta(other) != meta \
            or cond.target in ("ge", operator.ge, torch.ge, torch.greater_equal, aten.ge.Scalar) \
            and math.copysign(1.0, slope) < 0:   # (h >= 0 keeps a zero's sign; a negative slope flips it)
        return None
    if set(cond.users) != {node} or set(other.users) != {node} or not _unwritten(_base(h)):
        return None   # (nothing may write h, the mask or slope * h in between: review43k)
    return h, slope


def _is_view(n) -> bool:
    from fxfuse.state_writes import VIEW_FUNCTIONS, VIEW_METHODS
    return n.op == "call_function" and (n.target is operator.getitem or n.target in VIEW_FUNCTIONS
                                        or getattr(n.target, "is_view", False) is True) \
        or n.op == "call_method" and n.target in VIEW_METHODS   # (export's aten.select.int: is_view)


def _base(h, depth: int = 0):
    """The tensor h views (through view ops), or h."""
    while _is_view(h) and isinstance(h.args[0], torch.fx.Node) and depth < 8:
        h, depth = h.args[0], depth + 1
    return h


def _unwritten(node, depth: int = 0) -> bool:
    """Whether no op writes node or a view of it in place (a method ending in `_`, an item
    assignment, an `out=`), over its views' readers too."""
    from fxfuse.data_dependent import op_name
    if node.op == "get_attr" or depth > 8:
        return False
    for u in node.users:
        if op_name(u).endswith("_") or u.target in (operator.setitem, "__setitem__") or "out" in u.kwargs \
                or _is_view(u) and not _unwritten(u, depth + 1):
            return False
    return True
