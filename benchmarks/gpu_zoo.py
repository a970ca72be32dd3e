"""Differential check on the GPU: models the tests do not build, every plan's kernels for real.

    python -m benchmarks.gpu_zoo [--budget-s 240]

Why: the CPU tests run the generated kernels under the Triton interpreter at tiny shapes, which
cannot catch what only the GPU does: CUDA-graph capture and replay, output handout across calls,
split-K counters, PDL, bf16, tile edges of irregular sizes at real block sizes. Each case
optimizes a model (strict=False, as users call it) and checks on fresh random inputs:
  - the result against float64 (eager fp32/fp16/bf16's own error x 4, at least 1e-5 / 1e-2);
  - output safety: call 1's output unchanged after call 2 with other data;
  - other batch sizes and a non-contiguous input after the example (guards, re-specialization);
  - that something was rewritten (fused kernels or generated GEMMs), unless the case says not.
Prints one line per case and a summary; exit status 1 when a case fails.
"""
import argparse
import os
import sys
import time
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from benchmarks.mlp import ResidualMLP
from benchmarks.blocks import ConvNeXtBlock, GPT2MLP, MatmulChain, MixerTokens

DEVICE = "cuda"


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention by matmul and softmax, GELU MLP, residuals."""

    def __init__(self, d, heads=3):
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class Spelled(nn.Module):
    """The same Linear+bias+activation written five ways, a tied weight and a scale parameter."""

    def __init__(self, n):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(n, n) / n ** 0.5), nn.Parameter(torch.randn(n))
        self.scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        x = F.relu(F.linear(x, self.w, self.b))
        x = torch.addmm(self.b, x, self.w.t()).clamp(min=0)
        x = torch.sigmoid(x @ self.w.T + self.b) * x
        x = F.silu(torch.matmul(x, self.w.t()) + self.b)
        return x.mm(self.w.t()).add(self.b, alpha=2) * self.scale


class ConvNet(nn.Module):
    def __init__(self, c=3, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, groups=2), nn.BatchNorm2d(32), nn.SiLU(),
            nn.AdaptiveAvgPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(128, 33), nn.GELU(), nn.Linear(33, classes))

    def forward(self, x):
        return self.head(self.features(x))


class TwoHeads(nn.Module):
    """Two inputs, a dict output with a view and a residual, a number argument."""

    def __init__(self, n):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(n, 2 * n), nn.Linear(n, 2 * n), nn.Linear(2 * n, n, bias=False)

    def forward(self, x, y, alpha: float = 0.5):
        h = torch.tanh(self.a(x)) + alpha * F.leaky_relu(self.b(y), 0.2)
        out = self.c(h)
        return {"out": out + x, "first": out[:, :3], "h": h}


class NormedScaled(nn.Module):
    """weight_norm Linears (traced through: the weight computed in the graph) and a per-feature
    scale spelled g[None] (folded into broadcasting, so the epilogue stays fused); 2026-11-26."""

    def __init__(self, d):
        super().__init__()
        self.l1 = nn.utils.parametrizations.weight_norm(nn.Linear(d, d))
        self.l2 = nn.utils.parametrizations.weight_norm(nn.Linear(d, d))
        self.g = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)) * self.g[None]) + x


class PackedSplit(nn.Module):   # a packed [q; kv] projection split in forward (fold_constant_slice)
    def __init__(self, d):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(3 * d, d) / d ** 0.5), nn.Parameter(torch.randn(3 * d) * 0.1)
        self.d = d

    def forward(self, q, kv):
        wq, wkv = self.w.split([self.d, 2 * self.d])
        k, v = F.linear(kv, wkv, self.b[self.d:]).chunk(2, -1)
        return torch.relu(F.linear(q, wq, self.b[:self.d])) + F.gelu(k) * v


def mlp(widths, act=nn.ReLU, bias=True):
    mods = []
    for i, o in zip(widths, widths[1:]):
        mods += [nn.Linear(i, o, bias=bias), act()]
    return nn.Sequential(*mods)


def cases():
    """(name, model factory, input factory(batch), batches after the example, options, must rewrite)."""
    vec = lambda n: (lambda b, dt: (torch.randn(b, n, device=DEVICE, dtype=dt),))  # noqa: E731
    out = []
    for h, b in ((7, 3), (100, 1), (257, 17), (1000, 65), (1536, 300)):
        out.append((f"seed 8x{h} b{b}", lambda h=h: mlp([h] * 9), vec(h), b, (1, 5, 2 * b + 1), {}, True))
    out.append(("mlp 33-1000-7 gelu b9", lambda: mlp([33, 1000, 300, 7], nn.GELU), vec(33), 9, (2, 64), {}, True))
    out.append(("mlp nobias tanh b31", lambda: mlp([48, 96, 48], nn.Tanh, bias=False), vec(48), 31, (1,), {}, True))
    out.append(("seed 4x2048 strassen auto b512", lambda: mlp([2048] * 5), vec(2048), 512, (256,),
                {"strassen": "auto"}, True))
    out.append(("seed 2x1024 strassen force b300", lambda: mlp([1024] * 3), vec(1024), 300, (17,),
                {"strassen": "force"}, True))
    out.append(("seed 8x128 fused_mlp force b5", lambda: mlp([128] * 9), vec(128), 5, (1, 40), {"fused_mlp": "force"},
                True))
    out.append(("seed 4x512 gemm force b64", lambda: mlp([512] * 5), vec(512), 64, (3,), {"gemm": "force"}, True))
    out.append(("seed 4x256 no graphs b16", lambda: mlp([256] * 5), vec(256), 16, (4,), {"cuda_graphs": False}, True))
    for h, b in ((100, 1100), (96, 7)):   # residual chains: planned whole (looped / row-wise fused MLP)
        out.append((f"resmlp 6x{h} b{b}", lambda h=h: ResidualMLP(6, h), vec(h), b, (1, 513, 2 * b + 1), {}, True))
    out.append(("block d96 s13", lambda: Block(96), lambda b, dt: (torch.randn(b, 13, 96, device=DEVICE, dtype=dt),),
                2, (1, 3), {}, True))
    out.append(("block d78 s11 gemm force", lambda: Block(78),   # skips: the residual stream in fc2's epilogue
                lambda b, dt: (torch.randn(b, 11, 78, device=DEVICE, dtype=dt),), 3, (1, 20), {"gemm": "force"}, True))
    out.append(("spelled 40", lambda: Spelled(40), vec(40), 6, (1, 11), {}, True))
    out.append(("shrink acts 72 gemm force", lambda: nn.Sequential(   # activations added on 2026-11-25
        nn.Linear(72, 72), nn.CELU(0.5), nn.Linear(72, 72), nn.Softshrink(0.1), nn.Linear(72, 72), nn.Tanhshrink(),
        nn.Linear(72, 72), nn.LogSigmoid(), nn.Linear(72, 72), nn.Softsign(), nn.Linear(72, 72), nn.Hardshrink(0.01),
        nn.Linear(72, 72), nn.Threshold(-0.5, -0.5)), vec(72), 33, (1, 200), {"gemm": "force"}, True))
    # ^ small jumps only: Threshold(0.01, -0.5) jumps by 0.5 where bf16 eager and the fp32 kernel
    #   round a value near 0.01 to different sides (1e-1 off float64 in bf16 on 2026-11-25: refused, as it should)
    out.append(("convnet 3x17x19", ConvNet, lambda b, dt: (torch.randn(b, 3, 17, 19, device=DEVICE, dtype=dt),),
                4, (1,), {}, True))
    out.append(("two heads 24", lambda: TwoHeads(24),
                lambda b, dt: (torch.randn(b, 24, device=DEVICE, dtype=dt), torch.randn(b, 24, device=DEVICE, dtype=dt)),
                5, (1, 9), {}, True))
    out.append(("weight-normed scaled 200", lambda: NormedScaled(200), vec(200), 24, (1, 130), {}, True))
    # weights stored [in, out] and views around the product (benchmarks/blocks.py; 2026-11-26)
    seq = lambda d: (lambda b, dt: (torch.randn(b, 13, d, device=DEVICE, dtype=dt),))  # noqa: E731
    out.append(("gpt2 mlp d96 s13", lambda: GPT2MLP(96), seq(96), 2, (5, 1), {}, True))   # x.view: eager needs
    # a viewable input, so the non-contiguous call (the last batch) is at batch 1
    out.append(("gpt2 mlp d64 s13 gemm force", lambda: GPT2MLP(64), seq(64), 3, (1,), {"gemm": "force"}, True))
    out.append(("x @ W chain 4x200 mlp force", lambda: MatmulChain(200, 4), vec(200), 9, (1, 70), {"fused_mlp": "force"},
                True))
    out.append(("einsum chain 4x72 gemm force", lambda: MatmulChain(72, 4, einsum=True), vec(72), 33, (1, 300),
                {"gemm": "force"}, True))
    out.append(("convnext d24 7x9", lambda: ConvNeXtBlock(24),
                lambda b, dt: (torch.randn(b, 24, 7, 9, device=DEVICE, dtype=dt),), 2, (1, 5), {}, True))
    out.append(("mixer t16 d40", lambda: MixerTokens(16, 40),
                lambda b, dt: (torch.randn(b, 16, 40, device=DEVICE, dtype=dt),), 3, (1, 33), {}, True))
    out.append(("packed split d48 gemm force", lambda: PackedSplit(48),
                lambda b, dt: (torch.randn(b, 48, device=DEVICE, dtype=dt), torch.randn(b, 48, device=DEVICE, dtype=dt)),
                5, (1, 40), {"gemm": "force"}, True))
    return out


def leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def rel_err(got, ref64):
    return max(((g.double() - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(leaves(got), leaves(ref64)))


def check_case(name, make, inputs, batch, later, options, must_rewrite, dtype):
    torch.manual_seed(0)
    model = make().to(DEVICE).eval()
    for m in model.modules():   # statistics that fold into something other than the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    model64 = make().to(DEVICE).eval().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    model = model.to(dtype)
    floor = 1e-5 if dtype == torch.float32 else 1e-2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, inputs(batch, dtype), **options)
        problems = []
        stats = fxfuse.stats(opt)
        if must_rewrite and stats["fused_kernels"] == 0 and stats["library_epilogues"] == 0:
            problems.append(f"nothing rewritten: {stats}")
        with torch.no_grad():
            for b in (batch, batch) + tuple(later):
                args = inputs(b, dtype)
                if b == later[-1]:   # a non-contiguous input of the same values
                    args = tuple(a.transpose(0, -1).contiguous().transpose(0, -1) if a.dim() >= 2 else a
                                 for a in args)
                y = opt(*args)
                kept = [t.clone() for t in leaves(y)]
                ref = model64(*(a.double() for a in args))
                eager_err = rel_err(model(*args), ref)
                err = rel_err(y, ref)
                if not err <= max(4 * eager_err, floor):
                    problems.append(f"batch {b}: rel err {err:.2e} (eager {eager_err:.2e})")
                opt(*inputs(b, dtype))   # call 2 with other data: call 1's output must not move
                synchronize()
                if any(not torch.equal(k, t) for k, t in zip(kept, leaves(y))):
                    problems.append(f"batch {b}: output of a call changed by the next call")
        fxfuse.explain(opt)
        stats = dict(stats, specializations=fxfuse.stats(opt)["specializations"])
    warns = [str(w.message)[:100] for w in caught]
    return problems, stats, warns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--only", default="", help="comma-separated case-name prefixes")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    a = ap.parse_args()
    if a.device not in ("cuda", "cpu"):
        ap.error(f"--device {a.device!r}: cuda or cpu")
    if a.device == "cuda" and not torch.cuda.is_available():   # fuzz36g: a traceback
        ap.error("no CUDA GPU here: --device cpu (with TRITON_INTERPRET=1) runs a smoke test")
    unknown = [d for d in a.dtypes.split(",") if d not in ("fp32", "fp16", "bf16")]
    if unknown:
        ap.error(f"--dtypes: unknown {unknown}; known: fp32, fp16, bf16")
    global DEVICE
    DEVICE = a.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    deadline, failed, ran = time.time() + a.budget_s, 0, 0
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else (
        "cpu (interpreter)" if interpreted else "cpu (torch reference: TRITON_INTERPRET=1 not set)")
    print(f"gpu zoo, {name}, torch {torch.__version__}")
    for dname in a.dtypes.split(","):
        for name, make, inputs, batch, later, options, must in cases():
            if a.only and not any(name.startswith(p) for p in a.only.split(",")):
                continue
            if time.time() > deadline:
                print(f"{dname:5} {name:34} SKIPPED (budget)")
                continue
            ran += 1
            try:
                problems, stats, warns = check_case(name, make, inputs, batch, later, options, must, dtypes[dname])
            except Exception as e:  # noqa: BLE001 -- a crash is a failure of this case
                problems, stats, warns = [f"{type(e).__name__}: {e}"[:300]], {}, []
                traceback.print_exc(limit=4)
            failed += bool(problems)
            summary = f"kern {stats.get('fused_kernels', '?')} lib {stats.get('library_calls', '?')} " \
                      f"specs {stats.get('specializations', '?')}"
            print(f"{dname:5} {name:34} {'FAIL' if problems else 'ok':4} {summary}"
                  + "".join(f"\n      - {p}" for p in problems) + "".join(f"\n      warning: {w}" for w in warns),
                  flush=True)
    print(f"{ran} cases, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
