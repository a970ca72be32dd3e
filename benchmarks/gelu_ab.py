"""A/B of the fused tanh-GELU expression (stop 48): `x * sigmoid(2u)` (now) against stop 47's
`0.5 * x * (1 + tanh(u))`, which lost the negative tail to cancellation. Both arms build the same
models with fxfuse (GPT-2's MLP block, whose GELU sits in a GEMM epilogue or a pointwise kernel by
the cost model's choice, and a lone GELU over a large tensor), interleaved, CUDA events around 200
calls, median of 7 repetitions; eager and torch.compile in the same run for scale.

    python -m benchmarks.gelu_ab [--out DIR]
"""
import argparse
import dataclasses
import json
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse import ops

from .blocks import GPT2MLP

OLD = lambda a, approximate="none": (   # noqa: E731 -- stop 47's template, as it was
    f"(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))" if approximate == "none" else
    f"(0.5 * {a} * (1.0 + _tanh(0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a}))))")


class LoneGelu(nn.Module):
    def forward(self, x):
        return F.gelu(x * 1.0, approximate="tanh")


CASES = {"gpt2-mlp 8x128x768": (lambda: GPT2MLP(768), (8, 128, 768)),
         "gpt2-mlp-small 1x32x256": (lambda: GPT2MLP(256), (1, 32, 256)),
         "gelu 64x4096x1024": (LoneGelu, (64, 4096, 1024))}


def _with_gelu(expr):
    """Swap the gelu template in every table that holds the op (a frozen dataclass: replaced)."""
    old = ops.BY_NAME["gelu"]
    new = dataclasses.replace(old, expr=expr)
    for table in (ops.BY_NAME, ops.POINTWISE):
        for k, v in list(table.items()):
            if v is old:
                table[k] = new
    return old, new


def _restore(old, new):
    for table in (ops.BY_NAME, ops.POINTWISE):
        for k, v in list(table.items()):
            if v is new:
                table[k] = old


def _time(fn, x, calls=200, reps=7):
    times = []
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / calls)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name, (make, shape) in CASES.items():
        torch.manual_seed(0)
        model = make().cuda().eval()
        x = torch.randn(*shape, device="cuda")
        with torch.no_grad():
            ref = model.double()(x.double())
            model.float()
        tools = {"eager": model, "compile": torch.compile(model)}
        tools["fxfuse (sigmoid)"] = fxfuse.optimize(model, x)
        old, new = _with_gelu(OLD)
        try:
            tools["fxfuse (tanh, stop 47)"] = fxfuse.optimize(model, x)
        finally:
            _restore(old, new)
        samples = {k: [] for k in tools}
        for _ in range(2):   # interleaved
            for k, fn in tools.items():
                samples[k] += _time(fn, x)
        row = {"case": name}
        for k, fn in tools.items():
            with torch.no_grad():
                err = ((fn(x).double() - ref).abs().max() / ref.abs().max()).item()
            row[k] = {"us": statistics.median(samples[k]), "max_rel_err": err}
        rows.append(row)
        print(name, "  ".join(f"{k} {v['us']:.1f} us (err {v['max_rel_err']:.1e})"
                             for k, v in row.items() if k != "case"), flush=True)
    if args.out:
        with open(f"{args.out}/gelu_ab.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
