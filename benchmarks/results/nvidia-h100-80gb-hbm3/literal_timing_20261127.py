"""Per-call us of an attention-style scale written with tensors made in forward (no device=), against eager,
eager in a CUDA graph and torch.compile; run with PYTHONPATH=<old fxfuse> for the before column."""
import sys
import torch
import torch.nn as nn
import fxfuse
from benchmarks.timing import time_interleaved


class Scaled(nn.Module):
    def forward(self, x):
        return (x / torch.sqrt(torch.tensor(64.0))).softmax(-1) * torch.tensor(0.9) + 0.05


def graphed(model, x):
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model(static)

    def run(inp):
        static.copy_(inp)
        g.replay()
        return out
    return run


with torch.no_grad():
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(64, 1024, device="cuda", dtype=dtype)
        model = Scaled().eval()
        opt = fxfuse.optimize(model, x)
        tools = {"eager": model, "eager+graph": graphed(model, x), "fxfuse": opt}
        if len(sys.argv) > 1 and sys.argv[1] == "--compile":
            tools["compile"] = torch.compile(model)
            tools["compile"](x)
        t = time_interleaved(tools, [x])
        print(f"{fxfuse.__file__} {dtype}: " + ", ".join(f"{k} {t[k].us:.1f}" for k in tools)
              + f" us; stats {fxfuse.stats(opt)}; equal to eager {torch.equal(opt(x), model(x))}")
