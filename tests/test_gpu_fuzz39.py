"""Stop 39 on the GPU: number operands as CUDA eager reads them, clamp with mixed-dtype bounds, a
submodule swapped through _modules under a CUDA graph, and nn.Module methods the model's class
overrides."""
import pytest
import torch
import torch.nn as nn

import fxfuse
from test_fuzz39 import BIG, ClampTensorAndNumber, ComparesWithABigInt, ReverseSubtract
from test_fuzz39_state import OwnMethods

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


class Literals(nn.Module):
    def forward(self, x):
        return (x * 0.1 + 0.3) / 3.0 - 1e-3, torch.where(x > 0.2, x, 0.7) * 2.5, x + 16777217


class Subnormal(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 1e-40 + 1e-44


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_number_operands_match_cuda_eager_bit_for_bit(dtype):
    model = Literals().eval()
    x = torch.randn(64, 33, device="cuda").to(dtype)
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(64, 33, device="cuda").to(dtype)
            for got, want in zip(opt(x), model(x)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_subnormal_number_operand_matches_cuda_eager():
    model, x = Subnormal().eval(), torch.randn(64, 33, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [ReverseSubtract, ComparesWithABigInt, ClampTensorAndNumber])
def test_the_stops_literal_and_clamp_cases_match_cuda_eager(cls):
    model = cls().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8, device="cuda"), strict=True)
    x = torch.tensor([[0.05, 0.05000001, -1.0, 2.0, 2.0 ** 60, 2.0 ** 60 + 2.0 ** 37, 3.5, -0.9]] * 4, device="cuda")
    with torch.no_grad():
        got, want = opt(x), model(x)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert BIG > 2 ** 53


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(64, 64), nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x)) * 2


def test_a_submodule_swapped_through_modules_is_seen_under_a_cuda_graph():
    model = Block().cuda().eval()
    opt = fxfuse.optimize(model, torch.randn(8, 64, device="cuda"), strict=True)
    with torch.no_grad():
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(opt(x), model(x))
        model._modules["act"] = nn.Sigmoid()
        torch.testing.assert_close(opt(x), model(x))


def test_the_models_own_to_runs_through_opt_on_cuda():
    model = OwnMethods().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    opt.to("cuda")
    assert model.freq.is_cuda and model.l1.weight.is_cuda
    with torch.no_grad():
        x = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(opt(x), model(x))
