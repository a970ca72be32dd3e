"""Measured choice between library spellings of the same GEMM, per shape, on the GPU.

cuBLAS picks its kernel by heuristics, and two spellings of one Linear can differ by 20x:
on an H100 (fp32, 8 layers in a CUDA graph, benchmarks/probe_linear_epilogue.py) `mm` took
418 us where `addmm` with the bias in cuBLASLt's epilogue took 20 us (batch 16, width 128),
while at batch 64, width 1024 `mm` took 104 us and `addmm` 229 us. So rather than guess,
time both once per (batch, in, out, dtype, TF32 setting) and remember the answer for the
process. This is the seed of the cost model's calibration: a measured fact per shape.
"""
import functools
import time

import torch
import triton
import triton.language as tl

from .graph_launch import clear_cublas_workspaces
from .kernel import PRODUCT_FP_FUSION


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
    clear_cublas_workspaces()   # its own workspace, none left cached for later captures (graph_launch)
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    clear_cublas_workspaces()
    return graph, calls


WARM_UP_S = 0.03          # GPU work before timing after an idle spell: the clocks rise under load
_last_timed = [float("-inf")]


def warm_up_gpu() -> None:
    """Run ~WARM_UP_S of matmuls on the current GPU if nothing was timed in the last second. An
    idle H100 sits at 345 MHz: timed right after the build, 1024 x 128 measured 19.5 us per
    layer where the same process timed 8.3 us a moment later (choices of 2026-11-25)."""
    if time.monotonic() - _last_timed[0] < 1.0:
        return
    a = torch.randn(2048, 2048, device="cuda")
    start = time.monotonic()
    while time.monotonic() - start < WARM_UP_S:
        for _ in range(4):
            a @ a
        torch.cuda.synchronize()
    _last_timed[0] = time.monotonic()


def _time_us(fn, reps: int = 5, max_calls: int = 20, target_us: float = 400.0) -> float:
    """GPU time per call of fn, replayed from a CUDA graph of back-to-back calls: what the
    call costs inside fxfuse's own graph. Timing eager calls instead measures the host's
    launch cost (~30 us per F.linear on the H100 host, above the GEMM itself at small sizes),
    which made this choice a coin toss: at batch 64, width 1024 it once put the bias into the
    GEMM, 2x slower on the GPU (31.0 vs 35.1 us "measured" eager). A graph of ~target_us:
    20 calls of a tiny GEMM, 1 of a large one (which takes ms, where optimize() must stay
    fast and the launch cost no longer matters)."""
    warm_up_gpu()
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
    _last_timed[0] = time.monotonic()
    return best


def _operands(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """x, W, b of a timed layer; W scaled by 1/sqrt(K) so chains of layers keep finite values."""
    gen = torch.Generator(device=device).manual_seed(0)
    x, w, b = (torch.randn(*shape, device=device, dtype=dtype, generator=gen) for shape in ((batch, k), (n, k), (n,)))
    return x, w / max(k, 1) ** 0.5, b


@functools.lru_cache(maxsize=512)
def _gemm_times(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device, allow_tf32: bool) -> tuple:
    """(us of F.linear(x, W), us of F.linear(x, W, b)) on this GPU. allow_tf32 is part of the
    key: it changes cuBLAS's kernels (the caller's current setting is what runs)."""
    x, w, b = _operands(batch, k, n, dtype, device)
    with torch.no_grad(), torch.cuda.device(device):   # the capture stream and launches on the model's GPU
        return _time_us(lambda: torch.nn.functional.linear(x, w)), _time_us(lambda: torch.nn.functional.linear(x, w, b))


def bias_in_library_gemm(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                         allow_tf32: bool, lone: bool = False) -> tuple:
    """(True, reason) if F.linear(x, W, b) beats F.linear(x, W) for this shape on this GPU.

    The bias add itself is free in the other spelling where it joins a fused kernel of
    pointwise ops that read the sum, so the comparison is GEMM against GEMM-with-epilogue.
    Where nothing pointwise reads it (`lone`: a view the reader broadcasts, a chunk, a norm,
    the output), the add would be a kernel of its own: its launch and pass over the output
    are charged to the plain GEMM (lone_kernel_us), and without a GPU the library takes it.
    """
    if device.type != "cuda":
        if lone:
            return True, "bias in the library call: nothing pointwise reads the sum, it would be a kernel of its own"
        return False, "bias fused into the pointwise kernel (no GPU to measure on)"
    plain, with_bias = _gemm_times(batch, k, n, dtype, device, allow_tf32)
    extra = lone_kernel_us(batch * n * torch.empty((), dtype=dtype).element_size()) if lone else 0.0
    if _bias_in_gemm(plain + extra, with_bias):
        return True, (f"bias in the library GEMM: measured {with_bias:.1f} us vs {plain:.1f} us without"
                      + (f" plus {extra:.1f} us for a bias kernel of its own (nothing pointwise reads the sum)"
                         if lone else ""))
    return False, f"bias fused into the pointwise kernel: GEMM measured {plain:.1f} us vs {with_bias:.1f} us with bias"


LONE_KERNEL_LAUNCH_US = 1.5    # one more small kernel node in a CUDA graph (H100: 1.2-2 us per launch, issue 5)
LONE_KERNEL_BYTES_PER_US = 2.5e6   # its read and write of the output at ~2.5 TB/s


def lone_kernel_us(out_bytes: int) -> float:
    """Estimated GPU us of a kernel that only adds a bias to an output of out_bytes."""
    return LONE_KERNEL_LAUNCH_US + 2 * out_bytes / LONE_KERNEL_BYTES_PER_US


BIAS_TIE = 0.01   # timing noise between the two GEMM spellings


def _bias_in_gemm(plain: float, with_bias: float) -> bool:
    """The faster spelling; a tie (within BIAS_TIE) goes to the GEMM with bias, eager's own
    spelling (addmm), so that a GEMM-bound layer is never slower than eager by the noise of one
    timing: ties going to `mm` left 8 x 2048 at batch 4096 0.5% slower than eager
    (mlp_20261125-203955: mm 702.8 vs addmm 700.4 us per layer), and a 5% margin once kept `mm`
    at 1024 x 4096 -> 4096 where addmm measured 678 vs 697 us (mlp_20261123-044640)."""
    return with_bias <= (1 + BIAS_TIE) * plain


RELU_EPILOGUE_MARGIN = 0.02   # timed in a chain of dependent layers (_layer_us): what the layers do in the model.
# Timed as one layer alone (weights hot in L2, calls independent), 256 x 1024 measured 29.2 us with the
# epilogue vs 30.2 without, and 8 such layers in one graph took 270 us against 195 (mlp_20261125-113435);
# a 10% margin then kept the epilogue out where chains gain 10-34% (splitk_act_probe_20261125.txt: 8 layers,
# batch x width 1024 x 128 38.4 vs 51.6 us, 1024 x 512 153 vs 169, 4096 x 512 406 vs 446, 4096 x 256 142 vs 163)
CHAIN_DEPTH = 4               # dependent layers per timed call (square layers: the output feeds the next)
CHAIN_MAX_US = 300.0          # past this per layer, one layer is timed: chains change nothing there, optimize() stays fast


def _layer_us(step, x, depth: int) -> float:
    """GPU us per layer of step (x -> its output) timed as `depth` dependent calls, each
    reading what the one before wrote, as the model's layers run; one call where depth is 1."""
    def run():
        y = x
        for i in range(depth):
            y = step(y, i)
        return y
    return _time_us(run) / depth


def _depth(k: int, n: int, plain_us: float) -> int:
    return CHAIN_DEPTH if k == n and plain_us < CHAIN_MAX_US else 1


@functools.lru_cache(maxsize=512)
def _unsplit_us(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device, allow_tf32: bool) -> float:
    """us per layer of Linear + bias + ReLU as fxfuse runs it in the library plan: the faster GEMM
    spelling, then one kernel over its output (bias and ReLU; here torch's ReLU where the bias
    went into the GEMM, else _sum_bias_relu as the generated kernel's stand-in)."""
    plain, with_bias = _gemm_times(batch, k, n, dtype, device, allow_tf32)
    x, w, b = _operands(batch, k, n, dtype, device)
    depth = _depth(k, n, plain)
    with torch.no_grad(), torch.cuda.device(device):
        if _bias_in_gemm(plain, with_bias):
            step = lambda y, i: torch.relu(torch.nn.functional.linear(y, w, b))  # noqa: E731
        else:
            step = _gemm_and_epilogue_step(x, w, b, 1)
        return _layer_us(step, x, depth)


@functools.lru_cache(maxsize=512)
def relu_in_library_gemm(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                         allow_tf32: bool) -> tuple:
    """(True, reason) if one cuBLASLt call with bias and ReLU in its epilogue
    (torch._addmm_activation) beats the faster GEMM spelling followed by a ReLU kernel, and
    split-K where that is legal (split_k_library_gemm), for a Linear + bias + ReLU whose ReLU
    fuses with nothing else (the seed network's layers).

    What it saves is a kernel over the output: at 4096 x 4096 per layer a pass over 64 MB
    (~45 us of ~2.7 ms), at small sizes a launch; what it may cost is cuBLASLt's choice of GEMM
    kernel, which differs from cuBLAS's (the issue's numbers: 232 us at batch 64 / hidden
    1024 for 8 layers against 138 us for compile's). Measured, as bias_in_library_gemm is,
    in chains of dependent layers (_layer_us)."""
    if device.type != "cuda":
        return False, "ReLU in the pointwise kernel (no GPU to measure on)"
    plain, _ = _gemm_times(batch, k, n, dtype, device, allow_tf32)
    x, w, b = _operands(batch, k, n, dtype, device)
    wt = w.t()
    with torch.no_grad(), torch.cuda.device(device):
        fused_step = lambda y, i: torch._addmm_activation(b, y, wt)  # noqa: E731
        # in turns, twice (the GPU's clocks still rise after the idle build: the one timed second won)
        fused = _layer_us(fused_step, x, _depth(k, n, plain))
        separate = _unsplit_us(batch, k, n, dtype, device, allow_tf32)
        fused = min(fused, _layer_us(fused_step, x, _depth(k, n, plain)))
    split = _split_us(batch, k, n, dtype, device, allow_tf32)
    other, how = separate, "GEMM + ReLU kernel"
    if split and min(split.values()) < other:
        best = min(split, key=split.get)
        other, how = split[best], f"split-K in {best} slices"
    if fused < (1 - RELU_EPILOGUE_MARGIN) * other:
        return True, (f"bias and ReLU in the library GEMM's epilogue (cuBLASLt): measured {fused:.1f} us vs "
                      f"{other:.1f} us for {how}")
    return False, (f"ReLU in the pointwise kernel: {how} measured {other:.1f} us vs {fused:.1f} us "
                   "with it in cuBLASLt's epilogue")


SPLIT_K_SLICES = (2, 4, 8)     # slice counts timed; 16 lost everywhere in splitk_probe_20261125.txt
SPLIT_K_MARGIN = 0.02          # timed in chains (_layer_us); one layer alone misled: 1024 x 512 "won" by 3.3% and lost 6% in 8 layers


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


def _gemm_and_epilogue_step(x, w, b, splits: int):
    """step(y, i) for _layer_us: the GEMM of y (in `splits` slices of K) and the fused
    epilogue's kernel, into buffers allocated once (outputs alternate with i, so a step never
    writes what it reads), as the layer runs inside fxfuse's graph."""
    m, n = x.shape[0], w.shape[0]
    parts = torch.empty(splits, m, n, device=x.device, dtype=x.dtype)
    outs = [torch.empty(m, n, device=x.device, dtype=x.dtype) for _ in range(2)]
    grid = (triton.cdiv(m * n, 1024),)

    def step(y, i):
        if splits == 1:
            torch.mm(y, w.t(), out=parts[0])
        else:
            torch.bmm(*_split_operands(y, w, splits), out=parts)
        _sum_bias_relu[grid](parts, b, outs[i % 2], m * n, n, S=splits, BLOCK=1024, **PRODUCT_FP_FUSION)
        return outs[i % 2]
    return step


@functools.lru_cache(maxsize=512)
def _split_us(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device, allow_tf32: bool) -> dict:
    """{S: us per layer split in S slices} for the slice counts split_k_slices allows (empty: none)."""
    slices = split_k_slices(batch, k, n, dtype, device)
    if not slices:
        return {}
    plain, _ = _gemm_times(batch, k, n, dtype, device, allow_tf32)
    x, w, b = _operands(batch, k, n, dtype, device)
    with torch.no_grad(), torch.cuda.device(device):
        return {s: _layer_us(_gemm_and_epilogue_step(x, w, b, s), x, _depth(k, n, plain)) for s in slices}


@functools.lru_cache(maxsize=512)
def split_k_library_gemm(batch: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                         allow_tf32: bool) -> tuple:
    """(S, reason): S > 1 where a Linear + bias runs faster as split_k_mm in S slices with the S
    partials summed in its epilogue kernel than as the faster library spelling followed by that
    kernel; 1 (and why) otherwise, '' where no split is worth timing. Each side is timed as it
    runs: the GEMM and the epilogue kernel (bias, ReLU; the sum of the partials when split), or
    addmm and a ReLU where the bias in the library GEMM measured faster, in chains of dependent
    layers (_layer_us). Timed with torch's sum(0) in place of that kernel, the split lost 2-4 us
    per layer to the chain's own numbers (1024 x 1024: 64.2 us alone, 60.1 per layer in
    splitk_probe's 8-layer chain)."""
    split = _split_us(batch, k, n, dtype, device, allow_tf32)
    if not split:
        return 1, ""
    one = _unsplit_us(batch, k, n, dtype, device, allow_tf32)
    best = min(split, key=split.get)
    if split[best] < (1 - SPLIT_K_MARGIN) * one:
        return best, (f"split-K: K = {k} in {best} slices through one batched library GEMM, the partials "
                      f"summed in the epilogue kernel: measured {split[best]:.1f} us vs {one:.1f} us unsplit")
    return 1, f"one library GEMM: measured {one:.1f} us vs {split[best]:.1f} us split-K in {best} slices"
