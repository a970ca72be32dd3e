"""A specialization whose whole graph is ONE fused MLP kernel runs it without a CUDA graph.

Why: a narrow MLP fused into one kernel (mlp_kernel.py) takes 4-10 us of GPU time on the H100,
while a call through the CUDA-graph runtime costs 11-19 us of host time (pick a graph copy,
re-point its input node, cuGraphLaunch, hand out the output): the host is the bound. A graph
of one kernel gains nothing from capture. Launched directly, the kernel reads the caller's
tensor where it lies (no input copy, no memcpy node on the GPU) and writes a fresh tensor from
the caching allocator (which no later call overwrites: output safety without graph copies).

The launch is one cuLaunchKernel through ctypes with the argument block built once: per call
only the input and output addresses change. Triton's own launcher measured 13 us per launch on
the H100 machine's host (argument parsing, scratch allocation hooks), more than the whole
graph path. The block follows the compiled kernel's signature (its non-constexpr arguments in
order, then the scratch pointers Triton appends, null here), checked against the driver's own
parameter list (cuFuncGetParamInfo): any kernel this does not describe exactly keeps the graph.

What keeps it safe: Triton compiled the kernel for the example's integer arguments (rows,
row strides: the specialization's guards hold them fixed) and for 16-byte aligned pointers
(the weights are fxfuse's own buffers, the output is fresh). A call whose input is not aligned
so, or that runs on another current device, takes the ordinary path (the module's forward,
which compiles what it needs). Before it is used, one direct launch on the example input must
give exactly what the module's own launch gave.
"""
import ctypes

import torch
import torch.fx

from .graph_launch import _current_device, _current_stream
from .input_copy import driver
from .kernel import interpreting
from .log import logger
from .mlp_kernel import FusedMLP

ALIGN = 16   # bytes: Triton specializes pointer arguments on 16-byte alignment


def single_kernel(gm: torch.fx.GraphModule):
    """The FusedMLP module of a graph `x -> one FusedMLP call -> output`, else None."""
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    output = nodes[-1]
    if len(inputs) != 1 or len(calls) != 1 or len(nodes) != 3 or output.op != "output":
        return None
    call = calls[0]
    if call.args != (inputs[0],) or call.kwargs or output.args[0] is not call:
        return None
    module = gm.get_submodule(call.target)
    return module if isinstance(module, FusedMLP) else None


SCALAR_TYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
                "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
                "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "fp64": ctypes.c_double}


def _driver_params(kernel) -> list | None:
    """[(offset, size)] of the kernel function's parameters, from the driver, or None."""
    lib = driver()
    if lib is None or not hasattr(lib, "cuFuncGetParamInfo"):
        return None
    out, offset, size = [], ctypes.c_size_t(), ctypes.c_size_t()
    func = ctypes.c_void_p(kernel.function)
    while len(out) < 256 and lib.cuFuncGetParamInfo(func, ctypes.c_size_t(len(out)), ctypes.byref(offset),
                                                    ctypes.byref(size)) == 0:
        out.append((offset.value, size.value))
    return out


def _signature_types(kernel) -> list:
    """The kernel's argument types in order ("*fp32", "i32", "constexpr", ...)."""
    signature = kernel.src.signature
    names = kernel.src.fn.arg_names
    return [signature[n] if n in signature else signature[k] for k, n in enumerate(names)]


class DirectLaunch:
    """__call__(x): the kernel's output for x, or None where the ordinary path must run."""

    def __init__(self, module: FusedMLP, x: torch.Tensor):
        self.module = module
        self.device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        self.prototype = torch.empty(0, dtype=x.dtype, device=x.device)   # new_empty: no device parsing per call
        self.out_shape = tuple(x.shape[:-1]) + (module.out_width,)
        kernel, grid, args = module.launch_plan(x)
        meta = kernel.metadata
        for field, ok in (("num_ctas", 1), ("global_scratch_size", 0), ("profile_scratch_size", 0),
                          ("launch_pdl", False), ("launch_cooperative_grid", False)):
            if getattr(meta, field, ok) != ok:
                raise ValueError(f"the kernel needs {field}={getattr(meta, field)}")
        types = _signature_types(kernel)
        if len(types) != len(args) or types[0][:1] != "*" or types[1][:1] != "*":
            raise ValueError(f"signature {types} does not match the arguments")
        values = []
        for ty, arg in zip(types, args):
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                values.append(ctypes.c_uint64(arg.data_ptr() if isinstance(arg, torch.Tensor) else 0))
            elif ty in SCALAR_TYPES:
                values.append(SCALAR_TYPES[ty](arg))
            else:
                raise ValueError(f"argument type {ty}")
        params = _driver_params(kernel)
        if params is None:
            raise ValueError("the driver cannot list the kernel's parameters (cuFuncGetParamInfo)")
        extra = params[len(values):]   # scratch pointers Triton appends: null (their sizes are 0)
        if len(params) < len(values) or len(extra) > 2 or any(size != 8 for _, size in extra) \
                or [size for _, size in params[:len(values)]] != [ctypes.sizeof(v) for v in values]:
            raise ValueError(f"the driver's parameters {params} do not match the signature {types}")
        values += [ctypes.c_uint64(0) for _ in extra]
        self.x_ptr, self.out_ptr, self._values = values[0], values[1], values
        self.params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                                        for v in values])
        self.launch = driver().cuLaunchKernel   # (f, grid xyz, block xyz, shared bytes, stream, params, extra)
        self.launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.launch.restype = ctypes.c_int
        self.fixed = (kernel.function, grid[0], grid[1], grid[2], 32 * meta.num_warps, 1, 1, meta.shared)

    @classmethod
    def build(cls, gm: torch.fx.GraphModule, example_args: tuple) -> tuple:
        """(DirectLaunch or None, why not)."""
        module = single_kernel(gm)
        if module is None:
            return None, "the graph is more than one fused MLP kernel"
        x = example_args[0] if len(example_args) == 1 else None
        if not (isinstance(x, torch.Tensor) and x.is_cuda and not interpreting()):
            return None, "not a CUDA tensor input with compiled kernels"
        if not (x.is_contiguous() and x.numel() > 0 and x.data_ptr() % ALIGN == 0 and module._matches((x,))
                and module.use_kernel):
            return None, "the input is not one contiguous, aligned, non-empty tensor the kernel was built for"
        try:
            with torch.no_grad():
                want = gm(x)          # compiles the kernel; the ordinary path's answer
                direct = cls(module, x)
                got = direct(x)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- an optimization: the CUDA graph is the safe way
            logger.info("direct launch unavailable: %s", e)
            return None, f"the direct launch failed ({type(e).__name__}: {str(e)[:120]})"
        if got is None or not torch.equal(got, want):
            return None, "a direct launch did not reproduce the module's own launch"
        return direct, ""

    def __call__(self, x: torch.Tensor):
        if x.data_ptr() % ALIGN or _current_device() != self.device:
            return None
        out = self.prototype.new_empty(self.out_shape)
        self.x_ptr.value, self.out_ptr.value = x.data_ptr(), out.data_ptr()
        if self.launch(*self.fixed, _current_stream(self.device), self.params, None):
            return None   # nothing was launched: the ordinary path runs
        self.module.launches += 1
        return out
