"""Stop 41 (fuzz41b): tensor attributes forward() assigns before it reads them are written back by
the graph (fxfuse/attribute_writes.py); one whose earlier value forward() reads stays refused."""
import copy
import warnings

import torch
from torch import nn

import fxfuse
from fxfuse.attribute_writes import writes_attributes

from conftest import optimize_warned


class RevIN(nn.Module):
    """Time-Series-Library's reversible instance normalization."""

    def __init__(self, channels, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.affine_weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.affine_bias = nn.Parameter(torch.randn(channels))

    def forward(self, x, mode):
        if mode == "norm":
            self.mean = torch.mean(x, dim=1, keepdim=True).detach()
            self.stdev = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).detach()
            return (x - self.mean) / self.stdev * self.affine_weight + self.affine_bias
        x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class Forecaster(nn.Module):
    def __init__(self, history=24, horizon=7, channels=3):
        super().__init__()
        self.rev = RevIN(channels)
        self.lin = nn.Linear(history, horizon)

    def forward(self, x):
        x = self.rev(x, "norm")
        y = self.lin(x.permute(0, 2, 1)).permute(0, 2, 1)
        return self.rev(y, "denorm")


def _check_revin(called_before: bool):
    model = Forecaster().eval()
    if called_before:   # the attributes exist at the build (an eager call first)
        model(torch.randn(2, 24, 3))
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(2, 24, 3), strict=True)
        gm = next(iter(opt._specializations.values())).gm
        assert writes_attributes(gm) and fxfuse.stats(opt)["fused_kernels"] >= 1
        for scale in (1.0, 3.0, 0.5):
            x = torch.randn(2, 24, 3) * scale
            with torch.no_grad():
                torch.testing.assert_close(opt(x), eager(x))
            torch.testing.assert_close(model.rev.mean, eager.rev.mean)   # the module holds this call's values
            torch.testing.assert_close(model.rev.stdev, eager.rev.stdev)
    assert len(opt._specializations) == 1 and not opt._misses   # no rebuild per call
    assert "assigns a module attribute" in fxfuse.explain(opt) or not torch.cuda.is_available()


def test_revin_statistics_are_written_back():
    # before: refused ("forward() changes the module's state (rev.mean, rev.stdev)")
    _check_revin(called_before=False)


def test_revin_statistics_written_back_where_they_existed_before():
    _check_revin(called_before=True)


class RunningMean(nn.Module):
    """State carried between calls: forward() reads the earlier value before it assigns."""

    def __init__(self):
        super().__init__()
        self.running = torch.zeros(8)

    def forward(self, x):
        self.running = 0.9 * self.running + 0.1 * x.mean(0)
        return torch.relu(x - self.running)


def test_an_attribute_read_before_it_is_assigned_stays_refused():
    model = RunningMean().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert opt is model and len(messages) == 1 and "state" in messages[0]


class KeepsLast(nn.Module):
    def forward(self, x):
        h = torch.tanh(x) * 2
        self.last = h.detach()
        return h + 1


def test_an_attribute_only_assigned_holds_the_last_calls_value():
    model = KeepsLast().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    for _ in range(2):
        x = torch.randn(4, 8)
        with torch.no_grad():
            out = opt(x)
        torch.testing.assert_close(out, torch.tanh(x) * 2 + 1)
        torch.testing.assert_close(model.last, torch.tanh(x) * 2)
    assert len(opt._specializations) == 1


class LazyState(nn.Module):
    """Filled on the first call, then carried: the existence check decides."""

    def __init__(self, declared: bool):
        super().__init__()
        if declared:
            self.h = None

    def forward(self, x):
        if getattr(self, "h", None) is None:
            self.h = torch.zeros_like(x)
        self.h = 0.5 * self.h + x
        return self.h * 2


def test_a_lazily_created_state_attribute_stays_refused():
    for declared in (False, True):
        model = LazyState(declared).eval()
        opt, messages = optimize_warned(model, torch.randn(4, 8))
        assert opt is model and len(messages) == 1 and "state" in messages[0], messages


class RevINByMode(nn.Module):
    """RevIN optimized on its own: the mode is an argument, so each mode is its own specialization."""

    def forward(self, x, mode):
        if mode == "norm":
            self.mean = x.mean(1, keepdim=True).detach()
            return x - self.mean
        return x + self.mean


def test_a_specialization_reading_what_another_writes_runs_the_original():
    # review41b: the 'denorm' specialization folded the mean of the call before it (off by 10-20)
    model = RevINByMode().eval()
    eager = copy.deepcopy(model)
    opt = fxfuse.optimize(model, (torch.randn(2, 8, 3), "norm"))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for shift in (0.0, 10.0, 20.0):
            x = torch.randn(2, 8, 3) + shift
            torch.testing.assert_close(opt(x, "norm"), eager(x, "norm"))
            y = torch.randn(2, 8, 3)
            torch.testing.assert_close(opt(y, "denorm"), eager(y, "denorm"))
    assert sum("for some inputs and not for others" in str(w.message) for w in caught) == 1


class DetachedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x):
        self.a = self.w.detach()
        return torch.relu(x) * self.a


def test_a_detached_parameter_written_back_is_no_new_parameter():
    # review41b: the passes dropped the detach, and setattr registered w a second time as parameter a
    model = DetachedWeight().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(opt(x), torch.relu(x) * model.w)
    assert [n for n, _ in model.named_parameters()] == ["w"] and not isinstance(model.a, nn.Parameter)
    model(x)   # the original still runs


class Smoother(nn.Module):
    def __init__(self):
        super().__init__()
        self.prev = None

    def forward(self, x):
        first = self.prev is None   # reads whether it exists: state
        self.prev = x.detach() * 1
        return torch.relu(x) * (0.5 if first else 2.0)


def test_a_branch_on_the_written_attribute_is_state_also_without_verify():
    # review41b: the second trace's graph differed only in a constant (0.5 / 2.0) and passed
    for verify in (True, False):
        model = Smoother().eval()
        opt, messages = optimize_warned(model, torch.randn(4, 8), verify=verify)
        assert opt is model and len(messages) == 1 and "state" in messages[0]


class KeepInput(nn.Module):
    def forward(self, x):
        self.last_input = x.detach()
        return torch.relu(x) * 2


def test_a_detached_input_written_back_is_detached():
    # review41c: the passes dropped the detach, and the attribute was the caller's autograd leaf
    model = KeepInput().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        opt(x)
    assert model.last_input is not x and not model.last_input.requires_grad
    torch.testing.assert_close(model.last_input, x.detach())


class WithConstant(nn.Module):
    def forward(self, x):
        self.mean = x.mean(0, keepdim=True).detach()
        return (x - self.mean) * torch.tensor([1.0, 2.0, 3.0])


def test_a_write_back_beside_a_tensor_constant():
    # review41c: torch.fx numbered the constant anew in the second trace, which then differed: refused
    model = WithConstant().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 3), strict=True)
    x = torch.randn(4, 3)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), (x - x.mean(0, keepdim=True)) * torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(model.mean, x.mean(0, keepdim=True))


class KeepInputCast(nn.Module):
    def forward(self, x):
        self.last_input = x.detach().float()
        return torch.relu(x) * 2, x.detach()[0]


def test_a_detach_followed_by_a_no_op_cast_or_view_stays_detached():
    # review41d: `.float()` / `[0]` after the detach kept the caller's autograd leaf
    model = KeepInputCast().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        _, row = opt(x)
    assert not model.last_input.requires_grad and not row.requires_grad


class Warmup(nn.Module):
    def __init__(self):
        super().__init__()
        self.prev = None

    def forward(self, x):
        scale = torch.tensor(0.5 if self.prev is None else 2.0)   # a branch between tensor constants
        self.prev = x.detach() * 1
        return torch.relu(x) * scale


def test_a_branch_between_tensor_constants_on_the_written_attribute_is_state():
    # review41d: renaming torch.fx's constants hid the branch (verify=False: every later call off by 2-4)
    model = Warmup().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8), verify=False)
    assert opt is model and len(messages) == 1 and "state" in messages[0]
