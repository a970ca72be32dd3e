"""Probe: a whole narrow MLP in ONE kernel spread over many SMs, layers separated by a grid barrier.

    python -m benchmarks.grid_sync_probe [--cells 1x128,16x512,...] [--budget-s 200]

Why: the fused MLP kernel (mlp_kernel.py) gives each program whole rows, so at batch 1 one SM
does all the work (30-51 us for 8 x 128, fused_form_probe_20261123.txt), while the per-layer
plan pays ~1.4-2 us per kernel boundary in its graph (11.5 us for 8 x 128). Here every program
owns BN output columns of every layer: it loads its weight slice of layer l+1 before waiting
for layer l (weights do not depend on activations), so the chain's critical path is one
activation exchange through L2 plus a barrier per layer, not a kernel launch.

The barrier: each program stores its slice of the layer's output, syncs its threads, adds 1 to a
counter (release), and polls until the counter reaches (l + 1) * NPROG (acquire). At the end,
the last program to leave resets the counters for the next launch. A bounded poll turns a bug
into a wrong result (checked against float64) instead of a hang. The programs must all be
resident at once: NPROG <= the SM count, one program per SM's worth of resources.
"""
import argparse
import time

import torch
import triton
import triton.language as tl

from benchmarks.fused_form_probe import LAYERS, default_plan
from benchmarks.mlp_probe import graphed, max_rel_err, per_call_us
MAX_POLLS = 1 << 22


@triton.jit
def grid_sync_mlp(x_ptr, w_ptr, b_ptr, h_ptr, out_ptr, bar_ptr, M,
                  L: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, NPROG: tl.constexpr,
                  VOLATILE_POLL: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BN + tl.arange(0, BN)
    k = tl.arange(0, H)
    w = tl.load(w_ptr + cols[:, None] * H + k[None, :])                     # [BN, H] of layer 0
    for layer in tl.static_range(L):
        b = tl.load(b_ptr + layer * H + cols)
        if layer + 1 < L:                                                    # prefetch the next slice
            w_next = tl.load(w_ptr + (layer + 1) * H * H + cols[:, None] * H + k[None, :])
        for r in range(M):
            if layer == 0:
                a = tl.load(x_ptr + r * H + k)
            else:
                a = tl.load(h_ptr + ((layer - 1) % 2) * M * H + r * H + k, cache_modifier=".cg")
            y = tl.maximum(tl.sum(a[None, :] * w, axis=1) + b, 0.0)
            if layer + 1 < L:
                tl.store(h_ptr + (layer % 2) * M * H + r * H + cols, y)
            else:
                tl.store(out_ptr + r * H + cols, y)
        if layer + 1 < L:
            tl.debug_barrier()
            tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
            target = (layer + 1) * NPROG
            polls = 0
            if VOLATILE_POLL:
                seen = tl.load(bar_ptr, volatile=True)
                while (seen < target) & (polls < 4194304):
                    seen = tl.load(bar_ptr, volatile=True)
                    polls += 1
                tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            else:
                seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
                while (seen < target) & (polls < 4194304):
                    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
                    polls += 1
            tl.debug_barrier()
            w = w_next
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == NPROG - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


def cell(batch, h, deadline, sms):
    _, layers, x, y64, us, err = default_plan(batch, h)
    rows = [(f"{batch}x{h}", "default plan (whole graph)", "", us, err)]
    w = torch.stack([l.weight.detach() for l in layers]).contiguous()
    b = torch.stack([l.bias.detach() for l in layers]).contiguous()
    hbuf = torch.empty(2, batch, h, device="cuda")
    bar = torch.zeros(2, dtype=torch.int32, device="cuda")
    for nprog in (16, 32, 64, 128):
        if h % nprog or nprog > sms:
            continue
        bn = h // nprog
        for warps in (4, 8):
            for poll in (0, 1):
                name = f"nprog {nprog} bn {bn} w{warps} {'volatile' if poll else 'atomic'}"
                if time.time() > deadline:
                    rows.append((f"{batch}x{h}", name, "", float("nan"), "deadline"))
                    continue
                out = torch.empty(batch, h, device="cuda")

                def run(xx, nprog=nprog, bn=bn, warps=warps, poll=poll, out=out):
                    grid_sync_mlp[(nprog,)](xx, w, b, hbuf, out, bar, batch, L=LAYERS, H=h, BN=bn, NPROG=nprog,
                                            VOLATILE_POLL=poll, num_warps=warps)
                    return out
                try:
                    run(x)
                    torch.cuda.synchronize()
                    err_first = max_rel_err(out, y64)
                    us, y = graphed_time(run, x)
                    err = max(err_first, max_rel_err(y, y64))
                    left = bar.tolist()
                    note = f"{err:.1e}" + ("" if left == [0, 0] else f" counters left {left}")
                    rows.append((f"{batch}x{h}", name, kernel_regs(grid_sync_mlp), us, note))
                except Exception as e:  # noqa: BLE001 -- a probe: record and go on
                    rows.append((f"{batch}x{h}", name, "", float("nan"), f"{type(e).__name__}: {str(e)[:80]}"))
    return rows


def graphed_time(fn, x):
    replay, out = graphed(fn, x)
    return per_call_us(replay), out


def kernel_regs(kernel) -> str:
    """Registers/spills of the kernel's last compiled variant (the probes print them per row)."""
    try:
        cache = kernel.device_caches[torch.cuda.current_device()][0]
        ck = list(cache.values())[-1]
        return f"{ck.n_regs}/{ck.n_spills}"
    except Exception:  # noqa: BLE001 -- Triton internals differ between versions
        return "?"


def probe_args(title: str, default_cells: str) -> tuple:
    """(arguments, deadline, SM count) from the probes' command line (--cells, --budget-s), after
    the title line; each probe's cell() then gives rows for print_rows."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=default_cells)
    ap.add_argument("--budget-s", type=float, default=200)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    deadline = time.time() + a.budget_s
    print(f"{title}, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{LAYERS} layers fp32 (TF32 off); GPU us of the kernel alone in a CUDA graph")
    return a, deadline, sms


def print_rows(rows, name_width: int = 36) -> None:
    """Rows (cell, variant, regs/spills, us, error or note) as the probes' table."""
    for r in rows:
        err = f"{r[4]:.1e}" if isinstance(r[4], float) else r[4]
        print(f"{r[0]:8} {r[1]:{name_width}} {r[2]!s:>11} {r[3]:9.2f}  {err}", flush=True)


def main():
    a, deadline, sms = probe_args("grid sync probe", "1x128,16x128,1x512,16x512,1x1024,16x1024")
    print(f"{'cell':8} {'variant':36} {'regs/spills':>11} {'us':>9}  err")
    for c in a.cells.split(","):
        batch, h = map(int, c.split("x"))
        print_rows(cell(batch, h, deadline, sms))


if __name__ == "__main__":
    main()
