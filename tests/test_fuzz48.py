"""Stop 48: helper findings and small mends (each test fails on the code before its fix)."""
import torch
from torch import nn

import fxfuse

from conftest import optimize_strict


class AttributeViews(nn.Module):
    def forward(self, x):
        return torch.bmm(x.mT, x).relu() + 1, x.mH.sum()


def test_attribute_views_are_counted_as_views():
    """`x.mT` stays a getattr node; explain called it a library call (report.VIEWS named "mT", which no node
    name ever is)."""
    x = torch.randn(2, 3, 4)
    opt = optimize_strict(AttributeViews().eval(), x)
    text = fxfuse.explain(opt)
    assert "getattr" in text and fxfuse.stats(opt)["fused_kernels"] == 1
    assert [line for line in text.splitlines() if line.startswith("getattr") and "library call" in line] == []
    assert fxfuse.stats(opt)["library_calls"] == 2   # bmm and sum
    torch.testing.assert_close(opt(x), AttributeViews()(x))


class FillsFromHeldTensors(nn.Module):
    """`torch.full_like(held, held_value)` runs once while tracing (no proxy in it): the fill value is read,
    the shape source is not."""
    def __init__(self):
        super().__init__()
        self.cfg = {"like": torch.randn(3, 4), "s": torch.tensor(2.0)}

    def forward(self, x):
        return x * torch.full_like(self.cfg["like"], self.cfg["s"]) + 1


def test_a_held_fill_value_read_while_tracing_is_watched():
    model = FillsFromHeldTensors().eval()
    x = torch.randn(3, 4)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.cfg["like"].mul_(5)          # only its shape was read: no rebuild
        torch.testing.assert_close(opt(x), model(x))
        assert opt._dropped[0] == 0
        model.cfg["s"].mul_(-3)            # its value was read: the next call must see it
        x2 = torch.randn(3, 4)
        torch.testing.assert_close(opt(x2), model(x2))
