"""Stop 44: what a build shows of forward()'s own warnings, prints and logs (review44g)."""
import logging
import sys
import warnings

import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict

LOG = logging.getLogger("fxfuse_test_fuzz44_messages")


class Chatty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        warnings.warn(f"deprecated input layout {x.shape}")
        h = self.lin(x)
        print("h.shape", h.shape, file=sys.stderr)
        LOG.warning("log: h.shape %s", h.shape)
        return torch.relu(h)


@pytest.mark.parametrize("verify", [True, False])
def test_a_build_shows_no_traced_values(verify, capsys, caplog):
    """symbolic_trace quieted stdout only: forward()'s stderr print and log record showed
    "Proxy(getattr_1)", and its warning came twice from one line, once with the Proxy's text."""
    model = Chatty().eval()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        opt = optimize_strict(model, torch.randn(4, 8), verify=verify)
    texts = [str(w.message) for w in caught if "deprecated" in str(w.message)]
    assert texts == (["deprecated input layout torch.Size([4, 8])"] if verify else [])
    out = capsys.readouterr()
    assert "Proxy" not in out.err + out.out and "Proxy" not in caplog.text
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_matches_eager(opt, model, torch.randn(4, 8))


def test_explain_says_why_fused_groups_run_their_reference(monkeypatch):
    """explain() named "option use_kernels=False" where the user passed nothing (no CUDA device,
    no interpreter) or use_kernels=True that could not run (review44g)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(3, 8)
    off = " ".join(fxfuse.explain(fxfuse.optimize(model, x, use_kernels=False)).split())
    assert "runs the torch reference (option" in off and "use_kernels=False)" in off
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for options in ({}, {"use_kernels": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = fxfuse.optimize(model, x, **options)
        text = " ".join(fxfuse.explain(opt).split())
        assert "runs the torch reference (no CUDA" in text and "use_kernels=False" not in text
        assert_matches_eager(opt, model, x)


def test_a_fallback_warning_names_the_users_line_through_torch_containers():
    """From inside nn.Sequential the warning was filed under torch's container.py (review44g)."""
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    outer = nn.Sequential(fxfuse.optimize(inner, torch.randn(3, 8)), nn.Tanh())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outer(torch.randn(3, 8, requires_grad=True))   # grad on: the original runs, one warning
    mine = [w for w in caught if issubclass(w.category, fxfuse.FxfuseWarning)]
    assert mine and all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in mine]


class OptionalScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.alpha = nn.Linear(8, 8), 2.0

    def forward(self, x):
        return torch.relu(self.lin(x)) * getattr(self, "alpha", 1.0)


def test_a_deleted_attribute_rebuilds_and_is_named_as_deleted():
    model = OptionalScale().eval()
    opt = optimize_strict(model, torch.randn(3, 8))
    del model.alpha
    assert_matches_eager(opt, model, torch.randn(3, 8))
    assert "was assigned, deleted or changed in place" in " ".join(fxfuse.explain(opt).split())
