"""Triton source of a fused MLP (mlp_spec.MLPSpec): one straight-line kernel for the whole chain.

A Linear is unrolled at generation time into one tile product per (K tile, N tile), and each
pointwise op runs tile by tile. The source is generated per chain and loaded through the
kernel cache.

Two forms of the tile product (`KernelConfig.rowwise`): tl.dot needs 16 rows, so at batch 1
it would compute 15 rows of padding; the row-wise form (one program per row) holds each value
as 1-D tiles and computes a Linear as GEMV tile products (multiply a weight tile by the
activation broadcast along one axis, sum over the other), doing only the real row's work.
Every program streams all weights through its SM, so it pays only while they are small.
Two things decide its speed (benchmarks/gemv_chain_probe.py, H100, 8 x Linear(64) at batch 1:
4.7 us against 12.5 us for the per-layer plan; the earlier row-wise form took 30-51 us at
width 128 against the plan's 11.3):
  - no layout conversion between layers: a sum over axis 1 leaves the result in the layout a
    broadcast along axis 1 needs, and a sum over axis 0 the one along axis 0. So the weight
    tiles alternate with the chain: a Linear whose input came out of a sum over axis 0 (or is
    x) reads [N, K] tiles and sums over axis 1; one whose input came out of a sum over axis 1
    reads [K, N] tiles (W.T) and sums over axis 0 (`Layout.transposed`);
  - the next Linear's weight tiles are loaded before this one's products where both fit the
    register budget (PREFETCH_ELEMENTS per thread), so the weight stream overlaps the math.

Padding: weights are zero-padded to whole tiles and packed tile by tile in the order the kernel
reads them (mlp_kernel.pack, from the same Layout), once at optimize time; constant vectors are
padded with zeros. Padded lanes of an activation may still become non-zero (sigmoid(0) = 0.5,
x / 0 = nan), so partial tiles are masked to 0 before they feed a product (0 * nan would spread
into real lanes), and the final store masks rows and columns. Rows past the batch are loaded
as 0 and never stored; rows are independent in a matrix product, so they cannot leak.

Code size: an fp32 "ieee" tl.dot and the row-wise product are lowered to FMAs fully unrolled,
BLOCK_M * K * N / threads of them per product; the whole chain is straight-line code, so
`why_not_kernel` bounds that count (about 8 layers of 256 at BLOCK_M 16), which bounds compile
time. Of triton.language's jit-defined helpers only tl.sum is used (tl.reduce with a combine
function of our own is ~60x slower under the interpreter): like every generated kernel, this
one runs under the interpreter only if TRITON_INTERPRET=1 was set before triton was imported.
"""
import hashlib

import torch

from .codegen import HEADER, IndentedBuffer
from .mlp_spec import (MAX_TILE, PREFETCH_ELEMENTS, KernelConfig, Linear, MLPSpec, Pointwise, _padded_kn,
                       layer_period, tile_of, vectors_before)
from .ops import BY_NAME, PRELUDE, TRITON_DTYPE, literal


def value_axes(spec: MLPSpec) -> dict:
    """Row-wise form: the axis of a 2-D weight tile each value runs along (module docstring).
    x runs along axis 1 (broadcast as v[None, :]); a Linear sums over its input's axis, so its
    result runs along the other one; a pointwise result along its first value operand's."""
    axis = {0: 1}
    for s in spec.steps:
        if isinstance(s, Linear):
            axis[s.out] = 1 - axis[s.src]
        else:
            axis[s.out] = next((axis[ref] for kind, ref in s.operands if kind == "value"), 1)
    return axis


class Layout:
    """Element offsets of every weight block (by the value id its Linear defines) and constant
    vector in the two packed buffers, and which Linears read transposed [K, N] tiles. Code
    generation and packing both read it, so they cannot disagree."""

    def __init__(self, spec: MLPSpec, numels: tuple, max_tile: int = MAX_TILE, rowwise: bool = False):
        self.weight_offset, self.vector_offset = {}, {}
        axis = value_axes(spec)
        # tl.dot takes [K, N] tiles; the row-wise form [N, K] where its input runs along axis 1
        self.transposed = {s.out for s in spec.linears if not rowwise or axis[s.src] == 0}
        at = 0
        for s, (k, n, _) in zip(spec.linears, _padded_kn(spec, max_tile)):
            self.weight_offset[s.out] = at
            at += k * n
        self.weight_numel = max(at, 1)
        self.vector_size = [1] * len(numels)   # 1 for a scalar, else whole tiles of its consumer
        for s in spec.steps:
            if isinstance(s, Pointwise):
                for kind, ref in s.operands:
                    if kind == "vector" and numels[ref] > 1:
                        t, n = tile_of(spec.widths[s.out], max_tile)
                        self.vector_size[ref] = t * n
        at = 0
        for k, size in enumerate(self.vector_size):
            self.vector_offset[k] = at
            at += -(-size // 16) * 16          # 64-byte aligned starts
        self.vector_numel = max(at, 1)


def kernel_name(spec: MLPSpec, config: KernelConfig, numels: tuple = ()) -> str:
    """Named by everything the source depends on: the spec, the config and the constant vectors'
    sizes (a [w] vector and a scalar one load differently)."""
    digest = hashlib.sha256(repr((spec, config, tuple(numels))).encode()).hexdigest()[:10]
    form = "rows" if config.rowwise else "loop" if config.looped else "dot"
    return f"fxmlp_{len(spec.linears)}x{max(spec.widths)}_{form}_{digest}"


def generate_mlp(spec: MLPSpec, numels: tuple, config: KernelConfig) -> tuple:
    """(source, kernel name) of one Triton kernel computing the whole chain.

    Arguments of the kernel: x [M, K0] (row stride stride_xm, unit column stride), out
    [M, N] (row stride stride_om), the packed weights and constants, M, and BLOCK_M. The
    row-wise form runs one program per row (grid M); values are 1-D tiles there, [BLOCK_M, T]
    tiles in the tl.dot form.
    """
    name = kernel_name(spec, config, numels)
    mt = config.max_tile
    layout = Layout(spec, numels, mt, config.rowwise)
    buf = IndentedBuffer()
    buf.line("@triton.jit")
    buf.line(f"def {name}(x_ptr, out_ptr, w_ptr, v_ptr, M, stride_xm, stride_om, BLOCK_M: tl.constexpr):")
    with buf.indent():
        esize = torch.empty((), dtype=spec.dtype).element_size()
        widths = " -> ".join(str(spec.widths[s.out]) for s in spec.linears)
        buf.line(f"# {len(spec.linears)} Linear layers, widths {spec.widths[0]} -> {widths}; "
                 f"{'row-wise GEMV products' if config.rowwise else 'tl.dot'}, {config}")
        buf.line(f"# per program: reads BLOCK_M rows of x and all {layout.weight_numel * esize} bytes "
                 "of packed weights; activations stay in registers; writes BLOCK_M rows")
        if config.rowwise:
            buf.line("row = tl.program_id(0).to(tl.int64)   # one program per row: the grid is M")
        else:
            buf.line("rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)")
            buf.line("row_ok = rows < M")
            buf.line("rows = rows.to(tl.int64)")
        for t in sorted({tile_of(w, mt)[0] for w in spec.widths}):
            buf.line(f"c{t} = tl.arange(0, {t})")
        if config.looped:
            _emit_looped(buf, spec, numels, layout, config)
            return HEADER + PRELUDE + "\n\n" + buf.getvalue(), name
        ahead = _preloaded(spec, config)
        if spec.linears[0].out in ahead:
            _emit_weight_loads(buf, spec, spec.linears[0], layout, config, "   # before x: the weight stream starts")
        _emit_input(buf, spec, config)
        loaded, later = set(), spec.linears[1:] + [None]   # later[k]: the Linear after the k-th
        for step in spec.steps:
            if isinstance(step, Linear):
                after = later.pop(0)
                if after is not None and after.out in ahead:
                    _emit_weight_loads(buf, spec, after, layout, config, "   # next Linear's, ahead")
                _emit_linear(buf, spec, step, layout, config, step.out in ahead)
            else:
                _emit_pointwise(buf, spec, step, layout, numels, loaded, config)
        _emit_store(buf, spec, config)
    return HEADER + PRELUDE + "\n\n" + buf.getvalue(), name


def _emit_looped(buf, spec, numels, layout, config):
    """The chain as a runtime loop over its identical layers (mlp_spec.layer_period): the
    prefix steps unrolled, then layer 0's steps with the weight block and constant vectors of
    layer g at g times their stride. One tile per value (KernelConfig.max_tile covers the width)."""
    found = layer_period(spec, numels)
    t, n = tile_of(spec.widths[0], config.max_tile)
    if found is None or n != 1 or not all(s.out in layout.transposed for s in spec.linears):
        raise ValueError("the looped form needs identical layers of one tile each")
    prefix, period = found
    layers, width = len(spec.linears), spec.widths[0]
    prefix_vectors = vectors_before(spec, prefix)
    per_layer = (len(numels) - prefix_vectors) // layers     # layer g's vectors: prefix_vectors + g * per_layer + j
    stride = (layout.vector_offset[prefix_vectors + per_layer] - layout.vector_offset[prefix_vectors]
              if per_layer else 0)
    _emit_input(buf, spec, config)
    loaded = set()
    for step in spec.steps[:prefix]:
        _emit_pointwise(buf, spec, step, layout, numels, loaded, config)
    buf.line(f"h = v{prefix}_0   # the running activation, [BLOCK_M, {t}]")
    buf.line(f"for g in range({layers}):   # not unrolled: one layer's weights in registers at a time")
    with buf.indent():
        masked = "h" if t == width else f"tl.where((c{t} < {width})[None, :], h, 0.0)   # padded lanes"
        buf.line(f"v{prefix}_0 = {masked}")
        linear = spec.steps[prefix]
        buf.line(f"w = tl.load(w_ptr + g * {t * t} + c{t}[:, None] * {t} + c{t}[None, :])   # W.T of layer g")
        buf.line(f"v{linear.out}_0 = tl.dot(v{prefix}_0, w, out_dtype=tl.float32, "
                 f"input_precision=\"{config.precision}\")")
        loaded = set()
        for step in spec.steps[prefix + 1:prefix + period]:
            _emit_pointwise(buf, spec, step, layout, numels, loaded, config, f" + g * {stride}")
        buf.line(f"h = v{prefix + period}_0")
    buf.line(f"v{spec.output}_0 = h")
    _emit_store(buf, spec, config)


def _tile_elements(spec: MLPSpec, step: Linear, max_tile: int) -> int:
    (tk, nk), (tn, nn) = tile_of(spec.widths[step.src], max_tile), tile_of(spec.widths[step.out], max_tile)
    return tk * nk * tn * nn


def _preloaded(spec: MLPSpec, config: KernelConfig) -> set:
    """Row-wise form: the Linears (by value id) whose weight tiles are loaded ahead, before the
    previous Linear's products (the first one's before x): where its tiles and the previous
    one's together stay within PREFETCH_ELEMENTS per thread. gemv_chain_probe (H100, 8 layers
    fp32, 4 warps): width 64, 32 + 32 elements per thread, 4.7 us ahead vs 7.2 us not; width
    128, 128 + 128, spills: 11.3 vs 10.3 us."""
    if not config.rowwise:
        return set()
    threads = 32 * config.num_warps
    sizes = [_tile_elements(spec, s, config.max_tile) for s in spec.linears]
    ahead = {spec.linears[0].out} if sizes[0] <= PREFETCH_ELEMENTS * threads else set()
    for k in range(1, len(sizes)):
        if sizes[k - 1] + sizes[k] <= PREFETCH_ELEMENTS * threads:
            ahead.add(spec.linears[k].out)
    return ahead


def _cols(j: int, t: int) -> str:
    return f"({j * t} + c{t})" if j else f"c{t}"


def _along_row(config: KernelConfig, expr: str) -> str:
    """A per-column vector as the value tiles hold it: 1-D (row-wise) or [1, T] (tl.dot form)."""
    return expr if config.rowwise else f"{expr}[None, :]"


def _emit_input(buf, spec, config):
    k0 = spec.widths[0]
    t, n = tile_of(k0, config.max_tile)
    buf.line(f"# input: {k0} columns as {n} tile(s) of {t}")
    for j in range(n):
        partial = (j + 1) * t > k0
        if config.rowwise:
            mask = f", mask={_cols(j, t)} < {k0}, other=0.0" if partial else ""
            buf.line(f"v0_{j} = tl.load(x_ptr + row * stride_xm + {_cols(j, t)}{mask}).to(tl.float32)")
            continue
        mask = "row_ok[:, None]" + (f" & ({_cols(j, t)} < {k0})[None, :]" if partial else "")
        buf.line(f"v0_{j} = tl.load(x_ptr + rows[:, None] * stride_xm + {_cols(j, t)}[None, :], "
                 f"mask={mask}, other=0.0).to(tl.float32)")


def _weight_tile(spec, step, layout, config, j: int, kk: int) -> str:
    """The load of weight tile (N tile j, K tile kk): [tk, tn] if the Linear is in
    layout.transposed, else [tn, tk]."""
    (tk, nk), (tn, _) = tile_of(spec.widths[step.src], config.max_tile), tile_of(spec.widths[step.out], config.max_tile)
    at = layout.weight_offset[step.out] + (j * nk + kk) * tk * tn
    rows, cols = (tk, tn) if step.out in layout.transposed else (tn, tk)
    return f"tl.load(w_ptr + {at} + c{rows}[:, None] * {cols} + c{cols}[None, :])"


def _emit_weight_loads(buf, spec, step, layout, config, comment=""):
    (_, nk), (_, nn) = tile_of(spec.widths[step.src], config.max_tile), tile_of(spec.widths[step.out], config.max_tile)
    for j in range(nn):
        for kk in range(nk):
            buf.line(f"w{step.out}_{j}_{kk} = {_weight_tile(spec, step, layout, config, j, kk)}{comment}")


def _emit_linear(buf, spec, step, layout, config, preloaded=False):
    k, n = spec.widths[step.src], spec.widths[step.out]
    (tk, nk), (tn, nn) = tile_of(k, config.max_tile), tile_of(n, config.max_tile)
    buf.line(f"# v{step.out} = v{step.src} @ W.T: {k} -> {n} as {nk} x {nn} tiles of "
             f"[{tk}, {tn}] (weights at element {layout.weight_offset[step.out]})")
    to_dot = spec.dtype != torch.float32 and not config.rowwise
    dot_kw = f", input_precision=\"{config.precision}\"" if spec.dtype == torch.float32 else ""
    operands = []
    for kk in range(nk):
        expr = f"v{step.src}_{kk}"
        if (kk + 1) * tk > k and step.src != 0:   # padded lanes may hold f(0) != 0 or nan
            expr = f"tl.where({_along_row(config, f'({_cols(kk, tk)} < {k})')}, {expr}, 0.0)"
        if to_dot:
            expr = f"{expr}.to({TRITON_DTYPE[spec.dtype]})"
        if expr != f"v{step.src}_{kk}":
            buf.line(f"a{step.out}_{kk} = {expr}")
            expr = f"a{step.out}_{kk}"
        operands.append(expr)
    for j in range(nn):
        for kk in range(nk):
            w = f"w{step.out}_{j}_{kk}"
            if not preloaded:
                buf.line(f"{w} = {_weight_tile(spec, step, layout, config, j, kk)}")
            if config.rowwise:   # GEMV: sum over the axis the input runs along (module docstring)
                w = w if spec.dtype == torch.float32 else f"{w}.to(tl.float32)"
                prod = (f"tl.sum({w} * {operands[kk]}[:, None], axis=0)" if step.out in layout.transposed
                        else f"tl.sum({w} * {operands[kk]}[None, :], axis=1)")
                buf.line(f"acc = {prod}" if kk == 0 else f"acc = acc + {prod}")
            else:                # [tk, tn] tile, as tl.dot takes it
                acc = "out_dtype=tl.float32" if kk == 0 else "acc=acc"
                buf.line(f"acc = tl.dot({operands[kk]}, {w}, {acc}{dot_kw})")
        buf.line(f"v{step.out}_{j} = acc")


def _emit_pointwise(buf, spec, step, layout, numels, loaded, config, vector_base=""):
    t, n = tile_of(spec.widths[step.out], config.max_tile)
    op = BY_NAME[step.op]
    for kind, ref in step.operands:        # constants: loaded once, where first needed
        if kind == "vector" and ref not in loaded:
            loaded.add(ref)
            at = f"{layout.vector_offset[ref]}{vector_base}"   # vector_base: layer g's (looped form)
            if numels[ref] == 1:
                buf.line(f"k{ref} = tl.load(v_ptr + {at})")
            else:
                for j in range(n):
                    buf.line(f"k{ref}_{j} = {_along_row(config, f'tl.load(v_ptr + {at} + {_cols(j, t)})')}")
    for j in range(n):
        args = []
        for kind, ref in step.operands:
            if kind == "value":
                args.append(f"v{ref}_{j}")
            elif kind == "number":
                args.append(literal(ref))
            else:
                args.append(f"k{ref}" if numels[ref] == 1 else f"k{ref}_{j}")
        buf.line(f"v{step.out}_{j} = {op.expr(*args, **dict(step.params))}")


def _emit_store(buf, spec, config):
    w = spec.widths[spec.output]
    t, n = tile_of(w, config.max_tile)
    for j in range(n):
        partial = (j + 1) * t > w
        value = f"v{spec.output}_{j}.to({TRITON_DTYPE[spec.dtype]})"
        if config.rowwise:
            mask = f", mask={_cols(j, t)} < {w}" if partial else ""
            buf.line(f"tl.store(out_ptr + row * stride_om + {_cols(j, t)}, {value}{mask})")
            continue
        mask = "row_ok[:, None]" + (f" & ({_cols(j, t)} < {w})[None, :]" if partial else "")
        buf.line(f"tl.store(out_ptr + rows[:, None] * stride_om + {_cols(j, t)}[None, :], {value}, mask={mask})")
