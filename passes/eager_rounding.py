"""Operands as eager rounds them before it computes: a fused kernel computes in fp32, eager in the
operation's dtype (fp16 comparisons, fp16 compositions rounded inside) and with its own reading of
Python numbers (an int past 2**53 rounded once). Used by fuse_pointwise when it builds a kernel's IR."""
import numbers

import torch
import torch.fx

from fxfuse.ir import IRBuilder
from fxfuse.ops import POINTWISE, as_layout, is_pointwise_target


def _meta(node):
    return node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None


def _nargs(target) -> int:
    return 1 if target is as_layout else POINTWISE[target].nargs if is_pointwise_target(target) else 0


def comparison_dtype(node: torch.fx.Node) -> torch.dtype:
    """The dtype eager compares in: both operands are converted to it first (x_fp16 > 0.1
    compares with 0.1 rounded to fp16; an int64 compared with an int compares as integers)."""
    def like(a):
        m = _meta(a) if isinstance(a, torch.fx.Node) else None
        return torch.empty((1,) * len(m.shape), dtype=m.dtype, device="meta") if m is not None else a
    operands = [like(a) for a in node.args[:_nargs(node.target)]]
    return torch.result_type(*operands) if len(operands) == 2 else getattr(operands[0], "dtype", torch.float32)


# torch's Python-level compositions, whose inner result eager rounds to fp16 / bf16 before the last step
# (F.tanhshrink is x - x.tanh(), F.softsign x / (x.abs() + 1); fuzz38c: 61 of 64 fp16 tanhshrinks differed)
HALF_COMPOSITES = {
    "tanhshrink": lambda b, a, dtype: b.op("sub", [a, b.op("cast", [b.op("tanh", [a])], dtype=dtype)]),
    "softsign": lambda b, a, dtype: b.op("div", [a, b.op("cast", [b.op("add", [b.op("abs", [a]), b.const(1.0)])],
                                                          dtype=dtype)]),
}


def number_literal(a, node):
    """A Python number operand of a fp32 / fp16 / bf16 op as eager's CUDA kernels read it: as an
    fp32 scalar (their compute type), so the kernel source holds that fp32 value. The GPU's Triton
    types an in-range float literal as fp32 anyway; the interpreter and an fp64 expression kept
    it exact (review39: rsub(x, 0.1, alpha=2) at x = 0.05 gave -1.5e-9, eager 0). An int past 2**24
    goes int64 -> fp32 in one rounding, not two through fp64 (`x == 2**60 + 2**36 + 1` flipped), nor
    exact into an fp64 expression (add_scaled's: review48r2).
    Comparisons round their operands in round_operands (to fp16 directly for an fp16 one)."""
    op = POINTWISE.get(node.target) if is_pointwise_target(node.target) else None
    if isinstance(a, bool) or not isinstance(a, (int, float)) or op is None:
        return a
    dtype = comparison_dtype(node) if op.returns_bool else _meta(node).dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return a
    if isinstance(a, int):   # past 2**24 fp32 rounds it too (review48r2: rsub(h, 2**30 + 1, alpha=2), fp64 math)
        return float(torch.tensor(a, dtype=torch.int64, device="cpu").to(torch.float32)) \
            if 2 ** 24 < abs(a) < 2 ** 63 else a
    return a if op.returns_bool else float(torch.tensor(a, dtype=torch.float32, device="cpu"))


def _cpu_reads_unrounded(node, op, k, a) -> bool:
    """CPU eager's mul and true div of an fp16 / bf16 tensor by a one-element tensor of another dtype
    as the second operand (`x16 * torch.tensor(1e-8)`, `x16 / t` with t an fp32 or int64 0-dim tensor)
    read that element in fp32 (BinaryOpsKernel.cpp's `original_scalar_value<opmath_t>`), where the
    other ops and the first operand round it to fp16 (fuzz44b: 1e-8 became 0, 70000 inf). On CUDA a
    CUDA tensor is rounded (its dynamic cast) and a CPU one is a number by then
    (fold_literals.cpu_literal_as_number)."""
    meta = _meta(a)
    return op.name in ("mul", "div") and k == 1 and meta is not None and meta.shape.numel() == 1 \
        and getattr(node.meta.get("fxfuse", {}).get("device"), "type", None) == "cpu"


def round_operands(b: IRBuilder, node, args: list) -> list:
    """Operands rounded to the dtype eager computes in, when that is narrower than the kernel's
    fp32. A comparison converts both operands to their common dtype: x_fp16 == 0.1 is true where
    x holds fp16(0.1). Any other op converts tensor operands to its result dtype: x_fp16 + t,
    with t a 0-dim fp32 tensor, adds t rounded to fp16. A Python number there stays as it is:
    CUDA's kernels read it unrounded (CPU eager is not consistent about it, by op)."""
    op = POINTWISE[node.target]
    dtype = comparison_dtype(node) if op.returns_bool else _meta(node).dtype
    if dtype == torch.float32 and op.returns_bool:   # x == 1e-50 compares with fp32(1e-50) = 0.0 in eager; Triton
        return [b.const(torch.tensor(float(number_literal(a, node)), dtype=dtype, device="cpu").item())   # Triton types a literal
                if isinstance(a, numbers.Real) and not isinstance(a, (bool, torch.fx.Node)) else v   # outside fp32's normal
                for a, v in zip(node.args[:op.nargs], args)]   # range as fp64 and compares in fp64 on the GPU (fuzz34e)
    if dtype not in (torch.float16, torch.bfloat16) or op.name == "cast":
        return args
    rounded = []
    for k, (a, v) in enumerate(zip(node.args[:op.nargs], args)):
        if isinstance(a, torch.fx.Node):
            condition = node.target is torch.where and k == 0
            if not op.returns_bool and _meta(a).dtype != dtype and _cpu_reads_unrounded(node, op, k, a):
                v = b.op("cast", [v], dtype=torch.float32)
            elif op.returns_bool or (_meta(a).dtype != dtype and not condition):
                v = b.op("cast", [v], dtype=dtype)
        elif op.returns_bool:  # a number: round it here, Triton source cannot call .to() on a literal
            v = b.const(torch.tensor(float(number_literal(a, node)), dtype=dtype, device="cpu").item())
        rounded.append(v)
    return rounded


