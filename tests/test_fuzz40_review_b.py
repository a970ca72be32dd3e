"""Stop 40, third round: the review of the stop's newest diff (review40b)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse.runtime import OptimizedModule

from conftest import assert_refused_and_eager, optimize_warned


class NoisedAtATimestep(nn.Module):   # DDPM's q_sample at one timestep (batch 1)
    def __init__(self):
        super().__init__()
        ac = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100), 0)
        self.register_buffer("sqrt_ac", ac.sqrt())
        self.register_buffer("sqrt_1m_ac", (1 - ac).sqrt())

    def forward(self, x, t, noise):
        a = self.sqrt_ac[t].view(-1, 1, 1)
        b = self.sqrt_1m_ac[t].view(-1, 1, 1)
        h = a * x + b * noise
        return F.silu(h).reshape(h.shape[0], -1)


class Modulo(nn.Module):
    def forward(self, x, period):
        h = x % period   # a 0-dim tensor operand
        return torch.sigmoid(h).reshape(h.shape[0], -1)


class HuberAtBatchOne(nn.Module):
    def forward(self, p, t):
        loss = F.huber_loss(p, t, reduction="none")
        return torch.exp(loss).reshape(loss.shape[0], -1)


class AddWithAlpha(nn.Module):
    def forward(self, x, s):
        return torch.sigmoid(torch.add(x, s, alpha=0.5)) * 2


@pytest.mark.parametrize("make,args", [
    (NoisedAtATimestep, lambda: (torch.randn(1, 3, 4), torch.tensor([7]), torch.randn(1, 3, 4))),
    (Modulo, lambda: (torch.randn(1, 3, 4), torch.tensor(0.7))),
    (HuberAtBatchOne, lambda: (torch.randn(1, 4), torch.randn(1, 4))),
    (AddWithAlpha, lambda: (torch.randn(3, 4), torch.tensor(0.3))),
])
def test_one_element_tensors_read_as_tensors_are_no_sizes(make, args):
    # before (this stop): the deny-list took them for sizes read from values: refused, or nothing fused
    model = make().eval()
    opt, messages = optimize_warned(model, args())
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] >= 1
    a = args()
    with torch.no_grad():
        torch.testing.assert_close(opt(*a), model(*a))


class CaughtValueSizedSize(nn.Module):
    def forward(self, x, n):
        try:
            if x[:n.item()].shape[0] > 2:   # the size of a value-sized slice: export raises here too
                x = x * 2
        except Exception:  # noqa: BLE001
            pass
        return torch.relu(x) + 1


def test_a_caught_error_at_the_size_of_a_value_sized_tensor_is_refused():
    # before (this stop): taken for a size branch; export's own error was caught too, so every input took the
    # except path
    model = CaughtValueSizedSize().eval()
    opt, messages = optimize_warned(model, (torch.randn(6, 4), torch.tensor(1)))
    assert opt is model and len(messages) == 1 and "catches the error" in messages[0]


class SimplifiedCheck(nn.Module):
    def forward(self, x, n):
        if x.shape[0] > 0:   # torch.export traces
            pass
        k = n.item()
        torch._check(k + 1 <= 7)   # export prints it as u0 <= 6
        return torch.relu(x[:, :k]) * 2


class SizeCheck(nn.Module):
    def forward(self, x, n):
        if x.shape[0] > 0:
            pass
        k = n.item()
        torch._check_is_size(k)
        return torch.relu(x[:, :k]) * 2


@pytest.mark.parametrize("make,bad", [(SimplifiedCheck, 7), (SizeCheck, -1)])
def test_the_users_own_checks_stay_in_the_exported_graph(make, bad):
    # before (this stop): a check export simplified, and torch._check_is_size, were dropped
    model = make().eval()
    opt, _ = optimize_warned(model, (torch.randn(4, 8), torch.tensor(3)))
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, torch.tensor(5)), model(x, torch.tensor(5)))
        with pytest.raises(RuntimeError):
            model(x, torch.tensor(bad))
        with pytest.raises(RuntimeError):
            opt(x, torch.tensor(bad))


class DetachMadeToRequireGrad(nn.Module):
    def forward(self, x):
        d = x.detach()
        d.requires_grad_()   # d's own flag, not x's
        return d


def test_requires_grad_on_a_detach_is_not_set_on_its_source():
    model = DetachMadeToRequireGrad().eval()
    opt, _ = optimize_warned(model, torch.randn(4, 8), verify=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = opt(x)
    assert not x.requires_grad and out.requires_grad


class RoundTripTransposed(nn.Module):
    def forward(self, x):
        h = torch.sigmoid(x)
        v = h.view(32).view(4, 8)   # a round trip back to h's shape
        v.t_()                      # v only
        return h * 2, v * 1


class MaskedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(16, 8))

    def forward(self, mask):
        h = self.table[mask]          # a buffer picked by a boolean mask: as many rows as mask has Trues
        return torch.relu(h).sum(0) / h.shape[0]


@pytest.mark.parametrize("make,example,later", [
    (RoundTripTransposed, lambda: (torch.randn(4, 8),), lambda: (torch.randn(4, 8),)),
    (MaskedBuffer, lambda: (torch.rand(16) > 0.5,), lambda: (torch.rand(16) > 0.3,)),
])
def test_review40b_wrong_values_are_gone(make, example, later):
    model = make().eval()
    opt, _ = optimize_warned(model, example(), verify=False)
    args = later()
    with torch.no_grad():
        got, want = opt(*args), model(*args)
    if isinstance(want, tuple):
        assert [t.shape for t in got] == [t.shape for t in want]
    torch.testing.assert_close(got, want)


class PermutedContiguous(nn.Module):
    def forward(self, x):
        if x.shape[0] > 0:   # torch.export traces: it spells .contiguous() aten.contiguous
            pass
        return (torch.relu(x).permute(1, 0).contiguous() + 1) * 2


def test_exports_contiguous_between_pointwise_ops_splits_no_chain():
    # before: 2 kernels and a copy on the export path (1 kernel under symbolic_trace)
    model = PermutedContiguous().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and "torch.export" in fxfuse.explain(opt)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class InverseFFTOfN(nn.Module):
    def forward(self, x, n):
        h = torch.fft.irfft(x, n=n)   # n: a 0-dim tensor
        return h.sum(-1) / h.shape[-1]


class SummedAlongADim(nn.Module):
    def forward(self, x, d):
        h = x.sum(d)                  # the dim given as a tensor
        return h.sum() / h.shape[0]


@pytest.mark.parametrize("make,example,later", [
    (InverseFFTOfN, lambda: (torch.randn(3, 5, dtype=torch.complex64), torch.tensor(6)),
     lambda: (torch.randn(3, 5, dtype=torch.complex64), torch.tensor(8))),
    (SummedAlongADim, lambda: (torch.randn(4, 8), torch.tensor(0)), lambda: (torch.randn(4, 8), torch.tensor(1))),
])
def test_sizes_and_dims_given_as_tensors_to_more_ops_are_refused_where_read(make, example, later):
    # before (review40c): the allow-list lacked irfft's n and a reduction's dim: the size read stayed the example's
    assert_refused_and_eager(make, example, later)


class CaughtWhereSize(nn.Module):
    def forward(self, x, c):
        try:
            if torch.where(c)[0].shape[0] > 2:   # value-sized: export raises here too
                x = x * 2
        except Exception:  # noqa: BLE001
            pass
        return torch.relu(x) + 1


class RotatedHalfInTry(nn.Module):
    def forward(self, x):
        h = torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)   # sizes, not values
        try:
            if h.shape[0] > 2:
                h = h * 2
        except Exception:  # noqa: BLE001
            pass
        return torch.relu(h) + 1


def test_caught_size_branches_refused_only_for_value_sized_tensors():
    model = CaughtWhereSize().eval()
    opt, messages = optimize_warned(model, (torch.randn(4), torch.tensor([True, False, True, False])))
    assert opt is model and len(messages) == 1 and "catches the error" in messages[0]
    model = RotatedHalfInTry().eval()   # before (review40c): refused as a value branch
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages
    for rows in (4, 2):
        x = torch.randn(rows, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


class IndexChecked(nn.Module):
    def forward(self, x, n):
        if x.shape[0] > 0:   # torch.export traces
            pass
        k = n.item()
        torch._check_index(k <= 6, lambda: "k must be at most 6")
        return torch.relu(x[:, :k]) * 2


def test_check_index_stays_in_the_exported_graph():
    model = IndexChecked().eval()
    opt, _ = optimize_warned(model, (torch.randn(4, 8), torch.tensor(3)))
    with pytest.raises(IndexError):
        model(torch.randn(4, 8), torch.tensor(7))
    with pytest.raises(RuntimeError):
        opt(torch.randn(4, 8), torch.tensor(7))


class ScheduleLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("schedule", torch.linspace(0.1, 1.0, 10))

    def forward(self, x, t):
        h = x * self.schedule[t.item()]   # a buffer indexed by a number: one element, no size
        return torch.relu(h).sum(0) / h.shape[0]


def test_a_buffer_indexed_by_a_number_read_from_a_value_is_optimized():
    # before: refused at the size read (call_method __getitem__ was not indexing)
    model = ScheduleLookup().eval()
    opt, messages = optimize_warned(model, (torch.randn(4, 8), torch.tensor(3)))
    assert isinstance(opt, OptimizedModule) and not messages
    for t in (0, 9):
        args = (torch.randn(4, 8), torch.tensor(t))
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), model(*args))


class ScaledCheck(nn.Module):
    def forward(self, x, n):
        if x.shape[0] > 0:   # torch.export traces
            pass
        k = n.item()
        torch._check(2 * k <= 12)   # export prints it as u0 <= 6
        torch._check_is_size(k, "k is a size")   # the message positional: no bound (review40d: a TypeError)
        return torch.relu(x[:, :k]) * 2


def test_a_scaled_check_and_a_size_check_with_a_message_stay():
    model = ScaledCheck().eval()
    opt, messages = optimize_warned(model, (torch.randn(4, 8), torch.tensor(3)))
    assert isinstance(opt, OptimizedModule) and not messages
    with pytest.raises(RuntimeError):
        opt(torch.randn(4, 8), torch.tensor(7))


class CaughtNarrowByATensor(nn.Module):
    def forward(self, x, n):
        try:
            if x.narrow(0, 0, n).shape[0] > 2:   # sized by a one-element tensor: export raises here too
                x = x * 2
        except Exception:  # noqa: BLE001
            pass
        return torch.relu(x) + 1


class VarianceWithATensorCorrection(nn.Module):
    def forward(self, x, c):
        h = x - x.var(-1, keepdim=True, correction=c)   # correction is no size
        return torch.relu(h) * 2 + h.shape[0]


def test_review40d_cases():
    model = CaughtNarrowByATensor().eval()   # before: handed to export, whose error forward() caught too
    opt, messages = optimize_warned(model, (torch.randn(6, 4), torch.tensor(2)))
    assert opt is model and len(messages) == 1
    model = VarianceWithATensorCorrection().eval()   # before (5654602): refused
    opt, messages = optimize_warned(model, (torch.randn(4, 8), torch.tensor(1)))
    assert isinstance(opt, OptimizedModule) and not messages
    args = (torch.randn(4, 8), torch.tensor(0))
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))


class PreviousTimestep(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("schedule", torch.linspace(0.1, 1.0, 10))

    def forward(self, x, t):
        h = x * self.schedule[t.item() - 1]   # arithmetic on the number: still one element
        return torch.relu(h).sum(0) / h.shape[0]


def test_a_buffer_indexed_by_arithmetic_on_a_number_is_optimized():
    model = PreviousTimestep().eval()   # before: refused at the size read
    opt, messages = optimize_warned(model, (torch.randn(4, 8), torch.tensor(3)))
    assert isinstance(opt, OptimizedModule) and not messages
    args = (torch.randn(4, 8), torch.tensor(8))
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))
