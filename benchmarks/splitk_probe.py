"""Probe: split-K through the library's batched GEMM, for fp32 Linear layers with few rows.

    python -m benchmarks.splitk_probe [--cells 64x2048,64x4096] [--splits 2,4,8]

Why: at batch 64 / hidden 4096 (fp32, TF32 off) cuBLAS's GEMM reached 62% of the FLOP floor
(mlp_20261125-153333): a 64-row output has few tiles for 132 SMs. Splitting K into S slices,
bmm([S, M, K/S] x [S, K/S, N]) -> [S, M, N] gives S times the tiles, and the S partials are
summed in the epilogue kernel that already adds the bias and applies the ReLU. Both operands
are views (no copy): x [M, K] as [S, M, K/S] and W^T [K, N] as [S, K/S, N].

Times 8 layers of (Linear + ReLU) in one CUDA graph, GPU time per chain (us), per spelling:
addmm = F.linear with bias, then ReLU (eager's kernels); act = torch._addmm_activation (cuBLASLt's
bias + ReLU epilogue, one kernel per layer); mm = mm + one Triton kernel adding the
bias and applying the ReLU (fxfuse's library plan); split S = bmm over S slices of K + the same
kernel summing the S partials first. Speedups are against the faster of addmm and mm.
"""
import argparse

import torch
import triton

from fxfuse.library_choice import _sum_bias_relu, _time_us   # the epilogue fxfuse's split-K choice times


def chain(kind, x, weights, biases, splits):
    m = x.shape[0]
    n = weights[0].shape[0]
    parts = torch.empty(splits, m, n, device=x.device, dtype=x.dtype)
    outs = [torch.empty(m, n, device=x.device, dtype=x.dtype) for _ in range(2)]

    def run():
        y = x
        for i, (w, b) in enumerate(zip(weights, biases)):
            if kind == "addmm":
                y = torch.relu(torch.nn.functional.linear(y, w, b))
                continue
            if kind == "act":   # cuBLASLt's bias + ReLU epilogue: one kernel per layer
                y = torch._addmm_activation(b, y, w.t())
                continue
            k = w.shape[1]
            if splits == 1:
                torch.mm(y, w.t(), out=parts[0])
            a = y.view(m, splits, k // splits).transpose(0, 1)
            bt = w.t().reshape(splits, k // splits, n)          # a view: W^T's K rows are contiguous
            if splits > 1:
                torch.bmm(a, bt, out=parts)
            y = outs[i % 2]
            grid = (triton.cdiv(m * n, 1024),)
            _sum_bias_relu[grid](parts, b, y, m * n, n, S=splits, BLOCK=1024)
        return y
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="64x1024,64x2048,64x4096,64x8192,256x512,256x1024,"
                    "256x2048,256x4096,256x8192,1024x512,1024x1024,1024x2048,4096x512,4096x1024,16x4096,16x8192")
    ap.add_argument("--splits", default="2,4,8,16", help="'' for none")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--choice", action="store_true",
                    help="print fxfuse's measured split-K choice per cell (one layer) instead of timing chains")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    if args.choice:
        from fxfuse.library_choice import split_k_library_gemm, split_k_slices
        for cell in args.cells.split(","):
            m, h = map(int, cell.split("x"))
            print(m, h, split_k_slices(m, h, h, torch.float32, dev),
                  split_k_library_gemm(m, h, h, torch.float32, dev, False), flush=True)
        return
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"fp32, TF32 off; {args.layers} layers, GPU us per chain in one CUDA graph")
    for cell in args.cells.split(","):
        m, h = map(int, cell.split("x"))
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, h, device=dev, generator=gen)
        ws = [torch.randn(h, h, device=dev, generator=gen) / h ** 0.5 for _ in range(args.layers)]
        bs = [torch.randn(h, device=dev, generator=gen) for _ in range(args.layers)]
        ref = chain("addmm", x, ws, bs, 1)()
        row = {"addmm": _time_us(chain("addmm", x, ws, bs, 1), target_us=3000),
               "mm": _time_us(chain("split", x, ws, bs, 1), target_us=3000),
               "act": _time_us(chain("act", x, ws, bs, 1), target_us=3000)}
        errs = []
        for s in (map(int, args.splits.split(",")) if args.splits else []):
            if h % s or h // s < 32:
                continue
            fn = chain("split", x, ws, bs, s)
            errs.append(((fn() - ref).norm() / ref.norm()).item())
            row[f"split {s}"] = _time_us(fn, target_us=3000)
        base = min(row["addmm"], row["mm"])
        best = min((v, k) for k, v in row.items() if k.startswith("split") or k == "act")
        errs.append(((chain("act", x, ws, bs, 1)() - ref).norm() / ref.norm()).item())
        print(f"{m:>5} x {h:<5} " + "  ".join(f"{k} {v:.1f}" for k, v in row.items())
              + f"  | best {best[1]}: {base / best[0]:.2f}x  (max rel err {max(errs):.2g})", flush=True)
        del ws, bs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
