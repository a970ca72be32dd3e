"""Stop 41 on the GPU: attributes written back by the graph (no CUDA graph for it), size-1 strides
served by the captured specialization, swap_tensors of a weight under a CUDA graph, empty constants."""
import copy

import pytest
import torch
from torch import nn

import fxfuse
from test_fuzz41_keys import ReturnsEmpty, Scaled
from test_fuzz41_writes import Forecaster

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def test_revin_statistics_are_written_back_on_the_gpu():
    model = Forecaster().eval().cuda()
    eager = copy.deepcopy(model)
    opt = fxfuse.optimize(model, torch.randn(2, 24, 3, device="cuda"), strict=True)
    assert "assigns a module attribute" in fxfuse.explain(opt)
    for scale in (1.0, 4.0):
        x = torch.randn(2, 24, 3, device="cuda") * scale
        with torch.no_grad():
            torch.testing.assert_close(opt(x), eager(x))
        torch.testing.assert_close(model.rev.mean, eager.rev.mean)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1 and len(opt._specializations) == 1


def test_size_one_strides_are_served_by_the_captured_graph():
    model = Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(1, 8, device="cuda"), max_specializations=1, strict=True)
    for _ in range(3):
        row = torch.randn(8, 1, device="cuda").T
        with torch.no_grad():
            torch.testing.assert_close(opt(row), model(row))
    assert len(opt._specializations) == 1 and not opt._misses


def test_swap_tensors_of_a_weight_rebuilds_the_captured_graph():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).eval().cuda()
    x = torch.randn(16, 64, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.randn(64, 64, device="cuda")))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_empty_constants_are_fresh_each_call_on_the_gpu():
    opt = fxfuse.optimize(ReturnsEmpty().eval(), torch.randn(4, 8, device="cuda"), strict=True)
    with torch.no_grad():
        first = opt(torch.randn(4, 8, device="cuda"))
        first[1].resize_(3).fill_(7.0)
        second = opt(torch.randn(4, 8, device="cuda"))
    assert second[1] is not first[1] and second[1].shape == (0,)
