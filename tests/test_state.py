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


def test_buffers_changing_every_call_warn_once_and_stay_right():
    m, x = bn_model(), torch.randn(5, 6)
    opt = fxfuse.optimize(m, x)
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(12):
            m[1].running_var.mul_(1.1)
            torch.testing.assert_close(opt(x), m(x))
    assert sum("keep changing" in str(w.message) for w in record) == 1


def test_a_few_edits_by_hand_do_not_warn():
    """Three edits, a call after each (tuning a model interactively): rebuilt, no advice."""
    m, x = bn_model(), torch.randn(5, 6)
    opt = fxfuse.optimize(m, x)
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for edit in (lambda: m[0].weight.mul_(1.1), lambda: m[1].running_mean.add_(0.1),
                     lambda: m[1].weight.mul_(0.9)):
            edit()
            torch.testing.assert_close(opt(x), m(x))
    assert not record and fxfuse.stats(opt)["fused_kernels"] > 0


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
    with pytest.warns(fxfuse.FxfuseWarning, match=r"changes the module's state \(Counter.count\)"):
        opt = fxfuse.optimize(m, x)
    assert opt is m and torch.equal(m.count, torch.zeros(3))
    with pytest.raises(fxfuse.UnsupportedError):
        fxfuse.optimize(m, x, strict=True)
    assert torch.equal(m.count, torch.zeros(3))


class KeepsLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.last = nn.Linear(4, 4), None

    def forward(self, x):
        y = self.lin(x)
        self.last = y
        return y.relu()


class Reassigns(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1
        return x * self.count


class FunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))

    def forward(self, x):
        return torch.nn.functional.batch_norm(x, self.rm, self.rv, training=True, momentum=0.1)


@pytest.mark.parametrize("make, what", [(Reassigns, "Reassigns.count"),
                                        (FunctionalBatchNorm, "FunctionalBatchNorm.rm")],
                         ids=["reassigned buffer", "running stats without a version bump"])
@pytest.mark.parametrize("verify", [True, False])
def test_forward_with_module_state_is_refused_and_the_model_left_as_it_was(make, what, verify):
    """Second fuzzing round: tracing stored a torch.fx Proxy in `self.last`; a reassigned buffer
    gave x * 1 on every call; F.batch_norm(training=True) moved the buffers during the build."""
    torch.manual_seed(0)
    m, x = make().eval(), torch.randn(3, 4) + 2
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.warns(fxfuse.FxfuseWarning, match=f"changes the module's state \\({what}"):
        opt = fxfuse.optimize(m, x, verify=verify)
    assert opt is m
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not isinstance(getattr(m, "last", None), torch.fx.Proxy)


@pytest.mark.parametrize("verify", [True, False])
def test_an_attribute_forward_only_assigns_is_written_back(verify):
    """Stop 41: `self.last = y` (assigned before any read: no state between calls) was refused; the
    graph now assigns it on each call as eager does (fxfuse/attribute_writes.py)."""
    m = KeepsLast().eval()
    opt = fxfuse.optimize(m, torch.randn(3, 4), verify=verify, strict=True)
    assert m.last is None   # the build leaves the model as it found it
    for _ in range(2):
        x = torch.randn(3, 4)
        with torch.no_grad():
            out = opt(x)
            torch.testing.assert_close(m.last, m.lin(x))
        torch.testing.assert_close(out, m.last.relu())


def test_model_created_in_inference_mode_is_optimized():
    """Its parameters and buffers are inference tensors, which have no version counter."""
    with torch.inference_mode():
        m = bn_model()
        x = torch.randn(5, 6)
        opt = fxfuse.optimize(m, x)
        assert isinstance(opt, fxfuse.OptimizedModule) and fxfuse.stats(opt)["fused_kernels"] > 0
        torch.testing.assert_close(opt(x), m(x))
