"""Stop 37: fixes from the fuzz37 helper round, and exp computed as Cody-Waite."""
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse


class ExpOps(nn.Module):
    def forward(self, x):
        return torch.exp(x) * 1.0, torch.sigmoid(x) + 0.0, F.softplus(x) * 1.0, F.logsigmoid(x) * 1.0


def test_exp_over_its_whole_range_edges_and_specials():
    # the exp form (fxfuse/ops.py _exp) takes 2 ** n apart from exp(r): results near the overflow edge,
    # subnormal results, infinities and nan must come out as eager's (the GPU's accuracy is a GPU test)
    x = torch.cat([torch.linspace(-110, 95, 2001), torch.tensor(
        [float("inf"), float("-inf"), float("nan"), -0.0, 88.72, 88.7228, 88.73, -87.3, -100.0, -103.9, -103.98])])
    opt = fxfuse.optimize(ExpOps().eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        for got, want in zip(opt(x), ExpOps()(x)):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
            torch.testing.assert_close(got, want, rtol=3e-7, atol=1.5e-45, equal_nan=True)   # one subnormal step
            assert (got[want.abs() > 1e-44] != 0).all()   # subnormal results are not flushed
