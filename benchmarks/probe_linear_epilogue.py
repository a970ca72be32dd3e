"""Probe: per-layer cost of Linear+ReLU spellings inside one CUDA graph (8 layers).

Why: at batch 16 fxfuse's `mm` + fused bias/ReLU kernel measured slower than eager's
`addmm` + `relu` in a CUDA graph; this separates the library's choice of GEMM kernel from
the fused kernel. python -m benchmarks.probe_linear_epilogue
"""
import torch
import torch.nn as nn

import fxfuse



def graphed(fn, x):
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(static)
    return g.replay


def median_us(replay, reps=7, n=200):
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        a.record()
        for _ in range(n):
            replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(out)[reps // 2]


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for h, batch in [(128, 16), (1024, 16), (2048, 16), (1024, 1), (1024, 64)]:
        lins = [nn.Linear(h, h).cuda().eval() for _ in range(8)]
        x = torch.randn(batch, h, device="cuda")
        Ws = [l.weight for l in lins]
        bs = [l.bias for l in lins]
        with torch.no_grad():
            variants = {
                "addmm+relu": lambda t: [t := torch.relu(torch.addmm(b, t, W.t())) for W, b in zip(Ws, bs)][-1],
                "mm+add+relu": lambda t: [t := torch.relu(torch.mm(t, W.t()) + b) for W, b in zip(Ws, bs)][-1],
                "linear_nobias": lambda t: [t := torch.nn.functional.linear(t, W) for W in Ws][-1],
                "addmm_only": lambda t: [t := torch.addmm(b, t, W.t()) for W, b in zip(Ws, bs)][-1],
                "_addmm_activation": lambda t: [t := torch._addmm_activation(b, t, W.t()) for W, b in zip(Ws, bs)][-1],
            }
            row = [h, batch]
            for name, fn in variants.items():
                row.append(f"{median_us(graphed(fn, x)):.1f}")
            seq = nn.Sequential(*[m for l in lins for m in (l, nn.ReLU())]).eval()
            opt = fxfuse.optimize(seq, x)
            row.append(f"{median_us(lambda: opt(x)):.1f}")
        rows.append(row)
    from tabulate import tabulate
    print(tabulate(rows, headers=["h", "batch"] + list(variants) + ["fxfuse call"]))


if __name__ == "__main__":
    main()
