"""Stop 44: spellings that lost a fusion (an in-place RReLU, an fp16 add with alpha) or left a dead
view behind (`x @ W.adjoint()`, unsafe_chunk / unsafe_split)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict


class InPlaceRReLU(nn.Module):
    """An eval-mode RReLU written in place, each spelling, between two pointwise ops."""

    def __init__(self, how):
        super().__init__()
        self.how, self.rrelu = how, nn.RReLU(0.1, 0.3, inplace=True)

    def forward(self, x):
        h = x * 2
        if self.how == "F.rrelu_":
            F.rrelu_(h)
        elif self.how == "inplace=True":
            h = F.rrelu(h, 0.2, 0.4, inplace=True)
        elif self.how == "torch.rrelu_":
            torch.rrelu_(h, 0.05, 0.25)
        else:
            self.rrelu(h)
        return torch.sigmoid(h)


@pytest.mark.parametrize("how", ["F.rrelu_", "inplace=True", "torch.rrelu_", "nn.RReLU(inplace=True)"])
def test_an_in_place_rrelu_joins_the_kernel(how):
    """`F.rrelu_(h)` was kept as an in-place op with no canonical form: a library call, and the
    sigmoid after it a library call too (so its write stayed in order)."""
    model = InPlaceRReLU(how).eval()
    opt = optimize_strict(model, torch.randn(3, 8))
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, torch.randn(3, 8))


class RReLUOnAView(nn.Module):
    def forward(self, x):
        h = x * 2
        F.rrelu_(h[:, :4])        # the write shows through h
        return h + 1


def test_an_in_place_rrelu_through_a_view_still_writes():
    model = RReLUOnAView().eval()
    opt = optimize_strict(model, torch.randn(3, 8))
    assert_matches_eager(opt, model, torch.randn(3, 8))


class HalfAddAlpha(nn.Module):
    def __init__(self, alpha, in_place):
        super().__init__()
        self.alpha, self.in_place = alpha, in_place

    def forward(self, x, y):
        h = x * 2
        h = h.add_(y, alpha=self.alpha) if self.in_place else h.add(y, alpha=self.alpha)
        return h * 0.5 + 1


@pytest.mark.parametrize("alpha", [3, -2.5, 0.1])
@pytest.mark.parametrize("in_place", [False, True])
def test_an_fp16_add_with_alpha_joins_the_kernel(alpha, in_place):
    """fp16 `h.add(y, alpha=a)` was a library call between two kernels. The kernel computes
    x + a * y in fp32 and rounds once, as CUDA's eager kernel (alpha as fp32); CPU eager reads alpha
    in fp16, so with a = 0.1 the two may differ by one fp16 ulp here (the GPU test is bit-exact)."""
    model = HalfAddAlpha(alpha, in_place).eval()
    x, y = torch.randn(16, 24, dtype=torch.float16), torch.randn(16, 24, dtype=torch.float16)
    opt = optimize_strict(model, x, y)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, x * 50, y * 50, rtol=2e-3, atol=1e-3)


class HalfMinusNumber(nn.Module):
    def forward(self, x):
        h = torch.rsub(torch.sigmoid(x), 0.1, alpha=3)   # 0.1 - 3 * sigmoid(x): eager reads fp16(0.1)
        return h.sub(0.1, alpha=0.7) * 2


def test_a_number_beside_an_fp16_tensor_with_alpha_keeps_eager_rounding():
    model = HalfMinusNumber().eval()
    x = torch.randn(16, 24, dtype=torch.float16)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        xi = torch.randn_like(x)
        assert torch.equal(opt(xi), model(xi))


class LinearSpelledWith(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin, self.how = nn.Linear(8, 16), how

    def forward(self, x):
        w = self.lin.weight
        if self.how == "adjoint":
            return torch.relu(x @ w.adjoint() + self.lin.bias)
        if self.how == "torch.adjoint":
            return torch.relu(x @ torch.adjoint(w) + self.lin.bias)
        h = self.lin(x)
        a, b = h.unsafe_chunk(2, -1) if self.how == "unsafe_chunk" else torch.unsafe_split(h, 8, -1)
        return torch.sigmoid(a) * b


@pytest.mark.parametrize("how", ["adjoint", "torch.adjoint"])
def test_a_dead_adjoint_is_dropped(how):
    """`x @ W.adjoint()` became F.linear(x, W), but the adjoint node stayed: one library call more."""
    model = LinearSpelledWith(how).eval()
    opt = optimize_strict(model, torch.randn(5, 8))
    assert fxfuse.stats(opt)["library_calls"] == 1 and fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(5, 8))


@pytest.mark.parametrize("how", ["unsafe_chunk", "unsafe_split"])
def test_unsafe_chunk_and_split_read_as_chunk_and_split(how):
    model = LinearSpelledWith(how).eval()
    opt = optimize_strict(model, torch.randn(5, 8))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(5, 8))


class HalfTimesOneElement(nn.Module):
    """An fp16 tensor times / divided by a one-element tensor of another dtype (the result stays fp16)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.register_buffer("s", torch.tensor(1e-8))

    def forward(self, x, t):
        h = torch.sigmoid(x) * 100
        if self.how == "buffer":
            return h * self.s + 1
        if self.how == "argument":
            return (h * t).relu()
        if self.how == "divide":
            return (h / torch.tensor(70000.0)) - 0.5
        return (h * torch.tensor(70000)).relu()   # an int64 one


@pytest.mark.parametrize("how", ["buffer", "argument", "divide", "int64"])
def test_an_fp16_tensor_times_a_one_element_tensor_reads_it_as_cpu_eager(how):
    """CPU eager's mul and div read the second operand's one element in fp32 (original_scalar_value);
    the kernel rounded it to fp16 first: 1e-8 became 0, 70000 inf, 0.1 one ulp off (fuzz44b)."""
    model = HalfTimesOneElement(how).eval()
    x = torch.randn(6, 16, dtype=torch.float16)
    opt = optimize_strict(model, x, torch.tensor(70000.0))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    for t in (torch.tensor(70000.0), torch.tensor(0.1), torch.tensor(1e-8)):
        with torch.no_grad():
            xi = torch.randn_like(x)
            assert torch.equal(opt(xi, t), model(xi, t))


class SpellingPair(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.register_buffer("scale", torch.tensor(0.125, dtype=torch.float64))

    def forward(self, x, y):
        return self.fn(self, torch.sigmoid(x - 0.5)) * y


SPELLINGS_FUSED_NOW = {   # each used to split the kernel around a library call (fuzz44b, fuzz44d)
    "h.bool()": lambda m, h: h.bool().float(),
    "h.to(torch.bool)": lambda m, h: (h - 0.5).to(torch.bool).float(),
    "0-dim fp64 scale": lambda m, h: h * m.scale + 1,
    "0-dim fp64 compare": lambda m, h: (h > m.scale).float(),
    "rad2deg": lambda m, h: torch.rad2deg(h) + 1,
    "deg2rad_": lambda m, h: h.deg2rad_() + 1,
    "special.round(decimals=0)": lambda m, h: torch.special.round(h * 3, decimals=0),
    "aten.special_round": lambda m, h: torch.ops.aten.special_round(h * 3, decimals=0),
}


@pytest.mark.parametrize("name", list(SPELLINGS_FUSED_NOW))
def test_spellings_that_split_the_kernel_join_it(name):
    model = SpellingPair(SPELLINGS_FUSED_NOW[name]).eval()
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    opt = optimize_strict(model, x, y)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, x, y)


def test_a_bool_cast_returned_by_the_kernel_keeps_nan_true():
    model = SpellingPair(lambda m, h: torch.log(h - 0.5).bool()).eval()   # log of a negative: NaN, which is true
    opt = optimize_strict(model, torch.randn(5, 7), torch.ones(5, 7, dtype=torch.bool))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(5, 7)
    with torch.no_grad():
        assert torch.equal(opt(x, torch.ones(5, 7, dtype=torch.bool)), model(x, torch.ones(5, 7, dtype=torch.bool)))


class ShiftAdd(nn.Module):
    """`b[:, 1:] += x[:, :-1]` on a fresh tensor, then pointwise ops reading b and x."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x, bias):
        b = bias.expand(4, 6).clone()
        if self.how == "+=":
            b[:, 1:] += x[:, :-1]
        else:
            b[:, 1:].add_(x[:, :-1])
        return torch.sigmoid(b) * x


@pytest.mark.parametrize("how", ["+=", "add_"])
def test_what_an_in_place_op_only_reads_is_not_held_back(how):
    """The alias walk followed every input of a kept in-place op, so x (only read by `+=`) counted
    as written and `sigmoid(b) * x` ran unfused, with a message blaming x (fuzz44a)."""
    model = ShiftAdd(how).eval()
    opt = optimize_strict(model, torch.randn(4, 6), torch.randn(6))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert "operand x may alias" not in fxfuse.explain(opt)
    assert_matches_eager(opt, model, torch.randn(4, 6), torch.randn(6))


COPIES = {   # each split the kernel around a library copy; `.contiguous()` did not
    "clone": lambda h: h.clone(),
    "torch.clone": lambda h: torch.clone(h),
    "clone(contiguous_format)": lambda h: h.clone(memory_format=torch.contiguous_format),
    "t().clone(contiguous_format)": lambda h: h.t().clone(memory_format=torch.contiguous_format).t(),
    "expand().clone()": lambda h: h[None].expand(3, 5, 7).clone().sum(0),
}
SIBLINGS = {"t().clone(contiguous_format)": lambda h: h.t().contiguous().t(),
            "expand().clone()": lambda h: h[None].expand(3, 5, 7).contiguous().sum(0)}


class CopyThenRead(nn.Module):
    def __init__(self, copy):
        super().__init__()
        self.copy = copy

    def forward(self, x, y):
        return self.copy(torch.relu(x)) * 2 + y


@pytest.mark.parametrize("name", list(COPIES))
def test_a_copy_read_only_by_pointwise_ops_joins_the_kernel(name):
    model = CopyThenRead(COPIES[name]).eval()
    opt = optimize_strict(model, torch.randn(5, 7), torch.randn(5, 7))
    sibling = optimize_strict(CopyThenRead(SIBLINGS.get(name, lambda h: h)).eval(), torch.randn(5, 7), torch.randn(5, 7))
    assert (fxfuse.stats(opt)["fused_kernels"], fxfuse.stats(opt)["library_calls"]) == \
        (fxfuse.stats(sibling)["fused_kernels"], fxfuse.stats(sibling)["library_calls"])
    assert_matches_eager(opt, model, torch.randn(5, 7), torch.randn(5, 7))


class CopyKeptApart(nn.Module):
    """A copy that is returned, or whose source is written afterwards, stays a copy."""

    def forward(self, x):
        h = torch.relu(x)
        c = h.clone()
        h.mul_(3)                  # eager's copy holds h before the write
        return c + 1, h, x.clone()   # x.clone(): fresh memory, not the input


def test_a_copy_that_is_returned_or_outlives_a_write_stays_a_copy():
    model = CopyKeptApart().eval()
    opt = optimize_strict(model, torch.randn(5, 7))
    got = assert_matches_eager(opt, model, torch.randn(5, 7))
    x = torch.randn(5, 7)
    with torch.no_grad():
        assert opt(x)[2].data_ptr() != x.data_ptr()
    assert got[0].data_ptr() != got[1].data_ptr()
