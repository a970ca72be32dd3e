"""How a call's inputs get into a CUDA graph: the graph's own memcpy node, re-pointed per call.

Why: a call of a small optimized model is bound by the host, and `static.copy_(x)` before
the replay is its largest part: 8 us of CPU on the H100 host we measure on, more than the
replay (5.5 us). The driver's cuMemcpyDtoDAsync is no cheaper (7.4 us): launching any copy
costs that. So each graph is captured starting with `static.copy_(source)` for every
contiguous input, which becomes a memcpy node, and a call re-points that node's source at
the caller's tensor with cuGraphExecMemcpyNodeSetParams (2.6 us) and replays: 9.2 us per call
instead of 17.5 (benchmarks/graph_update_probe.py). CUDA applies the update to the next
launch only, so launches already queued keep their own source.

Safe because the specialization's guard has checked shape, dtype, device and strides: a
contiguous input is the same dense byte range as its static buffer. Everything else is the
plain way: an input that is not contiguous is copied into its static buffer with copy_ before
the replay; without the driver library, or if the node cannot be found or updated, the
input is copied into `source` and the graph's own memcpy carries it on (one extra copy on
the GPU, same result). A failed update puts every node back on its source, or, if even
that fails, tells the caller to stop replaying the graph.
"""
import ctypes

import torch

from .log import logger

_CU_GRAPH_NODE_TYPE_MEMCPY = 1


class CUDA_MEMCPY3D(ctypes.Structure):   # cuda.h; a 1-D device copy uses srcDevice/dstDevice/WidthInBytes
    _fields_ = [(name, ctype) for side in ("src", "dst") for name, ctype in (
        (f"{side}XInBytes", ctypes.c_size_t), (f"{side}Y", ctypes.c_size_t), (f"{side}Z", ctypes.c_size_t),
        (f"{side}LOD", ctypes.c_size_t), (f"{side}MemoryType", ctypes.c_int), (f"{side}Host", ctypes.c_void_p),
        (f"{side}Device", ctypes.c_uint64), (f"{side}Array", ctypes.c_void_p),
        (f"reserved{0 if side == 'src' else 1}", ctypes.c_void_p), (f"{side}Pitch", ctypes.c_size_t),
        (f"{side}Height", ctypes.c_size_t))] + [
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


_driver = None   # libcuda once loaded; False where it is unavailable


def driver():
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuGraphExecMemcpyNodeSetParams.argtypes = [ctypes.c_void_p] * 4
            lib.cuGraphExecMemcpyNodeSetParams.restype = ctypes.c_int
            lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]   # graph_launch.py
            lib.cuGraphLaunch.restype = ctypes.c_int
            _driver = lib
        except (OSError, AttributeError) as e:
            logger.info("graph inputs are copied with copy_: no CUDA driver library (%s)", e)
            _driver = False
    return _driver or None


BIND_MAX_BYTES = 16 << 20   # larger inputs: a call is GPU-bound, the host copy is hidden, and
                            # the source buffer a memcpy node needs would cost memory for nothing


BIND_INPUTS = True           # the benchmarks' A/B switch (False: every input copied with copy_)


def can_bind(static: torch.Tensor) -> bool:
    """Whether an input of this static buffer's layout comes in through a memcpy node."""
    return (BIND_INPUTS and static.device.type == "cuda" and static.is_contiguous() and static.numel() > 0
            and static.numel() * static.element_size() <= BIND_MAX_BYTES)


def new_graph(bindable: bool) -> tuple:
    """(graph, whether it keeps its cudaGraph_t): kept where there is an input to bind, so that
    GraphInputs can find the memcpy nodes. Without keep_graph (an older torch) the inputs still
    arrive, through `source` and the graph's own memcpy."""
    if bindable and driver() is not None:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:
            pass
    return torch.cuda.CUDAGraph(), False


def _memcpy_nodes(graph, pairs) -> list | None:
    """[(node, params)] of the graph's memcpy nodes from each (source, static) pair, or None."""
    cuda = driver()
    graph.instantiate()   # a failure here is a failed capture (the caller falls back), not a missing node
    try:
        raw = ctypes.c_void_p(graph.raw_cuda_graph())
    except (AttributeError, RuntimeError) as e:
        logger.info("graph inputs are copied with copy_: no raw graph (%s)", e)
        return None
    count = ctypes.c_size_t(0)
    if cuda.cuGraphGetNodes(raw, None, ctypes.byref(count)):
        return None
    nodes = (ctypes.c_void_p * count.value)()
    if cuda.cuGraphGetNodes(raw, nodes, ctypes.byref(count)):
        return None
    found = {}
    for node in nodes:
        kind, params = ctypes.c_int(-1), CUDA_MEMCPY3D()
        if cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) or kind.value != _CU_GRAPH_NODE_TYPE_MEMCPY:
            continue
        if cuda.cuGraphMemcpyNodeGetParams(ctypes.c_void_p(node), ctypes.byref(params)):
            continue
        found.setdefault((params.srcDevice, params.dstDevice), (ctypes.c_void_p(node), params))
    result = [found.get((source.data_ptr(), static.data_ptr())) for source, static in pairs]
    return None if any(r is None for r in result) else result


class GraphInputs:
    """load(tensors) makes one captured graph read this call's inputs (see the module docstring).

    `copied` [(position, static)]: inputs copied with copy_ before the replay; `bound`
    [(position, source)]: inputs the graph copies from `source` with a memcpy node of its own.
    """

    def __init__(self, graph, keeps_graph: bool, copied: list, bound: list, statics: dict):
        self.copied, self.bound = copied, bound
        self.node_updates = self.copies = self.repoints = 0   # loads through the nodes, copies, driver updates
        self.exec = self.nodes = None
        if bound and keeps_graph and driver() is not None:
            self.nodes = _memcpy_nodes(graph, [(source, statics[k]) for k, source in bound])
            if self.nodes is not None:
                context = ctypes.c_void_p()
                if driver().cuCtxGetCurrent(ctypes.byref(context)) == 0:
                    self.exec, self.context = ctypes.c_void_p(graph.raw_cuda_graph_exec()), context
        self.note = ("the graph's memcpy node reads the caller's tensor (no host copy)" if self.exec is not None
                     else "copied into static buffers" if not bound else "copied, then the graph's memcpy")

    def _point(self, node, params, address) -> bool:
        """Re-point one node; `params` keeps what the node reads now, so a call with the tensor
        of the previous call (a loop over one input buffer, or the caching allocator handing
        back the same block) costs no driver call: the node reads its bytes at the replay."""
        if params.srcDevice == address:
            return True
        old, params.srcDevice = params.srcDevice, address
        if _driver.cuGraphExecMemcpyNodeSetParams(self.exec, node, ctypes.byref(params), self.context) == 0:
            self.repoints += 1
            return True
        params.srcDevice = old
        return False

    @staticmethod
    def _address(x: torch.Tensor, source: torch.Tensor) -> int:
        """Where the node copies from: the caller's bytes, or, for a tensor whose conjugation or
        negation is pending (x.conj() of a complex tensor: same bytes, a flag), `source` after
        copy_ has applied it."""
        if x.is_conj() or x.is_neg():
            source.copy_(x)
            return source.data_ptr()
        return x.data_ptr()

    def load(self, tensors) -> bool:
        """False when the graph must not be replayed any more (its nodes could not be restored)."""
        for k, static in self.copied:
            static.copy_(tensors[k])
        if self.exec is not None:
            self.node_updates += 1
            for (k, source), (node, params) in zip(self.bound, self.nodes):
                if not self._point(node, params, self._address(tensors[k], source)):
                    break
            else:
                return True
            self.node_updates -= 1
            logger.info("cuGraphExecMemcpyNodeSetParams failed: graph inputs are copied from now on")
            restored = all(self._point(node, params, source.data_ptr())
                           for (_, source), (node, params) in zip(self.bound, self.nodes))
            self.exec = None
            if not restored:
                return False
        for k, source in self.bound:
            source.copy_(tensors[k])
        self.copies += 1
        return True
