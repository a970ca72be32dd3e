"""Differential tests on models, spellings and inputs the rest of the suite does not use:
fxfuse.optimize(model, x, strict=True) against eager on fresh random inputs, fp32 tolerance
1e-5 / 1e-6, and the rewrite asserted through fxfuse.stats. Each regression test names the
failure it guards against."""
import math
import operator
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from conftest import NO_MLP, _clone, assert_fast_path, assert_matches_eager, fresh_like, optimize_strict

RTOL, ATOL = 1e-5, 1e-6


class Lambda(nn.Module):
    """forward(x, y) = fn(x, y): one module per spelling under test."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


def check(model, *example, fused=1, rtol=RTOL, atol=ATOL, **options):
    """Optimize strictly, compare with eager on fresh inputs (outputs and inputs after the call:
    eager's in-place writes into inputs are part of its semantics), assert the fast path."""
    model = model.eval()
    opt = optimize_strict(model, *example, **options)
    args = [fresh_like(a) for a in example]
    eager_args, opt_args = [_clone(a) for a in args], [_clone(a) for a in args]
    with torch.no_grad():
        expected = model(*eager_args)
        got = opt(*opt_args)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(opt_args, eager_args, rtol=rtol, atol=atol, equal_nan=True)
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] >= fused, s
    if fused:
        assert_fast_path(opt)
    return opt


SPELLINGS = {
    "add_method": lambda x, y: x.add(y).relu(),
    "add_kw_other": lambda x, y: x.add(other=y).relu(),
    "add_alpha": lambda x, y: torch.add(x, y, alpha=2).relu(),
    "sub_alpha": lambda x, y: x.sub(y, alpha=0.5).relu(),
    "rsub": lambda x, y: torch.rsub(x, y).relu(),
    "rsub_scalar_alpha": lambda x, y: torch.rsub(x, 2.0, alpha=3) * y,
    "mul_inplace_fresh": lambda x, y: (x + y).mul_(2).relu(),
    "clamp_min_kw": lambda x, y: (x + y).clamp(min=0.1),
    "clamp_min_method": lambda x, y: (x + y).clamp_min(0.1),
    "clamp_tensor_bound": lambda x, y: (x * 2).clamp(min=y),
    "hardtanh_positional": lambda x, y: F.hardtanh(x + y, -0.5, 0.7),
    "relu6_inplace": lambda x, y: F.relu6((x + y) * 4, inplace=True),
    "leaky_relu_positional": lambda x, y: F.leaky_relu(x + y, 0.2),
    "elu_alpha": lambda x, y: F.elu(x + y, 0.5),
    "softplus_beta_threshold": lambda x, y: F.softplus(x + y, 2.0, 1.0),
    "gelu_tanh": lambda x, y: F.gelu(x + y, approximate="tanh"),
    "silu_hardswish_mish": lambda x, y: F.silu(x) + F.hardswish(4 * y) + F.mish(x * y) + F.hardsigmoid(4 * x),
    "sigmoid_method": lambda x, y: (x + y).sigmoid() + torch.sigmoid(x),
    "pow_spellings": lambda x, y: (x + y) ** 2 + x.pow(3) + torch.square(y),
    "where_scalar": lambda x, y: torch.where(x > 0, x + y, 0.0),
    "where_method": lambda x, y: (x + y).where(x > 0, y),
    "casts": lambda x, y: (x + y).half().float() + x.to(torch.float16).float() + y.type(torch.float16).float(),
    "divisions": lambda x, y: (x + y) / 3 + 3 / (x.abs() + 1),
    "neg_abs": lambda x, y: operator.neg(x + y) + abs(x - y),
    "bool_mask_mul": lambda x, y: (x > 0) * y + (x <= y).float(),
}


@pytest.mark.parametrize("fn", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_op_spellings(fn):
    check(Lambda(fn), torch.randn(4, 7), torch.randn(4, 7))


@pytest.mark.parametrize("xshape, yshape", [((7,), (3, 7)), ((3, 1), (1, 5)), ((2, 3, 4, 5), (3, 1, 1)),
                                            ((3, 1, 1), (2, 3, 4, 5)), ((), (3, 4))],
                         ids=["row", "outer", "channel", "channel-first", "0d"])
def test_broadcasting_both_ways(xshape, yshape):
    check(Lambda(lambda x, y: (x + y).relu() * 2), torch.randn(xshape), torch.randn(yshape))


@pytest.mark.parametrize("shape", [(), (1, 1), (1,)], ids=["0d", "1x1", "1"])
def test_one_point_kernel(shape):
    """A kernel over a single point ([] or [1, 1]) stored a block into a scalar address and the
    Triton interpreter rejected it (an internal error instead of a result)."""
    check(Lambda(lambda x, y: (x * y).relu() + 2), torch.randn(shape), torch.randn(shape))


def test_optimize_keeps_the_example_input_and_eager_input_writes():
    """Shape propagation and verification ran the graph on the user's example tensor, so a
    model that writes into its input (x.add_(1)) changed it and verification compared eager on
    the changed input against the graph on a twice-changed one: a spurious failure."""
    class AddInPlace(nn.Module):
        def forward(self, x, y):
            x.add_(1)
            return (x * y).sigmoid()

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    before = x.clone()
    check(AddInPlace(), x, y, fused=0)
    assert torch.equal(x, before)


def test_augmented_assignment_on_input_writes_it_as_eager_does():
    """torch.fx records `x += 1` as `x = x + 1`, and the graph did not write into the input (it
    fell back); fxfuse's tracer records operator.iadd, which writes as eager does."""
    class IAdd(nn.Module):
        def forward(self, x):
            x += 1
            return x.relu()

    model = IAdd().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 4), strict=True)
    with torch.no_grad():
        x = torch.randn(3, 4)
        a, b = x.clone(), x.clone()
        torch.testing.assert_close(opt(b), model(a))
        torch.testing.assert_close(b, a)       # the caller's tensor written, as in eager
        assert not torch.equal(b, x)


def test_exported_graph_with_tensor_constant_fuses():
    """torch.export wraps a tensor constant in detach_, which counted as an in-place op and kept
    the whole graph out of fusion. (Control flow on a shape makes symbolic_trace fail over to
    torch.export.)"""
    class ShapeBranch(nn.Module):
        def forward(self, x, y):
            if x.shape[0] > 1:
                x = x * torch.tensor(2.0)
            return x.relu() + y

    opt = check(ShapeBranch(), torch.randn(3, 4), torch.randn(3, 4))
    assert fxfuse.stats(opt)["fused_kernels"] == 1


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_fused_outputs_keep_eager_layout(layout):
    """Fused kernels wrote contiguous outputs while the graph's metadata kept eager's strides:
    channels_last results came back NCHW and every later kernel on them ran its reference."""
    class Chain(nn.Module):
        def forward(self, x, y):
            h = (x * 2).relu()
            return (h.transpose(0, 1) + 1).sigmoid(), h + y

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last) if layout == "channels_last" \
        else torch.randn(5, 3).t()
    opt = check(Chain(), x, torch.randn(x.shape), fused=2, **NO_MLP)
    with torch.no_grad():
        assert opt(x, x)[1].stride() == Chain()(x, x)[1].stride()


def test_channels_last_conv_bn_chain():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.c2 = nn.Conv2d(4, 4, 1, groups=2)

        def forward(self, x, y):
            h = F.silu(self.bn(self.c1(x)))
            return F.relu(self.c2(h)) + h * y

    net = Net()
    net.bn.running_mean.uniform_(-1, 1)
    net.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    check(net, x, torch.randn(4, 1, 1), fused=2)


def test_tensors_inside_a_list_argument_are_refused():
    """A list of tensors became a concrete argument: its tensors were baked into the graph as
    constants and the guard compared repr(), which elides the middle of large tensors."""
    class ListIn(nn.Module):
        def forward(self, xs):
            return (xs[0] * xs[1]).relu()

    model, xs = ListIn().eval(), [torch.randn(30, 40), torch.randn(30, 40)]
    with pytest.raises(fxfuse.UnsupportedError, match="holding tensors"):
        fxfuse.optimize(model, (xs,), strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, (xs,))
    assert [w.category for w in caught] == [fxfuse.FxfuseWarning]
    other = [xs[0].clone(), xs[1]]
    other[0][15, 20] += 5
    assert torch.equal(opt(other), model(other))


def test_keyword_arguments_bind_to_positions():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, scale: float = 2.0):
            return F.gelu(self.fc(x)) * scale

    model, x = Scaled().eval(), torch.randn(3, 4)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        torch.testing.assert_close(opt(x=x), model(x), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(opt(x, scale=3.0), model(x, scale=3.0), rtol=RTOL, atol=ATOL)
        with pytest.raises(TypeError, match="unexpected keyword argument 'bias'"):
            opt(x, bias=1.0)   # eager's own error, also under strict=True (test_calls_round5)


def test_alpha_with_a_number_fuses():
    """x.sub_(1, alpha=2) left a node `1 * 2` (two numbers) that no kernel could take."""
    opt = check(Lambda(lambda x, y: (x * y).sub_(1, alpha=2).relu()), torch.randn(3, 4), torch.randn(3, 4))
    assert fxfuse.stats(opt)["library_calls"] == 0


def test_wide_integer_comparison_is_exact():
    """Kernels load integers as fp32: int64 ids above 2**24 compared equal when they were not.
    The example input has small ids, so verification could not see it; the call has large ones."""
    model = Lambda(lambda a, b: (a == b).float() * 2 + (a > b).float()).eval()
    example = (torch.randint(0, 100, (5,)), torch.randint(0, 100, (5,)))
    opt = optimize_strict(model, *example)
    a = torch.tensor([2 ** 24, 2 ** 24 + 1, 5, 2 ** 40, 2 ** 40 + 1])
    b = torch.tensor([2 ** 24 + 1, 2 ** 24, 5, 2 ** 40 + 1, 2 ** 40])
    with torch.no_grad():
        assert torch.equal(opt(a, b), model(a, b))


def test_small_integer_comparison_still_fuses():
    check(Lambda(lambda a, y: (a > 3) * y + (a == 0).float()), torch.randint(-5, 5, (3, 4), dtype=torch.int8),
          torch.randn(3, 4))


@pytest.mark.parametrize("fn", [lambda x, y: (x * 1.0 == 0.1) | (x * 1.0 >= 1 / 3),
                                lambda x, y: torch.where(x * 1.0 <= 0.3, x, -x) * y,
                                lambda x, y: (x * 1.0 <= y).float() + 1],
                         ids=["scalar", "where", "fp32-0d"])
def test_fp16_comparison_rounds_operands(fn):
    """Eager compares an fp16 tensor with 0.1 (or an fp32 0-d tensor) after rounding it to fp16;
    the kernel compared in fp32, so x == fp16(0.1) was false and >= flipped at the boundary."""
    model = Lambda(fn).eval()
    x = torch.tensor([0.1, 0.2, 0.3, 1 / 3, 0.5], dtype=torch.float16)
    y = torch.tensor(0.3)
    opt = optimize_strict(model, x, y)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, y), model(x, y), rtol=1e-3, atol=1e-3)
    assert_fast_path(opt)


def test_failed_capture_prints_nothing(capfd):
    """ShapeProp printed the failing node's traceback and torch.export logged fake-tensor
    tracebacks at ERROR level: a wrong-shape input filled stderr before fxfuse's own error."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    with pytest.raises(fxfuse.TraceError):
        fxfuse.optimize(model, torch.randn(3, 5), strict=True)
    opt = optimize_strict(model, torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="cannot be multiplied"), torch.no_grad():
        opt(torch.randn(3, 5))   # a call the model itself rejects: the model's own error
    out, err = capfd.readouterr()
    assert out == "" and err == ""


class Attention(nn.Module):
    """Pre-norm attention + GELU FFN with view/reshape/permute/transpose between the matmuls."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 12), nn.Linear(12, d)

    def forward(self, x, bias):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, -1).permute(0, 2, 1, 3)
        v = v.view(b, t, self.heads, -1).transpose(1, 2)
        a = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + bias).softmax(dim=-1)
        x = x + self.out((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


@pytest.mark.parametrize("batch, seq", [(2, 5), (1, 3)])
def test_attention_block(batch, seq):
    check(Attention(), torch.randn(batch, seq, 8), torch.randn(seq, seq), fused=2, rtol=1e-4, atol=1e-5)


class Structured(nn.Module):
    """Nested outputs, a buffer used pointwise, one Linear applied twice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("scale", torch.randn(6))

    def forward(self, x, y):
        h = F.silu(self.fc(x)) * self.scale
        return [h, (self.fc(h) + y, {"gate": torch.sigmoid(y)})]


def test_nested_outputs_buffer_and_reused_layer():
    check(Structured(), torch.randn(3, 6), torch.randn(3, 6))


@pytest.mark.parametrize("x", [torch.randn(6, 5).t(), torch.randn(5, 12)[:, ::2],
                               torch.randn(1, 6).expand(5, 6), torch.randn(0, 6)],
                         ids=["transposed", "sliced", "expanded", "empty"])
def test_strided_and_empty_inputs(x):
    check(Lambda(lambda x, y: F.gelu(x * y) + 1), x, torch.randn(x.shape[-1]), fused=int(x.numel() > 0))


def test_respecializes_on_dtype_and_shape():
    model = Lambda(lambda x, y: F.softplus(x * y) - 1).eval()
    opt = optimize_strict(model, torch.randn(3, 4), torch.randn(3, 4))
    for x, tol in ((torch.randn(5, 4), 1e-5), (torch.randn(3, 4).half(), 1e-3), (torch.randn(3, 4).double(), 1e-12)):
        y = torch.randn(x.shape).to(x.dtype)
        with torch.no_grad():
            torch.testing.assert_close(opt(x, y), model(x, y), rtol=tol, atol=tol)
    assert fxfuse.stats(opt)["specializations"] == 4


class _ScalarFirst(nn.Module):
    """torch.maximum / minimum with a 0-d or one-element operand first (the fuzzer's case: the
    kernel or-ed a scalar-loaded mask with a block mask, which the interpreter rejects)."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.register_buffer("p", torch.randn(1))

    def forward(self, x, y):
        return self.op(y.sum(), x) * 2 + self.op(self.p, x)


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum], ids=["maximum", "minimum"])
def test_maximum_minimum_with_a_scalar_first_operand(op):
    model = _ScalarFirst(op).eval()
    x, y = torch.randn(6, 3), torch.randn(5)
    opt = fxfuse.optimize(model, (x, y), strict=True)
    assert_matches_eager(opt, model, x, y)
    assert_fast_path(opt)
