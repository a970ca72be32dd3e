"""Stop 49: helper findings in the optimized module's state handling (each test fails on the code before its fix)."""
import warnings

import torch
from torch import nn

import fxfuse

from conftest import optimize_strict
from test_fuzz36_state import HoldsVersioned


class OptionalBias(nn.Module):
    """Old checkpoints have no l2.bias: a load post hook accepts them and starts it at zero."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.seen, self.prefixes = [], []
        self.register_load_state_dict_post_hook(OptionalBias._optional_bias)
        self._register_load_state_dict_pre_hook(self._note_prefix)

    def _note_prefix(self, state_dict, prefix, *args):
        self.prefixes.append(prefix)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    @staticmethod
    def _optional_bias(module, incompatible):
        module.seen.append(list(incompatible.missing_keys))
        if "l2.bias" in incompatible.missing_keys:
            incompatible.missing_keys.remove("l2.bias")
            with torch.no_grad():
                module.l2.bias.zero_()


def test_the_models_load_hooks_see_its_own_keys():
    """fuzz49f: opt.load_state_dict loaded through the wrapper, so the model's post hook saw "original.l2.bias"
    (strict: the load raised where eager's loads; strict=False: the hook never zeroed the bias, and opt
    computed other values than the eager model loaded from the same checkpoint), its pre hook prefix
    "original."."""
    torch.manual_seed(0)
    checkpoint = OptionalBias().state_dict()
    del checkpoint["l2.bias"]
    x = torch.randn(4, 16)
    for strict in (True, False):
        eager = OptionalBias().eval()
        eager.load_state_dict(checkpoint, strict=strict)
        model = OptionalBias().eval()
        opt = optimize_strict(model, x)
        with torch.no_grad():
            opt(x)   # built from the old weights: the load must drop them
        result = opt.load_state_dict(checkpoint, strict=strict)
        assert model.seen == [["l2.bias"]] and model.prefixes == [""] and result.missing_keys == []
        with torch.no_grad():
            torch.testing.assert_close(opt(x), eager(x))
        assert fxfuse.stats(opt)["optimized"]


def test_an_older_fxfuse_checkpoint_loads_into_a_versioned_model_once_converted():
    """The checkpoint of a version-sensitive model names its tensors and versions "original.x" (opt.state_dict
    keeps them so); loaded straight into the model, the names and the versions are read as the model's."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    source = optimize_strict(HoldsVersioned().eval(), x)
    saved = source.state_dict()
    assert list(saved) == ["original.sc.scale"]
    opt = optimize_strict(HoldsVersioned().eval(), x)
    opt.load_state_dict(saved)
    assert torch.equal(opt.original.sc.scale, source.original.sc.scale)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), source(x))


def test_a_wrong_checkpoint_names_the_models_class_and_keys():
    x = torch.randn(4, 16)
    opt = optimize_strict(OptionalBias().eval(), x)
    checkpoint = OptionalBias().state_dict()
    checkpoint["l3.weight"] = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            opt.load_state_dict(checkpoint)
        except RuntimeError as e:
            assert "for OptionalBias" in str(e) and '"l3.weight"' in str(e) and "original" not in str(e)
        else:
            raise AssertionError("an unexpected key loaded")
