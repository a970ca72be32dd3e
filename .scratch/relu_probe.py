import torch, time
from fxfuse.library_choice import relu_in_library_gemm, bias_in_library_gemm
torch.backends.cuda.matmul.allow_tf32 = False
d = torch.device("cuda")
for b, h in [(1,1024),(16,1024),(64,1024),(256,1024),(64,2048),(256,2048),(1024,4096),(4096,4096),(1024,8192),(4096,8192)]:
    t = time.perf_counter()
    r = relu_in_library_gemm(b, h, h, torch.float32, d, False)
    print(f"{b}x{h}: {r[0]} {r[1]}  [{bias_in_library_gemm(b,h,h,torch.float32,d,False)[1]}] ({time.perf_counter()-t:.2f} s)", flush=True)
