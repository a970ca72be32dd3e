"""The fully fused narrow MLP: a whole chain of Linear layers and their pointwise epilogues in
ONE Triton kernel.

Why: for narrow layers at small batch, time goes to launches (two per Linear+ReLU, ~1.2 us
each even from a CUDA graph) and to round trips of activations through memory, not to FLOPs.
Here each program takes its rows through every layer: the activations never leave registers,
only the weights are read (from L2/HBM, tile by tile), and the whole network is one launch.

Where things are: mlp_spec.py describes a chain (MLPSpec) and chooses its kernel form
(choose_config) and legality (why_not_kernel); mlp_codegen.py generates the kernel source;
this module packs the weights in the order the kernel reads them (`pack`) and is the module
the graph calls (FusedMLP). The names of mlp_spec are re-exported here for the passes.

Precision: fp32 tl.dot uses input_precision="ieee" unless TF32 was allowed when the chain was
built (precision.matmul_allows_tf32: torch.backends.cuda.matmul.allow_tf32 or fp32_precision); fp16/bf16 feed tl.dot in their own type and
accumulate in fp32; the row-wise form computes in fp32. Epilogues compute in fp32.
"""
import torch
import torch.fx

from .kernel import PRODUCT_FP_FUSION, FusedKernel, kernels_available, launch_context, resolved, triton_cdiv
from .mlp_codegen import Layout, generate_mlp, kernel_name, value_axes  # noqa: F401  (re-exported)
from .mlp_spec import (KERNEL_DTYPES, MAX_DOTS, MAX_FMA_PER_THREAD, MAX_TILE, MAX_WIDTH,  # noqa: F401
                       PREFETCH_ELEMENTS, ROWWISE_MAX_BATCH, ROWWISE_MAX_TILE, ROWWISE_TC_MAX_BATCH, SMS,
                       KernelConfig, Linear, MLPSpec, Pointwise, choose_config, fma_per_thread, layer_period,
                       tile_of, why_not_kernel, why_slow)


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
        inputs = resolved(inputs)
        x = inputs[0] if inputs else None
        if not (self.use_kernel and self._matches(inputs) and kernels_available(x.device)):
            self.fallbacks += 1
            return self.reference.forward(*inputs)   # (torch.fx's __call__ prints a traceback on errors)
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[1] > 1 and x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        result = torch.empty(lead + (self.out_width,), dtype=self.spec.dtype, device=x.device)
        out = result.view(m, self.out_width)   # written through; `result` is no view (fuzz49h, as gemm_kernel)
        if m:
            bm = self.config.block_m
            with launch_context(x.device):
                self.compiled()[(triton_cdiv(m, bm),)](
                    x2, out, self.packed_weights, self.packed_vectors, m, x2.stride(0), out.stride(0),
                    BLOCK_M=bm, num_warps=self.config.num_warps, **PRODUCT_FP_FUSION)
            self.launches += 1
        return result

    def extra_repr(self) -> str:
        widths = [self.spec.widths[0]] + [self.spec.widths[s.out] for s in self.spec.linears]
        return f"kernel={self.kernel_name}, widths={widths}, {self.config}, members={list(self.members)}"
