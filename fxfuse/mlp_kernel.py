"""The fully fused narrow MLP: a whole chain of Linear layers and their pointwise epilogues in
ONE Triton kernel.

Why: for narrow layers at small batch, time goes to launches (two per Linear+ReLU, ~1.2 us
each even from a CUDA graph) and to round trips of activations through memory, not to FLOPs.
Here each program takes BLOCK_M rows through every layer: the activations never leave
registers, only the weights are read (from L2/HBM, tile by tile), and the whole network is
one launch.

How: the pass (passes/fuse_mlp.py) describes the chain as an `MLPSpec`, a straight-line
program over *values* (value 0 is the input; every value is [rows, width]):
  Linear(out, src, weight)                -> out = src @ W.T        (fp32 accumulate)
  Pointwise(out, op, operands, params)    -> out = op(operands)     (fxfuse.ops expressions)
Operands of a pointwise step are earlier values (residuals included), numbers, or constant
vectors (a bias [N], or a scalar tensor). Triton cannot slice a register tensor, so a value
of width w is held as ceil(w / T) column tiles of T lanes (`tile_of`); a Linear is unrolled at
generation time into one tile product per (K tile, N tile), and each pointwise op runs tile
by tile. The source is generated per chain and loaded through the kernel cache.

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
reads them (`pack`), once at optimize time; constant vectors are padded with zeros. Padded
lanes of an activation may still become non-zero (sigmoid(0) = 0.5, x / 0 = nan), so partial
tiles are masked to 0 before they feed a product (0 * nan would spread into real lanes), and
the final store masks rows and columns. Rows past the batch are loaded as 0 and never stored;
rows are independent in a matrix product, so they cannot leak.

Precision: fp32 tl.dot uses input_precision="ieee" unless TF32 was allowed when the chain was
built (torch.backends.cuda.matmul.allow_tf32); fp16/bf16 feed tl.dot in their own type and
accumulate in fp32; the row-wise form computes in fp32. Epilogues compute in fp32.

Code size: an fp32 "ieee" tl.dot and the row-wise product are lowered to FMAs fully unrolled,
BLOCK_M * K * N / threads of them per product; the whole chain is straight-line code, so
`why_not_kernel` bounds that count (about 8 layers of 256 at BLOCK_M 16), which bounds compile
time. Of triton.language's jit-defined helpers only tl.sum is used (tl.reduce with a combine
function of our own is ~60x slower under the interpreter): like every generated kernel, this
one runs under the interpreter only if TRITON_INTERPRET=1 was set before triton was imported.
"""
import hashlib
from dataclasses import dataclass

import torch
import torch.fx

from .codegen import HEADER, IndentedBuffer
from .kernel import FusedKernel, kernels_available, launch_context, triton_cdiv
from .ops import BY_NAME, PRELUDE, TRITON_DTYPE, literal

MAX_WIDTH = 1024             # widest value a kernel may hold
MAX_TILE = 64                # lanes per column tile (128 past 512 lanes: at most 8 x 8 products)
MAX_DOTS = 1024              # unrolled tile products per kernel (tensor-core forms)
MAX_FMA_PER_THREAD = 1 << 17  # unrolled FMAs per thread (FMA forms): bounds code size
ROWWISE_MAX_BATCH = 512      # batch up to which one program per row wins (choose_config), fp32 IEEE
ROWWISE_TC_MAX_BATCH = 16    # the same where tl.dot runs on tensor cores (fp16, bf16, fp32 with TF32)
ROWWISE_MAX_TILE = 128       # lanes per column tile of the row-wise form: fewer, larger GEMV tiles
PREFETCH_ELEMENTS = 64       # weight elements per thread of two Linears' tiles held at once (row-wise)
SMS = 132                    # H100 SXM; only used to judge when larger row tiles still fill the GPU
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Linear:
    out: int                 # value id it defines
    src: int                 # value id it reads ([rows, K])
    weight: int              # index into the weights list ([N, K], as nn.Linear stores it)


@dataclass(frozen=True)
class Pointwise:
    out: int
    op: str                  # key of fxfuse.ops.BY_NAME
    operands: tuple          # ("value", id) | ("number", x) | ("vector", index into vectors)
    params: tuple = ()       # sorted (name, value) pairs of the op's constant parameters


@dataclass(frozen=True)
class MLPSpec:
    widths: tuple            # width of every value; value 0 is the chain's input
    steps: tuple             # Linear / Pointwise in execution order; step k defines value k + 1
    output: int              # the value stored
    dtype: torch.dtype       # input, weight and output dtype

    @property
    def linears(self) -> list:
        return [s for s in self.steps if isinstance(s, Linear)]


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = 16        # rows per program
    rowwise: bool = False    # broadcast-multiply-reduce products, BLOCK_M 1 (else tl.dot)
    num_warps: int = 4
    max_tile: int = MAX_TILE
    precision: str = "ieee"  # fp32 tl.dot: "ieee" or "tf32"


def tile_of(width: int, max_tile: int = MAX_TILE) -> tuple:
    """(T, n): a value of this width is held as n column tiles of T lanes.

    T is the next power of two >= 16 (tl.dot's minimum), capped at max_tile (at 128 past
    512 lanes); n * T covers the width with less padding than one power-of-two tile would
    (130 lanes: 3 x 64, not 256).
    """
    p = max(16, 1 << (max(width, 1) - 1).bit_length())
    t = min(p, max_tile if p <= 512 else max(max_tile, 128))
    return t, triton_cdiv(width, t)


def _padded_kn(spec: MLPSpec, max_tile: int) -> list:
    out = []
    for s in spec.linears:
        (tk, nk), (tn, nn) = tile_of(spec.widths[s.src], max_tile), tile_of(spec.widths[s.out], max_tile)
        out.append((tk * nk, tn * nn, nk * nn))
    return out


def choose_config(spec: MLPSpec, batch: int, allow_tf32: bool = False, **override) -> KernelConfig:
    """The kernel configuration for a batch: one place, kept apart from correctness.

    Row-wise up to ROWWISE_MAX_BATCH rows (ROWWISE_TC_MAX_BATCH where tl.dot has tensor cores),
    with tiles of up to ROWWISE_MAX_TILE lanes; else
    tl.dot with 16 rows per program, or 32/64 where the batch still gives every SM two programs
    and a value stays ~32 registers per thread (BLOCK_M * width <= 1024 * num_warps); row-wise
    also where tl.dot's unrolled code would exceed the budget (why_not_kernel). `override`
    sets fields (for the probe).

    Measured (H100, 8 x (Linear(w, w), ReLU) fp32, GPU us of the kernel in a CUDA graph against
    the per-layer plan's graph; mlp_probe sweeps, mlp_probe_20261124.txt): width 64, row-wise
    5.1 us at batch 1-64, 6.2 at 256 and 9.0 at 512 (plan 11-15, 32), tl.dot 11.1 at 256, 11.3
    at 512 and 11.6 at 1024 (row-wise 16.4, plan 41); width 128, row-wise in 128-lane tiles
    10.1-10.7 us at batch 1-64 and 15.3 at 256 (plan 11.2-13.3, 17.2; in 64-lane tiles 19.5 at
    batch 1), tl.dot 429 us at 64 and 256 rows (fp32 FMA code: the cost model's table keeps it
    from being chosen). On tensor cores (bf16, autotune mlp section) tl.dot is as fast at 1024
    rows as row-wise at 64 (width 128: 12.1 vs 11.4 us; 256: 36.5 vs 35.8) and 1.2-1.6x faster
    at 256 rows, so there row-wise serves up to ROWWISE_TC_MAX_BATCH rows only.
    """
    widest = max(spec.widths)
    warps = 4 if widest <= 128 else 8
    precision = "tf32" if allow_tf32 and spec.dtype == torch.float32 else "ieee"
    forced, override = bool(override), dict(override)
    tensor_cores = spec.dtype != torch.float32 or precision == "tf32"
    rowwise = override.pop("rowwise", batch <= (ROWWISE_TC_MAX_BATCH if tensor_cores else ROWWISE_MAX_BATCH))
    block_m = 1 if rowwise else 16
    if not rowwise:
        for bm in (64, 32):
            if batch >= 2 * SMS * bm and bm * widest <= 1024 * warps:
                block_m = bm
                break
    cfg = dict(block_m=block_m, rowwise=rowwise, num_warps=warps, precision=precision,
               max_tile=ROWWISE_MAX_TILE if rowwise else MAX_TILE)
    cfg.update(override)
    config = KernelConfig(**cfg)
    if not forced and why_not_kernel(spec, config) and not why_not_kernel(spec, rows := KernelConfig(
            block_m=1, rowwise=True, num_warps=warps, precision=precision, max_tile=ROWWISE_MAX_TILE)):
        return rows   # 16x fewer unrolled FMAs than tl.dot's 16 rows: fits where tl.dot does not
    return config


def fma_per_thread(spec: MLPSpec, config: KernelConfig) -> int:
    return config.block_m * sum(k * n for k, n, _ in _padded_kn(spec, config.max_tile)) // (32 * config.num_warps)


def why_not_kernel(spec: MLPSpec, config: KernelConfig = KernelConfig()) -> str | None:
    """None if the kernel can be generated for spec and config, else why not (legality)."""
    if spec.dtype not in KERNEL_DTYPES:
        return f"dtype {spec.dtype} has no fused MLP kernel"
    if not spec.linears:
        return "no Linear layer"
    if min(spec.widths) < 1:
        return "a width is 0 (empty weight)"
    if max(spec.widths) > MAX_WIDTH:
        return f"width {max(spec.widths)} > {MAX_WIDTH} does not fit on chip"
    if config.rowwise and config.block_m != 1:
        return "the row-wise form takes 1 row per program"
    if not config.rowwise and config.block_m < 16:
        return "tl.dot takes at least 16 rows per program"
    fma_form = config.rowwise or (spec.dtype == torch.float32 and config.precision == "ieee")
    if fma_form and fma_per_thread(spec, config) > MAX_FMA_PER_THREAD:
        return (f"{fma_per_thread(spec, config)} unrolled FMAs per thread > {MAX_FMA_PER_THREAD} "
                "(code size; fewer or narrower layers fit)")
    dots = sum(d for _, _, d in _padded_kn(spec, config.max_tile))
    if dots > MAX_DOTS:
        return f"{dots} unrolled tile products > {MAX_DOTS}"
    return None


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


def pack(spec: MLPSpec, weights: list, vectors: list, layout: Layout, config: KernelConfig) -> tuple:
    """(packed weights in spec.dtype, packed constants in fp32), padded with zeros.

    Weight tiles are stored in the order the kernel reads them, [N tile][K tile], each one
    contiguous: [T_k, T_n] (W.T: as tl.dot takes it, and for row-wise Linears in
    layout.transposed) or [T_n, T_k] (rows of W: the other row-wise Linears)."""
    device, mt = weights[0].device, config.max_tile
    wbuf = torch.zeros(layout.weight_numel, dtype=spec.dtype, device=device)
    for s in spec.linears:
        (tk, nk), (tn, nn) = tile_of(spec.widths[s.src], mt), tile_of(spec.widths[s.out], mt)
        w = weights[s.weight].detach()
        n, k = w.shape
        wp = torch.zeros(nn * tn, nk * tk, dtype=spec.dtype, device=device)
        wp[:n, :k] = w.to(device=device, dtype=spec.dtype)
        if s.out in layout.transposed:
            tiles = wp.reshape(nn, tn, nk, tk).permute(0, 2, 3, 1).reshape(-1)
        else:
            tiles = wp.reshape(nn, tn, nk, tk).permute(0, 2, 1, 3).reshape(-1)
        at = layout.weight_offset[s.out]
        wbuf[at:at + tiles.numel()] = tiles
    vbuf = torch.zeros(layout.vector_numel, dtype=torch.float32, device=device)
    for k, v in enumerate(vectors):
        flat = v.detach().reshape(-1).to(device=device, dtype=torch.float32)
        at = layout.vector_offset[k]
        vbuf[at:at + flat.numel()] = flat
    return wbuf, vbuf


def kernel_name(spec: MLPSpec, config: KernelConfig) -> str:
    digest = hashlib.sha256(repr((spec, config)).encode()).hexdigest()[:10]
    return f"fxmlp_{len(spec.linears)}x{max(spec.widths)}_{'rows' if config.rowwise else 'dot'}_{digest}"


def generate_mlp(spec: MLPSpec, numels: tuple, config: KernelConfig) -> tuple:
    """(source, kernel name) of one Triton kernel computing the whole chain.

    Arguments of the kernel: x [M, K0] (row stride stride_xm, unit column stride), out
    [M, N] (row stride stride_om), the packed weights and constants, M, and BLOCK_M. The
    row-wise form runs one program per row (grid M); values are 1-D tiles there, [BLOCK_M, T]
    tiles in the tl.dot form.
    """
    name = kernel_name(spec, config)
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


def _emit_pointwise(buf, spec, step, layout, numels, loaded, config):
    t, n = tile_of(spec.widths[step.out], config.max_tile)
    op = BY_NAME[step.op]
    for kind, ref in step.operands:        # constants: loaded once, where first needed
        if kind == "vector" and ref not in loaded:
            loaded.add(ref)
            at = layout.vector_offset[ref]
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


class FusedMLP(FusedKernel):
    """A chain of Linear layers + epilogues as one kernel launch (a FusedKernel to the rest
    of fxfuse: stats, explain and the runtime count its launches and fallbacks).

    forward(x) runs the kernel when kernels can run on x's device and x has the dtype, last
    dimension and device it was built for (any leading shape: the batch is a kernel argument);
    otherwise the reference, a GraphModule of the chain's original nodes.
    """

    def __init__(self, spec: MLPSpec, weights: list, vectors: list, reference: torch.fx.GraphModule,
                 members: tuple, use_kernel: bool = True, config: KernelConfig = KernelConfig()):
        torch.nn.Module.__init__(self)
        problem = why_not_kernel(spec, config)
        if problem:
            raise ValueError(f"no fused MLP kernel: {problem}")
        self.spec, self.config = spec, config
        self.ir = None                     # not a pointwise-IR kernel
        self.reference = reference
        self.members = members
        self.origin = "fused_mlp"
        self.use_kernel = use_kernel
        self.out_width = spec.widths[spec.output]
        numels = tuple(v.numel() for v in vectors)
        self.source, self.kernel_name = generate_mlp(spec, numels, config)
        wbuf, vbuf = pack(spec, weights, vectors, Layout(spec, numels, config.max_tile, config.rowwise), config)
        self.register_buffer("packed_weights", wbuf, persistent=False)
        self.register_buffer("packed_vectors", vbuf, persistent=False)
        self.input_meta = ((None, None, spec.dtype),)
        self._kernel = None
        self.launches = 0
        self.fallbacks = 0

    def _matches(self, inputs) -> bool:
        if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
            return False
        x = inputs[0]
        return (x.dim() >= 1 and x.shape[-1] == self.spec.widths[0] and x.dtype == self.spec.dtype
                and x.device == self.packed_weights.device)

    def forward(self, *inputs):
        x = inputs[0] if inputs else None
        if not (self.use_kernel and self._matches(inputs) and kernels_available(x.device)):
            self.fallbacks += 1
            return self.reference(*inputs)
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[1] > 1 and x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        out = torch.empty((m, self.out_width), dtype=self.spec.dtype, device=x.device)
        if m:
            bm = self.config.block_m
            with launch_context(x.device):
                self.compiled()[(triton_cdiv(m, bm),)](
                    x2, out, self.packed_weights, self.packed_vectors, m, x2.stride(0), out.stride(0),
                    BLOCK_M=bm, num_warps=self.config.num_warps)
            self.launches += 1
        return out.view(lead + (self.out_width,))

    def extra_repr(self) -> str:
        widths = [self.spec.widths[0]] + [self.spec.widths[s.out] for s in self.spec.linears]
        return f"kernel={self.kernel_name}, widths={widths}, {self.config}, members={list(self.members)}"
