"""Stop 35: torch's random ops in an optimized CUDA model (CUDA graph replays must draw anew)."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


class _Reparametrize(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu, self.logvar = nn.Linear(64, 32), nn.Linear(64, 32)

    def forward(self, x):
        mu, logvar = self.mu(x), self.logvar(x)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return F.dropout(z.relu(), p=0.25, training=True) * 2 + 1


def test_random_ops_in_a_cuda_graph_draw_anew_and_as_eager_under_the_same_seed():
    torch.manual_seed(0)
    model, x = _Reparametrize().cuda().eval(), torch.randn(8, 64, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        torch.manual_seed(11)
        got = [opt(x).clone() for _ in range(3)]
        torch.manual_seed(11)
        want = [model(x) for _ in range(3)]
    assert not torch.equal(got[0], got[1]) and not torch.equal(got[1], got[2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
