"""Blocks written the way real code spells a Linear: GPT-2's Conv1D MLP and `x @ W` chains.

    python -m benchmarks.blocks [--cases gpt2-mlp,matmul-chain,einsum-chain] [--tools ...]

Why: the seed network uses nn.Linear. Code ported from other frameworks stores weights
[in, out] and writes `x @ W`, `torch.addmm(b, x.view(-1, k), W).view(b, s, n)` (Hugging Face
GPT-2's Conv1D) or einsum; before 2026-11-26 those stayed library matmuls with the
activation, bias and residual in kernels of their own (the view after the addmm stopped
every epilogue). Column `fxfuse-spelled-before` builds with that behaviour back (no
transposed-weight rewrite, no einsum rewrite, no sink_views pass) in the same run, so the
gain of the rewrite is measured against eager, torch.compile and the old plan together.
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import common
from . import tools as toolmod


class Conv1D(nn.Module):
    """Hugging Face transformers' GPT-2 Conv1D: a Linear with its weight stored [in, out]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2MLP(nn.Module):
    """GPT-2's MLP with its residual: h + c_proj(gelu_new(c_fc(h)))."""

    def __init__(self, d):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * d, d), Conv1D(d, 4 * d)

    def forward(self, h):
        return h + self.c_proj(F.gelu(self.c_fc(h), approximate="tanh"))


class PreNormMLP(nn.Module):
    """A pre-norm transformer's MLP sublayer: h + fc2(gelu(fc1(ln(h)))); the residual stream h
    is no input of fc2, so fc2's epilogue reads it as a skip tensor."""

    def __init__(self, d, layers=1):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(d), "fc1": nn.Linear(d, 4 * d),
                                                   "fc2": nn.Linear(4 * d, d)}) for _ in range(layers))

    def forward(self, h):
        for b in self.blocks:
            h = h + b["fc2"](F.gelu(b["fc1"](b["ln"](h))))
        return h


class MatmulChain(nn.Module):
    """`relu(x @ W + b)` per layer, W [in, out] (or einsum "bi,io->bo")."""

    def __init__(self, width, layers, einsum=False):
        super().__init__()
        self.einsum = einsum
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width ** 0.5) for _ in range(layers))
        self.biases = nn.ParameterList(nn.Parameter(torch.randn(width) * 0.1) for _ in range(layers))

    def forward(self, x):
        for w, b in zip(self.weights, self.biases):
            x = torch.relu((torch.einsum("bi,io->bo", x, w) if self.einsum else x @ w) + b)
        return x


class ConvNeXtBlock(nn.Module):   # NHWC Linears, layer scale, permute back, residual (passes/hoist_permutes.py)
    def __init__(self, d):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw1, self.pw2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.gamma * self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


class MixerTokens(nn.Module):    # MLP-Mixer's token mixing: an MLP over the transposed tokens, residual
    def __init__(self, tokens, d):
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(d), nn.Linear(tokens, 2 * tokens), nn.Linear(2 * tokens, tokens)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(self.ln(x).transpose(1, 2)))).transpose(1, 2)


class PackedSwiGLU(nn.Module):   # LLaMA's FFN with w1 and w3 packed into one Linear (passes/hoist_slices.py)
    def __init__(self, d, hidden):
        super().__init__()
        self.w13, self.w2 = nn.Linear(d, 2 * hidden), nn.Linear(hidden, d)

    def forward(self, x):
        a, b = self.w13(x).chunk(2, -1)
        return x + self.w2(F.silu(a) * b)


class LSTMByHand(nn.Module):   # an LSTM written as its cell, unrolled over the sequence by the trace
    def __init__(self, inputs, hidden):
        super().__init__()
        self.hidden, self.ih, self.hh = hidden, nn.Linear(inputs, 4 * hidden), nn.Linear(hidden, 4 * hidden)

    def forward(self, x):
        h = c = x.new_zeros(x.size(0), self.hidden)
        for t in range(x.size(1)):
            i, f, g, o = (self.ih(x[:, t]) + self.hh(h)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return h


class WaveNetStack(nn.Module):   # dilated causal convs, gated tanh * sigmoid, residual
    def __init__(self, channels, layers):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(channels, 2 * channels, 2, dilation=2 ** k) for k in range(layers))
        self.outs = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(layers))

    def forward(self, x):
        for k, (conv, out) in enumerate(zip(self.convs, self.outs)):
            a, b = conv(F.pad(x, (2 ** k, 0))).chunk(2, 1)
            x = x + out(torch.tanh(a) * torch.sigmoid(b))
        return x


class AdaLNBlock(nn.Module):
    """DiT's adaLN-Zero modulation around an MLP: the conditioning Linear's output is chunked and
    each part unsqueezed before the ops that broadcast it (here the conditioning is the tokens'
    mean, so the case takes one input)."""

    def __init__(self, d):
        super().__init__()
        self.ada, self.fc = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x):
        shift, scale, gate = self.ada(F.silu(x.mean(1))).chunk(3, dim=1)
        h = self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        return x + gate.unsqueeze(1) * self.fc(h)


class RotaryEveryTwo(nn.Module):
    """GPT-J's rotary embedding: pairs (x1, x2) of each head rotated by position, stacked back
    (passes/join_outputs.py: the kernel writes the stack)."""

    def __init__(self, seq, heads, dim):
        super().__init__()
        self.heads = heads
        angle = torch.arange(seq)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
        self.register_buffer("cos", angle.cos()[:, None, :])   # [T, 1, D/2]
        self.register_buffer("sin", angle.sin()[:, None, :])

    def forward(self, x):
        b, t, _ = x.shape
        x1, x2 = x.view(b, t, self.heads, -1, 2).unbind(-1)
        return torch.stack([x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin], -1).flatten(-2)


class PositionalEncoding(nn.Module):
    """NeRF's encoding: x and sin / cos of 2^k x for k < frequencies, concatenated."""

    def __init__(self, frequencies):
        super().__init__()
        self.frequencies = frequencies

    def forward(self, x):
        return torch.cat([x] + [f(x * 2.0 ** k) for k in range(self.frequencies) for f in (torch.sin, torch.cos)], -1)


class Mamba2Gate(nn.Module):
    """Mamba-2's gated output: (y + y * D) over heads, merged, gated by silu of another branch
    (sink_views computes the gate at the heads' shape: one kernel, stop 43)."""

    def __init__(self, heads, dim):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.D = nn.Parameter(torch.randn(heads))

    def forward(self, x):
        b, t, _ = x.shape
        y = x.view(b, t, self.heads, self.dim)
        y = y * 0.5 + y * self.D[:, None]
        return y.reshape(b, t, -1) * F.silu(x * 2.0)


class Dist2BBox(nn.Module):
    """YOLOv8's box decoding: a cat of two pointwise results scaled by the anchors' strides
    (join_outputs applies the scale to the pieces: one kernel writing the cat, stop 43)."""

    def __init__(self, anchors):
        super().__init__()
        self.register_buffer("anchors", torch.rand(1, 2, anchors) * 80)
        self.register_buffer("strides", torch.rand(1, anchors) * 32)

    def forward(self, x):
        lt, rb = x[:, :2], x[:, 2:]
        x1y1, x2y2 = self.anchors - lt, self.anchors + rb
        return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * self.strides


class HeadMerge(nn.Module):
    """Attention's head merge between pointwise ops: `(o * s + 1).transpose(1, 2).reshape(b, n, c) + bias`
    (a reshape that copies, read as contiguous + view: stop 43)."""

    def __init__(self, width):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x):
        b, h, n, d = x.shape
        return torch.tanh((x * 0.5 + 1).transpose(1, 2).reshape(b, n, h * d) + self.bias)


class PatchScale(nn.Module):
    """A patch embedding's flatten followed by a per-channel scale and shift (the broadcast
    operand moves with the view: stop 43)."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 16, stride=16)
        self.scale, self.shift = nn.Parameter(torch.randn(channels)), nn.Parameter(torch.randn(channels))

    def forward(self, x):
        return F.gelu(self.conv(x)).flatten(2) * self.scale[:, None] + self.shift[:, None]


CASES = {   # name -> (factory, input shape, note)
    "gpt2-mlp": (lambda: GPT2MLP(768), (8, 128, 768), "GPT-2 small MLP block, 8 x 128 tokens"),
    "gpt2-mlp-small": (lambda: GPT2MLP(256), (1, 32, 256), "width 256, 32 tokens"),
    "prenorm-mlp": (lambda: PreNormMLP(256, 4), (1, 32, 256), "4 pre-norm MLP sublayers, width 256, 32 tokens"),
    "prenorm-mlp-768": (lambda: PreNormMLP(768, 2), (1, 16, 768), "2 pre-norm MLP sublayers, width 768, 16 tokens"),
    "matmul-chain": (lambda: MatmulChain(1024, 8), (64, 1024), "8 x relu(x @ W + b), 64 x 1024"),
    "matmul-chain-narrow": (lambda: MatmulChain(128, 8), (1, 128), "8 x relu(x @ W + b), 1 x 128"),
    "einsum-chain": (lambda: MatmulChain(512, 8, einsum=True), (16, 512), "8 x relu(einsum + b), 16 x 512"),
    "convnext": (lambda: ConvNeXtBlock(96), (1, 96, 56, 56), "ConvNeXt-T stage-1 block, 96 x 56 x 56"),
    "mixer-tokens": (lambda: MixerTokens(196, 512), (4, 196, 512),
                     "MLP-Mixer-S token mixing, 196 tokens x 512, batch 4"),
    "swiglu-packed": (lambda: PackedSwiGLU(512, 1376), (1, 64, 512), "packed SwiGLU FFN, 512 -> 2 x 1376, 64 tokens"),
    "lstm-by-hand": (lambda: LSTMByHand(128, 256), (32, 8, 128), "LSTM cell by hand, batch 32, 8 steps, 128 -> 256"),
    "wavenet": (lambda: WaveNetStack(64, 4), (1, 64, 1024), "4 gated dilated conv layers, 64 channels, 1024 steps"),
    "dit-adaln": (lambda: AdaLNBlock(384), (4, 256, 384), "DiT-S adaLN-Zero modulation + MLP, 4 x 256 tokens"),
    "dit-adaln-small": (lambda: AdaLNBlock(128), (2, 16, 128), "width 128, 2 x 16 tokens"),
    "rotary-gptj": (lambda: RotaryEveryTwo(512, 12, 64), (4, 512, 768), "rotary every two, 4 x 512 tokens, 12 x 64"),
    "posenc": (lambda: PositionalEncoding(10), (65536, 3), "NeRF encoding, 65536 points, 10 frequencies"),
    "mamba2-gate": (lambda: Mamba2Gate(24, 64), (4, 512, 1536), "Mamba-2 gated output, 4 x 512 tokens, 24 x 64"),
    "dist2bbox": (lambda: Dist2BBox(8400), (16, 4, 8400), "YOLOv8 box decoding, batch 16, 8400 anchors"),
    "head-merge": (lambda: HeadMerge(768), (8, 12, 256, 64), "head merge + bias + tanh, 8 x 12 heads x 256 x 64"),
    "patch-scale": (lambda: PatchScale(384), (8, 3, 224, 224), "patch embedding + per-channel scale, 8 x 224^2"),
}


@contextlib.contextmanager
def spelled_as_before():
    """fxfuse as it was before these spellings were rewritten (the ablation column)."""
    import fxfuse.passes.normalize_layers as nl
    import fxfuse.passes.pipeline as pl
    saved = nl._stored_weight, nl._einsum_operands, pl.PIPELINE
    nl._stored_weight = lambda node: None
    nl._einsum_operands = lambda node: None
    pl.PIPELINE = [p for p in pl.PIPELINE if p[0] != "sink_views"]
    try:
        yield
    finally:
        nl._stored_weight, nl._einsum_operands, pl.PIPELINE = saved


def build_before(model, example):
    with spelled_as_before():
        return toolmod.build_fxfuse(model, example)


BEFORE = toolmod.Tool("fxfuse-spelled-before", "fxfuse before", build_before, default=False, fxfuse=True,
                      private_copy=True)


@contextlib.contextmanager
def _patched(obj, name, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def build_no_skips(model, example):
    """fxfuse without skip tensors in the generated GEMM's epilogue (before 2026-11-26, stop 30)."""
    import fxfuse.gemm_kernel as gk
    with _patched(gk, "MAX_SKIPS", 0):
        return toolmod.build_fxfuse(model, example)


def build_no_hoist(model, example):
    """fxfuse without passes/hoist_permutes.py (before stop 31): the op under a permute keeps
    its own kernel instead of joining the residual add after the permute."""
    import fxfuse.passes.pipeline as pl
    with _patched(pl, "PIPELINE", [p for p in pl.PIPELINE if p[0] != "hoist_permutes"]):
        return toolmod.build_fxfuse(model, example)


def build_no_slices(model, example):
    """fxfuse without passes/hoist_slices.py and the fp32 glu rewrite (before stop 33): the op
    before a chunk or split keeps its own kernel instead of joining the gate after it."""
    import fxfuse.passes.normalize as nz
    import fxfuse.passes.pipeline as pl
    with _patched(pl, "PIPELINE", [p for p in pl.PIPELINE if p[0] != "hoist_slices"]), \
            _patched(nz, "glu_as_gate", lambda gm, node: False):
        return toolmod.build_fxfuse(model, example)


def build_no_lone(model, example):
    """fxfuse before stop 35: a bias nothing pointwise reads measured as if a kernel took it for
    free, and views adding size-1 dims left where they were."""
    import fxfuse.passes.hoist_permutes as hp
    import fxfuse.passes.linear_epilogue as le
    with _patched(le, "_lone", lambda add: False), _patched(hp, "is_unit_view", lambda node: False):
        return toolmod.build_fxfuse(model, example)


def build_no_joins(model, example):
    """fxfuse before stop 42: a stack or cat of a kernel's results copied by the library."""
    import fxfuse.passes.fuse_pointwise as fp
    with _patched(fp, "kernel_joins", lambda *args: []):
        return toolmod.build_fxfuse(model, example)


NO_JOINS = toolmod.Tool("fxfuse-no-joins", "fxfuse no joins", build_no_joins, default=False, fxfuse=True,
                        private_copy=True)
NO_LONE = toolmod.Tool("fxfuse-no-lone", "fxfuse no lone", build_no_lone, default=False, fxfuse=True,
                       private_copy=True)
NO_SKIPS = toolmod.Tool("fxfuse-no-skips", "fxfuse no skips", build_no_skips, default=False, fxfuse=True,
                        private_copy=True)
NO_HOIST = toolmod.Tool("fxfuse-no-hoist", "fxfuse no hoist", build_no_hoist, default=False, fxfuse=True,
                        private_copy=True)
NO_SLICES = toolmod.Tool("fxfuse-no-slices", "fxfuse no slices", build_no_slices, default=False, fxfuse=True,
                         private_copy=True)
for _tool in (BEFORE, NO_SKIPS, NO_HOIST, NO_SLICES, NO_LONE, NO_JOINS):
    toolmod.TOOLS.append(_tool)
    toolmod.TOOLS_BY_KEY[_tool.key] = _tool


DEFAULT_TOOLS = "eager,cudagraph,compile,compile-ro,fxfuse,fxfuse-spelled-before"
QUICK = ("gpt2-mlp-small", "matmul-chain-narrow", "dit-adaln-small")   # --quick: small cases (fuzz36g: it was ignored)


def main(argv=None):
    parser = common.main_parser(__doc__.splitlines()[0])
    parser.add_argument("--cases", help=f"comma list of {','.join(CASES)} (default: all; --quick: {','.join(QUICK)})")
    for action in parser._actions:   # this benchmark's own default columns (fuzz36g: help named the common ones)
        if action.dest == "tools":
            action.help = f"comma list of columns (default {DEFAULT_TOOLS}; --quick: eager,fxfuse)"
    args = parser.parse_args(argv)
    if not args.tools:
        args.tools = "eager,fxfuse" if args.quick else DEFAULT_TOOLS
    if args.cases is not None and not args.cases.strip(","):
        parser.error("--cases is empty")
    names = [n.strip() for n in args.cases.split(",") if n.strip()] if args.cases else list(QUICK if args.quick else CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    cases = [common.Case(params={"case": n}, make_model=CASES[n][0], input_shape=CASES[n][1], notes=[CASES[n][2]])
             for n in names]
    common.run_benchmark("blocks", cases, args)


if __name__ == "__main__":
    main()
