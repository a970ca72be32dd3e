"""The spelling tables of the normalize pass: every way PyTorch code can write an op, mapped to
fxfuse's canonical form (functions, methods, in-place variants, nn modules, aten overloads),
and where a node's metadata decides (casts, masked_fill: passes/metadata_spellings.py).

Kept apart from the pass so that adding an op's spellings is an edit to tables, not to the
rewriting logic in passes/normalize.py.
"""
import math
import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.node_meta import single_tensor_meta
from fxfuse.ops import HALF_DTYPES, POINTWISE, lerp_scalar

from .metadata_spellings import (cast_target, masked_fill_is_where,  # noqa: F401 (cast_target: re-exported)
                                 masked_fill_value_cast)

aten = torch.ops.aten


@dataclass(frozen=True)
class Spelling:
    canonical: object                  # key of fxfuse.ops.POINTWISE
    names: tuple                       # this spelling's parameter names, positional order
    inplace: bool = False
    fixed: dict = field(default_factory=dict)   # canonical params this spelling implies
    rename: dict = field(default_factory=dict)  # this spelling's name -> canonical param name


UNARY = {  # canonical target: function spellings (each also has methods `name` and `name_`)
    torch.exp: [torch.exp],
    torch.log: [torch.log], torch.sqrt: [torch.sqrt], torch.rsqrt: [torch.rsqrt],
    torch.abs: [torch.abs, torch.absolute], torch.sin: [torch.sin], torch.cos: [torch.cos],
    torch.erf: [torch.erf, torch.special.erf], torch.floor: [torch.floor], torch.ceil: [torch.ceil],
    torch.expm1: [torch.expm1, torch.special.expm1], torch.log1p: [torch.log1p, torch.special.log1p],
    torch.reciprocal: [torch.reciprocal], torch.relu: [torch.relu, F.relu],
    torch.sigmoid: [torch.sigmoid, F.sigmoid, torch.special.expit], torch.tanh: [torch.tanh, F.tanh],
    F.silu: [F.silu], F.mish: [F.mish], F.selu: [F.selu], F.hardsigmoid: [F.hardsigmoid],
    F.hardswish: [F.hardswish], operator.neg: [operator.neg, torch.neg, torch.negative],
    torch.logical_not: [torch.logical_not], torch.trunc: [torch.trunc, torch.fix],
    torch.round: [torch.round, torch.special.round],
    torch.frac: [torch.frac], torch.sign: [torch.sign, torch.sgn], torch.exp2: [torch.exp2, torch.special.exp2],
    torch.log2: [torch.log2], torch.log10: [torch.log10], torch.isnan: [torch.isnan], torch.isinf: [torch.isinf],
    torch.isfinite: [torch.isfinite], torch.isposinf: [torch.isposinf], torch.isneginf: [torch.isneginf],
}
METHOD_NAMES = {torch.exp: "exp", torch.log: "log", torch.sqrt: "sqrt", torch.rsqrt: "rsqrt",
                torch.abs: "abs", torch.sin: "sin", torch.cos: "cos", torch.erf: "erf",
                torch.floor: "floor", torch.ceil: "ceil", torch.expm1: "expm1",
                torch.log1p: "log1p", torch.reciprocal: "reciprocal", torch.relu: "relu",
                torch.sigmoid: "sigmoid", torch.tanh: "tanh", operator.neg: "neg", torch.logical_not: "logical_not",
                torch.trunc: "trunc", torch.round: "round", torch.frac: "frac", torch.sign: "sign", torch.exp2: "exp2",
                torch.log2: "log2", torch.log10: "log10", torch.isnan: "isnan", torch.isinf: "isinf", torch.isfinite: "isfinite",
                torch.isposinf: "isposinf", torch.isneginf: "isneginf"}
# `~mask`, torch.bitwise_not(mask): logical_not where the operand is bool (on integers a bitwise not)
BOOL_NOTS = {operator.invert, torch.bitwise_not, aten.bitwise_not.default, "bitwise_not", "__invert__"}
BINARY = {operator.add: ("add", [torch.add]), operator.sub: ("sub", [torch.sub, torch.subtract]),
          operator.mul: ("mul", [torch.mul, torch.multiply]),
          operator.truediv: ("div", [torch.div, torch.divide, torch.true_divide]),
          operator.gt: ("gt", [torch.gt, torch.greater]), operator.lt: ("lt", [torch.lt, torch.less]),
          operator.ge: ("ge", [torch.ge, torch.greater_equal]),
          operator.le: ("le", [torch.le, torch.less_equal]), operator.eq: ("eq", [torch.eq]),
          operator.ne: ("ne", [torch.ne, torch.not_equal]),
          torch.maximum: ("maximum", [torch.maximum]), torch.minimum: ("minimum", [torch.minimum]),
          torch.logical_and: ("logical_and", [torch.logical_and]), torch.logical_or: ("logical_or", [torch.logical_or]),
          torch.logical_xor: ("logical_xor", [torch.logical_xor])}
# `mask_a & mask_b`, `|`, `^`, bitwise_and/or/xor of two bool tensors: logical ops (on integers bitwise ones);
# aten.__and__ & co. are export's `&` (fuzz33m)
BOOL_BINARY = {spelling: logical for op, name, logical in ((operator.and_, "and", torch.logical_and),
                                                         (operator.or_, "or", torch.logical_or),
                                                         (operator.xor, "xor", torch.logical_xor))
               for spelling in (op, getattr(torch, f"bitwise_{name}"), f"bitwise_{name}", f"__{name}__",
                                getattr(aten, f"bitwise_{name}").Tensor, getattr(aten, f"__{name}__").Tensor)}
BOOL_INPLACE = {spelling: logical for op, name, logical in ((operator.iand, "and", torch.logical_and),   # `m &= c`
                                                          (operator.ior, "or", torch.logical_or),      # (review38b)
                                                          (operator.ixor, "xor", torch.logical_xor))
                for spelling in (op, f"bitwise_{name}_", f"__i{name}__", getattr(aten, f"bitwise_{name}_").Tensor,
                                 getattr(aten, f"__i{name}__").Tensor)}
# three-operand ops after input (a value= keyword for addcmul/addcdiv, keyword-only in torch)
TERNARY = {torch.lerp: ("end", "weight"), torch.addcmul: ("tensor1", "tensor2", "value"),
           torch.addcdiv: ("tensor1", "tensor2", "value")}
# torch.max(a, b) / a.min(b) of two tensors: maximum / minimum (fuzz35f: OPT's attention), True for max
BINARY_MAX_MIN = {torch.max: True, "max": True, aten.max.other: True, torch.min: False, "min": False, aten.min.other: False}
_OPERANDS = {operator.pow: ("input", "exponent")}   # canonical parameter names where not (input, other)
INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub,
                     operator.imul: operator.mul, operator.itruediv: operator.truediv, operator.ipow: operator.pow}
ACTIVATION_PARAMS = {  # canonical: (F spelling, its parameter names after input, module class)
    torch.relu: ((), nn.ReLU), torch.sigmoid: ((), nn.Sigmoid), torch.tanh: ((), nn.Tanh),
    F.silu: ((), nn.SiLU), F.mish: ((), nn.Mish), F.selu: ((), nn.SELU),
    F.hardsigmoid: ((), nn.Hardsigmoid), F.hardswish: ((), nn.Hardswish),
    F.gelu: (("approximate",), nn.GELU), F.leaky_relu: (("negative_slope",), nn.LeakyReLU),
    F.elu: (("alpha",), nn.ELU), F.softplus: (("beta", "threshold"), nn.Softplus),
    F.celu: (("alpha",), nn.CELU), F.softsign: ((), nn.Softsign), F.logsigmoid: ((), nn.LogSigmoid),
    F.tanhshrink: ((), nn.Tanhshrink), F.hardshrink: (("lambd",), nn.Hardshrink),
    F.softshrink: (("lambd",), nn.Softshrink), F.threshold: (("threshold", "value"), nn.Threshold),
}


# x.masked_fill(mask, value) = torch.where(mask, value, x) (normalize checks the dtypes agree)
MASKED_FILL = Spelling(torch.where, ("input", "mask", "value"), fixed={"_masked_fill": True},
                       rename={"input": "other", "mask": "condition", "value": "input"})
MASKED_FILL_ = replace(MASKED_FILL, inplace=True)


ANGLE_FACTORS = {"rad2deg": 180 / math.pi, "deg2rad": math.pi / 180}   # ATen's M_180_PI, M_PI_180 (fuzz44b)


def _build_function_spellings() -> dict:
    table = {}
    for canon, spellings in UNARY.items():
        for fn in spellings:
            table[fn] = Spelling(canon, ("input", "inplace"))
        under = getattr(torch, f"{getattr(canon, '__name__', '')}_", None)
        if under is not None and canon is not operator.neg:
            table[under] = Spelling(canon, ("input",), inplace=True)
    for canon, (_, spellings) in BINARY.items():
        table[canon] = Spelling(canon, ("input", "other"))
        for fn in spellings:
            table[fn] = Spelling(canon, ("input", "other", "alpha", "rounding_mode"))
    for op, canon in INPLACE_OPERATORS.items():
        table[op] = Spelling(canon, _OPERANDS.get(canon, ("input", "other")), inplace=True)
    for canon, (params, _) in ACTIVATION_PARAMS.items():
        if canon in (F.gelu, F.leaky_relu, F.elu, F.softplus, F.celu, F.threshold):
            table[canon] = Spelling(canon, ("input",) + params + ("inplace",))
        elif canon in (F.softsign, F.logsigmoid, F.tanhshrink, F.hardshrink, F.softshrink):
            table[canon] = Spelling(canon, ("input",) + params)
    table[torch.selu] = Spelling(F.selu, ("input",))   # torch's own names of F's activations (fuzz41e)
    table[torch.celu] = Spelling(F.celu, ("input", "alpha"))
    table[torch.threshold] = Spelling(F.threshold, ("input", "threshold", "value"))
    table[F.threshold_] = Spelling(F.threshold, ("input", "threshold", "value"), inplace=True)
    table[torch.celu_] = Spelling(F.celu, ("input", "alpha"), inplace=True)
    table[F.relu_] = Spelling(torch.relu, ("input",), inplace=True)
    table[F.leaky_relu_] = Spelling(F.leaky_relu, ("input", "negative_slope"), inplace=True)
    table[F.elu_] = Spelling(F.elu, ("input", "alpha"), inplace=True)
    table[torch.pow] = Spelling(operator.pow, ("input", "exponent"))
    table[operator.pow] = Spelling(operator.pow, ("input", "exponent"))
    table[torch.square] = Spelling(operator.pow, ("input",), fixed={"exponent": 2})
    table[operator.abs] = Spelling(torch.abs, ("input",))   # the builtin abs(h)
    clamp = ("input", "min", "max")
    for fn in (torch.clamp, torch.clip):
        table[fn] = Spelling(torch.clamp, clamp)
    table[torch.clamp_] = table[torch.clip_] = Spelling(torch.clamp, clamp, inplace=True)
    table[torch.square_] = Spelling(operator.pow, ("input",), fixed={"exponent": 2}, inplace=True)   # (fuzz43b)
    table[torch.neg_] = table[torch.negative_] = Spelling(operator.neg, ("input",), inplace=True)
    table[torch.fix_] = Spelling(torch.trunc, ("input",), inplace=True)
    table[torch.clamp_min] = Spelling(torch.clamp, ("input", "min"))
    table[torch.clamp_max] = Spelling(torch.clamp, ("input", "max"))
    table[torch.clamp_min_] = Spelling(torch.clamp, ("input", "min"), inplace=True)   # (fuzz38j)
    table[torch.clamp_max_] = Spelling(torch.clamp, ("input", "max"), inplace=True)
    table[F.hardtanh] = Spelling(torch.clamp, ("input", "min_val", "max_val", "inplace"),
                                 fixed={"min": -1.0, "max": 1.0},
                                 rename={"min_val": "min", "max_val": "max"})
    table[F.hardtanh_] = Spelling(torch.clamp, ("input", "min_val", "max_val"), inplace=True,
                                  fixed={"min": -1.0, "max": 1.0},
                                  rename={"min_val": "min", "max_val": "max"})
    table[F.relu6] = Spelling(torch.clamp, ("input", "inplace"), fixed={"min": 0.0, "max": 6.0})
    table[torch.where] = Spelling(torch.where, ("condition", "input", "other"))
    table[torch.masked_fill] = MASKED_FILL
    table[torch.rsub] = Spelling(operator.sub, ("input", "other", "alpha"), fixed={"_swap": True})
    for canon, names in TERNARY.items():
        table[canon] = Spelling(canon, ("input",) + names)
    table[torch.round] = table[torch.special.round] = Spelling(torch.round, ("input", "decimals"))   # decimals=0:
    for name, factor in ANGLE_FACTORS.items():   # round (canonical_call); rad2deg is x * (180 / pi) in ATen
        table[getattr(torch, name)] = Spelling(operator.mul, ("input",), fixed={"other": factor})
        table[getattr(torch, name + "_")] = Spelling(operator.mul, ("input",), fixed={"other": factor}, inplace=True)
    for name in ("silu", "mish", "hardsigmoid", "hardswish", "leaky_relu", "elu", "hardtanh", "relu6", "gelu"):
        row = table[getattr(F, name)]   # torch._C._nn's own names, which F's functions call (no inplace=;
        row = replace(row, names=tuple(n for n in row.names if n != "inplace"))   # elu's scale= not fused)
        for suffix in [s for s in ("", "_") if hasattr(torch._C._nn, name + s)]:
            table.setdefault(getattr(torch._C._nn, name + suffix), replace(row, inplace=suffix == "_"))
    return table


ALIASES = {"absolute": "abs", "negative": "neg", "divide": "div", "true_divide": "div", "subtract": "sub",
           "multiply": "mul", "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le",
           "not_equal": "ne", "special_expit": "sigmoid", "special_erf": "erf", "special_expm1": "expm1",
           "special_log1p": "log1p", "fix": "trunc", "sgn": "sign", "special_exp2": "exp2",
           "special_round": "round"}   # torch's other names of fused ops (x.multiply_, aten.special_expit, ...)


def _build_method_spellings() -> dict:
    table = {}
    for canon, name in METHOD_NAMES.items():
        table[name] = Spelling(canon, ("input",))
        table[name + "_"] = Spelling(canon, ("input",), inplace=True)
    table["negative"] = Spelling(operator.neg, ("input",))
    for canon, (name, _) in BINARY.items():
        if name in ("maximum", "minimum"):
            table[name] = Spelling(canon, ("input", "other"))
            continue
        table[name] = Spelling(canon, ("input", "other", "alpha", "rounding_mode"))
        table[name + "_"] = Spelling(canon, ("input", "other", "alpha", "rounding_mode"), inplace=True)
    for alias, name in ALIASES.items():   # x.multiply_(y), x.absolute(), x.greater(0): the same rows
        for suffix in ("", "_"):
            if name + suffix in table:
                table.setdefault(alias + suffix, table[name + suffix])
    table["pow"] = Spelling(operator.pow, ("input", "exponent"))
    table["pow_"] = Spelling(operator.pow, ("input", "exponent"), inplace=True)
    table["square"] = Spelling(operator.pow, ("input",), fixed={"exponent": 2})
    table["square_"] = Spelling(operator.pow, ("input",), inplace=True, fixed={"exponent": 2})
    for name in ("clamp", "clip"):
        table[name] = Spelling(torch.clamp, ("input", "min", "max"))
        table[name + "_"] = Spelling(torch.clamp, ("input", "min", "max"), inplace=True)
    table["clamp_min"] = Spelling(torch.clamp, ("input", "min"))
    table["clamp_max"] = Spelling(torch.clamp, ("input", "max"))
    table["clamp_min_"] = Spelling(torch.clamp, ("input", "min"), inplace=True)
    table["clamp_max_"] = Spelling(torch.clamp, ("input", "max"), inplace=True)
    table["hardshrink"] = Spelling(F.hardshrink, ("input", "lambd"))
    for name, factor in ANGLE_FACTORS.items():
        table[name] = Spelling(operator.mul, ("input",), fixed={"other": factor})
        table[name + "_"] = Spelling(operator.mul, ("input",), fixed={"other": factor}, inplace=True)
    for suffix in ("", "_"):   # x.round(decimals=0) too (canonical_call)
        table["round" + suffix] = Spelling(torch.round, ("input", "decimals"), inplace=suffix == "_")
    table["where"] = Spelling(torch.where, ("input", "condition", "other"), fixed={"_where_method": True})
    table["masked_fill"], table["masked_fill_"] = MASKED_FILL, MASKED_FILL_
    for canon, names in TERNARY.items():   # x.lerp(y, 0.5), x.addcmul_(a, b, value=2)
        table[canon.__name__] = Spelling(canon, ("input",) + names)
        table[canon.__name__ + "_"] = Spelling(canon, ("input",) + names, inplace=True)
    for op, canon in INPLACE_OPERATORS.items():   # h.__iadd__(b): torch.fx records the dunder as a method
        table[f"__{op.__name__}__"] = Spelling(canon, _OPERANDS.get(canon, ("input", "other")), inplace=True)
    return table


def _build_aten_spellings() -> dict:
    """aten overloads that torch.export produces, mapped onto the same canonical ops."""
    table = {}
    for canon, name in METHOD_NAMES.items():
        for overload in ("default",):
            for suffix, inplace in (("", False), ("_", True)):
                packet = getattr(aten, name + suffix, None)
                if packet is not None and hasattr(packet, overload):
                    table[getattr(packet, overload)] = Spelling(canon, ("input",), inplace=inplace)
    for canon, (name, _) in BINARY.items():
        for suffix, inplace in (("", False), ("_", True)):
            packet = getattr(aten, name + suffix, None)
            for overload in ("Tensor", "Scalar", "default", "Tensor_mode", "Scalar_mode"):   # div's: fused
                # where its rounding_mode is None (canonical_call), export's `div(a, b, rounding_mode=None)`
                if packet is not None and hasattr(packet, overload):
                    table[getattr(packet, overload)] = Spelling(
                        canon, ("input", "other", "alpha", "rounding_mode"), inplace=inplace)
    for canon, (params, _) in ACTIVATION_PARAMS.items():
        name = getattr(canon, "__name__", "").lstrip("_")   # F.threshold is functional._threshold
        for suffix, inplace in (("", False), ("_", True)):
            packet = getattr(aten, name + suffix, None)
            if packet is not None and hasattr(packet, "default"):
                table[packet.default] = Spelling(canon, ("input",) + params, inplace=inplace)
    table[aten.hardtanh.default] = Spelling(
        torch.clamp, ("input", "min_val", "max_val"), fixed={"min": -1.0, "max": 1.0},
        rename={"min_val": "min", "max_val": "max"})
    table[aten.hardtanh_.default] = Spelling(
        torch.clamp, ("input", "min_val", "max_val"), inplace=True, fixed={"min": -1.0, "max": 1.0},
        rename={"min_val": "min", "max_val": "max"})
    table[aten.relu6.default] = Spelling(torch.clamp, ("input",), fixed={"min": 0.0, "max": 6.0})
    table[aten.clamp.default] = Spelling(torch.clamp, ("input", "min", "max"))
    table[aten.clamp_.default] = Spelling(torch.clamp, ("input", "min", "max"), inplace=True)
    table[aten.clamp_min.default] = Spelling(torch.clamp, ("input", "min"))
    table[aten.clamp_max.default] = Spelling(torch.clamp, ("input", "max"))
    table[aten.square.default] = Spelling(operator.pow, ("input",), fixed={"exponent": 2})
    optional = (   # (packet, overload, row): not every torch names them all
        ("square_", "default", Spelling(operator.pow, ("input",), inplace=True, fixed={"exponent": 2})),
        ("relu6_", "default", Spelling(torch.clamp, ("input",), inplace=True, fixed={"min": 0.0, "max": 6.0})),
        ("pow_", "Scalar", Spelling(operator.pow, ("input", "exponent"), inplace=True)),
        ("masked_fill_", "Scalar", MASKED_FILL_), ("masked_fill_", "Tensor", MASKED_FILL_),
        ("clamp", "Tensor", Spelling(torch.clamp, ("input", "min", "max"))),
        ("clamp_", "Tensor", Spelling(torch.clamp, ("input", "min", "max"), inplace=True)),
        ("clamp_min", "Tensor", Spelling(torch.clamp, ("input", "min"))),
        ("clamp_max", "Tensor", Spelling(torch.clamp, ("input", "max"))),
        ("clamp_min_", "default", Spelling(torch.clamp, ("input", "min"), inplace=True)),
        ("clamp_max_", "default", Spelling(torch.clamp, ("input", "max"), inplace=True)))
    for name, overload, row in optional:
        if hasattr(getattr(aten, name, None), overload):
            table[getattr(getattr(aten, name), overload)] = row
    for canon, names in TERNARY.items():
        for suffix, inplace in (("", False), ("_", True)):
            packet = getattr(aten, canon.__name__ + suffix, None)
            for overload in ("default", "Scalar", "Tensor"):
                if hasattr(packet, overload):
                    table[getattr(packet, overload)] = Spelling(canon, ("input",) + names, inplace=inplace)
    for overload in (aten.rsub.Scalar, aten.rsub.Tensor):
        table[overload] = Spelling(operator.sub, ("input", "other", "alpha"), fixed={"_swap": True})
    for overload in (aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar):
        table[overload] = Spelling(torch.where, ("condition", "input", "other"))
    table[aten.pow.Tensor_Scalar] = Spelling(operator.pow, ("input", "exponent"))
    table[aten.where.self] = Spelling(torch.where, ("condition", "input", "other"))
    table[aten.masked_fill.Scalar] = table[aten.masked_fill.Tensor] = MASKED_FILL
    for name, inplace in (("clip", False), ("clip_", True)):
        if hasattr(getattr(aten, name, None), "default"):
            table[getattr(aten, name).default] = Spelling(torch.clamp, ("input", "min", "max"), inplace=inplace)
    for alias, name in ALIASES.items():    # aten.multiply.Tensor is aten.mul.Tensor under another name
        for suffix in ("", "_"):
            packet, base = getattr(aten, alias + suffix, None), getattr(aten, name + suffix, None)
            for overload in ("default", "Tensor", "Scalar"):
                if hasattr(packet, overload) and hasattr(base, overload) and getattr(base, overload) in table:
                    table[getattr(packet, overload)] = table[getattr(base, overload)]
    table[aten.round.decimals] = table[aten.special_round.default] = Spelling(torch.round, ("input", "decimals"))
    for name, factor in ANGLE_FACTORS.items():   # (fuzz44d, fuzz44b)
        for suffix in ("", "_"):
            table[getattr(aten, name + suffix).default] = Spelling(operator.mul, ("input",), fixed={"other": factor},
                                                                   inplace=suffix == "_")
    for overload, row in list(table.items()):   # torch.ops.aten.relu(x): the packet, no overload named
        table.setdefault(overload.overloadpacket, row)
    return table


FUNCTION_SPELLINGS = _build_function_spellings()
METHOD_SPELLINGS = _build_method_spellings()
ATEN_SPELLINGS = _build_aten_spellings()
POSITIVE = {torch.positive, "positive", aten.positive.default, operator.pos, "__pos__"}   # +x: x itself
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout, nn.Identity)
DROPOUT_FUNCTIONS = {F.dropout: 2, F.dropout1d: 2, F.dropout2d: 2, F.dropout3d: 2,
                     F.alpha_dropout: 2, F.feature_alpha_dropout: 2,   # index of `training` (or `train`)
                     **{f: 2 for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout")
                        for suffix in ("", "_")   # torch's and export's own (fuzz43b)
                        for f in (getattr(torch, name + suffix, None), getattr(getattr(aten, name + suffix, None),
                                                                               "default", None)) if f is not None}}
SHAPE_METHODS = {"size", "dim", "numel", "nelement", "ndimension", "stride", "element_size"}   # (guarded by
#                                                      the signature: shape, strides, dtype; the last two: fuzz43b)
SHAPE_ATTRS = {"shape", "ndim", "dtype", "device"}
ARITH = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
         operator.mod, operator.getitem, operator.neg, operator.pow, operator.abs}
CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
EXPORT_ASSERTS = {p.default for p in (getattr(aten, "_assert_tensor_metadata", None),) if p is not None}


def spelling_of(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """The Spelling row of a node, with module spellings bound to the module's attributes."""
    first = single_tensor_meta(node.args[0]) if node.args else None
    if first is not None and first.dtype.is_complex:   # no kernel computes complex values, and torch's other
        return None   # names differ there (sgn is z / |z|, sign refuses complex; fuzz38b)
    if node.op in ("call_function", "call_method") and node.target in BOOL_NOTS:
        meta = single_tensor_meta(node.args[0]) if len(node.args) == 1 and not node.kwargs else None
        return Spelling(torch.logical_not, ("input",)) if meta is not None and meta.dtype == torch.bool else None
    if node.op in ("call_function", "call_method") and node.target in BINARY_MAX_MIN:
        other = node.args[1] if len(node.args) == 2 and not node.kwargs else node.kwargs.get("other") \
            if len(node.args) == 1 and set(node.kwargs) == {"other"} or not node.args and set(node.kwargs) == {
                "input", "other"} else None   # torch.max(input=h, other=s) (fuzz43b)
        if single_tensor_meta(other) is None:   # max(x), max(x, dim): reductions, not this
            return None
        return Spelling(torch.maximum if BINARY_MAX_MIN[node.target] else torch.minimum, ("input", "other"))
    if node.op in ("call_function", "call_method") and (node.target in BOOL_BINARY or node.target in BOOL_INPLACE):
        metas = [single_tensor_meta(a) for a in node.args] if len(node.args) == 2 and not node.kwargs else [None]
        if not all(m is not None and m.dtype == torch.bool for m in metas):
            return None
        inplace = node.target in BOOL_INPLACE
        return Spelling((BOOL_INPLACE if inplace else BOOL_BINARY)[node.target], ("input", "other"), inplace=inplace)
    if node.op == "call_function":
        if node.target is operator.abs and not (node.args and single_tensor_meta(node.args[0]) is not None):
            return None   # abs() of a number (a size the shape folding did not take) stays Python's
        return FUNCTION_SPELLINGS.get(node.target) or ATEN_SPELLINGS.get(node.target)
    if node.op == "call_method":
        return METHOD_SPELLINGS.get(node.target)
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        for canon, (params, cls) in ACTIVATION_PARAMS.items():
            if type(mod) is cls:
                fixed = {p: getattr(mod, p) for p in params}
                return Spelling(canon, ("input",), inplace=getattr(mod, "inplace", False), fixed=fixed)
        if type(mod) in (nn.Hardtanh, nn.ReLU6):
            return Spelling(torch.clamp, ("input",), inplace=mod.inplace,
                            fixed={"min": float(mod.min_val), "max": float(mod.max_val)})
    return None


def _bind(row: Spelling, node: torch.fx.Node) -> dict | None:
    names = row.names
    if row.fixed.get("_where_method"):
        names = ("input", "condition", "other")
    if len(node.args) > len(names):
        return None
    bound = dict(zip(names, node.args))
    for k, v in node.kwargs.items():
        if k not in names or k in bound:
            return None
        bound[k] = v
    bound.pop("inplace", None)
    return {row.rename.get(k, k): v for k, v in bound.items()}


def canonical_call(row: Spelling, node: torch.fx.Node):
    """(target, args, kwargs) of the canonical form of a node, or None if it has none."""
    bound = _bind(row, node)
    if bound is None:
        return None
    params = {k: v for k, v in row.fixed.items() if not k.startswith("_")}
    params.update(bound)
    canon = row.canonical
    op = POINTWISE[canon]
    if canon is torch.where:
        if {"condition", "input", "other"} - set(params):  # torch.where(cond) is nonzero(), not pointwise
            return None
        if row.fixed.get("_masked_fill") and not masked_fill_is_where(params["other"], params["input"]):
            params["input"] = masked_fill_value_cast(params["other"], params["input"], node)
            if params["input"] is None:
                return None
        return canon, (params["condition"], params["input"], params["other"]), {}
    if canon in TERNARY:
        return _ternary_call(canon, params, node)
    x = params.pop("input")
    if op.nargs == 2:
        other = params.pop("other")
        if params.pop("rounding_mode", None) is not None:
            return None
        alpha = params.pop("alpha", 1)
        if params:
            return None
        if row.fixed.get("_swap"):  # rsub(input, other, alpha) = other - alpha * input
            x, other = other, x
        if canon is operator.truediv and node.target is operator.truediv and alpha == 1 \
                and not isinstance(x, torch.fx.Node) and single_tensor_meta(other) is not None:   # not 1.0 / s.item()
            return "rtruediv", (other, x), {}   # `c / x` is Tensor.__rtruediv__: x.reciprocal() * c (fuzz35a)
        if alpha != 1:
            if not isinstance(alpha, (int, float)) or canon not in (operator.add, operator.sub):
                return None
            # fp16/bf16: CUDA computes x + alpha * y in fp32 and rounds once, as add_scaled does (split,
            # y * alpha would round to fp16 first, and may overflow); a number beside a half tensor is
            # kept as written (eager rounds it to fp16 first: `torch.rsub(h, 0.1, alpha=3)` reads fp16(0.1)).
            # Eager scales y in the result's dtype (a uint8 y * 3 of its own would wrap around)
            if any(getattr(a.meta.get("tensor_meta"), "dtype", None) in HALF_DTYPES
                   for a in (x, other) if isinstance(a, torch.fx.Node)) and not (
                    isinstance(x, torch.fx.Node) and isinstance(other, torch.fx.Node)) \
                    or isinstance(other, torch.fx.Node) \
                    and getattr(other.meta.get("tensor_meta"), "dtype", None) \
                    != getattr(node.meta.get("tensor_meta"), "dtype", False):
                return None
            out = getattr(node.meta.get("tensor_meta"), "dtype", None)   # number * number: exact for integers,
            if not isinstance(other, torch.fx.Node) and not (out == torch.float32 or out is not None and not (
                    out.is_floating_point or out.is_complex) and isinstance(other, int) and isinstance(alpha, int)):
                return None   # one fp32 multiply-add (add_number_scaled); fp64 and the rest as written
            return ("alpha", canon), (x, other, alpha), {}
        return canon, (x, other), {}
    dtype = getattr(x.meta.get("tensor_meta"), "dtype", None) if isinstance(x, torch.fx.Node) else None
    if canon in (F.hardshrink, F.softshrink, F.threshold) and dtype in HALF_DTYPES:   # CUDA reads them in
        params = {k: float(torch.tensor(v, dtype=dtype, device="cpu")) if isinstance(v, (float, int)) and not isinstance(v, bool)
                  else v   # x's dtype: fp16(0.3)
                  for k, v in params.items()}                     # is 0.30005 (a numpy float too: fuzz34a)
    if canon is operator.pow:
        e = params.pop("exponent")  # an int stays an int: int_tensor ** 2 is an int tensor, ** 2.0 a float one
        if isinstance(e, (float, int)) and not isinstance(e, bool) and dtype in (torch.float16, torch.bfloat16,
                                                                                 torch.float32) and math.isfinite(e):
            read = float(torch.tensor(e, dtype=dtype, device="cpu"))   # CUDA's pow reads the exponent in the tensor's dtype:
            if read in (0.5, -0.5) and e != read:   # but takes sqrt / rsqrt only for a written +-0.5, powf
                return torch.pow, (x, e), {}        # otherwise (-0.0 and -inf differ; fuzz36d): the library's
            e = e if type(e) is int and read == e else read   # 2.0001 is 2.0 in fp16 ((-2) ** e is 4, not nan),
            #          and so are a numpy float and an int past the dtype's integers (fp16: 2051 is 2052; fuzz34a)
        return (canon, (x, e), {}) if isinstance(e, (int, float)) and not params else None
    if canon is torch.clamp:
        if row.fixed and not (dtype is not None and dtype.is_floating_point):
            return None   # hardtanh / relu6 of an integer tensor: an integer result, bounds cast to it (review35)
        lo, hi = params.get("min"), params.get("max")
        if any(isinstance(b, torch.fx.Node) and single_tensor_meta(b) is None for b in (lo, hi)):
            return None   # a bound read from a tensor (`x.mean().item()`): a number at run time (fuzz35e)
        if isinstance(lo, torch.fx.Node) or isinstance(hi, torch.fx.Node):
            out = getattr(node.meta.get("tensor_meta"), "dtype", None)   # maximum, then minimum: promoted a
            operands = {getattr(b.meta.get("tensor_meta"), "dtype", None)
                        for b in (x, lo, hi) if isinstance(b, torch.fx.Node)}
            one = [b for b in (lo, hi) if b is not None]
            if out is not None and len(one) == 1 and isinstance(one[0], torch.fx.Node) and operands != {out}:
                return (torch.maximum if lo is not None else torch.minimum), (x, one[0]), {}   # one bound of
                #   another dtype: eager's clamp promotes as maximum / minimum does, NaNs and zeros alike (fuzz46b)
            if out is None or operands != {out} or not out.is_floating_point and any(isinstance(b, float)
                                                                                      for b in (lo, hi)):
                return None   # pair at a time; clamp all three at once (review39: 0-dim fp16 x, int16 and fp32 bounds)
            return "tensor_clamp", (x, lo, hi), {}
        return canon, (x,), {"min": lo, "max": hi}  # ints stay ints: clamp(int tensor, 0, 6) is an int tensor
    if canon is torch.round and type(params.get("decimals", 0)) is int and params.get("decimals", 0) == 0:
        params.pop("decimals", None)
    allowed = set(op.params)
    if set(params) - allowed:
        return None
    if any(isinstance(v, torch.fx.Node) for v in params.values()):
        return None
    return canon, (x,), {k: v for k, v in params.items() if op.defaults.get(k, object()) != v}


def _ternary_call(canon, params, node):
    """lerp(x, end, weight) (a number weight: lerp_scalar, the weight a parameter), addcmul and
    addcdiv(x, t1, t2, value=v) as canonical calls; None where they stay as written: torch's
    deprecated addcmul(x, value, t1, t2), a tensor `value`."""
    operands = [params.pop(n, None) for n in ("input",) + TERNARY[canon][:2]]
    if len(node.args) > 3 or not all(isinstance(a, torch.fx.Node) for a in operands[:2]):
        return None
    x, first, second = operands
    if canon is torch.lerp:
        if params:
            return None
        if isinstance(second, torch.fx.Node):
            return canon, (x, first, second), {}
        if isinstance(second, (int, float)):   # True: 1.0, as torch reads a bool Scalar (fuzz41e: fused with
            return lerp_scalar, (x, first), {"weight": float(second) if isinstance(second, bool) else second}
        return None                            # the bool, the kernel failed)
    value = params.pop("value", 1)
    if params or not isinstance(second, torch.fx.Node) or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return canon, (x, first, second), ({} if value == 1 else {"value": value})
