"""Stop 43, review43c: grad and inference modes at call time (inputs that are inference tensors,
forward()'s own set_grad_enabled / requires_grad_, an inference-mode branch, saved-tensor hooks
disabled, training mode of several submodules)."""
import warnings

import pytest
import torch
from torch import nn

import fxfuse

from conftest import optimize_strict


class AsksInference(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.relu(self.lin(x)) * 0.5
        return h + 1 if x.is_inference() else h - 1


def _calls(opt, x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = opt(x)
    return out, [str(w.message) for w in caught]


def test_an_input_made_under_inference_mode_takes_eagers_branch():
    """A batch made under inference_mode and passed under no_grad took the graph's other branch,
    silently (2.0 off)."""
    model = AsksInference().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    with torch.inference_mode():
        x = torch.randn(4, 16)
    with torch.no_grad():
        got, told = _calls(opt, x)
        torch.testing.assert_close(got, model(x))
        assert len(told) == 1 and "is_inference()" in told[0]
        plain = torch.randn(4, 16)
        torch.testing.assert_close(opt(plain), model(plain))
    assert sum(opt._original_calls.values()) == 1


class StartsAutograd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x).detach().requires_grad_()   # a saliency map's start
        return torch.relu(h) * 2 + 1


def test_forward_starting_autograd_itself_runs_the_original_with_grad_on():
    """With verify=False the graph ran and returned no autograd history where eager did."""
    model = StartsAutograd().eval().requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(4, 8), verify=False)
    x = torch.randn(4, 8)
    got, told = _calls(opt, x)
    assert got.requires_grad and got.grad_fn is not None and len(told) == 1
    with torch.no_grad():
        assert _calls(opt, x)[1] == []


class FrozenFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.features, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        with torch.set_grad_enabled(False):
            f = torch.relu(self.features(x)) * 2
        return self.head(f).sigmoid()


@pytest.mark.parametrize("verify", [True, False])
def test_set_grad_enabled_false_inside_forward_is_no_reason_to_run_the_original(verify):
    """`set_grad_enabled` in forward()'s code counted as turning grad on whatever its argument:
    with verify=False every no_grad call ran the original."""
    opt = optimize_strict(FrozenFeatures().eval(), torch.randn(4, 8), verify=verify)
    with torch.no_grad():
        for _ in range(2):
            opt(torch.randn(4, 8))
    assert sum(opt._original_calls.values()) == 0


class InferenceBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        return h * 2 if torch.is_inference_mode_enabled() else h - 1


def test_an_inference_mode_branch_does_not_mark_grad_mode_too():
    """The probe with grad on and the other inference mode changed the output through inference
    mode alone and marked grad mode as read: every grad-mode call of a frozen model ran the original."""
    model = InferenceBranch().eval().requires_grad_(False)
    with torch.no_grad():
        opt = fxfuse.optimize(model, torch.randn(4, 16))
    x = torch.randn(4, 16)
    got, told = _calls(opt, x)   # grad on, nothing requires grad, inference off as traced
    assert told == [] and not got.requires_grad
    torch.testing.assert_close(got, model(x))
    with torch.inference_mode():
        got, told = _calls(opt, x)
        assert len(told) == 1 and "inference mode" in told[0]
        torch.testing.assert_close(got, model(x))


def test_builds_under_disabled_saved_tensor_hooks():
    """verify's grad probes enter saved-tensor hooks: under disable_saved_tensors_hooks (torch.func's
    transforms use it) optimize failed, and a new shape's build failed for good."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Sigmoid()).eval()
    with torch.autograd.graph.disable_saved_tensors_hooks("none here"):
        opt = optimize_strict(model, torch.randn(4, 16))
        with torch.no_grad():
            x = torch.randn(5, 16)
            torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["specializations"] == 2


def test_each_submodule_put_in_training_mode_gets_its_warning():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with torch.no_grad():
        for index in (1, 4):
            model[index].train()
            told = _calls(opt, x)[1]
            assert len(told) == 1 and f"submodule {index}" in told[0]
            model[index].eval()


def test_an_inference_tensor_example_is_no_reason_to_run_the_original_for_plain_inputs():
    """Only where forward() asks is_inference() does an input's inference-ness matter (a build from
    an example made inside inference_mode, called with plain tensors under no_grad)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16)).eval()
    with torch.inference_mode():
        opt = optimize_strict(model, torch.randn(16, 4).t())
    with torch.no_grad():
        x = torch.randn(16, 4).t()
        torch.testing.assert_close(opt(x), model(x))
    assert sum(opt._original_calls.values()) == 0
