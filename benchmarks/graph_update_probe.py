"""Probe: host cost of getting a call's input into a CUDA graph, three ways.

    python -m benchmarks.graph_update_probe

1. static.copy_(x) then replay (what fxfuse does);
2. the driver's cuMemcpyDtoDAsync then replay;
3. a graph that starts with its own memcpy node, whose source is re-pointed at x by
   cuGraphExecMemcpyNodeSetParams before each replay (no copy launched from the host).
The graph is a small chain of kernels; each way is checked for the right result.
"""
import ctypes

import torch

from fxfuse.input_copy import CUDA_MEMCPY3D

from .overhead_probe import cpu_us


def main():
    cuda = ctypes.CDLL("libcuda.so.1")
    check = lambda status, what: status == 0 or (_ for _ in ()).throw(RuntimeError(f"{what}: CUresult {status}"))
    w = [torch.randn(128, 128, device="cuda") for _ in range(4)]
    model = lambda t: torch.relu(torch.relu(t @ w[0]) @ w[1])
    xs = [torch.randn(1, 128, device="cuda") for _ in range(4)]
    static, source = torch.empty(1, 128, device="cuda"), torch.empty(1, 128, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(static)
    torch.cuda.synchronize()

    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        out_plain = model(static)
    node_graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(node_graph):
        static.copy_(source)
        out_node = model(static)
    node_graph.instantiate()
    raw, exe = ctypes.c_void_p(node_graph.raw_cuda_graph()), ctypes.c_void_p(node_graph.raw_cuda_graph_exec())
    count = ctypes.c_size_t(0)
    check(cuda.cuGraphGetNodes(raw, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(cuda.cuGraphGetNodes(raw, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    copy_node, params = None, CUDA_MEMCPY3D()
    for node in nodes:
        kind = ctypes.c_int(-1)
        check(cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == 1:   # CU_GRAPH_NODE_TYPE_MEMCPY
            check(cuda.cuGraphMemcpyNodeGetParams(ctypes.c_void_p(node), ctypes.byref(params)), "GetParams")
            print(f"memcpy node: src {params.srcDevice:#x} (source {source.data_ptr():#x}), dst {params.dstDevice:#x} "
                  f"(static {static.data_ptr():#x}), {params.WidthInBytes} bytes, types {params.srcMemoryType}/"
                  f"{params.dstMemoryType}")
            if params.srcDevice == source.data_ptr() and params.dstDevice == static.data_ptr():
                copy_node = ctypes.c_void_p(node)
    print(f"{count.value} nodes; input memcpy node found: {copy_node is not None}")
    context = ctypes.c_void_p()
    check(cuda.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    memcpy = cuda.cuMemcpyDtoDAsync_v2
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    set_params = cuda.cuGraphExecMemcpyNodeSetParams
    set_params.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    params_ref = ctypes.byref(params)

    def way_copy(x):
        static.copy_(x)
        plain.replay()
        return out_plain

    def way_driver(x):
        memcpy(static.data_ptr(), x.data_ptr(), x.numel() * 4, torch._C._cuda_getCurrentRawStream(0))
        plain.replay()
        return out_plain

    def way_node(x):
        params.srcDevice = x.data_ptr()
        status = set_params(exe, copy_node, params_ref, context)
        if status:
            raise RuntimeError(f"cuGraphExecMemcpyNodeSetParams: {status}")
        node_graph.replay()
        return out_node

    with torch.no_grad():
        for name, way in (("copy_ + replay", way_copy), ("driver memcpy + replay", way_driver),
                          ("memcpy node update + replay", way_node)):
            ok = all(torch.allclose(way(x).clone(), model(x)) for x in xs)
            k = iter(range(10 ** 9))
            print(f"{name:30s} {cpu_us(lambda: way(xs[next(k) % 4])):6.2f} us host per call; correct: {ok}")
        print(f"{'replay alone':30s} {cpu_us(plain.replay):6.2f} us")
        print(f"{'node update alone':30s} {cpu_us(lambda: set_params(exe, copy_node, params_ref, context)):6.2f} us")


if __name__ == "__main__":
    main()
