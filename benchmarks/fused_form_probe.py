"""Probe: why the fully fused MLP kernel is slow at small batch, and which form fixes it.

    python -m benchmarks.fused_form_probe [--budget-s 240] [--cells 1x128,16x128,...]

The fused 8 x 128 kernel took 51 us at batch 1 (prefetch_probe_20261123.txt) where its 512 KB
of weights stream through one SM in a few us. Suspicion: the unrolled straight-line code lets
the compiler hoist every layer's weight loads to the top (a load is pure to LLVM), so the
registers overflow and the weights go through local memory. Variants: the generated kernel
(row-wise, 4 or 8 warps; tl.dot with 16 rows) and a hand-written kernel that loops over
identical layers at run time (width 128 only). A first run (fused_form_probe_20261123.txt) also
had a barrier between layers and each Linear in a one-trip runtime loop (a KernelConfig field,
removed after it): no spills anywhere in the generated kernel, and the one-program-per-row
forms take 30-51 us for 8 x 128 whatever the variant, against 11.3 us for the per-layer plan.
Per variant: registers and spills of the compiled kernel, GPU time of the kernel alone in a
CUDA graph (median of 5 blocks of back-to-back replays), error against float64. The default
plan's whole graph (per-layer GEMMs) is the row to beat.
"""
import argparse
import time

import torch
import triton
import triton.language as tl

import fxfuse
from fxfuse.mlp_kernel import FusedMLP, KernelConfig, Linear, MLPSpec, Pointwise
from fxfuse.kernel import triton_cdiv
from benchmarks.mlp_probe import graphed, max_rel_err, per_call_us

LAYERS = 8


@triton.jit
def loop_mlp(x_ptr, w_ptr, b_ptr, out_ptr, M, L, H: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    k = tl.arange(0, H)
    h = tl.load(x_ptr + rows[:, None] * H + k[None, :], mask=row_ok[:, None], other=0.0)
    for layer in range(L):
        w = tl.load(w_ptr + layer * H * H + k[:, None] * H + k[None, :])       # [N, K]
        acc = tl.sum(h[:, None, :] * w[None, :, :], axis=2)
        b = tl.load(b_ptr + layer * H + k)
        h = tl.maximum(acc + b[None, :], 0.0)
    tl.store(out_ptr + rows[:, None] * H + k[None, :], h, mask=row_ok[:, None])


def seed(h):
    torch.manual_seed(0)
    mods = []
    for _ in range(LAYERS):
        mods += [torch.nn.Linear(h, h), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods).eval().cuda()


def spec_of(layers):
    widths, steps = [layers[0].in_features], []
    for k, lin in enumerate(layers):
        n = lin.out_features
        steps += [Linear(len(widths), len(widths) - 1, k),
                  Pointwise(len(widths) + 1, "add", (("value", len(widths)), ("vector", k))),
                  Pointwise(len(widths) + 2, "relu", (("value", len(widths) + 1),))]
        widths += [n, n, n]
    return MLPSpec(tuple(widths), tuple(steps), len(widths) - 1, torch.float32)


def variants(batch):
    out = []
    for warps in (4, 8):
        out.append((f"rows w{warps}", KernelConfig(block_m=1, rowwise=True, num_warps=warps)))
    if batch >= 16:
        out.append(("dot16 w4", KernelConfig(block_m=16, num_warps=4)))
    return out


def time_graph(fn, x):
    replay, out = graphed(fn, x)
    return per_call_us(replay), out


def default_plan(batch, h):
    """(model, its Linears, x, float64 reference, GPU us and error of fxfuse's default plan's
    whole graph): the row every probe variant is compared with."""
    model = seed(h)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    x = torch.randn(batch, h, device="cuda")
    with torch.no_grad():
        y64 = model.double()(x.double())
        model.float()
    opt = fxfuse.optimize(model, x)
    spec = next(iter(opt._specializations.values()))
    us = per_call_us(spec.launcher.replay) if spec.graph is not None else float("nan")
    with torch.no_grad():
        err = max_rel_err(opt(x), y64)
    return model, layers, x, y64, us, err


def cell(batch, h, deadline):
    model, layers, x, y64, us, err = default_plan(batch, h)
    rows = [(f"{batch}x{h}", "default plan (whole graph)", "", "", us, err)]
    ref = torch.fx.symbolic_trace(model)
    for name, cfg in variants(batch):
        if time.time() > deadline:
            rows.append((f"{batch}x{h}", name, "", "", float("nan"), "deadline"))
            continue
        try:
            mod = FusedMLP(spec_of(layers), [l.weight for l in layers], [l.bias for l in layers], ref, (),
                           config=cfg).cuda()
            out = torch.empty(batch, h, device="cuda")
            ck = mod.compiled()[(triton_cdiv(batch, cfg.block_m),)](
                x, out, mod.packed_weights, mod.packed_vectors, batch, x.stride(0), out.stride(0),
                BLOCK_M=cfg.block_m, num_warps=cfg.num_warps)
            us, y = time_graph(mod, x)
            rows.append((f"{batch}x{h}", name, getattr(ck, "n_regs", "?"), getattr(ck, "n_spills", "?"), us,
                         max_rel_err(y, y64)))
        except Exception as e:  # noqa: BLE001 -- a probe: record and go on
            rows.append((f"{batch}x{h}", name, "", "", float("nan"), f"{type(e).__name__}: {str(e)[:80]}"))
    if h == 128:
        w = torch.stack([l.weight.detach() for l in layers]).contiguous()
        b = torch.stack([l.bias.detach() for l in layers]).contiguous()
        for bm in (1, 2, 4, 8, 16):
            for warps in (4, 8):
                out = torch.empty(batch, h, device="cuda")

                def run(xx, bm=bm, warps=warps, out=out):
                    loop_mlp[(triton_cdiv(batch, bm),)](xx, w, b, out, batch, LAYERS, H=h, BM=bm, num_warps=warps)
                    return out
                try:
                    ck = loop_mlp[(triton_cdiv(batch, bm),)](x, w, b, out, batch, LAYERS, H=h, BM=bm, num_warps=warps)
                    us, y = time_graph(run, x)
                    rows.append((f"{batch}x{h}", f"hand loop bm{bm} w{warps}", ck.n_regs, ck.n_spills, us,
                                 max_rel_err(y, y64)))
                except Exception as e:  # noqa: BLE001
                    rows.append((f"{batch}x{h}", f"hand loop bm{bm} w{warps}", "", "", float("nan"),
                                 f"{type(e).__name__}: {str(e)[:80]}"))
    return rows


def kernel_row(cell_name, name, launch, fn, x, y64) -> tuple:
    """One probe row (cell, variant, regs, spills, us, err) for a kernel variant: launch() compiles
    and runs it once and returns the compiled kernel; fn(x) is what the CUDA graph captures. A
    failure is recorded in the row (a probe goes on with the next variant)."""
    try:
        ck = launch()
        replay, y = graphed(fn, x)
        return (cell_name, name, getattr(ck, "n_regs", "?"), getattr(ck, "n_spills", "?"), per_call_us(replay),
                max_rel_err(y, y64))
    except Exception as e:  # noqa: BLE001 -- a probe: record and go on
        return (cell_name, name, "", "", float("nan"), f"{type(e).__name__}: {str(e)[:80]}")


def probe_main(title: str, default_cells: str, budget_s: float, run_cell, variant_width: int = 28) -> None:
    """The command line and table of the kernel probes: --cells BxH,..., --budget-s; run_cell(batch,
    hidden, deadline) gives rows (cell, variant, regs, spills, us, err)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=default_cells)
    ap.add_argument("--budget-s", type=float, default=budget_s)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    deadline = time.time() + a.budget_s
    print(f"{title}, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{LAYERS} layers fp32 (TF32 off); GPU us of the kernel alone in a CUDA graph")
    print(f"{'cell':8} {'variant':{variant_width}} {'regs':>5} {'spills':>7} {'us':>9}  err")
    for c in a.cells.split(","):
        batch, h = map(int, c.split("x"))
        for r in run_cell(batch, h, deadline):
            err = f"{r[5]:.1e}" if isinstance(r[5], float) else r[5]
            print(f"{r[0]:8} {r[1]:{variant_width}} {r[2]!s:>5} {r[3]!s:>7} {r[4]:9.2f}  {err}", flush=True)


def main():
    probe_main("fused form probe", "1x128,16x128,64x128,256x128,1x256,16x256,64x256,1x512,16x512", 240, cell)


if __name__ == "__main__":
    main()
