"""Probe: an nn.TransformerEncoder inside a model, eager vs fxfuse two ways.

    python -m benchmarks.transformer_probe

Why: symbolic_trace keeps every torch.nn module as one call, so an encoder inside a model ran
as one opaque library call (eager's native fast path inside fxfuse's graph), while fxfuse now
traces such a model through torch.export (tracing._exported_through, transformer_blocks) and fuses the encoder's
Linears, bias adds and residual adds. Columns: eager; `leaf` = the encoder kept as one call
(the old behaviour, transformer_blocks.DECOMPOSED_BY_EXPORT emptied); `export` = decomposed. fp32, TF32
off, per-call us (median of blocks of back-to-back calls), fused kernels, relative error.
"""
import torch
import torch.nn as nn

import fxfuse
import fxfuse.transformer_blocks as tb
from benchmarks.timing import time_per_call


def per_call_us(fn) -> float:
    return time_per_call(lambda _: fn(), [torch.empty(1, device="cuda")]).us


torch.backends.cuda.matmul.allow_tf32 = False


class Model(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        block = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True)
        self.enc = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.enc(x))


def main():
    for width, layers, batch, seq in ((128, 2, 1, 16), (256, 4, 8, 64), (512, 6, 16, 128)):
        torch.manual_seed(0)
        model = Model(width, layers).cuda().eval()
        x = torch.randn(batch, seq, width, device="cuda")
        with torch.no_grad():
            ref = model(x)
            row = {"eager": per_call_us(lambda: model(x))}
            saved = tb.DECOMPOSED_BY_EXPORT
            for name, composites in (("leaf", ()), ("export", saved)):
                tb.DECOMPOSED_BY_EXPORT = composites
                try:
                    opt = fxfuse.optimize(model, x)
                finally:
                    tb.DECOMPOSED_BY_EXPORT = saved
                row[name] = per_call_us(lambda: opt(x))
                row[f"{name} kernels"] = fxfuse.stats(opt)["fused_kernels"]
                row[f"{name} err"] = f"{((opt(x) - ref).norm() / ref.norm()).item():.1e}"
        print(f"width {width}, {layers} layers, batch {batch}, seq {seq}:",
              {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


if __name__ == "__main__":
    main()
