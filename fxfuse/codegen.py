"""Triton source from the fused-kernel IR.

Every kernel follows the tutorial skeleton: pid -> offsets -> mask -> index decomposition ->
loads -> scalar ops in fp32 -> stores. Shapes, strides and offsets are baked into the source
as constants (a kernel is built for exactly one shape; guards make sure it only ever sees
that shape), so the compiler turns div/mod by them into multiplies and shifts.
"""
import hashlib

import torch

from .ir import IndexMap, KernelIR
from .ops import BY_NAME, PRELUDE, TRITON_DTYPE, literal

HEADER = "import triton\nimport triton.language as tl\n"


class IndentedBuffer:
    """Lines with an indentation level, as in Inductor's IndentedBuffer."""

    def __init__(self):
        self.lines: list = []
        self.level = 0

    def line(self, text: str = "") -> None:
        self.lines.append(("    " * self.level + text) if text else "")

    def indent(self):
        buf = self

        class _Indent:
            def __enter__(self):
                buf.level += 1

            def __exit__(self, *exc):
                buf.level -= 1
        return _Indent()

    def getvalue(self) -> str:
        return "\n".join(self.lines) + "\n"


def elements_per_thread(streams: int) -> int:
    """Elements each thread handles, from how many tensors a kernel loads and stores per point.

    Each stream keeps one register per element: a plain epilogue (a few streams) takes 8
    elements per thread (wide, coalesced accesses), but Strassen's 49-way prefix/suffix
    kernels at 8 would hold ~400 values per thread and spill. Measured on an H100: that
    kernel moved 2.0 TB/s at 1024 elements per program against 3.0 TB/s for a plain one.
    """
    return 8 if streams <= 8 else 4 if streams <= 16 else 2 if streams <= 32 else 1


def block_size(numel: int, streams: int = 1) -> int:
    """Elements per program: up to 4 warps x 32 threads x elements_per_thread(streams)."""
    cap = 4 * 32 * elements_per_thread(streams)
    return max(16, min(cap, 1 << (max(numel, 1) - 1).bit_length()))


def num_warps(block: int, streams: int = 1) -> int:
    return max(1, min(4, block // (32 * elements_per_thread(streams))))


def streams(ir: KernelIR) -> int:
    """Tensors a kernel reads or writes per point (loads of a broadcast scalar excluded)."""
    loads = sum(1 for i in ir.instrs if i.op == "load" and any(i.param("index").strides))
    return loads + len(ir.stores)


def kernel_name(ir: KernelIR) -> str:
    """Deterministic, readable: the ops it computes plus a hash of the whole IR."""
    ops = [i.op for i in ir.instrs if i.op not in ("load", "const")]
    seen = []
    for op in ops:
        if op not in seen:
            seen.append(op)
    digest = hashlib.sha256(repr(ir).encode()).hexdigest()[:10]
    return "fxk_" + "_".join(seen[:4]) + ("_" if seen else "") + digest


def _address(index: IndexMap, dim_vars) -> str:
    terms = [str(index.offset)] if index.offset else []
    for var, stride in zip(dim_vars, index.strides):
        if stride == 1:
            terms.append(var)
        elif stride != 0:
            terms.append(f"{var} * {stride}")
    return " + ".join(terms) if terms else "0"


def _needs_int64(ir: KernelIR) -> bool:
    limit = 2 ** 31 - 1
    if ir.numel > limit:
        return True
    for m in ir.index_maps():
        far = m.offset + sum(abs(s) * (n - 1) for s, n in zip(m.strides, ir.shape))
        if far > limit:
            return True
    return False


def generate(ir: KernelIR, name: str | None = None) -> tuple:
    """Return (source, kernel name) of a Triton module with one kernel computing `ir`."""
    ir = ir.coalesced()
    name = name or kernel_name(ir)
    buf = IndentedBuffer()
    in_args = [f"in{k}" for k in range(len(ir.inputs))]
    out_args = [f"out{k}" for k in range(len(ir.outputs))]
    buf.line("@triton.jit")
    buf.line(f"def {name}({', '.join(in_args + out_args + ['BLOCK: tl.constexpr'])}):")
    with buf.indent():
        read = sum(torch.empty((), dtype=d).element_size() for d in ir.inputs)
        written = sum(torch.empty((), dtype=o.dtype).element_size() for o in ir.outputs)
        buf.line(f"# iteration space {list(ir.shape)} ({ir.numel} points); per point "
                 f"at most {read} bytes read, {written} bytes written")
        pid = "tl.program_id(0).to(tl.int64)" if _needs_int64(ir) else "tl.program_id(0)"
        buf.line(f"offs = {pid} * BLOCK + tl.arange(0, BLOCK)")
        buf.line(f"mask = offs < {ir.numel}")
        dim_vars = _emit_index_decomposition(buf, ir)
        values = {}
        is_vector = {}
        is_bool = set()    # int1 values: bool loads and comparisons
        for k, ins in enumerate(ir.instrs):
            if ins.op == "const":
                values[k], is_vector[k] = literal(ins.param("value")), False
                continue
            if ins.op == "load":
                index, inp = ins.param("index"), ins.param("input")
                dtype = ir.inputs[inp]
                vec = any(index.strides)
                load = (f"tl.load(in{inp} + {_address(index, dim_vars)}, mask=mask, other=0)"
                        if vec else f"tl.load(in{inp} + {index.offset})")
                conv = "" if dtype == torch.bool else ".to(tl.float32)"
                buf.line(f"v{k} = {load}{conv}")
                if dtype == torch.bool:
                    is_bool.add(k)
            else:
                op = BY_NAME[ins.op]
                # a bool operand of arithmetic (sigmoid(x > 0), mask * x) is 0.0 / 1.0 as in eager's
                # promotion; Triton's math functions reject int1. where's condition and casts keep it
                args = [values[a] if a not in is_bool or op.name == "cast" or (op.name == "where" and j == 0)
                        else f"{values[a]}.to(tl.float32)" for j, a in enumerate(ins.args)]
                if op.returns_bool or op.name == "cast" and ins.param("dtype") == torch.bool:   # (x.bool() / 3:
                    is_bool.add(k)                                       # int1 where fp32 was read; fuzz45b)
                buf.line(f"v{k} = {op.expr(*args, **dict(ins.params))}")
                vec = any(is_vector[a] for a in ins.args)
            values[k], is_vector[k] = f"v{k}", vec
        for st in ir.stores:
            spec = ir.outputs[st.output]
            value = values[st.value]
            if not is_vector[st.value]:  # a value built only from scalars still fills the block;
                value = f"(tl.full([BLOCK], -2147483648, tl.int32).to(tl.float32, bitcast=True) + {value})"   # + -0.0:
                # x for any x (-0.0 too); the bits, since Triton made a -0.0 constant +0.0 on the GPU (stop 37)
            address = _address(st.index, dim_vars)
            if not any(st.index.strides):  # a one-point space ([], [1, 1]): a block of one address
                address += " + offs * 0"
            buf.line(f"tl.store(out{st.output} + {address}, "
                     f"{value}.to({TRITON_DTYPE[spec.dtype]}), mask=mask)")
    source = HEADER + PRELUDE + "\n\n" + buf.getvalue()
    return source, name


def _emit_index_decomposition(buf: IndentedBuffer, ir: KernelIR) -> list:
    """i_k for each dim of the (coalesced) iteration space, only where some map needs it."""
    ndim = len(ir.shape)
    used = [any(m.strides[k] != 0 for m in ir.index_maps()) for k in range(ndim)]
    if ndim == 1:
        return ["offs"]
    dim_vars = [f"i{k}" for k in range(ndim)]
    inner = 1
    for k in reversed(range(ndim)):
        if used[k]:
            div = f"(offs // {inner})" if inner != 1 else "offs"
            expr = f"{div} % {ir.shape[k]}" if k > 0 else div
            buf.line(f"i{k} = {expr}")
        inner *= ir.shape[k]
    return dim_vars
