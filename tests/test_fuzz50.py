"""Stop 50: helper findings (fuzz50c, fuzz50l and their reviews) in the passes: views returned through ops
that return their input, a bias of two dims, value-sized ops in other spellings (each test fails on the code
before its fix). What a trace reads and freezes: test_fuzz50_trace.py."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse

from conftest import optimize_strict

WHOLE_VIEWS_WRITTEN = {
    "slice_mul_": lambda x: x[:].mul_(2),
    "ellipsis_relu_": lambda x: x[...].relu_(),
    "detach_mul_": lambda x: x.detach().mul_(2),
    "narrow_add_": lambda x: x.narrow(0, 0, 4).add_(1),
    "permute_add_": lambda x: x.permute(0, 1).add_(1),
    "data_mul_": lambda x: x.data.mul_(2),
    "slice_contiguous": lambda x: x[:].contiguous(),
    "slice_float": lambda x: x[:].float(),
    "slice_dropout": lambda x: F.dropout(x[:], 0.1, False),
}


def _floats(h, times=9):
    for _ in range(times):
        h = h.float()
    return h


WHOLE_VIEWS_WRITTEN.update({   # review50r1: ops not on the first list, keywords, long chains
    "slice_cpu": lambda x: x[:].cpu(),
    "slice_flatten_1_1": lambda x: x[:].flatten(1, 1),
    "slice_conj": lambda x: x[:].conj(),
    "slice_sum_to_size": lambda x: x[:].sum_to_size(4, 6),
    "mul_out_slice": lambda x: torch.mul(x, 2, out=x[:]),
    "positive_input_slice": lambda x: torch.positive(input=x[:]),
    "relu__input_slice": lambda x: torch.relu_(input=x[:]),
    "slice_nine_floats": lambda x: _floats(x[:]),
    "detach_cpu": lambda x: x.detach().cpu(),
    "detach_nine_floats": lambda x: _floats(x.detach()),
})


class Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("name", sorted(WHOLE_VIEWS_WRITTEN))
def test_a_returned_whole_view_is_not_the_input_itself(name):
    """fuzz50c: `x[:].mul_(2)` returned came back as x itself (the view was dropped and the in-place op
    returns its operand), so a caller's `out.unsqueeze_(0)` reshaped the caller's input too."""
    model = Apply(WHOLE_VIEWS_WRITTEN[name]).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6))
    assert fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        xe, xo = torch.randn(4, 6), torch.randn(4, 6)
        xo.copy_(xe)
        want, got = model(xe), opt(xo)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(xo, xe)
    assert (got is xo) == (want is xe) is False
    got.unsqueeze_(0)
    assert xo.shape == (4, 6)


class TwiceThroughAWrite(nn.Module):
    def forward(self, x):
        h = x.exp()
        return h, h[:].mul_(2)


def test_a_value_and_its_written_whole_view_come_back_as_two_tensors():
    opt = fxfuse.optimize(TwiceThroughAWrite().eval(), torch.randn(4, 6))
    with torch.no_grad():
        a, b = opt(torch.randn(4, 6))
    assert a is not b
    b.unsqueeze_(0)
    assert a.shape == (4, 6)


class ReshapedThroughAWrite(nn.Module):
    def forward(self, x):
        h = x.exp()
        w = h[:].add_(1)
        w.unsqueeze_(0)
        return h * 2


class DetachedReshapedThroughACast(nn.Module):
    def forward(self, x):
        h = x.exp()
        w = h.detach().float()
        w.t_()
        return h + 1


class ReshapedThroughOthers(nn.Module):
    """review50r1: h reshaped in place through ops that hand it back (cpu(), flatten(1, 1), conj(), 9 mul_)."""
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        h = x * 2
        v = h.detach() if self.kind == "detach_cpu" else h[:]
        if self.kind in ("cpu", "detach_cpu"):
            h.cpu().t_()
        elif self.kind == "flatten":
            h.flatten(1, 1).t_()
        elif self.kind == "conj":
            h.conj().t_()
        else:
            w = h
            for _ in range(9):
                w = w.mul_(1.0)
            w.t_()
        return v + 1


@pytest.mark.parametrize("kind", ["cpu", "detach_cpu", "flatten", "conj", "nine_writes"])
def test_a_view_taken_before_its_source_is_reshaped_through_any_op_keeps_its_shape(kind):
    model, x = ReshapedThroughOthers(kind).eval(), torch.randn(4, 4)
    opt = fxfuse.optimize(model, x, verify=False)
    assert fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        xi = torch.randn(4, 4)
        torch.testing.assert_close(opt(xi.clone()), model(xi.clone()))


class ViewOfFresh(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(4, 4)

    def forward(self, x):
        if self.kind == "second_operand":
            return (x * 3).add_(torch.sin(x).detach())
        if self.kind == "fresh_detach":
            return torch.tanh(self.lin(x)).detach().mul_(0.5).add_(0.5)
        if self.kind == "fresh_slice":
            return torch.sin(x)[:, :].relu_()
        return {"plain_second_operand": lambda: (x * 3).add_(torch.sin(x)),
                "plain_fresh_detach": lambda: torch.tanh(self.lin(x)).mul_(0.5).add_(0.5),
                "plain_fresh_slice": lambda: torch.sin(x).relu_()}[self.kind]()


@pytest.mark.parametrize("kind", ["second_operand", "fresh_detach", "fresh_slice"])
def test_an_alias_of_a_fresh_value_no_caller_sees_still_goes(kind):
    """review50r1: the first fix kept a detach / whole view of a fresh intermediate returned through an
    in-place op (or read as an in-place op's second operand), which cost a kernel or a library call."""
    x = torch.randn(3, 4)
    counts = []
    for k in (kind, "plain_" + kind):
        torch.manual_seed(0)
        model = ViewOfFresh(k).eval()
        opt = optimize_strict(model, x)
        with torch.no_grad():
            torch.testing.assert_close(opt(x.clone()), model(x.clone()))
        counts.append((fxfuse.stats(opt)["fused_kernels"], fxfuse.stats(opt)["library_calls"]))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("model_class", [ReshapedThroughAWrite, DetachedReshapedThroughACast])
def test_a_view_reshaped_in_place_through_an_op_returning_it_leaves_its_source(model_class):
    """fuzz50c: the reshape landed on h ([1, 4, 6] where eager gives [4, 6]); verify refused it blaming the model."""
    model, x = model_class().eval(), torch.randn(4, 6)
    for verify in (False, True):
        opt = fxfuse.optimize(model, x, verify=verify)
        assert fxfuse.stats(opt)["optimized"]
        with torch.no_grad():
            xi = torch.randn(4, 6)
            torch.testing.assert_close(opt(xi), model(xi))


class RowBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16))
        self.bias = nn.Parameter(torch.randn(1, 8))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias).relu()


def test_linear_of_one_sample_with_a_row_bias_keeps_its_shape():
    """fuzz50c: the bias split out of F.linear broadcast a [1, N] bias up a rank: [1, 8] where eager gives [8]."""
    model = RowBias().eval()
    opt = fxfuse.optimize(model, torch.randn(16), verify=False)
    assert fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        x = torch.randn(16)
        got, want = opt(x), model(x)
    assert got.shape == want.shape == (8,)
    torch.testing.assert_close(got, want)


def test_linear_of_a_batch_with_a_row_bias_is_still_split():
    model = RowBias().eval()
    x = torch.randn(5, 16)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


IN_PLACE_ACTIVATION_VIEWS = {
    "elu_slice": lambda x: F.elu(x, inplace=True)[:],
    "leaky_relu_slice": lambda x: F.leaky_relu(x, 0.1, inplace=True)[:],
    "hardswish_detach": lambda x: F.hardswish(x, inplace=True).detach(),
    "max_values_detach": lambda x: (lambda m: (m, m.values.detach()))(torch.max(x * 2, 1)),
    "max_item_slice": lambda x: (lambda m: (m, m[0][:]))(torch.max(x * 2, 1)),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE_ACTIVATION_VIEWS))
def test_a_view_of_a_value_the_caller_holds_stays_another_object(name):
    """review50r3: an in-place activation's result (the input itself) and a returned max tuple's part were taken
    for fresh values no caller holds, so their returned view came back as that very tensor."""
    model = Apply(IN_PLACE_ACTIVATION_VIEWS[name]).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6))
    with torch.no_grad():
        x = torch.randn(4, 6)
        got, want = opt(x.clone()), model(x.clone())
    if isinstance(want, tuple):
        (got_max, got_view), (_, want_view) = got, want
        torch.testing.assert_close(got_view, want_view)
        assert got_view is not got_max.values
        got_view.unsqueeze_(0)
        assert got_max.values.shape == (4,)
    else:
        torch.testing.assert_close(got, want)
        x = torch.randn(4, 6)
        got = opt(x)
        assert got is not x
        got.unsqueeze_(0)
        assert x.shape == (4, 6)


class ReducedView(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        h = x.sin()
        v = h[:] if self.spelling == "slice" else h
        return h, v.argmax(-1), v.flatten(0), v * 2 + 1


def test_a_whole_view_read_by_reductions_still_goes():
    """review50r3: argmax / flatten(0) of the view were taken for ops that may hand it back (2 kernels, not 1)."""
    x = torch.randn(3, 4)
    counts = [fxfuse.stats(optimize_strict(ReducedView(s).eval(), x))["fused_kernels"] for s in ("slice", "plain")]
    assert counts[0] == counts[1]


DATA_DEPENDENT_SPELLINGS = {
    "aten_where": lambda x: torch.ops.aten.where.default(x * 2 > 0)[0],
    "private_unique2": lambda x: torch._unique2((x * 2).round())[0],
    "aten_repeat_interleave": lambda x: torch.ops.aten.repeat_interleave.self_Tensor(
        x, (x[:, 0] > 0).long() + 1, 0),
    "unbound_repeat_interleave": lambda x: torch.Tensor.repeat_interleave(x, (x[:, 0] > 0).long() + 1, dim=0),
    "numel_of_masked": lambda x: x[x > 0].sum() / torch.numel(x[x > 0]),
}


@pytest.mark.parametrize("name", sorted(DATA_DEPENDENT_SPELLINGS))
def test_value_sized_spellings_are_not_frozen_at_the_example(name):
    """fuzz50l: aten overloads, private functions and torch.numel of a value-sized tensor kept the example's size."""
    fn = DATA_DEPENDENT_SPELLINGS[name]

    class Sized(nn.Module):
        def forward(self, x):
            h = fn(x)
            return torch.zeros_like(h) + h.shape[0] if h.dim() else h

    model = Sized().eval()
    opt = fxfuse.optimize(model, torch.randn(6, 3), verify=False)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(6, 3)
            torch.testing.assert_close(opt(x), model(x))
