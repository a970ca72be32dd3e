"""Replaying a captured CUDA graph with one driver call.

Why: at batch 1 a call is bound by the host, and torch's CUDAGraph.replay() costs 5.3 us of
CPU on the H100 host against 4.1 us for cuGraphLaunch through ctypes (overhead_probe
--host-only). What replay() does besides the launch is set a device guard and run the
random-number generators' replay prologue (each replay of a graph that draws random numbers
must move the generator's offset on, or every call would draw the same numbers).

So the direct launch is used only for a graph that draws no random numbers (the caller says
so: the generator's offset did not move over the eager warm-up runs, and no node takes a
generator or is a random op) and only while the current device is the graph's, which is
what the device guard ensured. Anything else, a missing driver library, or a launch that
returns an error (nothing was launched then) goes through graph.replay(), for good after an
error.
"""
import ctypes

import torch

from .input_copy import driver
from .log import logger

RANDOM_OP_WORDS = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson",
                   "exponential", "cauchy", "geometric", "gumbel", "rrelu",   # (review35c: gumbel_softmax,
                   "binomial", "standard_gamma", "dirichlet")                 # F.rrelu(training=True); review38b:
#                                                          torch.binomial, torch._standard_gamma, _sample_dirichlet)
NOT_RANDOM_WORDS = ("normalize",)   # F.normalize (review35c)
ATTENTION = {torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def draws_random_numbers(gm: torch.fx.GraphModule) -> bool:
    """Whether a node of the graph may draw random numbers (by name: conservative)."""
    return any(draws_random(gm, node) for node in gm.graph.nodes)


def draws_random(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether node may draw random numbers (by name: conservative). Such a node is never dead
    code: unread, it still moves the generator, and the draws after it depend on that."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if "generator" in node.kwargs or any(isinstance(a, torch.Generator) for a in node.args):
        return True
    if node.target in ATTENTION:   # dropout_p > 0 draws (review38c: refused beside a thread, or removed as dead)
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return not isinstance(p, (int, float)) or p > 0
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    if node.op == "call_module":
        name = type(gm.get_submodule(node.target)).__name__
    name = name.lower()
    return any(word in name for word in RANDOM_OP_WORDS) and not any(word in name for word in NOT_RANDOM_WORDS)


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


if hasattr(torch._C, "_cuda_getCurrentRawStream"):   # the C functions themselves: one Python frame less per call
    _current_device, _current_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream


def generator_offset(device_index: int) -> int | None:
    try:
        return torch.cuda.default_generators[device_index].get_offset()
    except (AttributeError, IndexError, RuntimeError):
        return None


def clear_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces (one per handle and stream) around a capture, as
    Inductor's cudagraph trees do, so that the workspace a captured library GEMM uses is
    allocated inside the capturing graph's own pool and no later capture inherits it.

    Why: every torch.cuda.graph() without a stream captures on one shared side stream, and
    cuBLAS reuses the workspace cached for that stream, so a graph can bake in a workspace
    that lies in an earlier graph's pool. Once that graph is gone and something clears the
    cache (torch.compile's reduce-overhead mode does, before each recording) and empties the
    allocator, the workspace's memory can be released while the later graph still uses it.
    A defence, not a proven fix: benchmarks.blocks faulted (illegal memory access) five times
    on two H100 machines on 2026-11-26, in the replay of its hand-captured eager graph after
    torch.compile(mode="reduce-overhead") and fxfuse were built in the same process; it did
    not fault on a third machine before this change either, and a scenario built to force the
    hazard (graph A's workspace reused by fxfuse's capture, A freed, cache cleared and emptied)
    ran clean with and without it. benchmarks.tools captures the same way.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class GraphLauncher:
    """replay() of one captured graph: cuGraphLaunch where that is the same, else graph.replay()."""

    def __init__(self, graph, device_index: int, draws_random: bool):
        self.graph, self.device, self.launch = graph, device_index, None
        self.direct = self.replays = 0
        lib = driver()
        if draws_random or lib is None:
            self.note = "torch's replay (" + ("the graph draws random numbers)" if draws_random else "no driver library)")
            return
        try:
            self.exec = ctypes.c_void_p(graph.raw_cuda_graph_exec())
        except (AttributeError, RuntimeError) as e:
            self.note = f"torch's replay (no graph executable: {e})"
            return
        self.launch = lib.cuGraphLaunch
        self.note = "cuGraphLaunch"

    def replay(self) -> None:
        if self.launch is not None and _current_device() == self.device:
            status = self.launch(self.exec, _current_stream(self.device))   # argtypes: ints pass as pointers
            if status == 0:
                self.direct += 1
                return
            logger.info("cuGraphLaunch returned %d: replaying through torch from now on", status)
            self.launch, self.note = None, f"torch's replay (cuGraphLaunch returned {status})"
        self.replays += 1
        self.graph.replay()
