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


class CompareWithNumber(nn.Module):
    def __init__(self, number, op):
        super().__init__()
        self.number, self.op = number, op

    def forward(self, x):
        return self.op(x, self.number).float() * 2 + x.float().sigmoid()


@pytest.mark.parametrize("dtype,number,op", [
    (torch.uint8, 300, torch.eq), (torch.uint8, -1, torch.gt), (torch.int8, 200, torch.lt),
    (torch.int16, 40000, torch.ge)])
def test_comparing_a_narrow_integer_with_a_number_out_of_its_range(dtype, number, op):
    """Fuzz: eager converts the number to the tensor's dtype first (uint8 == 300 compares with
    44); the kernel compared unwrapped: a wrong answer on inputs the example did not show."""
    model = CompareWithNumber(number, op).eval()
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 120)
    opt = fxfuse.optimize(model, torch.randint(lo, hi, (4, 8), dtype=dtype), strict=True)
    with torch.no_grad():
        x = torch.arange(lo, lo + 256, dtype=torch.int32).clamp(max=info.max).to(dtype).view(8, 32)
        torch.testing.assert_close(opt(x), model(x))
        assert fxfuse.stats(opt)["fused_kernels"] >= 1     # the rest still fuses
    assert "outside the torch." in " ".join(str(fxfuse.explain(opt)).split())
