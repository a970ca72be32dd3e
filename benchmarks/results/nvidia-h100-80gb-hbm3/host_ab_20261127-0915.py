"""A/B of the per-call time: the seed network 8 x 128 at batch 1 and 8 x 512 at batch 16, fxfuse's whole call,
with a bare CUDA graph replay (torch only) as the host's speed in the same process."""
import sys, time, torch
import fxfuse
from benchmarks.timing import time_per_call

def graph_replay_us():
    tiny = torch.randn(1, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tiny.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        tiny.add_(1.0)
    return time_per_call(lambda x: g.replay(), [tiny], max_calls=20000).us

row = [sys.argv[1], f"replay {graph_replay_us():.2f}", f"module {time_per_call(torch.nn.Identity(), [torch.randn(1)], max_calls=20000).us:.2f}"]
for hidden, batch in ((128, 1), (512, 16)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(hidden, hidden), torch.nn.ReLU())]).cuda().eval()
    xs = [torch.randn(batch, hidden, device="cuda") for _ in range(4)]
    opt = fxfuse.optimize(model, xs[0])
    with torch.no_grad():
        row.append(f"{batch}x{hidden} {time_per_call(opt, xs, max_calls=20000).us:.2f}")
row.append(f"replay {graph_replay_us():.2f}")
print(" | ".join(row), flush=True)
