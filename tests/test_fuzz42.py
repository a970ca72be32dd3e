"""Stop 42: a dead weakref.proxy among a model's attributes (a module kept after the trainer or
owner it pointed to), never read by forward(): both torch tracers and fxfuse's walks of the model's
state called isinstance() on it, which raises ReferenceError, and the model fell back."""
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_warned


class Owner:
    scale = 2.0


@dataclasses.dataclass
class Holder:
    owner: object


def _place(model, where, proxy):
    if where == "attribute":
        model.owner = proxy
    elif where == "list":
        model.owners = [proxy]
    elif where == "dataclass":
        model.cfg = Holder(proxy)
    elif where == "child":
        model.lin.owner = proxy
    elif where == "child dict":
        model.lin.cfg = {"owner": proxy}


class ProxyHolder(nn.Module):
    def __init__(self, where, owner):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        _place(self, where, weakref.proxy(owner))

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2 + 1


@pytest.mark.parametrize("dies", ["before optimize", "after optimize"])
@pytest.mark.parametrize("where", ["attribute", "list", "dataclass", "child", "child dict"])
def test_a_dead_weak_proxy_attribute_is_no_reason_to_fall_back(where, dies):
    owner = Owner()
    model = ProxyHolder(where, owner).eval()
    if dies == "before optimize":
        del owner
        gc.collect()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(4, 8))
        assert isinstance(opt, fxfuse.OptimizedModule) and not messages
        owner = None
        gc.collect()
        for rows in (4, 4, 3):
            assert_matches_eager(opt, model, torch.randn(rows, 8))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    proxies = [m for m in model.modules() if any(type(v) is weakref.ProxyType for v in vars(m).values())]
    assert proxies or where in ("list", "dataclass", "child dict")   # put back after the trace
