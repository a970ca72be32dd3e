"""Probe: asymmetric fused Strassen (passes/strassen.py) on the GPU, checked and timed.

    python -m benchmarks.strassen_probe            # 3 shapes x (eager, fxfuse classical, L=1, L=2); < 4 min
    python -m benchmarks.strassen_probe --cases 256x8192,64x4096   # other (batch x hidden) cells
    OUT=dir python -m benchmarks.strassen_probe    # also writes dir/strassen_probe.json

Why: DESIGN.md measured 7 half-size products in one bmm at 0.88x (L=1) and 49 quarter-size
products at 0.76x (L=2) of the classical fp32 product at 4096x8192x8192. This checks how much
of that survives the prefix / fused suffix+bias+ReLU+prefix kernels in a real chain, and
whether the result stays accurate. It is the data the "auto" threshold and the cost model need.

Model: Sequential of 8 x (Linear(h, h), ReLU(inplace=True)), fp32, TF32 off (IEEE fp32).
Per-call ms: warm-up, then calls queued back to back, CUDA events, one synchronization per
repetition, median of 5 (DESIGN.md, "Measuring"). Columns:
  eager          the model as is
  classical      fxfuse.optimize(model, x) with strassen="off" (same runtime: CUDA graph, fused epilogues)
  L1, L2         strassen="force", strassen_levels=1 / 2 (falls back per layer if over tolerance)
  x eager        eager / column: > 1 is faster than eager
  err            ||y - y64|| / ||y64|| against the model in float64, per column
  gemm-only      8 x one classical x @ W.T, and 8 x one Strassen bmm (the library part alone):
                 what is left of the Strassen column above it is prefix/suffix kernel time
  floor          classical FLOPs / 51.6 TFLOP/s (DESIGN.md's measured fp32 ceiling)
Checks (printed as FAIL lines): 8 bmm nodes per Strassen build, generated kernels ran with no
torch-reference fallback, error within 1e-4 of float64.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)   # compiled kernels on the GPU, never the interpreter

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402

CASES = [(4096, 8192), (4096, 4096), (1024, 4096)]     # (batch, hidden)
LAYERS = 8
REPS = 5
DEADLINE_S = 220                                       # stop starting new cells past this
MATMUL_TFLOPS = 51.6


def make_model(h: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(h, h), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers).eval()


def per_call_ms(fn, x, target_ms: float = 150.0) -> float:
    """Median over REPS of (elapsed / calls) with `calls` chosen so a repetition lasts ~target_ms."""
    for _ in range(2):
        fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(x)
    end.record()
    torch.cuda.synchronize()
    calls = max(1, min(50, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(REPS):
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def rel_err(y: torch.Tensor, y64: torch.Tensor) -> float:
    return ((y.double() - y64).norm() / y64.norm()).item()


def gemm_only_ms(batch: int, h: int, levels: int) -> float:
    """8 library products alone: classical x @ W.T (levels 0) or one Strassen bmm (levels >= 1)."""
    s, r = 1 << levels, 7 ** levels
    if levels == 0:
        a, b = torch.randn(batch, h, device="cuda"), torch.randn(h, h, device="cuda")
        fn = lambda _: torch.mm(a, b)  # noqa: E731
    else:
        a = torch.randn(r, batch // s, h // s, device="cuda")
        b = torch.randn(r, h // s, h // s, device="cuda")
        fn = lambda _: torch.bmm(a, b)  # noqa: E731
    return LAYERS * per_call_ms(fn, None)


def check_build(opt, levels: int, notes: list) -> None:
    gm = next(iter(opt._specializations.values())).gm
    bmm = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.bmm]
    if len(bmm) != LAYERS:
        notes.append(f"FAIL L={levels}: {len(bmm)} of {LAYERS} layers rewritten")
    got = sorted({n.meta["fxfuse"].get("levels") for n in bmm})
    errs = [n.meta["fxfuse"].get("error", float("nan")) for n in bmm]
    notes.append(f"L={levels}: levels used {got}; per-layer error on the example input "
                 f"{min(errs, default=0):.1e}..{max(errs, default=0):.1e}; "
                 f"extra weight bytes {sum(n.meta['fxfuse'].get('extra_weight_bytes', 0) for n in bmm) / 2**30:.2f} GiB")
    s = fxfuse.stats(opt)
    if s["kernel_launches"] == 0 or s["reference_fallbacks"]:
        notes.append(f"FAIL L={levels}: kernels did not run as built ({s})")


def run_case(batch: int, h: int) -> dict:
    model = make_model(h).cuda()
    x = torch.randn(batch, h, device="cuda")
    with torch.no_grad():
        y64 = copy.deepcopy(model).double()(x.double())
    row = {"batch": batch, "hidden": h, "notes": []}
    variants = [("eager", None), ("classical", dict(strassen="off")),
                ("L1", dict(strassen="force", strassen_levels=1)), ("L2", dict(strassen="force", strassen_levels=2))]
    for name, options in variants:
        try:
            t0 = time.perf_counter()
            fn = model if options is None else fxfuse.optimize(model, x, strict=True, **options)
            build_s = time.perf_counter() - t0
            if options is not None and options["strassen"] == "force":
                check_build(fn, options["strassen_levels"], row["notes"])
            with torch.no_grad():
                err = rel_err(fn(x), y64)
                ms = per_call_ms(fn, x)
            row[name] = {"ms": ms, "err": err, "build_s": build_s}
            if err > 1e-4:
                row["notes"].append(f"FAIL {name}: error {err:.1e} > 1e-4")
        except Exception as e:  # noqa: BLE001 -- report and continue with the next cell
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            row["notes"].append(f"FAIL {name}: {row[name]['error']}")
        torch.cuda.empty_cache()
    row["gemm_only_ms"] = {f"L{k}": gemm_only_ms(batch, h, k) for k in (0, 1, 2)}
    row["floor_ms"] = 2.0 * batch * h * h * LAYERS / (MATMUL_TFLOPS * 1e9)
    return row


def parse_cases(text: str) -> list:
    """'256x8192,64x4096' -> [(256, 8192), (64, 4096)] (batch x hidden)."""
    try:
        return [tuple(int(v) for v in cell.lower().split("x")) for cell in text.split(",") if cell.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected cells like 256x8192,64x4096, got {text!r}") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=parse_cases, default=CASES, help="batch x hidden cells, comma-separated")
    parser.add_argument("--budget-s", type=float, default=DEADLINE_S, help="start no new cell past this many seconds")
    args = parser.parse_args()
    cases, deadline_s = args.cases, args.budget_s
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False      # IEEE fp32, as DESIGN.md's numbers
    torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, fp32 TF32 off, "
          f"{LAYERS} x (Linear(h, h), ReLU)")
    rows = []
    for batch, h in cases:
        if time.perf_counter() - start > deadline_s:
            print(f"# skipped batch={batch} h={h}: past the {deadline_s:.0f} s deadline")
            continue
        rows.append(run_case(batch, h))
        print(f"# batch={batch} h={h} done at {time.perf_counter() - start:.0f} s", flush=True)
    print("\n| batch | hidden | floor ms | eager ms | classical ms | L1 ms (x eager) | L2 ms (x eager) "
          "| gemm-only ms: classical / L1 / L2 | err eager / L1 / L2 | build s L1 / L2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def ms(k):
            return f"{r[k]['ms']:.2f}" if "ms" in r.get(k, {}) else "err"

        def ratio(k):
            return f"{ms(k)} ({r['eager']['ms'] / r[k]['ms']:.3f}x)" if "ms" in r.get(k, {}) and "ms" in r["eager"] else ms(k)

        def err(k):
            return f"{r[k]['err']:.1e}" if "err" in r.get(k, {}) else "-"

        def build(k):
            return f"{r[k]['build_s']:.0f}" if "build_s" in r.get(k, {}) else "-"
        g = r["gemm_only_ms"]
        print(f"| {r['batch']} | {r['hidden']} | {r['floor_ms']:.2f} | {ms('eager')} | {ms('classical')} | "
              f"{ratio('L1')} | {ratio('L2')} | {g['L0']:.2f} / {g['L1']:.2f} / {g['L2']:.2f} | "
              f"{err('eager')} / {err('L1')} / {err('L2')} | {build('L1')} / {build('L2')} |")
    for r in rows:
        for note in r["notes"]:
            print(f"batch={r['batch']} h={r['hidden']}: {note}")
    print(f"# total {time.perf_counter() - start:.0f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "strassen_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 1 if any(n.startswith("FAIL") for r in rows for n in r["notes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
