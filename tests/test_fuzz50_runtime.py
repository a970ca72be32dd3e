"""Stop 50: helper findings (fuzz50e) in the runtime: fused optimizer kernels called without
torch.optim.Optimizer.step (each test fails on the code before its fix)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse


class FoldedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(F.relu(self.bn(self.a(x))))


class FastSGD(torch.optim.Optimizer):
    """An optimizer of one's own calling torch's fused kernel: no "fused" param group."""
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            torch._fused_sgd_(ps, [p.grad for p in ps], [], weight_decay=0.0, momentum=0.0, lr=g["lr"],
                              dampening=0.0, nesterov=False, maximize=False, is_first_step=True)


def _functional_adam(params):
    from torch.optim.adam import adam
    adam(params, [p.grad for p in params], [torch.zeros_like(p) for p in params],
         [torch.zeros_like(p) for p in params], [], [torch.tensor(0.0, device=p.device) for p in params],
         fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=0.5, weight_decay=0.0, eps=1e-8, maximize=False)


@pytest.mark.parametrize("how", ["functional_adam", "own_optimizer"])
def test_a_fused_step_outside_optimizer_step_rebuilds_the_folded_weights(how):
    """fuzz50e: torch's fused kernels bump no version counter, and only Optimizer.step's hooks counted
    them: torch.optim.adam.adam(fused=True) or an optimizer calling torch._fused_sgd_ left the folded
    BatchNorm copy stale (2.08 off, no warning)."""
    if not hasattr(torch, "_fused_sgd_"):
        pytest.skip("torch without fused optimizer kernels")
    torch.manual_seed(0)
    model, x = FoldedBlock().eval(), torch.randn(5, 8)
    opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        opt(x)
    params = list(model.parameters())
    model(torch.randn(5, 8)).square().mean().backward()
    if how == "functional_adam":
        _functional_adam(params)
    else:
        FastSGD(params, lr=0.5).step()
    with torch.no_grad():
        xi = torch.randn(5, 8)
        torch.testing.assert_close(opt(xi), model(xi))
