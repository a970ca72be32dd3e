"""Probe: a whole narrow MLP in ONE kernel over many SMs, activations exchanged with the flag in
the data (NCCL's "LL" protocol) instead of a grid barrier.

    python -m benchmarks.ll_exchange_probe [--cells 1x128,1x512,16x512,1x1024] [--budget-s 200]

Why: grid_sync_probe (grid_sync_probe_20261123.txt) split every layer's columns over programs
and separated layers with a counter barrier (release add, acquire poll, then the exchange read):
8 x 128 at batch 1 took 11.4 us, what the per-layer plan's graph takes (11.3), so a barrier cost
about what a kernel boundary with PDL costs (~1.4 us). Most of that is three L2 round trips in
series: the release (wait for every store to be acknowledged), the poll, the read. Here each
fp32 result is stored as ONE 8-byte word, (epoch << 32) | bits, so a reader that sees the epoch
sees the value: no fence, no counter, one round trip (the poll is the read). The epoch is the
launch count, kept per program in its own slot (every launch runs every program, so the slots
agree); a word left by the previous launch carries the previous epoch and is not taken.

Forms: batch 1, each program owns BN columns, reduces [BN, H] * [H] (its weights for every
layer loaded up front, or one layer ahead); batch > 1, tl.dot of the [M, H] activations with
the [H, BN] weight slice (IEEE fp32), one layer ahead. Per variant: GPU us of the kernel alone in
a CUDA graph (median of 5 blocks of back-to-back replays), error against float64 after the
timing (thousands of launches later: a stale word would show), and the same for fxfuse's
default plan's whole graph. "runtime floor" is fxfuse's whole call for a model of one ReLU at
the cell's shape: what a call costs apart from the kernels.
A bounded poll turns a bug into a wrong result instead of a hang. All programs must be resident
at once (NPROG <= SMs; nothing else runs).
"""
import os
import time

import torch
import triton
import triton.language as tl

import fxfuse
from benchmarks.fused_form_probe import LAYERS, default_plan
from benchmarks.grid_sync_probe import kernel_regs, print_rows, probe_args
from benchmarks.mlp_probe import graphed, max_rel_err, per_call_us

MAX_POLLS = 1 << 20
ROW_FORM = os.environ.get("LL_ROW_FORM", "1") == "1"   # LL_ROW_FORM=0: chunk forms only
DOT_FORM = False   # tl.dot of the whole [M, H] activations: 145-218 us at 16 x 512 (ll_exchange_probe_20261126.txt)


@triton.jit
def _exchange(xb_ptr, y, cols, e, rows, k, M: tl.constexpr, H: tl.constexpr, MAXP: tl.constexpr):
    """Store this program's [M, BN] results tagged with epoch e; return the whole [M, H] once
    every word carries e."""
    packed = (e.to(tl.int64) << 32) | (y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.store(xb_ptr + rows[:, None] * H + cols[None, :], packed)
    p = xb_ptr + rows[:, None] * H + k[None, :]
    v = tl.load(p, volatile=True)
    ready = (v >> 32) == e
    polls = 0
    while (tl.sum(tl.sum(ready.to(tl.int32), axis=1), axis=0) < M * H) & (polls < MAXP):
        v = tl.where(ready, v, tl.load(p, volatile=True))
        ready = (v >> 32) == e
        polls += 1
    return (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def ll_mlp_row(x_ptr, w_ptr, b_ptr, xb_ptr, ep_ptr, out_ptr,
               L: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, PRELOAD: tl.constexpr, MAXP: tl.constexpr):
    """Batch 1 (M = 1 as a [1, H] tile)."""
    pid = tl.program_id(0)
    e = tl.load(ep_ptr + pid) + 1
    cols = pid * BN + tl.arange(0, BN)
    k = tl.arange(0, H)
    rows = tl.arange(0, 1)
    a = tl.load(x_ptr + rows[:, None] * H + k[None, :])                       # [1, H]
    w = tl.load(w_ptr + cols[:, None] * H + k[None, :])                       # [BN, H]
    if PRELOAD:
        w1 = tl.load(w_ptr + 1 * H * H + cols[:, None] * H + k[None, :])
        w2 = tl.load(w_ptr + 2 * H * H + cols[:, None] * H + k[None, :])
        w3 = tl.load(w_ptr + 3 * H * H + cols[:, None] * H + k[None, :])
    for layer in tl.static_range(L):
        if PRELOAD:
            if layer + 4 < L:
                w_next = tl.load(w_ptr + (layer + 4) * H * H + cols[:, None] * H + k[None, :])
        else:
            if layer + 1 < L:
                w_next = tl.load(w_ptr + (layer + 1) * H * H + cols[:, None] * H + k[None, :])
        b = tl.load(b_ptr + layer * H + cols)
        y = tl.maximum(tl.sum(a * w, axis=1) + b, 0.0)[None, :]              # [1, BN]
        if layer + 1 < L:
            a = _exchange(xb_ptr + layer * H, y, cols, e, rows, k, 1, H, MAXP)
            if PRELOAD:
                w, w1, w2 = w1, w2, w3
                if layer + 4 < L:
                    w3 = w_next
            else:
                w = w_next
        else:
            tl.store(out_ptr + rows[:, None] * H + cols[None, :], y)
    tl.store(ep_ptr + pid, e)


@triton.jit
def ll_mlp_dot(x_ptr, w_ptr, b_ptr, xb_ptr, ep_ptr, out_ptr,
               L: tl.constexpr, M: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, MAXP: tl.constexpr):
    """M rows (M >= 16, a power of two) through tl.dot against the [H, BN] weight slice."""
    pid = tl.program_id(0)
    e = tl.load(ep_ptr + pid) + 1
    cols = pid * BN + tl.arange(0, BN)
    k = tl.arange(0, H)
    rows = tl.arange(0, M)
    a = tl.load(x_ptr + rows[:, None] * H + k[None, :])                       # [M, H]
    wt = tl.load(w_ptr + cols[None, :] * H + k[:, None])                      # [H, BN]
    for layer in tl.static_range(L):
        if layer + 1 < L:
            wt_next = tl.load(w_ptr + (layer + 1) * H * H + cols[None, :] * H + k[:, None])
        b = tl.load(b_ptr + layer * H + cols)
        y = tl.maximum(tl.dot(a, wt, input_precision="ieee") + b[None, :], 0.0)
        if layer + 1 < L:
            a = _exchange(xb_ptr + layer * M * H, y, cols, e, rows, k, M, H, MAXP)
            wt = wt_next
        else:
            tl.store(out_ptr + rows[:, None] * H + cols[None, :], y)
    tl.store(ep_ptr + pid, e)


@triton.jit
def ll_mlp_chunks(x_ptr, w_ptr, b_ptr, xb_ptr, ep_ptr, out_ptr, L: tl.constexpr, M: tl.constexpr,
                  H: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, MAXP: tl.constexpr):
    """M rows (a power of two) as [M, BN, KB] products over K steps: each step waits only for the
    KB columns it reads, and W's step tile is loaded before the wait (it does not depend on them)."""
    pid = tl.program_id(0)
    e = tl.load(ep_ptr + pid) + 1
    cols = pid * BN + tl.arange(0, BN)
    rows = tl.arange(0, M)
    offs_k = tl.arange(0, KB)
    for layer in tl.static_range(L):
        acc = tl.zeros([M, BN], dtype=tl.float32)
        for kk in tl.static_range(0, H, KB):
            k = kk + offs_k
            w = tl.load(w_ptr + layer * H * H + cols[:, None] * H + k[None, :])          # [BN, KB]
            if layer == 0:
                a = tl.load(x_ptr + rows[:, None] * H + k[None, :])
            else:
                p = xb_ptr + (layer - 1) * M * H + rows[:, None] * H + k[None, :]
                v = tl.load(p, volatile=True)
                ready = (v >> 32) == e
                polls = 0
                while (tl.sum(tl.sum(ready.to(tl.int32), axis=1), axis=0) < M * KB) & (polls < MAXP):
                    v = tl.where(ready, v, tl.load(p, volatile=True))
                    ready = (v >> 32) == e
                    polls += 1
                a = (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
        b = tl.load(b_ptr + layer * H + cols)
        y = tl.maximum(acc + b[None, :], 0.0)
        if layer + 1 < L:
            packed = (e.to(tl.int64) << 32) | (y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
            tl.store(xb_ptr + layer * M * H + rows[:, None] * H + cols[None, :], packed)
        else:
            tl.store(out_ptr + rows[:, None] * H + cols[None, :], y)
    tl.store(ep_ptr + pid, e)


def runtime_floor(batch, h):
    """fxfuse's whole call for relu(x): guards, input copy, one-kernel graph replay, handout."""
    model = torch.nn.Sequential(torch.nn.ReLU()).eval().cuda()
    x = torch.randn(batch, h, device="cuda")
    opt = fxfuse.optimize(model, x)
    with torch.no_grad():
        return per_call_us(lambda: opt(x))


def empty_graph_us():
    x = torch.randn(1, device="cuda")
    replay, _ = graphed(lambda t: t.add_(0), x)
    return per_call_us(replay)


def cell(batch, h, deadline, sms):
    _, layers, x, y64, us, err = default_plan(batch, h)
    name = f"{batch}x{h}"
    rows = [(name, "default plan (whole graph)", "", us, err)]
    with torch.no_grad():
        rows.append((name, "runtime floor (fxfuse relu(x), whole call)", "", runtime_floor(batch, h), ""))
    w = torch.stack([l.weight.detach() for l in layers]).contiguous()
    b = torch.stack([l.bias.detach() for l in layers]).contiguous()
    xb = torch.zeros(LAYERS, batch, h, dtype=torch.int64, device="cuda")
    variants = []
    if batch == 1 and ROW_FORM:
        for bn in (2, 4, 8, 16, 32):
            for preload in (0, 1):
                for warps in (1, 2, 4):
                    if not 8 <= h // bn <= 128:
                        continue
                    variants.append((f"row bn {bn} pre{preload} w{warps}", bn, dict(PRELOAD=preload), warps))
    if batch & (batch - 1) == 0:
        for bn in (2, 4, 8):
            for kb in (32, 64, 128):
                for warps in (2, 4):
                    if 8 <= h // bn <= 128 and batch * bn * kb <= 4096 * warps and kb <= h:
                        variants.append((f"chunks bn {bn} kb {kb} w{warps}", bn, dict(KB=kb), warps))
    if batch >= 16 and batch & (batch - 1) == 0 and DOT_FORM:
        for bn in (16, 32):
            for warps in (4, 8):
                variants.append((f"dot bn {bn} w{warps}", bn, {}, warps))
    for vname, bn, extra, warps in variants:
        nprog = h // bn
        if h % bn or nprog > sms:
            continue
        vname = f"nprog {nprog} {vname}"
        if time.time() > deadline:
            rows.append((name, vname, "", float("nan"), "deadline"))
            continue
        ep = torch.zeros(nprog, dtype=torch.int32, device="cuda")
        xb.zero_()
        out = torch.empty(batch, h, device="cuda")

        def run(xx, bn=bn, extra=extra, warps=warps, out=out, ep=ep, nprog=nprog):
            if "KB" in extra:
                ll_mlp_chunks[(nprog,)](xx, w, b, xb, ep, out, L=LAYERS, M=batch, H=h, BN=bn, MAXP=MAX_POLLS,
                                        num_warps=warps, **extra)
            elif batch == 1:
                ll_mlp_row[(nprog,)](xx, w, b, xb, ep, out, L=LAYERS, H=h, BN=bn, MAXP=MAX_POLLS,
                                     num_warps=warps, **extra)
            else:
                ll_mlp_dot[(nprog,)](xx, w, b, xb, ep, out, L=LAYERS, M=batch, H=h, BN=bn, MAXP=MAX_POLLS,
                                     num_warps=warps)
            return out
        try:
            run(x)
            torch.cuda.synchronize()
            err_first = max_rel_err(out, y64)
            replay, static_out = graphed(run, x)
            us = per_call_us(replay)
            replay()
            torch.cuda.synchronize()
            err = max(err_first, max_rel_err(static_out, y64))
            epochs = set(ep.tolist())
            note = f"{err:.1e}" + ("" if len(epochs) == 1 else f" epochs differ {sorted(epochs)[:4]}")
            rows.append((name, vname, kernel_regs(ll_mlp_chunks if 'KB' in extra else ll_mlp_row if batch == 1 else ll_mlp_dot), us, note))
        except Exception as ex:  # noqa: BLE001 -- a probe: record and go on
            rows.append((name, vname, "", float("nan"), f"{type(ex).__name__}: {str(ex)[:100]}"))
    return rows


def main():
    a, deadline, sms = probe_args("LL exchange probe", "1x128,1x512,16x512,1x1024,16x128")
    print(f"empty graph (one tiny kernel): {empty_graph_us():.2f} us")
    print(f"{'cell':8} {'variant':44} {'regs/spills':>11} {'us':>9}  err")
    for c in a.cells.split(","):
        batch, h = map(int, c.split("x"))
        print_rows(cell(batch, h, deadline, sms), name_width=44)


if __name__ == "__main__":
    main()
