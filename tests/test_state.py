"""The model's state after optimize: submodules switched to training mode, buffers that move
in place, and internal errors while building a later specialization (fuzzing finds, CPU)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402


def bn_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m


def test_a_submodule_in_training_mode_runs_the_original_with_one_warning():
    m, x = bn_model(), torch.randn(5, 6)
    opt = fxfuse.optimize(m, x)
    assert fxfuse.stats(opt)["fused_kernels"] > 0
    m[1].train()                      # only the BatchNorm: eager now normalizes with batch statistics
    with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="training mode"):
        got = opt(x)
    m[1].train()
    want = m(x)
    torch.testing.assert_close(got, want)
    with pytest.raises(fxfuse.GuardError, match="training mode"):
        _strict_call(x)


def _strict_call(x):
    m = bn_model()
    opt = fxfuse.optimize(m, x, strict=True)
    m[1].train()
    with torch.no_grad():
        opt(x)


def test_buffers_moved_by_a_training_call_are_seen():
    """A call in training mode runs the original, which moves BatchNorm's running statistics;
    back in eval mode the next call builds from the new statistics instead of the folded old ones."""
    m, x = bn_model(), torch.randn(5, 6)
    opt = fxfuse.optimize(m, x)
    opt.train()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt(torch.randn(7, 6) * 3 + 1)
    opt.eval()
    fresh = torch.randn(5, 6)
    with torch.no_grad():
        torch.testing.assert_close(opt(fresh), m(fresh))
        m[1].running_mean.add_(0.5)       # an in-place edit of a buffer by hand: seen as well
        torch.testing.assert_close(opt(fresh), m(fresh))
    assert fxfuse.stats(opt)["fused_kernels"] > 0


def test_internal_error_in_a_later_build_falls_back_with_one_warning(monkeypatch):
    m, x = bn_model(), torch.randn(5, 6)
    opt = fxfuse.optimize(m, x)

    def broken(*args):
        raise RuntimeError("something deep inside")
    monkeypatch.setattr(opt, "_build", broken)
    y = torch.randn(3, 6)
    with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="internal error.*something deep inside"):
        torch.testing.assert_close(opt(y), m(y))
    strict = fxfuse.optimize(m, x, strict=True)
    monkeypatch.setattr(strict, "_build", broken)
    with torch.no_grad(), pytest.raises(fxfuse.FxfuseError, match="internal error"):
        strict(y)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        self.count.add_(1)
        return x + self.count


def test_forward_that_updates_a_buffer_falls_back_and_leaves_it_as_it_was():
    """Tracing ran `count.add_(1)` once for real and baked its result into the graph: every
    call would have returned x + 1 (and the model's count was already moved). Now: one warning,
    the original module, and the buffer untouched by optimize."""
    m, x = Counter().eval(), torch.randn(2, 3)
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's tensor 'count' in place"):
        opt = fxfuse.optimize(m, x)
    assert opt is m and torch.equal(m.count, torch.zeros(3))
    with pytest.raises(fxfuse.UnsupportedError):
        fxfuse.optimize(m, x, strict=True)
    assert torch.equal(m.count, torch.zeros(3))
