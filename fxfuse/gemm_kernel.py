"""Epilogue-fused GEMM: y = epilogue(x @ W.T) in ONE Triton kernel, split-K for small batch.

Why (DESIGN.md, "Middle"): a Linear with its bias and activation costs a library GEMM plus a
pointwise kernel, and at small batch cuBLAS fp32 is far from peak (30 us for a 64x1024x1024
layer on an H100). Fusing the epilogue saves a launch and a round trip of y through memory;
splitting K over several programs puts more SMs to work when [M, N] has few output tiles.

Kernel: a classical tiled GEMM (pid -> an output tile [BLOCK_M, BLOCK_N] and a K slice ->
loop over BLOCK_K steps, fp32 accumulate, pipelined loads), then the epilogue on the tile:
pointwise steps of fxfuse.ops over the product, numbers and constant vectors (bias [N]),
described exactly like a fused MLP's epilogue (mlp_spec.Pointwise; value 0 is x @ W.T).
W is read in place ([N, K], as nn.Linear stores it): no copy of the weights (except its two
TF32 parts where a tf32x3 config has split_weights).

Split-K without a second kernel ("serial split-K", CUTLASS's semaphore): each of SPLIT_K
programs of a tile stores its fp32 partial to a workspace, then increments the tile's counter
(barrier, then an acq_rel atomic: the CUTLASS release pattern); the program that sees the
last count sums the partials in a fixed order (so results do not depend on arrival order),
resets the counter for the next launch, applies the epilogue and stores y. The workspace and
counters belong to the module, so one module must not run on two streams at once (a CUDA
graph replays on one stream).

Row-wise form (`GemmConfig.rowwise`, small batch): tl.dot needs 16 rows, so at batch 1 it
computes 15 rows of padding, and fp32 "ieee" dot is FMA code anyway. The row-wise form keeps
BLOCK_M = the batch rounded up to a power of two (<= 16), multiplies [BLOCK_M, 1, BLOCK_K]
by [1, BLOCK_N, BLOCK_K] W tiles into an fp32 accumulator and reduces over K once at the end:
a GEMV that reads W once over many programs (few output columns each), which is what a
small-batch layer is bound by. For fp32 IEEE it also serves batches up to 256 (16 to 64 rows
per program): there tl.dot is FMA code too, and measured slower (gemm_config._rowwise_config).

Precision as in mlp_kernel: fp32 uses input_precision="ieee" unless TF32 was allowed, or
"tf32x3" where the plan chose it (option tf32x3, fxfuse/tf32x3.py: the tl.dot form on tensor
cores, tiles by tf32x3.gemm_tiles; from 256 rows with W's parts split once, `split_weights`);
fp16/bf16 multiply in their type and accumulate in fp32; the epilogue computes in fp32.
Only builtins of triton.language are used (tl.full, not tl.zeros), see mlp_kernel.
"""
import hashlib
import math

import torch
import torch.fx

from .codegen import HEADER, IndentedBuffer
from .kernel import (BF16_INTERPRETED, GRID_YZ_MAX, INT32_INDEX_MAX, PRODUCT_FP_FUSION, FusedKernel, interpreting,
                     kernels_available, launch_context, pdl_available, resolved, triton_cdiv)
from .mlp_spec import SMS, Pointwise  # noqa: F401  (epilogue steps; re-exported for callers)
from .ops import BY_NAME, PRELUDE, TRITON_DTYPE, literal
from .gemm_config import (GEMM_DTYPES, MAX_SPLIT_K, ROWWISE_FP32_MAX_BATCH, ROWWISE_MAX_BATCH,  # noqa: F401
                          GemmConfig, GemmSpec, _rowwise_stages, _split_k, choose_gemm_config)  # (re-exported)
from .tf32x3 import stored_parts

def why_not_gemm(spec: GemmSpec, config: GemmConfig = GemmConfig(), rows: int = 0) -> str | None:
    """None if the kernel can be generated and launched for spec and config over `rows` rows of x."""
    if spec.dtype not in GEMM_DTYPES:
        return f"dtype {spec.dtype} has no fused GEMM kernel"
    if spec.dtype == torch.bfloat16 and interpreting():
        return BF16_INTERPRETED
    if spec.k < 1 or spec.n < 1:
        return f"empty weight [{spec.n}, {spec.k}]"
    blocks = (config.block_m, config.block_n, config.block_k)
    if any(b < 1 or b & (b - 1) for b in blocks):
        return f"block sizes {blocks} are not powers of two"
    if not config.rowwise and min(blocks) < 16:
        return "tl.dot takes blocks of at least 16"
    if config.split_k < 1 or config.split_k & (config.split_k - 1):
        return "split_k must be a power of two"
    if config.block_n >= 1 and triton_cdiv(spec.n, config.block_n) > GRID_YZ_MAX:   # an LM head of 262144 words
        return (f"{triton_cdiv(spec.n, config.block_n)} column blocks of {config.block_n} are more than CUDA's grid "
                f"takes ({GRID_YZ_MAX}; review42a)")
    if rows + config.block_m > INT32_INDEX_MAX:
        return f"{rows} rows: the kernel's row indices are int32"
    for j, s in enumerate(spec.epilogue):
        if s.op not in BY_NAME or any(kind == "value" and not 0 <= ref <= j for kind, ref in s.operands):
            return f"epilogue step {j} ({s.op}) reads a value it cannot see"
        if spec.k != spec.n and any(kind == "input" for kind, _ in s.operands):
            return f"epilogue step {j} ({s.op}) reads the input, which is {spec.k} wide, not {spec.n}"
    refs = skip_refs(spec)
    if refs != list(range(len(refs))):
        return f"the epilogue's skip tensors are numbered {refs}, not 0..{len(refs) - 1}"
    if not 0 <= spec.output <= len(spec.epilogue):
        return "output is not a value of the epilogue"
    return None


MAX_SKIPS = 2   # other tensors one epilogue reads at the output tile (a residual's skip, a gate); read at
#               call time by passes.fuse_gemm and passes.plan_linears (benchmarks.blocks sets it to 0)


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether a tensor of `shape` broadcasts to `target` (torch's rule; torch.broadcast_shapes
    would import sympy, which optimize() avoids)."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def skip_fits(meta, product_meta) -> bool:
    """Whether the epilogue can read a tensor of this meta at the product's output tile: its dtype,
    a shape that broadcasts to its shape (fuse_gemm takes it, plan_linears prices it so)."""
    return (hasattr(meta, "shape") and meta.dtype == getattr(product_meta, "dtype", None)
            and broadcasts_to(tuple(meta.shape), tuple(product_meta.shape)))


def skip_view(s: torch.Tensor, lead: tuple, n: int) -> tuple:
    """(a [B, rows, n] view of skip s broadcast to lead + (n,), rows): the kernel reads row r of the
    product at (r // rows, r % rows). Two levels of rows take a [B, 1, n] gate or a [T, n] table
    against [B, T, n] without a copy (stride 0 where they broadcast); a copy only where even
    those do not fit (a broadcast in the middle of 4-D rows)."""
    e = s.expand(lead + (n,))
    m = math.prod(lead)   # > 0: the kernel runs only for rows
    for rows in dict.fromkeys((1, lead[-1] if lead else 1)):
        try:
            return e.view(m // rows, rows, n), rows
        except RuntimeError:   # the rows do not merge into that view
            continue
    return e.reshape(m, 1, n), 1


def skip_refs(spec: GemmSpec) -> list:
    """The j of the epilogue's operands ("skip", j): other tensors it reads at the output tile."""
    return sorted({ref for s in spec.epilogue for kind, ref in s.operands if kind == "skip"})


def skip_count(spec: GemmSpec) -> int:
    return len(skip_refs(spec))


def gemm_kernel_name(spec: GemmSpec, config: GemmConfig) -> str:
    ops = "_".join(dict.fromkeys(s.op for s in spec.epilogue)) or "plain"
    digest = hashlib.sha256(repr((spec, config)).encode()).hexdigest()[:10]
    return f"fxgemm_{ops}_{digest}"


def generate_gemm(spec: GemmSpec, numels: tuple, config: GemmConfig) -> tuple:
    """(source, kernel name). Kernel arguments: x [M, K] (row stride stride_xm, unit column
    stride), W [N, K] contiguous, out [M, N] (row stride stride_om), the epilogue constants
    (fp32, each padded to a multiple of 16), the split-K workspace and counters, the skip
    tensors [M, N] (skip_count of them, any strides), M, the strides."""
    name = gemm_kernel_name(spec, config)
    c = config
    k_split = triton_cdiv(triton_cdiv(spec.k, c.block_k), c.split_k) * c.block_k   # K elements per split
    dot_kw = f", input_precision=\"{c.precision}\"" if spec.dtype == torch.float32 else ""
    skips = range(skip_count(spec))
    buf = IndentedBuffer()
    buf.line("@triton.jit")
    buf.line(f"def {name}(x_ptr, w_ptr, wl_ptr, out_ptr, v_ptr, ws_ptr, cnt_ptr, "
             + "".join(f"s{j}_ptr, " for j in skips) + "M, stride_xm, stride_om, "
             + "".join(f"rows_s{j}, stride_s{j}b, stride_s{j}t, stride_s{j}n, " for j in skips)
             + "BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):")
    with buf.indent():
        buf.line(f"# y[M, {spec.n}] = epilogue(x[M, {spec.k}] @ W[{spec.n}, {spec.k}].T); split-K {c.split_k} "
                 f"({k_split} K elements per program); {c}")
        buf.line("pid_m = tl.program_id(0)")
        buf.line("pid_n = tl.program_id(1)")
        buf.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        buf.line("offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        buf.line("offs_k = tl.arange(0, BLOCK_K)")
        buf.line("m_ok = offs_m < M")
        buf.line(f"n_ok = offs_n < {spec.n}")
        k0 = "0"
        if c.split_k > 1:
            buf.line("pid_k = tl.program_id(2)")
            k0 = f"pid_k * {k_split}"
        if c.rowwise:
            _emit_rowwise_product(buf, spec, c, k0, k_split)
        else:
            buf.line("x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm")
            buf.line(f"w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * {spec.k}")
            load_w = "{b} = tl.load(w_cols + {k}[:, None], mask={ok}[:, None] & n_ok[None, :], other=0.0)"
            init, dot = "acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)", f"acc = tl.dot({{a}}, {{b}}, acc=acc{dot_kw})"
            if c.split_weights:
                buf.line(f"wl_cols = wl_ptr + offs_n.to(tl.int64)[None, :] * {spec.k}")
                load_w += "; " + load_w.replace("{b} =", "{b}_lo =").replace("w_cols", "wl_cols")
                dot = "acc = split_dot_step({a}, {b}, {b}_lo, acc)"   # fxfuse.tf32x3, imported below
            load_x = "{a} = tl.load(x_rows + {k}[None, :], mask=m_ok[:, None] & {ok}[None, :], other=0.0)"
            _emit_k_steps(buf, spec, c, k0, k_split, load_x, load_w, init, dot, "{}")
            if c.split_weights:   # a NaN in the sum: again with the low products' NaN masked
                _emit_masked_redo(buf, spec, k0, k_split, load_x, load_w)
        if c.split_k > 1:
            _emit_split_k_fixup(buf, c)
            with buf.indent():
                _emit_epilogue_and_store(buf, spec, numels)
        else:
            _emit_epilogue_and_store(buf, spec, numels)
    imports = "from fxfuse.tf32x3 import nan_in, split_dot_step\n" if c.split_weights else ""
    return HEADER + imports + PRELUDE + "\n\n" + buf.getvalue(), name


def _emit_rowwise_product(buf, spec: GemmSpec, c: GemmConfig, k0: str, k_split: int):
    """acc [BLOCK_M, BLOCK_N] = x @ W.T over this program's K range, without tl.dot: products
    of [BLOCK_M, 1, BLOCK_K] rows and [1, BLOCK_N, BLOCK_K] weight rows summed in fp32."""
    buf.line("x_rows = (x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm)[:, :, None]        # [BM, 1, 1]")
    buf.line(f"w_rows = (w_ptr + offs_n.to(tl.int64)[:, None] * {spec.k})[None, :, :]      # [1, BN, 1]")
    keep = ", eviction_policy=\"evict_last\"" if c.keep_x else ""   # gemm_config._rowwise_config says why
    _emit_k_steps(buf, spec, c, k0, k_split, "{a} = tl.load(x_rows + {k}, mask=m_ok[:, None, None] & {ok}, other=0.0"
                  + keep + ")",
                  "{b} = tl.load(w_rows + {k}, mask=n_ok[None, :, None] & {ok}, other=0.0)",
                  "acc3 = tl.full([BLOCK_M, BLOCK_N, BLOCK_K], 0.0, tl.float32)",
                  "acc3 += {a}.to(tl.float32) * {b}.to(tl.float32)", "({})[None, None, :]")
    buf.line("acc = tl.sum(acc3, axis=2)")


PREFETCH_ELEMENTS = 4096   # W elements a row-wise program loads before gdc_wait (32 registers at 4 warps)


def prefetch_steps(c: GemmConfig, k_split: int) -> int:
    """K steps whose W tiles are loaded before gdc_wait: the whole slice where it fits the
    budget (row-wise form, small batch: the layer's time is its weight read, which then
    overlaps the previous layer), else the first step (tl.dot form: registers go to the tile).
    At batch 1 at most 2 steps. H100, 8 layers, GPU time of the graph (launch_probe):
    16x1024 49.0 -> 29.0 us with the whole slice (8 steps), 16x512 24.0 -> 17.2, 1x512
    14.5 -> 12.8, 1x2048 66.8 -> 64.9, but 1x1024 20.4 -> 23.7 with 4 steps (2 steps: 20.2)."""
    if not c.rowwise:
        return 1
    steps = min(k_split // c.block_k, PREFETCH_ELEMENTS // (c.block_n * c.block_k))
    return max(1, min(steps, 2) if c.block_m == 1 else steps)


def _emit_k_steps(buf, spec: GemmSpec, c: GemmConfig, k0: str, k_split: int, load_x: str, load_w: str,
                  init: str, accumulate: str, k_shape: str):
    """The K loop with its first prefetch_steps() steps unrolled in front: their W tiles are
    loaded before gdc_wait (weights are module constants that no kernel of the graph writes);
    everything that reads the previous kernel's output or writes memory comes after it
    (USE_GDC: see kernel.pdl_available). `load_x`, `load_w` and `accumulate` are templates
    over {a}, {b}, {k}, {ok}. Summation order is that of the plain loop."""
    steps = prefetch_steps(c, k_split)
    buf.line(init)
    for j in range(steps):   # names of their own: the epilogue's vectors are k0, k1, ...
        buf.line(f"k_pre{j} = " + k_shape.format(f"{k0} + {j * c.block_k} + offs_k"))
        buf.line(f"ok_pre{j} = k_pre{j} < {spec.k}")
        buf.line(load_w.format(b=f"w_pre{j}", k=f"k_pre{j}", ok=f"ok_pre{j}") + "   # constant weights: before the wait")
    buf.line("if USE_GDC:")
    with buf.indent():
        buf.line("tl.extra.cuda.gdc_wait()               # the previous kernel's writes are visible")
        buf.line("tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start loading its weights")
    for j in range(steps):
        buf.line(load_x.format(a=f"x_pre{j}", k=f"k_pre{j}", ok=f"ok_pre{j}"))
        buf.line(accumulate.format(a=f"x_pre{j}", b=f"w_pre{j}"))
    stages = f", num_stages={c.num_stages}" if c.rowwise and c.pipelined else ""
    loop = "tl.range" if stages else "range"
    buf.line(f"for kk in {loop}({steps * c.block_k}, {k_split}, BLOCK_K{stages}):")
    with buf.indent():
        buf.line("k = " + k_shape.format(f"{k0} + kk + offs_k"))
        buf.line(f"k_ok = k < {spec.k}")
        buf.line(load_x.format(a="a", k="k", ok="k_ok"))
        buf.line(load_w.format(b="b", k="k", ok="k_ok"))
        buf.line(accumulate.format(a="a", b="b"))


def _emit_masked_redo(buf, spec: GemmSpec, k0: str, k_split: int, load_x: str, load_w: str):
    """The split-weights K loop once more with MASK_NAN, for a tile whose sum came out NaN
    (fxfuse.tf32x3.split_dot_step says why the plain steps come first)."""
    buf.line("if nan_in(acc):")
    with buf.indent():
        buf.line("acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)")
        buf.line(f"for kk in range(0, {k_split}, BLOCK_K):")
        with buf.indent():
            buf.line(f"k = {k0} + kk + offs_k")
            buf.line(f"k_ok = k < {spec.k}")
            buf.line(load_x.format(a="a", k="k", ok="k_ok"))
            buf.line(load_w.format(b="b", k="k", ok="k_ok"))
            buf.line("acc = split_dot_step(a, b, b_lo, acc, MASK_NAN=True)")


def _emit_split_k_fixup(buf, c: GemmConfig):
    """Partial to the workspace; the last of the tile's SPLIT_K programs sums them. Ends with
    an open `if`: the caller emits the epilogue one level deeper, inside it."""
    buf.line("# serial split-K: workspace [SPLIT_K, grid_m * BLOCK_M, grid_n * BLOCK_N] fp32")
    buf.line("ws_cols = tl.num_programs(1) * BLOCK_N")
    buf.line("ws_tile = ws_ptr + (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * ws_cols "
             "+ offs_n[None, :]")
    buf.line("ws_split = (tl.num_programs(0) * BLOCK_M).to(tl.int64) * ws_cols")
    buf.line("tl.store(ws_tile + pid_k * ws_split, acc)")
    buf.line("tl.debug_barrier()  # every thread's partial is written before the release below")
    buf.line("tile = pid_m * tl.num_programs(1) + pid_n")
    buf.line('count = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")')
    buf.line(f"if count == {c.split_k - 1}:")
    with buf.indent():
        buf.line("acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)")
        for s in range(c.split_k):   # fixed order: the sum does not depend on who came last
            buf.line(f'acc += tl.load(ws_tile + {s} * ws_split, cache_modifier=".cg")')
        buf.line('tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch')


def _emit_epilogue_and_store(buf, spec: GemmSpec, numels: tuple):
    buf.line("v0 = acc")
    offsets, at = {}, 0
    for k, n in enumerate(numels):
        offsets[k], at = at, at + -(-n // 16) * 16
    loaded = set()
    for j, step in enumerate(spec.epilogue):
        args = []
        for kind, ref in step.operands:
            if kind == "vector":
                if ref not in loaded:
                    loaded.add(ref)
                    if numels[ref] == 1:
                        buf.line(f"k{ref} = tl.load(v_ptr + {offsets[ref]})")
                    else:
                        buf.line(f"k{ref} = tl.load(v_ptr + {offsets[ref]} + offs_n, mask=n_ok, other=0.0)[None, :]")
                args.append(f"k{ref}")
            elif kind == "value":
                args.append(f"v{ref}")
            elif kind == "input":   # x at the output tile (k == n): a residual's skip
                if "input" not in loaded:
                    loaded.add("input")
                    buf.line("xin = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :], "
                             "mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)")
                args.append("xin")
            elif kind == "skip":    # another [M, N] tensor at the output tile: a residual's skip
                if ("skip", ref) not in loaded:
                    loaded.add(("skip", ref))
                    # row r of the [M, N] product is (r // rows, r % rows) of the skip's [B, rows, N] view
                    buf.line(f"row_s{ref} = offs_m.to(tl.int64)")
                    buf.line(f"sk{ref} = tl.load(s{ref}_ptr + ((row_s{ref} // rows_s{ref}) * stride_s{ref}b "
                             f"+ (row_s{ref} % rows_s{ref}) * stride_s{ref}t)[:, None] "
                             f"+ offs_n.to(tl.int64)[None, :] * stride_s{ref}n, mask=m_ok[:, None] & n_ok[None, :], "
                             "other=0.0).to(tl.float32)")
                args.append(f"sk{ref}")
            else:
                args.append(literal(ref))
        buf.line(f"v{j + 1} = {BY_NAME[step.op].expr(*args, **dict(step.params))}")
    buf.line(f"tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], "
             f"v{spec.output}.to({TRITON_DTYPE[spec.dtype]}), mask=m_ok[:, None] & n_ok[None, :])")


def pack_vectors(vectors: list, device) -> torch.Tensor:
    sizes = [-(-v.numel() // 16) * 16 for v in vectors]
    buf = torch.zeros(max(sum(sizes), 1), dtype=torch.float32, device=device)
    at = 0
    for v, size in zip(vectors, sizes):
        buf[at:at + v.numel()] = v.detach().reshape(-1).to(device=device, dtype=torch.float32)
        at += size
    return buf


def epilogue_vectors(vectors: list, n: int, device) -> torch.Tensor:
    """The kernel's vector operand: a lone fp32 bias (or scalar) as the live tensor itself, so
    an in-place edit of it after optimize() reaches the kernel with no copy to watch
    (runtime: api.tensors_read); several vectors, or another dtype, packed (pack_vectors). The
    kernel masks vector loads to the N columns, so the live [N] vector needs no padding."""
    if len(vectors) == 1:
        v = vectors[0].detach()
        if v.dtype == torch.float32 and v.device == device and v.is_contiguous() and v.numel() in (1, n):
            return v.reshape(-1)
    return pack_vectors(vectors, device)


class EpilogueGemm(FusedKernel):
    """y = epilogue(x @ W.T) as one launch; a FusedKernel to the rest of fxfuse.

    forward(x, *skips) runs the kernel for x [..., K] of the built dtype on the weight's device
    (any batch: the config chosen for the example batch is kept) and skip tensors of that dtype
    that broadcast to the output [..., N] (skip_view), else the reference GraphModule.
    """

    def __init__(self, spec: GemmSpec, weight: torch.Tensor, vectors: list, reference: torch.fx.GraphModule,
                 members: tuple, use_kernel: bool = True, config: GemmConfig = GemmConfig()):
        torch.nn.Module.__init__(self)
        problem = why_not_gemm(spec, config)
        if problem:
            raise ValueError(f"no fused GEMM kernel: {problem}")
        if tuple(weight.shape) != (spec.n, spec.k) or weight.dtype != spec.dtype:
            raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not match {spec}")
        self.spec, self.config = spec, config
        self.ir = None
        self.reference = reference
        self.members = members
        self.origin = "gemm_epilogue"
        self.use_kernel = use_kernel
        self.weight = weight.detach() if weight.is_contiguous() else weight.detach().contiguous()
        self.weight_lo = self.weight   # the kernel's wl_ptr; read only with split_weights
        if config.split_weights:       # TF32 high and low parts, made once (derived copies: the runtime watches W)
            self.weight, self.weight_lo = stored_parts(self.weight)
        numels = tuple(v.numel() for v in vectors)
        self.source, self.kernel_name = generate_gemm(spec, numels, config)
        self.register_buffer("packed_vectors", epilogue_vectors(vectors, spec.n, weight.device), persistent=False)
        self.register_buffer("counters", torch.zeros(1, dtype=torch.int32, device=weight.device), persistent=False)
        self._workspace = None
        self.skips = skip_count(spec)
        self.input_meta = ((None, None, spec.dtype),) * (1 + self.skips)   # x, then the skips
        self._kernel = None
        self.launches = 0
        self.fallbacks = 0
        # programmatic dependent launch: set by the runtime for a specialization it captures in
        # a CUDA graph (and before the warm-up that compiles the kernel). Only there are the
        # weights, read before gdc_wait, never written by the kernel just before: the graph
        # writes no parameter (a model that mutates in place is not captured), and a user's
        # update between calls precedes the whole graph launch.
        self.use_pdl = False

    def _matches(self, inputs) -> bool:
        if len(inputs) != 1 + self.skips or not all(isinstance(t, torch.Tensor) for t in inputs):
            return False
        x, *skips = inputs
        out_shape = tuple(x.shape[:-1]) + (self.spec.n,)
        return x.dim() >= 1 and x.shape[-1] == self.spec.k and x.dtype == self.spec.dtype \
            and x.device == self.weight.device and all(broadcasts_to(tuple(s.shape), out_shape)
                                                       and s.dtype == self.spec.dtype and s.device == x.device
                                                       for s in skips)

    def _scratch(self, grid) -> tuple:
        """Workspace and zeroed counters big enough for this grid (grown, never shrunk)."""
        c = self.config
        tiles = grid[0] * grid[1]
        if self.counters.numel() < tiles:
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.weight.device)
        need = c.split_k * grid[0] * c.block_m * grid[1] * c.block_n
        if self._workspace is None or self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.float32, device=self.weight.device)
        return self._workspace, self.counters

    def forward(self, *inputs):
        inputs = resolved(inputs)
        x = inputs[0] if inputs else None
        if not (self.use_kernel and self._matches(inputs) and kernels_available(x.device)):
            self.fallbacks += 1
            return self.reference.forward(*inputs)   # (torch.fx's __call__ prints a traceback on errors)
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, self.spec.k)
        if self.spec.k > 1 and x2.stride(1) != 1:
            x2 = x2.contiguous()
        m, c = x2.shape[0], self.config
        result = torch.empty(lead + (self.spec.n,), dtype=self.spec.dtype, device=x.device)
        out = result.view(m, self.spec.n)   # written through; `result` is no view (fuzz49h: a view made under
        if m:                               # no_grad refused an in-place op with grad where eager's does not)
            skips = [skip_view(s, lead, self.spec.n) for s in inputs[1:]]
            grid = (triton_cdiv(m, c.block_m), triton_cdiv(self.spec.n, c.block_n), c.split_k)
            ws, cnt = self._scratch(grid) if c.split_k > 1 else (out, self.counters)
            pdl = {"launch_pdl": True} if self.use_pdl and pdl_available(x.device) else {}
            with launch_context(x.device):
                self.compiled()[grid](x2, self.weight, self.weight_lo, out, self.packed_vectors, ws, cnt,
                                      *(v for v, _ in skips), m, x2.stride(0), out.stride(0),
                                      *(a for v, rows in skips for a in (rows, *v.stride())),
                                      BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                                      USE_GDC=bool(pdl), num_warps=c.num_warps, num_stages=c.num_stages, **pdl,
                                      **PRODUCT_FP_FUSION)
            self.launches += 1
        return result

    def extra_repr(self) -> str:
        return f"kernel={self.kernel_name}, K={self.spec.k}, N={self.spec.n}, {self.config}"
