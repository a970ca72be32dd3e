"""Stop 40 on the GPU: outputs as eager gives them under a CUDA graph (a returned detach, constants
returned beside a kernel's result), a value index that now fuses, and a dict memo kept from the
example's eager run."""
import copy

import pytest
import torch

import fxfuse
from test_fuzz40 import ConstantOutputs, DetachedToo, GatedNorm, PickRow, Window

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def test_a_returned_detach_is_another_tensor_of_the_same_memory_under_a_cuda_graph():
    model = DetachedToo().eval().cuda()
    opt = fxfuse.optimize(model, torch.randn(64, 33, device="cuda"), strict=True)
    x = torch.randn(64, 33, device="cuda")
    with torch.no_grad():
        out = opt(x)
        want = model(x)
    torch.testing.assert_close(out, want)
    assert out[1] is not out[0] and out[1].data_ptr() == out[0].data_ptr()
    out[1].unsqueeze_(0)
    assert out[0].shape == (64, 33)


def test_constant_outputs_are_fresh_each_call_under_a_cuda_graph():
    model = ConstantOutputs().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8, device="cuda"), strict=True)
    with torch.no_grad():
        out = opt(torch.randn(4, 8, device="cuda"))
        again = opt(torch.randn(4, 8, device="cuda"))
    out[2].fill_(7)
    assert again[2].tolist() == [0.0, 0.0, 0.0] and out[1].tolist() == [[1.0] * 8] * 4
    assert out[2].data_ptr() == out[3].data_ptr() and out[4].tolist() == [7.0, 7.0]   # c twice and c[1:]: one
    #                                             memory (the CUDA graph's handout makes c twice two tensor objects)


@pytest.mark.parametrize("make", [PickRow, Window])
def test_an_index_read_from_a_value_fuses_on_cuda(make):
    # the graph reads i on the host: no CUDA graph (a failed capture left torch's CUDA generator broken for
    # every later test: "Offset increment outside graph capture encountered unexpectedly")
    model = make().eval()
    opt = fxfuse.optimize(model, (torch.randn(64, 33, device="cuda"), torch.tensor(2, device="cuda")), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and "reads a tensor's value on the host" in fxfuse.explain(opt)
    torch.randn(3, device="cuda")   # the generator still works
    for i in (0, 5, 1):
        x, k = torch.randn(64, 33, device="cuda"), torch.tensor(i, device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(opt(x, k), model(x, k))


def test_a_gated_norm_is_one_kernel_after_the_norm_on_cuda():
    model = GatedNorm().eval().cuda()
    args = (torch.randn(2, 9, 12, device="cuda"), torch.randn(2, 9, 12, device="cuda"))
    opt = fxfuse.optimize(model, args, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    args = (torch.randn(2, 9, 12, device="cuda"), torch.randn(2, 9, 12, device="cuda"))
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))


class ArgumentMemoOnItsDevice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x, scale: float = 1.0):
        if "s" not in self.cache:
            self.cache["s"] = torch.full((x.shape[-1],), scale, device=x.device)
        return torch.relu(x * self.cache["s"]) + 1


def test_a_dict_memo_from_an_argument_keeps_the_examples_value_on_cuda():
    model = ArgumentMemoOnItsDevice().eval()
    eager = copy.deepcopy(model)
    example = (torch.randn(3, 5, device="cuda"), 2.0)
    opt = fxfuse.optimize(model, example, strict=True)
    eager(*example)
    for scale in (3.0, 2.0):
        x = torch.randn(3, 5, device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(opt(x, scale), eager(x, scale))
    assert fxfuse.stats(opt)["specializations"] == 2
