import time, torch, fxfuse
from fxfuse.demo import seed_network
torch.backends.cuda.matmul.allow_tf32 = False
for h, b in ((8192, 4096), (1024, 64)):
    m = seed_network(h, 8).cuda(); x = torch.randn(b, h, device="cuda")
    t = time.perf_counter(); opt = fxfuse.optimize(m, x)
    with torch.no_grad(): y = opt(x)
    torch.cuda.synchronize(); print(h, b, "optimize+first call %.2f s" % (time.perf_counter() - t))
    print([l for l in fxfuse.explain(opt).splitlines() if "library GEMM" in l or "pointwise kernel: GEMM" in l][:1])
