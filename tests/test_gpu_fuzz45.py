"""Stop 45 on the GPU: filled tensors as one-element constants, whole writes read as values and
bool casts read by arithmetic, compiled and under the CUDA graph, against CUDA eager; the layout
of an output torch.export's trace gives otherwise than eager."""
import pytest
import torch

import fxfuse
from test_fuzz45 import BOOL_READERS, FILLS, NUMBER_WRITES, WHOLE_WRITES, Filled, RotaryHalf, WholeWrite
from test_fuzz45_runtime import AttentionBehindASizeBranch

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def _same(opt, model, *shapes, dtype=torch.float32, rtol=1e-5, atol=1e-5):
    for _ in range(3):
        args = [torch.randn(*s, device="cuda").to(dtype) for s in shapes]
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), model(*args), rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_filled_tensors_are_constants_in_the_kernel_on_the_gpu(dtype):
    for name, fill in FILLS.items():
        model = Filled(fill).eval().cuda()
        opt = fxfuse.optimize(model, torch.randn(37, 129, device="cuda").to(dtype), strict=True)
        assert fxfuse.stats(opt)["fused_kernels"] == 1, name
        _same(opt, model, (37, 129), dtype=dtype, rtol=1e-3, atol=1e-3)


def test_whole_writes_and_bool_casts_on_the_gpu():
    cases = [WholeWrite(w) for w in WHOLE_WRITES.values()] + \
        [WholeWrite(lambda x, y, f=f: f(x) + y) for f in BOOL_READERS.values()] + \
        [WholeWrite(lambda x, y, f=f: f(x) * y) for f in NUMBER_WRITES.values()]
    for model in cases:
        model = model.eval().cuda()
        opt = fxfuse.optimize(model, [torch.randn(37, 129, device="cuda") for _ in range(2)], strict=True)
        assert fxfuse.stats(opt)["fused_kernels"] == 1
        _same(opt, model, (37, 129), (37, 129), rtol=1e-3, atol=1e-3)


def test_an_attention_output_keeps_eagers_layout_on_the_gpu():
    model = AttentionBehindASizeBranch().eval().cuda()
    x = torch.randn(3, 5, 8, device="cuda")
    opt = fxfuse.optimize(model, x)
    with torch.no_grad():
        got, expected = opt(x), model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert got.stride() == expected.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotate_half_is_one_kernel_on_the_gpu(dtype):
    model = RotaryHalf().eval().cuda()
    shapes = [(2, 4, 33, 64), (33, 64), (33, 64)]
    opt = fxfuse.optimize(model, [torch.randn(*s, device="cuda").to(dtype) for s in shapes], strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    _same(opt, model, *shapes, dtype=dtype, rtol=1e-3, atol=1e-3)
