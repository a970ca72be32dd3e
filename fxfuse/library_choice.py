"""Measured choice between library spellings of the same GEMM, per shape, on the GPU.

cuBLAS picks its kernel by heuristics, and two spellings of one Linear can differ by 20x:
on an H100 (fp32, 8 layers in a CUDA graph, benchmarks/probe_linear_epilogue.py) `mm` took
418 us where `addmm` with the bias in cuBLASLt's epilogue took 20 us (batch 16, width 128),
while at batch 64, width 1024 `mm` took 104 us and `addmm` 229 us. So rather than guess,
time both once per (batch, in, out, dtype, TF32 setting) and remember the answer for the
process. This is the seed of the cost model's calibration: a measured fact per shape.
"""
import functools

import torch
import triton
import triton.language as tl


def graph_of_calls(fn, target_us: float, max_calls: int) -> tuple:
    """(CUDA graph, calls): `calls` back-to-back calls of fn captured in one graph, as many as
    make ~target_us of GPU work (1 to max_calls). Warm-up runs off the capture stream
    (compiles, cuBLAS handles, workspaces); outputs die at once, so the graph's pool reuses
    their memory. The one way fxfuse and benchmarks/autotune_cells.py time a call on the GPU."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, min(max_calls, int(target_us / max(start.elapsed_time(end) * 1e3, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph, calls


def _time_us(fn, reps: int = 5, max_calls: int = 20, target_us: float = 400.0) -> float:
    """GPU time per call of fn, replayed from a CUDA graph of back-to-back calls: what the
    call costs inside fxfuse's own graph. Timing eager calls instead measures the host's
    launch cost (~30 us per F.linear on the H100 host, above the GEMM itself at small sizes),
    which made this choice a coin toss: at batch 64, width 1024 it once put the bias into the
    GEMM, 2x slower on the GPU (31.0 vs 35.1 us "measured" eager). A graph of ~target_us:
    20 calls of a tiny GEMM, 1 of a large one (which takes ms, where optimize() must stay
    fast and the launch cost no longer matters)."""
    graph, calls = graph_of_calls(fn, target_us, max_calls)
    reps = reps if calls > 1 else 3
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def _operands(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple:
    gen = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(*shape, device=device, dtype=dtype, generator=gen) for shape in ((batch, k), (n, k), (n,)))


@functools.lru_cache(maxsize=512)
def _gemm_times(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device, allow_tf32: bool) -> tuple:
    """(us of F.linear(x, W), us of F.linear(x, W, b)) on this GPU. allow_tf32 is part of the
    key: it changes cuBLAS's kernels (the caller's current setting is what runs)."""
    x, w, b = _operands(batch, k, n, dtype, device)
    with torch.no_grad(), torch.cuda.device(device):   # the capture stream and launches on the model's GPU
        return _time_us(lambda: torch.nn.functional.linear(x, w)), _time_us(lambda: torch.nn.functional.linear(x, w, b))


def bias_in_library_gemm(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                         allow_tf32: bool) -> tuple:
    """(True, reason) if F.linear(x, W, b) beats F.linear(x, W) for this shape on this GPU.

    The bias add itself is free in the other spelling (it joins the fused epilogue kernel),
    so the comparison is GEMM against GEMM-with-epilogue.
    """
    if device.type != "cuda":
        return False, "bias fused into the pointwise kernel (no GPU to measure on)"
    plain, with_bias = _gemm_times(batch, k, n, dtype, device, allow_tf32)
    # the faster spelling, ties (within 1%: timing noise) to the fused kernel. A 5% margin
    # once kept `mm` at 1024 x 4096 -> 4096 where addmm measured 678 vs 697 us per layer:
    # 8 layers 1-2% slower than eager, which uses addmm (mlp_20261123-044640).
    if with_bias < 0.99 * plain:
        return True, f"bias in the library GEMM: measured {with_bias:.1f} us vs {plain:.1f} us without"
    return False, f"bias fused into the pointwise kernel: GEMM measured {plain:.1f} us vs {with_bias:.1f} us with bias"


RELU_EPILOGUE_MARGIN = 0.10   # a clear win only: one layer timed alone (its weights hot in L2) misleads.
# 256 x 1024 measured 29.2 us with the epilogue vs 30.2 without, and 8 such layers in one graph then
# took 270 us against 195 with the separate ReLU kernel (mlp_20261125-113435); at 8192 x 4096 a 1%
# "gain" came out 0.75% slower. Chosen where it counts: 1 x 1024 (3.7 vs 6.6 us), 16 x 1024 (8.3 vs 9.9)


@functools.lru_cache(maxsize=512)
def relu_in_library_gemm(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                         allow_tf32: bool) -> tuple:
    """(True, reason) if one cuBLASLt call with bias and ReLU in its epilogue
    (torch._addmm_activation) beats the faster GEMM spelling followed by a ReLU kernel, for a
    Linear + bias + ReLU whose ReLU fuses with nothing else (the seed network's layers).

    What it saves is a kernel over the output: at 4096 x 4096 per layer a pass over 64 MB
    (~45 us of ~2.7 ms), at small sizes a launch; what it may cost is cuBLASLt's choice of GEMM
    kernel, which differs from cuBLAS's (the issue's numbers: 232 us at batch 64 / hidden
    1024 for 8 layers against 138 us for compile's). Measured, as bias_in_library_gemm is."""
    if device.type != "cuda":
        return False, "ReLU in the pointwise kernel (no GPU to measure on)"
    plain, with_bias = _gemm_times(batch, k, n, dtype, device, allow_tf32)
    x, w, b = _operands(batch, k, n, dtype, device)
    wt = w.t()
    with torch.no_grad(), torch.cuda.device(device):
        # GEMM + one kernel over its output, as fxfuse runs it (there the bias joins the ReLU's kernel)
        bias = (b,) if with_bias < 0.99 * plain else ()
        separate_fn = lambda: torch.relu(torch.nn.functional.linear(x, w, *bias))  # noqa: E731
        fused_fn = lambda: torch._addmm_activation(b, x, wt)  # noqa: E731
        # in turns, twice (the GPU's clocks still rise after the idle build: the one timed second won)
        separate, fused = _time_us(separate_fn), _time_us(fused_fn)
        fused, separate = min(fused, _time_us(fused_fn)), min(separate, _time_us(separate_fn))
    if fused < (1 - RELU_EPILOGUE_MARGIN) * separate:
        return True, (f"bias and ReLU in the library GEMM's epilogue (cuBLASLt): measured {fused:.1f} us vs "
                      f"{separate:.1f} us for GEMM + ReLU kernel")
    return False, (f"ReLU in the pointwise kernel: GEMM + ReLU measured {separate:.1f} us vs {fused:.1f} us "
                   "with it in cuBLASLt's epilogue")


SPLIT_K_SLICES = (2, 4, 8)     # slice counts timed; 16 lost everywhere in splitk_probe_20261125.txt
SPLIT_K_MARGIN = 0.05          # single layers mislead: 1024 x 512 "won" by 3.3% alone and lost 6% in the 8-layer chain


def split_k_mm(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """The S partial products of x @ weight.T over S slices of K, as ONE batched library GEMM:
    [S, M, N], summed by the caller. Both operands are views where x's rows are contiguous
    (x [M, K] as [S, M, K/S]; W.T [K, N] as [S, K/S, N]), so nothing is copied."""
    if x.stride(1) != 1:
        x = x.contiguous()
    return torch.bmm(*_split_operands(x, weight, splits))


def _split_operands(x: torch.Tensor, weight: torch.Tensor, splits: int) -> tuple:
    """x [M, K] as [S, M, K/S] and weight.T [K, N] as [S, K/S, N]: views where x's rows are contiguous."""
    m, k = x.shape
    return x.view(m, splits, k // splits).transpose(0, 1), weight.t().reshape(splits, k // splits, weight.shape[0])


def split_k_slices(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """The slice counts worth timing for this GEMM (empty: none). Only fp32: the partials are
    stored in the output dtype, and fp16/bf16 partials would round S times where the library
    rounds once. Only where the output has fewer 128 x 128 tiles than the GPU has SMs: there the
    library's GEMM leaves SMs idle, and S slices give S times the tiles (H100, fp32, 8 layers,
    splitk_probe_20261125.txt: batch 1024 / width 1024 504 -> 439 us in 4 slices, batch 256 /
    width 1024 190 -> 164; where the tiles already fill the GPU, 4096 x 1024, it lost 20%)."""
    if dtype != torch.float32 or device.type != "cuda":
        return ()
    tiles = -(-batch // 128) * -(-n // 128)
    if tiles >= torch.cuda.get_device_properties(device).multi_processor_count:
        return ()
    return tuple(s for s in SPLIT_K_SLICES if k % s == 0 and k // s >= 64 and (k // s) % 4 == 0)


@triton.jit
def _sum_bias_relu(parts_ptr, bias_ptr, out_ptr, MN, N, S: tl.constexpr, BLOCK: tl.constexpr):
    """The epilogue fxfuse generates for a split Linear + bias + ReLU, for timing the choice:
    out = relu(sum of the S partials + bias); S = 1 is the unsplit GEMM's epilogue."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(bias_ptr + offs % N, mask=mask, other=0.0)
    for s in tl.static_range(S):
        acc += tl.load(parts_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, tl.maximum(acc, 0.0), mask=mask)


def _gemm_and_epilogue(x, w, b, splits: int):
    """A callable running the GEMM (in `splits` slices of K) and the fused epilogue's kernel into
    buffers allocated once, as the layer runs inside fxfuse's graph."""
    m, n = x.shape[0], w.shape[0]
    parts = torch.empty(splits, m, n, device=x.device, dtype=x.dtype)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    a, bt = _split_operands(x, w, splits)
    grid = (triton.cdiv(m * n, 1024),)

    def run():
        if splits == 1:
            torch.mm(x, w.t(), out=parts[0])
        else:
            torch.bmm(a, bt, out=parts)
        _sum_bias_relu[grid](parts, b, out, m * n, n, S=splits, BLOCK=1024)
        return out
    return run


@functools.lru_cache(maxsize=512)
def split_k_library_gemm(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                         allow_tf32: bool) -> tuple:
    """(S, reason): S > 1 where a Linear + bias runs faster as split_k_mm in S slices with the S
    partials summed in its epilogue kernel than as the faster library spelling followed by that
    kernel; 1 (and why) otherwise, '' where no split is worth timing. Each side is timed as it
    runs: the GEMM and the epilogue kernel (bias, ReLU; the sum of the partials when split), or
    addmm and a ReLU where the bias in the library GEMM measured faster. Timed with torch's
    sum(0) in place of that kernel, the split lost 2-4 us per layer to the chain's own numbers
    (1024 x 1024: 64.2 us alone, 60.1 per layer in splitk_probe's 8-layer chain)."""
    slices = split_k_slices(batch, k, n, dtype, device)
    if not slices:
        return 1, ""
    plain, with_bias = _gemm_times(batch, k, n, dtype, device, allow_tf32)
    x, w, b = _operands(batch, k, n, dtype, device)
    with torch.no_grad(), torch.cuda.device(device):
        if with_bias < 0.99 * plain:
            one_fn = lambda: torch.relu(torch.nn.functional.linear(x, w, b))  # noqa: E731
        else:
            one_fn = _gemm_and_epilogue(x, w, b, 1)
        one = _time_us(one_fn)
        split = {s: _time_us(_gemm_and_epilogue(x, w, b, s)) for s in slices}
        one = min(one, _time_us(one_fn))   # timed again last: the GPU's clocks may still be rising
    best = min(split, key=split.get)
    if split[best] < (1 - SPLIT_K_MARGIN) * one:
        return best, (f"split-K: K = {k} in {best} slices through one batched library GEMM, the partials "
                      f"summed in the epilogue kernel: measured {split[best]:.1f} us vs {one:.1f} us unsplit")
    return 1, f"one library GEMM: measured {one:.1f} us vs {split[best]:.1f} us split-K in {best} slices"
