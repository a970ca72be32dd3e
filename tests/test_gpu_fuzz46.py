"""Stop 46 on the GPU: GPT-J's rotary (rotate_every_two, a flattened stack) as one kernel, compiled and
under the CUDA graph, against CUDA eager."""
import pytest
import torch

import fxfuse
from test_fuzz46 import GPTJRotary, GPTJRotaryTables

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gptj_rotary_is_one_kernel_on_the_gpu(dtype):
    model = GPTJRotary().eval().cuda()
    shapes = [(2, 7, 4, 64), (1, 7, 1, 64), (1, 7, 1, 64)]
    opt = fxfuse.optimize(model, [torch.randn(*s, device="cuda").to(dtype) for s in shapes], strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    tables = GPTJRotaryTables(dim=64, positions=9).eval().cuda().to(dtype)
    opt_tables = fxfuse.optimize(tables, torch.randn(2, 9, 4, 64, device="cuda").to(dtype), strict=True)
    assert fxfuse.stats(opt_tables)["fused_kernels"] == 1
    for _ in range(3):
        args = [torch.randn(*s, device="cuda").to(dtype) for s in shapes]
        q = torch.randn(2, 9, 4, 64, device="cuda").to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), model(*args), rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(opt_tables(q), tables(q), rtol=1e-3, atol=1e-3)
