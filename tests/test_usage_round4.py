"""Fuzzing, fourth round (CPU): unseen architectures and spellings. Each test is a finding
that gave a wrong answer, a misleading warning or a missed kernel before its fix."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402


class OwnFusedName(nn.Module):
    """The model's own submodule is called fused_0, the name fuse_pointwise gives its first kernel."""

    def __init__(self):
        super().__init__()
        self.fused_0 = nn.Linear(6, 6)
        self.fused_1 = nn.GRU(6, 6, batch_first=True)

    def forward(self, x):
        y, _ = self.fused_1(self.fused_0(torch.relu(x * 2)))
        return torch.tanh(y) + 1


def test_a_submodule_named_like_a_kernel_keeps_its_name():
    """Fuzz: the first fused kernel replaced the model's own `fused_0` (wrong shape with
    verify=False, an internal error for a Linear)."""
    model = OwnFusedName().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 3, 6), verify=False)
    assert isinstance(opt, fxfuse.OptimizedModule)
    with torch.no_grad():
        x = torch.randn(4, 3, 6)
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] >= 2
