"""The op table: which canonical ops are pointwise, and how each one prints in Triton.

After the normalize pass every pointwise op in a graph is a `call_function` whose target is a
key of POINTWISE, with its value operands (nodes or Python numbers) as positional args and
its constant parameters as kwargs named in `PointwiseOp.params`. Everything downstream
(fusion, lowering to the fused-kernel IR, code generation) reads this table, so adding an
op is one entry here plus its spellings in passes/spellings.py.

Expressions compute in fp32 (the kernel's compute type); helpers such as `_tanh` live in the
prelude that codegen puts at the top of every generated module. They use only core `tl`
functions, because libdevice is not available under the Triton interpreter and the CPU tests
must run the same code as the GPU.
"""
import math
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .node_meta import fxfuse_meta, meta_tensor
from .ops_prelude import PRELUDE  # noqa: F401 (the generators import it from here)


def cast(x, dtype):
    """Canonical type cast (`x.float()`, `x.to(torch.half)`, `x.type(...)` all become this)."""
    return x.to(dtype)


def add_scaled(x, other, alpha):
    """x + alpha * other: torch.add(x, other, alpha=...) (sub and rsub with a negated alpha),
    which eager computes as one fused multiply-add in fp32 (fuzz34e: `x + other * alpha`
    rounded twice, 3e38 came out inf and cancelling terms lost every bit)."""
    return torch.add(x, other, alpha=alpha)


def add_number_scaled(x, other, alpha):
    """x + alpha * other with both numbers: eager's fp32 opmath multiply-add, rounded once
    (fuzz42c: folded in double, `x.sub(0.1, alpha=3)` was x - 0.30000000000000004, 1 ulp off
    for a quarter of the values and all bits lost where x cancels it)."""
    return torch.add(x, other, alpha=alpha)


def _add_number_scaled(a, other, alpha) -> str:
    product = _fp32(alpha) * _fp32(other)   # two fp32 values: exact in double, and as hi + lo in fp32
    hi = _fp32(product)                      # (past fp32's range a double literal itself; no `+ 0.0`,
    if not math.isfinite(hi) or product == hi:   # which would turn -0.0 + -0.0 into +0.0: review42f)
        return f"(({a}).to(tl.float64) + {literal(product)}).to(tl.float32)"
    return f"(({a}).to(tl.float64) + {literal(hi)} + {literal(product - hi)}).to(tl.float32)"


def lerp_scalar(x, end, weight):
    """torch.lerp with a number weight: the weight is the kernel's parameter, so `1 - weight`
    is computed once in fp32 as ATen's opmath does (a Triton literal would fold it in double)."""
    return torch.lerp(x, end, weight)


def _fp32(v) -> float:
    """A number as ATen's fp32 opmath reads a Python scalar."""
    return float(torch.tensor(v, dtype=torch.float32, device="cpu"))


def _fma(x, y, z) -> str:
    """x * y + z rounded once to fp32, as eager's fma (CPU's vectorized lerp, CUDA's addcmul and
    addcdiv, and nvcc's contraction of Lerp.h): the product of two fp32 values is exact in fp64
    (pointwise kernels launch with fp fusion off, so Triton contracts nothing: fuzz35b)."""
    x = x if _is_literal(x) else f"({x}).to(tl.float64)"   # a number is a float64 constant already
    return f"({x} * ({y}).to(tl.float64) + ({z}).to(tl.float64)).to(tl.float32)"


def _is_literal(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return text in ("(0.0 * 1e999)", "(-1e999)")


def _lerp_scalar(a, b, weight) -> str:
    # ATen's Lerp.h: from the nearer end, so lerp(a, b, 1.0) is b exactly; nan goes the far way
    w = _fp32(weight)
    if abs(w) < 0.5:
        return _fma(literal(w), f"({b} - {a})", a)
    one_minus = (torch.tensor(1.0, dtype=torch.float32, device="cpu") - torch.tensor(w, dtype=torch.float32, device="cpu")).item()
    # b - (b - a) * (1 - w) as eager writes it: (a - b) * (1 - w) + b made +0.0 of lerp(-0.0, -0.0, 0.7) (fuzz35e)
    return f"(({b}).to(tl.float64) - {literal(one_minus)} * ({b} - {a}).to(tl.float64)).to(tl.float32)"


def _addc(a, b, c, value, divide: bool) -> str:
    """addcmul / addcdiv as CUDA's kernel: fma(t1, t2, a) for addcmul with value 1, else
    fma(value, t1 op t2, a); addcdiv with value 1 is a + t1 / t2."""
    v = _fp32(value)
    if divide:
        return f"({a} + _div({b}, {c}))" if v == 1 else _fma(literal(v), f"_div({b}, {c})", a)
    return _fma(b, c, a) if v == 1 else _fma(literal(v), f"({b} * {c})", a)


def as_layout(x, stride):
    """x with the strides eager's op gave its result (a copy only where they differ). Inserted
    after a rewrite whose kernel writes row-major where eager kept its input's layout (a Linear's
    residual add over a transposed input, an eval BatchNorm as a multiply-add on a transposed
    input): a later `.view()` or the caller may rely on eager's layout."""
    if x.stride() == tuple(stride):
        return x
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


def keep_eager_layout(gm, node, eager_meta, produced_stride):
    """After `node` (a rewrite of an op eager ran), restore eager's strides where the rewrite
    writes others: the users read as_layout(node) instead (fxfuse.ops.as_layout). Returns the
    node they read."""
    stride = tuple(getattr(eager_meta, "stride", ()) or ())
    if not stride or produced_stride is not None and tuple(produced_stride) == stride:
        return node
    users = list(node.users)
    with gm.graph.inserting_after(node):
        fixed = gm.graph.call_function(as_layout, (node, stride))
    fixed.meta["tensor_meta"] = eager_meta
    fxfuse_meta(fixed)["note"] = "eager's memory layout restored (the rewrite writes another)"
    if "device" in fxfuse_meta(node):   # fusion groups ops of one device: the kernel after it takes it
        fxfuse_meta(fixed)["device"] = fxfuse_meta(node)["device"]
    for user in users:
        user.replace_input_with(node, fixed)
    return fixed


def masked_fill_layout(gm, where: torch.fx.Node) -> torch.fx.Node:
    """x.masked_fill(mask, v) is row-major in eager (aten clones x contiguous, then fills; the
    in-place form keeps x's layout), while torch.where lays its result out after its operands:
    where the two differ (a transposed or channels_last x), the users read eager's strides
    (as_layout). torch.where's strides come from meta tensors of the operands' recorded layouts,
    so a row-major x with a broadcast mask keeps its one kernel. Returns the node users read."""
    def fake(a):
        meta = a.meta.get("tensor_meta") if isinstance(a, torch.fx.Node) else None
        if isinstance(a, torch.fx.Node) and meta is None:
            raise LookupError(a.name)
        return a if meta is None else meta_tensor(meta)
    try:
        operands = [fake(a) for a in where.args]
        # meta tensors lay the result of an expanded operand out otherwise than real ones (fuzz39e: row-major
        # on meta, (1, 15, 1, 3) on the CPU for an x of strides (1, 5, 0, 1)): not trusted there
        produced = None if any(0 in [st for n, st in zip(o.shape, o.stride()) if n > 1]
                               for o in operands if isinstance(o, torch.Tensor)) else torch.where(*operands).stride()
    except (LookupError, RuntimeError, TypeError):   # unknown: as_layout checks at run time
        produced = None
    return keep_eager_layout(gm, where, where.meta.get("tensor_meta"), produced)


def row_major(shape) -> tuple:
    """The strides of a contiguous tensor of this shape."""
    out, step = [], 1
    for size in reversed(tuple(shape)):
        out.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(out))


@dataclass(frozen=True)
class PointwiseOp:
    name: str
    target: Callable
    nargs: int
    expr: Callable[..., str]  # (operand expressions..., **params) -> Triton expression
    params: tuple = ()
    returns_bool: bool = False
    defaults: dict = field(default_factory=dict)


def literal(v) -> str:
    """A Python number as a Triton source literal; full precision, inf and nan included
    (1e999 parses as inf, and Triton folds 0.0 * inf to nan at compile time)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    v = float(v)
    if math.isnan(v):
        return "(0.0 * 1e999)"
    if math.isinf(v):
        return "1e999" if v > 0 else "(-1e999)"
    if v == 0 and math.copysign(1.0, v) < 0:
        return "_neg_zero()"   # a -0.0 literal came out +0.0 on the H100 (F.threshold(x, 0.1, -0.0); stop 37)
    return repr(v)


def _pow(x, exponent) -> str:
    e = float(exponent)
    if not math.isfinite(e):   # as C pow: 1 ** e is 1; |x| < 1 or > 1 go to 0 or inf; nan stays nan
        if math.isnan(e):
            return f"tl.where({x} == 1.0, 1.0, {literal(math.nan)})"
        below, above = (0.0, math.inf) if e > 0 else (math.inf, 0.0)
        return (f"tl.where(tl.abs({x}) == 1.0, 1.0, tl.where(tl.abs({x}) < 1.0, {literal(below)}, "
                f"tl.where(tl.abs({x}) > 1.0, {literal(above)}, {literal(math.nan)})))")
    if e == 0:
        return f"tl.where({x} == {x}, 1.0, 1.0)"  # x ** 0 == 1, also for nan and inf, as in torch
    if e in (1, 2, 3, -1, -2):   # the exponents eager computes as products (ATen's pow_tensor_scalar); 4, -3,
        prod = " * ".join([f"{x}"] * int(abs(e)))   # -4 call powf: as products they lost subnormal results (fuzz34e)
        return f"({prod})" if e > 0 else f"_div(1.0, {prod})"
    if e == 0.5:
        return f"_sqrt({x})"
    if e == -0.5:
        return f"_div(1.0, _sqrt({x}))"  # torch computes x ** -0.5 as rsqrt: (-0) ** -0.5 == -inf
    if e.is_integer():
        # sign of an odd power follows the base, -0 included (1 / x < 0 sees its sign bit)
        mag = _exp2_log2(e, f"tl.abs({x})")
        return f"tl.where(({x} < 0) | (_div(1.0, {x}) < 0), ({mag}) * -1.0, {mag})" if int(e) % 2 else mag
    # negative finite base -> nan, as in torch; (-inf) ** e is inf (e > 0) or 0 (e < 0), as C pow
    return (f"tl.where({x} == {literal(-math.inf)}, {literal(math.inf if e > 0 else 0.0)}, "
            f"{_exp2_log2(e, x)})")


def _exp2_log2(e: float, x: str) -> str:
    """|x| ** e for x >= 0 (nan below) as exp2(e * log2(x)) in fp64, rounded once to fp32. In
    fp32 the rounding error of log2(x) is multiplied by |e * log2(x)|: up to 4e-6 relative
    error, where eager's powf is within an ulp. fp64 log2/exp2 are core tl ops (libdevice on
    the GPU, numpy in the interpreter); zeros, infs and nans come out as in fp32."""
    return f"tl.exp2({literal(e)} * tl.log2({x}.to(tl.float64))).to(tl.float32)"


def _clamp(x, min=None, max=None) -> str:
    if any(b is not None and math.isnan(b) for b in (min, max)):
        return f"tl.where({x} == {x}, {literal(math.nan)}, {literal(math.nan)})"  # a nan bound: all nan, as torch
    out = x   # keeps nan, as torch.clamp; a zero bound as CUDA's max / min (IEEE: -0 < +0): a -0.0
    if min is not None:   # clamped at +0.0 is +0.0, a +0.0 clamped from above at -0.0 is -0.0
        below = "<=" if min == 0 and math.copysign(1.0, min) > 0 else "<"
        out = f"tl.where({out} {below} {literal(min)}, {literal(min)}, {out})"
    if max is not None:
        above = ">=" if max == 0 and math.copysign(1.0, max) < 0 else ">"
        out = f"tl.where({out} {above} {literal(max)}, {literal(max)}, {out})"
    return out


def _op(name, target, nargs, expr, params=(), returns_bool=False, **defaults):
    return PointwiseOp(name, target, nargs, expr, tuple(params), returns_bool, defaults)


_TABLE = [
    # arithmetic: operator targets accept a number on either side, like eager
    _op("add", operator.add, 2, lambda a, b: f"({a} + {b})"),
    _op("sub", operator.sub, 2, lambda a, b: f"({a} - {b})"),
    _op("mul", operator.mul, 2, lambda a, b: f"({a} * {b})"),
    _op("div", operator.truediv, 2, lambda a, b: f"_div({a}, {b})"),
    _op("neg", operator.neg, 1, lambda a: f"({a} * -1.0)"),   # Triton's -x is 0 - x: +0.0 for x = +0.0 (fuzz34e)
    # the product exact in fp64 (both factors fp32: alpha as eager's fp32 opmath reads it), then one rounding
    _op("add_scaled", add_scaled, 2, lambda a, b, alpha: (   # (b is a tensor; a may be a number: rsub(x, 2.0))
        f"(({b}).to(tl.float64) * {literal(_fp32(alpha))} + {a})"
        ".to(tl.float32)"), ("alpha",)),
    _op("add_number_scaled", add_number_scaled, 1, _add_number_scaled, ("other", "alpha")),
    _op("pow", operator.pow, 1, _pow, ("exponent",)),
    # ATen's formulas (Lerp.h, CUDA's DeviceAddCmulCdiv), each multiply-add rounded once (_fma)
    _op("lerp", torch.lerp, 3, lambda a, b, w: f"_lerp({a}, {b}, {w})"),
    _op("lerp_scalar", lerp_scalar, 2, _lerp_scalar, ("weight",)),
    _op("addcmul", torch.addcmul, 3, lambda a, b, c, value=1: _addc(a, b, c, value, False), ("value",), value=1),
    _op("addcdiv", torch.addcdiv, 3, lambda a, b, c, value=1: _addc(a, b, c, value, True), ("value",), value=1),
    _op("maximum", torch.maximum, 2, lambda a, b: f"_maximum({a}, {b})"),
    _op("minimum", torch.minimum, 2, lambda a, b: f"_minimum({a}, {b})"),
    _op("where", torch.where, 3, lambda c, a, b: f"tl.where({c}, {a}, {b})"),
    _op("gt", operator.gt, 2, lambda a, b: f"({a} > {b})", returns_bool=True),
    _op("lt", operator.lt, 2, lambda a, b: f"({a} < {b})", returns_bool=True),
    _op("ge", operator.ge, 2, lambda a, b: f"({a} >= {b})", returns_bool=True),
    _op("le", operator.le, 2, lambda a, b: f"({a} <= {b})", returns_bool=True),
    _op("eq", operator.eq, 2, lambda a, b: f"({a} == {b})", returns_bool=True),
    _op("ne", operator.ne, 2, lambda a, b: f"({a} != {b})", returns_bool=True),
    _op("logical_not", torch.logical_not, 1, lambda a: f"({a} == 0)", returns_bool=True),   # ~mask of a bool
    # as int8 arithmetic, not `&` / `|`: the interpreter cannot and a 0-d (scalar-loaded) mask with a block (fuzz35a)
    _op("logical_and", torch.logical_and, 2, lambda a, b: f"((({a} != 0).to(tl.int8) * ({b} != 0).to(tl.int8)) != 0)",
        returns_bool=True),
    _op("logical_or", torch.logical_or, 2, lambda a, b: f"((({a} != 0).to(tl.int8) + ({b} != 0).to(tl.int8)) != 0)",
        returns_bool=True),
    _op("logical_xor", torch.logical_xor, 2, lambda a, b: f"(({a} != 0).to(tl.int8) != ({b} != 0).to(tl.int8))",
        returns_bool=True),
    # unary math
    _op("exp", torch.exp, 1, lambda a: f"_exp({a})"),
    _op("log", torch.log, 1, lambda a: f"tl.log({a})"),
    _op("sqrt", torch.sqrt, 1, lambda a: f"_sqrt({a})"),
    _op("rsqrt", torch.rsqrt, 1, lambda a: f"_div(1.0, _sqrt({a}))"),
    _op("reciprocal", torch.reciprocal, 1, lambda a: f"_div(1.0, {a})"),
    _op("abs", torch.abs, 1, lambda a: f"tl.abs({a})"),
    _op("sin", torch.sin, 1, lambda a: f"tl.sin({a})"),
    _op("cos", torch.cos, 1, lambda a: f"tl.cos({a})"),
    _op("erf", torch.erf, 1, lambda a: f"tl.erf({a})"),
    _op("floor", torch.floor, 1, lambda a: f"_floor({a})"),
    _op("ceil", torch.ceil, 1, lambda a: f"_ceil({a})"),
    _op("trunc", torch.trunc, 1, lambda a: f"_trunc({a})"),   # -0.5 -> -0.0, as eager
    _op("round", torch.round, 1, lambda a: f"_round({a})"),   # half to even; decimals= stays in the library
    _op("frac", torch.frac, 1, lambda a: f"({a} - _trunc({a}))"),   # -0.0 -> 0.0 and inf -> nan, as eager
    _op("sign", torch.sign, 1, lambda a: f"tl.where({a} > 0, 1.0, tl.where({a} < 0, -1.0, 0.0))"),   # nan -> 0
    # in fp64, rounded once (as _exp2_log2): the GPU's fp32 forms are approximate and may flush subnormals
    _op("exp2", torch.exp2, 1, lambda a: f"tl.exp2({a}.to(tl.float64)).to(tl.float32)"),
    _op("log2", torch.log2, 1, lambda a: f"tl.log2({a}.to(tl.float64)).to(tl.float32)"),
    _op("log10", torch.log10, 1, lambda a: f"(tl.log({a}.to(tl.float64)) * 0.4342944819032518).to(tl.float32)"),
    _op("isnan", torch.isnan, 1, lambda a: f"({a} != {a})", returns_bool=True),
    _op("isinf", torch.isinf, 1, lambda a: f"(tl.abs({a}) == 1e999)", returns_bool=True),
    _op("isfinite", torch.isfinite, 1, lambda a: f"(tl.abs({a}) < 1e999)", returns_bool=True),
    _op("isposinf", torch.isposinf, 1, lambda a: f"({a} == 1e999)", returns_bool=True),   # (fuzz49g: library calls)
    _op("isneginf", torch.isneginf, 1, lambda a: f"({a} == -1e999)", returns_bool=True),
    _op("expm1", torch.expm1, 1, lambda a: f"_expm1({a})"),
    _op("log1p", torch.log1p, 1, lambda a: f"_log1p({a})"),
    _op("clamp", torch.clamp, 1, _clamp, ("min", "max"), min=None, max=None),
    # activations
    _op("relu", torch.relu, 1, lambda a: f"tl.where({a} <= 0, 0.0, {a})"),  # keeps nan; -0.0 -> +0.0 as CUDA
    _op("sigmoid", torch.sigmoid, 1, lambda a: f"_sigmoid({a})"),
    _op("tanh", torch.tanh, 1, lambda a: f"_tanh({a})"),
    _op("gelu", F.gelu, 1, lambda a, approximate="none": (
        f"(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))" if approximate == "none" else
        f"({a} * _sigmoid(1.5957691216057308 * ({a} + 0.044715 * {a} * {a} * {a})))"),   # 0.5 (1 + tanh u) =
    #   sigmoid(2u), without 1 + tanh's cancellation in the negative tail (fuzz48h: 4x eager's error there)
        ("approximate",), approximate="none"),
    _op("silu", F.silu, 1, lambda a: f"({a} * _sigmoid({a}))"),
    _op("mish", F.mish, 1, lambda a: f"({a} * _tanh(_softplus({a}, 1.0, 20.0)))"),
    _op("leaky_relu", F.leaky_relu, 1,
        lambda a, negative_slope=0.01: f"tl.where({a} > 0, {a}, {a} * {literal(negative_slope)})",
        ("negative_slope",), negative_slope=0.01),
    _op("elu", F.elu, 1,
        lambda a, alpha=1.0: f"tl.where({a} > 0, {a}, {literal(alpha)} * _expm1({a}))",
        ("alpha",), alpha=1.0),
    _op("selu", F.selu, 1, lambda a: (
        f"(1.0507009873554805 * tl.where({a} > 0, {a}, 1.6732632423543772 * _expm1({a})))")),
    _op("softplus", F.softplus, 1,
        lambda a, beta=1.0, threshold=20.0: f"_softplus({a}, {literal(beta)}, {literal(threshold)})",
        ("beta", "threshold"), beta=1.0, threshold=20.0),
    # as CUDA's eager kernel: min(max(x + 3, 0), 6) * (1/6); x / 6 + 0.5 lost bits near x = -3 (fuzz33d)
    _op("hardsigmoid", F.hardsigmoid, 1, lambda a: f"({_clamp(f'({a} + 3.0)', 0.0, 6.0)} * 0.16666666666666666)"),
    _op("hardswish", F.hardswish, 1,   # times fp32(1/6) after the product, as CUDA eager (fuzz36d: / 6.0 was
        lambda a: f"({a} * {_clamp(f'({a} + 3.0)', 0.0, 6.0)} * 0.16666666666666666)"),   # approximate there)
    # as CUDA's eager kernels compute them, NaN and signed zeros included (softshrink's zeros are +0
    # there, a NaN stays NaN: the H100, stop 37; CPU eager's scalar loop keeps the sign)
    _op("celu", F.celu, 1, lambda a, alpha=1.0: (
        f"tl.where({a} > 0, {a}, {literal(alpha)} * _expm1({a} * {literal(1.0 / alpha)}))"), ("alpha",), alpha=1.0),
    _op("softsign", F.softsign, 1, lambda a: f"_div({a}, 1.0 + tl.abs({a}))"),
    _op("logsigmoid", F.logsigmoid, 1, lambda a: f"(tl.where({a} < 0, {a}, 0.0) - _log1p(_exp(-tl.abs({a}))))"),
    _op("tanhshrink", F.tanhshrink, 1, lambda a: f"({a} - _tanh({a}))"),
    _op("hardshrink", F.hardshrink, 1, lambda a, lambd=0.5: (
        f"tl.where({a} >= {literal(-lambd)}, tl.where({a} <= {literal(lambd)}, 0.0, {a}), {a})"),
        ("lambd",), lambd=0.5),
    _op("softshrink", F.softshrink, 1, lambda a, lambd=0.5: (
        f"tl.where({a} > {literal(lambd)}, {a} - {literal(lambd)}, "
        f"tl.where({a} < {literal(-lambd)}, {a} + {literal(lambd)}, tl.where({a} != {a}, {a}, 0.0)))"),
        ("lambd",), lambd=0.5),
    _op("threshold", F.threshold, 1, lambda a, threshold, value: (
        f"tl.where({a} <= {literal(threshold)}, {literal(value)}, {a})"), ("threshold", "value")),
    _op("cast", cast, 1, lambda a, dtype: _cast_expr(a, dtype), ("dtype",)),
]

POINTWISE: dict = {op.target: op for op in _TABLE}
BY_NAME: dict = {op.name: op for op in _TABLE}

# dtypes a fused kernel computes on: loads of these are upcast to fp32, results stored back
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)
TRITON_DTYPE = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.bool: "tl.int1", torch.int8: "tl.int8",
    torch.uint8: "tl.uint8", torch.int16: "tl.int16", torch.int32: "tl.int32",
    torch.int64: "tl.int64",
}


def _cast_expr(a, dtype) -> str:
    """A cast inside a kernel rounds to the target type and continues in fp32, as eager would."""
    if dtype == torch.bool:
        return f"({a} != 0)"
    if dtype == torch.float32:
        return f"{a}.to(tl.float32)"
    return f"{a}.to({TRITON_DTYPE[dtype]}).to(tl.float32)"


def is_pointwise_target(target) -> bool:
    try:
        return target in POINTWISE
    except TypeError:  # unhashable targets
        return False
