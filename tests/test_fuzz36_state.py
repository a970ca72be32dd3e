"""Stop 36: an OptimizedModule's state_dict holds the model's own keys (fuzz36e) and the loads
that review36, review36b and review36c broke in its first forms."""
import pytest
import torch
from torch import nn

import fxfuse


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.bn(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.block(x))


def _trained(module):
    with torch.no_grad():
        for t in module.state_dict().values():
            t.copy_(torch.randint(1, 5, t.shape) if not t.is_floating_point() else torch.rand(t.shape) + 0.5)
    return module.eval()


def test_a_parent_of_an_optimized_child_saves_and_loads_plain_checkpoints():
    """fuzz36e: `model.block = fxfuse.optimize(model.block, x)` renamed the parent's keys
    (block.original.lin.weight): old checkpoints no longer loaded, its own not into a plain Net."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    checkpoint = _trained(Net()).state_dict()
    model = Net().eval()
    model.block = fxfuse.optimize(model.block, x, strict=True)
    assert list(model.state_dict()) == list(checkpoint)
    model.load_state_dict(checkpoint)                       # strict: every key matched
    plain = Net().eval()
    plain.load_state_dict(checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
        assert fxfuse.stats(model.block)["fused_kernels"] > 0
    again = Net().eval()
    again.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), checkpoint.values()))
    metadata = model.state_dict()._metadata
    assert metadata["block.bn"] == metadata["block.original.bn"] and metadata["block.bn"]["version"] == 2


def test_an_optimized_module_loads_its_models_keys_and_older_prefixed_ones():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    opt = fxfuse.optimize(Block().eval(), x, strict=True)
    for trained in (_trained(Block()), _trained(Block())):
        state = trained.state_dict()
        opt.load_state_dict(state)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), trained(x))
        prefixed = {"original." + k: v.clone() for k, v in state.items()}
        opt.load_state_dict(prefixed)                       # a state_dict saved by fxfuse before stop 36
        with torch.no_grad():
            torch.testing.assert_close(opt(x), trained(x))


class Versioned(nn.Module):
    """Version 1 stored log(scale), version 2 scale: an upgrade on load, as BatchNorm's (review36)."""
    _version = 2

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(8) + 0.5)

    def _load_from_state_dict(self, state, prefix, local_metadata, *args):
        if local_metadata.get("version") is None or local_metadata["version"] < 2:
            if prefix + "scale" in state:
                state[prefix + "scale"] = state[prefix + "scale"].exp()
        super()._load_from_state_dict(state, prefix, local_metadata, *args)

    def forward(self, x):
        return torch.relu(x * self.scale) + 1


class HoldsVersioned(nn.Module):
    def __init__(self):
        super().__init__()
        self.sc = Versioned()

    def forward(self, x):
        return self.sc(x) * 2


def test_plain_keys_of_a_versioned_submodule_are_refused_not_converted_again():
    """review36: the keys were renamed, the versions not (torch looks them up by the prefixed name):
    the submodule upgraded a current checkpoint again. Now such a load through a parent raises naming
    the module (review36c: raised in the hook, before a module reads its keys); opt.load_state_dict loads
    straight into the model (stop 49), and opt.state_dict() keeps the prefixed keys, so its own round
    trip keeps the versions."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    source = HoldsVersioned().eval()
    opt = fxfuse.optimize(HoldsVersioned().eval(), x, strict=True)
    opt.load_state_dict(source.state_dict())
    assert torch.equal(opt.original.sc.scale, source.sc.scale)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), source(x))
    saved = opt.state_dict()
    assert list(saved) == ["original.sc.scale"] and saved._metadata["original.sc"]["version"] == 2
    again = fxfuse.optimize(HoldsVersioned().eval(), x, strict=True)
    again.load_state_dict(saved)
    assert torch.equal(again.original.sc.scale, source.sc.scale)
    parent = nn.Sequential(HoldsVersioned()).eval()
    checkpoint = parent.state_dict()
    parent[0] = fxfuse.optimize(parent[0], x, strict=True)
    with pytest.raises(RuntimeError, match="sc \\(Versioned\\) loads by its state version"):
        parent.load_state_dict(checkpoint)


def test_a_missing_num_batches_tracked_is_reported_missing():
    """review36c: BatchNorm, finding no version under the prefixed name, filled it in silently."""
    make = lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    opt = fxfuse.optimize(make(), torch.randn(3, 4), strict=True)
    state = make().state_dict()
    del state["1.num_batches_tracked"]
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "1.num_batches_tracked"'):
        opt.load_state_dict(state)
    assert opt.load_state_dict(state, strict=False).missing_keys == ["1.num_batches_tracked"]
    plain = dict(state)   # no versions filed (safetensors, a dict comprehension): eager fills it in (review36d)
    assert not opt.load_state_dict(plain).missing_keys and not make().load_state_dict(plain).missing_keys


def test_a_parent_loads_plain_checkpoints_through_batchnorm_and_instancenorm():
    """review36b: InstanceNorm (state version 2, like BatchNorm) counted as converting by version."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 5)
    make = lambda: nn.Sequential(nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4),
                                               nn.InstanceNorm2d(4, affine=True), nn.ReLU())).eval()
    source = _trained(make())
    parent = make()
    parent[0] = fxfuse.optimize(parent[0], x, strict=True)
    parent.load_state_dict(source.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(parent(x), source(x))


class ChildCalledOriginal(nn.Module):
    def __init__(self):
        super().__init__()
        self.original, self.specialization_0 = nn.Linear(6, 6), nn.Linear(6, 6)
        self.weight = nn.Parameter(torch.randn(6, 6))   # "weight" and "original.weight": review36b

    def forward(self, x):
        return torch.relu(self.original(x)) + self.specialization_0(x) @ self.weight


def test_a_model_with_children_named_original_and_specialization_loads_its_own_keys():
    """review36: "original.x" keys were taken for fxfuse's older form, "specialization_0.x" deleted."""
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    source = _trained(ChildCalledOriginal())
    opt = fxfuse.optimize(ChildCalledOriginal().eval(), x, strict=True)
    opt.load_state_dict(source.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(opt(x), source(x))
    again = ChildCalledOriginal().eval()
    again.load_state_dict(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), source.state_dict().values()))
    legacy = {"original." + k: v for k, v in _trained(ChildCalledOriginal()).state_dict().items()}
    opt.load_state_dict(legacy)   # fxfuse's form before stop 36
    assert torch.equal(opt.original.original.weight, legacy["original.original.weight"])


def test_missing_and_unexpected_keys_are_named_as_state_dict_names_them():
    opt = fxfuse.optimize(Block().eval(), torch.randn(4, 6), strict=True)
    state = _trained(Block()).state_dict()
    state.pop("lin.bias")
    state["extra"] = torch.zeros(1)
    result = opt.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lin.bias"] and result.unexpected_keys == ["extra"]


class ClassMaskMemo(nn.Module):
    _masks = {}   # shared by every instance: the trace stores a Proxy in it

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if "causal" not in self._masks:
            self._masks["causal"] = torch.ones(6, 6, device=x.device).tril()
        return (self.lin(x) @ x.transpose(-1, -2)) * self._masks["causal"]


def test_verify_runs_eager_without_the_traces_proxies(monkeypatch):
    """A cache on the class filled by the trace held a Proxy while verify ran eager: eager's
    output was a Proxy and the check compared nothing (stop 36)."""
    import fxfuse.api as api
    seen, verify = [], api._verify

    def spy(model, gm, args, rewind):
        out = verify(model, gm, args, rewind)
        seen.extend(type(o) for o in out)
        return out
    monkeypatch.setattr(api, "_verify", spy)
    ClassMaskMemo._masks.clear()
    model = ClassMaskMemo().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 6, 8), strict=True)
    assert seen == [torch.Tensor]   # the memo as verify's eager run left it (stop 40): no Proxy
    assert ClassMaskMemo._masks and all(type(v) is torch.Tensor for v in ClassMaskMemo._masks.values())
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
