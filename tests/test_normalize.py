"""The normalize and fold_batchnorm passes on small modules: every spelling of an op becomes
its canonical node (fxfuse.ops.POINTWISE key), layers are split, eval BatchNorm folded,
Dropout removed, in-place ops keep eager semantics; and the optimized model matches eager."""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from conftest import assert_fast_path, assert_matches_eager
from fxfuse.ops import POINTWISE, add_scaled, cast
from fxfuse.passes.fold_batchnorm import fold_batchnorm
from fxfuse.passes.normalize import normalize
from fxfuse.tracing import propagate_shapes, trace


class Fn(nn.Module):
    """A module whose forward is a lambda (traced through like any Python code)."""

    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, m in modules.items():
            self.add_module(name, m)

    def forward(self, x):
        return self.fn(self, x)


class Fn2(Fn):
    def forward(self, x, y):
        return self.fn(self, x, y)


def normalized(model, *args):
    """trace -> fold_batchnorm -> normalize, shapes re-propagated as the pipeline does."""
    gm = trace(model, args)
    gm = fold_batchnorm(gm)
    propagate_shapes(gm, args)
    gm = normalize(gm)
    propagate_shapes(gm, args)
    return gm


def calls(gm):
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def targets(gm):
    return [n.target for n in calls(gm)]


def assert_all_canonical(gm):
    for n in calls(gm):
        assert n.op == "call_function" and n.target in POINTWISE, f"not canonical: {n.op} {n.target}"


# (id, forward(self, x, y), the canonical target that must appear, expected kwargs or None)
# `y = x * 1.5` in front of in-place spellings gives them a fresh value to mutate.
SPELLINGS = [
    # relu
    ("nn.ReLU", lambda s, x, y: s.m(x), torch.relu, {}, {"m": nn.ReLU()}),
    ("nn.ReLU-inplace", lambda s, x, y: s.m(x * 1.5), torch.relu, {}, {"m": nn.ReLU(inplace=True)}),
    ("F.relu", lambda s, x, y: F.relu(x), torch.relu, {}, {}),
    ("F.relu-inplace", lambda s, x, y: F.relu(x * 1.5, inplace=True), torch.relu, {}, {}),
    ("torch.relu", lambda s, x, y: torch.relu(x), torch.relu, {}, {}),
    ("x.relu", lambda s, x, y: x.relu(), torch.relu, {}, {}),
    ("x.relu_", lambda s, x, y: (x * 1.5).relu_(), torch.relu, {}, {}),
    ("torch.relu_", lambda s, x, y: torch.relu_(x * 1.5), torch.relu, {}, {}),
    ("F.relu_", lambda s, x, y: F.relu_(x * 1.5), torch.relu, {}, {}),
    # binary arithmetic
    ("x+y", lambda s, x, y: x + y, operator.add, {}, {}),
    ("torch.add", lambda s, x, y: torch.add(x, y), operator.add, {}, {}),
    ("x.add", lambda s, x, y: x.add(y), operator.add, {}, {}),
    ("x.add_", lambda s, x, y: (x * 1.5).add_(y), operator.add, {}, {}),
    ("x+=y", lambda s, x, y: _iadd(x * 1.5, y), operator.add, {}, {}),
    ("torch.add-alpha", lambda s, x, y: torch.add(x, y, alpha=2), add_scaled, {"alpha": 2}, {}),
    ("x.sub-alpha", lambda s, x, y: x.sub(y, alpha=0.5), add_scaled, {"alpha": -0.5}, {}),
    ("x-y", lambda s, x, y: x - y, operator.sub, {}, {}),
    ("torch.sub", lambda s, x, y: torch.sub(x, y), operator.sub, {}, {}),
    ("torch.subtract", lambda s, x, y: torch.subtract(x, 2.0), operator.sub, {}, {}),
    ("x.sub_", lambda s, x, y: (x * 1.5).sub_(y), operator.sub, {}, {}),
    ("torch.rsub", lambda s, x, y: torch.rsub(x, y), operator.sub, {}, {}),
    ("torch.rsub-scalar", lambda s, x, y: torch.rsub(x, 2.0), operator.sub, {}, {}),
    ("1-x", lambda s, x, y: 1 - x, operator.sub, {}, {}),
    ("x*y", lambda s, x, y: x * y, operator.mul, {}, {}),
    ("torch.mul", lambda s, x, y: torch.mul(x, 3), operator.mul, {}, {}),
    ("x.mul", lambda s, x, y: x.mul(y), operator.mul, {}, {}),
    ("x.mul_", lambda s, x, y: (x * 1.5).mul_(y), operator.mul, {}, {}),
    ("torch.multiply", lambda s, x, y: torch.multiply(x, y), operator.mul, {}, {}),
    ("x/y", lambda s, x, y: x / (y.abs() + 0.5), operator.truediv, {}, {}),
    ("torch.div", lambda s, x, y: torch.div(x, 3.0), operator.truediv, {}, {}),
    ("x.div", lambda s, x, y: x.div(y.abs() + 0.5), operator.truediv, {}, {}),
    ("x.div_", lambda s, x, y: (x * 1.5).div_(7.0), operator.truediv, {}, {}),
    ("torch.true_divide", lambda s, x, y: torch.true_divide(x, 3.0), operator.truediv, {}, {}),
    ("2/x", lambda s, x, y: 2 / (x.abs() + 0.5), torch.reciprocal, {}, {}),   # x.reciprocal() * 2, as eager (stop 35)
    # negation
    ("-x", lambda s, x, y: -x, operator.neg, {}, {}),
    ("torch.neg", lambda s, x, y: torch.neg(x), operator.neg, {}, {}),
    ("x.neg", lambda s, x, y: x.neg(), operator.neg, {}, {}),
    ("torch.negative", lambda s, x, y: torch.negative(x), operator.neg, {}, {}),
    ("x.neg_", lambda s, x, y: (x * 1.5).neg_(), operator.neg, {}, {}),
    # unary math
    ("torch.exp", lambda s, x, y: torch.exp(x), torch.exp, {}, {}),
    ("x.exp", lambda s, x, y: x.exp(), torch.exp, {}, {}),
    ("x.exp_", lambda s, x, y: (x * 1.5).exp_(), torch.exp, {}, {}),
    ("torch.log", lambda s, x, y: torch.log(x), torch.log, {}, {}),
    ("x.log", lambda s, x, y: x.log(), torch.log, {}, {}),
    ("torch.sqrt", lambda s, x, y: torch.sqrt(x), torch.sqrt, {}, {}),
    ("x.sqrt_", lambda s, x, y: (x * 1.5).sqrt_(), torch.sqrt, {}, {}),
    ("torch.rsqrt", lambda s, x, y: torch.rsqrt(x), torch.rsqrt, {}, {}),
    ("x.rsqrt", lambda s, x, y: x.rsqrt(), torch.rsqrt, {}, {}),
    ("torch.abs", lambda s, x, y: torch.abs(x), torch.abs, {}, {}),
    ("x.abs", lambda s, x, y: x.abs(), torch.abs, {}, {}),
    ("torch.absolute", lambda s, x, y: torch.absolute(x), torch.abs, {}, {}),
    ("x.abs_", lambda s, x, y: (x * 1.5).abs_(), torch.abs, {}, {}),
    # pow by a scalar
    ("x**2", lambda s, x, y: x ** 2, operator.pow, {}, {}),
    ("x**3", lambda s, x, y: x ** 3, operator.pow, {}, {}),
    ("torch.pow", lambda s, x, y: torch.pow(x, 3), operator.pow, {}, {}),
    ("x.pow-half", lambda s, x, y: x.pow(0.5), operator.pow, {}, {}),
    ("x.pow-1.7", lambda s, x, y: x.abs().pow(1.7), operator.pow, {}, {}),
    ("x**-2", lambda s, x, y: x ** -2, operator.pow, {}, {}),
    ("x.pow_", lambda s, x, y: (x * 1.5).pow_(2), operator.pow, {}, {}),
    ("torch.square", lambda s, x, y: torch.square(x), operator.pow, {}, {}),
    ("x.square", lambda s, x, y: x.square(), operator.pow, {}, {}),
    # clamp and its relatives
    ("x.clamp", lambda s, x, y: x.clamp(-0.5, 0.5), torch.clamp, {"min": -0.5, "max": 0.5}, {}),
    ("torch.clamp-min", lambda s, x, y: torch.clamp(x, min=0), torch.clamp, {"min": 0.0, "max": None}, {}),
    ("x.clamp-max", lambda s, x, y: x.clamp(max=1), torch.clamp, {"min": None, "max": 1.0}, {}),
    ("torch.clip", lambda s, x, y: torch.clip(x, -1, 2), torch.clamp, {"min": -1.0, "max": 2.0}, {}),
    ("x.clamp_", lambda s, x, y: (x * 1.5).clamp_(-1, 1), torch.clamp, {"min": -1.0, "max": 1.0}, {}),
    ("torch.clamp_min", lambda s, x, y: torch.clamp_min(x, 0.25), torch.clamp, {"min": 0.25, "max": None}, {}),
    ("x.clamp_max", lambda s, x, y: x.clamp_max(0.25), torch.clamp, {"min": None, "max": 0.25}, {}),
    ("F.hardtanh", lambda s, x, y: F.hardtanh(x), torch.clamp, {"min": -1.0, "max": 1.0}, {}),
    ("F.hardtanh-args", lambda s, x, y: F.hardtanh(x, -0.5, 2.0), torch.clamp, {"min": -0.5, "max": 2.0}, {}),
    ("F.hardtanh-inplace", lambda s, x, y: F.hardtanh(x * 1.5, inplace=True), torch.clamp,
     {"min": -1.0, "max": 1.0}, {}),
    ("nn.Hardtanh", lambda s, x, y: s.m(x), torch.clamp, {"min": -2.0, "max": 0.5}, {"m": nn.Hardtanh(-2.0, 0.5)}),
    ("F.relu6", lambda s, x, y: F.relu6(x * 4), torch.clamp, {"min": 0.0, "max": 6.0}, {}),
    ("nn.ReLU6-inplace", lambda s, x, y: s.m(x * 4), torch.clamp, {"min": 0.0, "max": 6.0},
     {"m": nn.ReLU6(inplace=True)}),
    ("x.clamp-tensor-min", lambda s, x, y: x.clamp(min=y), torch.maximum, {}, {}),
    ("torch.clamp-tensor-both", lambda s, x, y: torch.clamp(x, min=y, max=y + 1), torch.minimum, {}, {}),
    # activations
    ("torch.sigmoid", lambda s, x, y: torch.sigmoid(x), torch.sigmoid, {}, {}),
    ("x.sigmoid", lambda s, x, y: x.sigmoid(), torch.sigmoid, {}, {}),
    ("x.sigmoid_", lambda s, x, y: (x * 1.5).sigmoid_(), torch.sigmoid, {}, {}),
    ("F.sigmoid", lambda s, x, y: F.sigmoid(x), torch.sigmoid, {}, {}),
    ("nn.Sigmoid", lambda s, x, y: s.m(x), torch.sigmoid, {}, {"m": nn.Sigmoid()}),
    ("torch.tanh", lambda s, x, y: torch.tanh(x), torch.tanh, {}, {}),
    ("x.tanh", lambda s, x, y: x.tanh(), torch.tanh, {}, {}),
    ("F.tanh", lambda s, x, y: F.tanh(x), torch.tanh, {}, {}),
    ("nn.Tanh", lambda s, x, y: s.m(x), torch.tanh, {}, {"m": nn.Tanh()}),
    ("F.gelu", lambda s, x, y: F.gelu(x), F.gelu, {}, {}),
    ("F.gelu-none", lambda s, x, y: F.gelu(x, approximate="none"), F.gelu, {}, {}),
    ("F.gelu-tanh", lambda s, x, y: F.gelu(x, approximate="tanh"), F.gelu, {"approximate": "tanh"}, {}),
    ("nn.GELU", lambda s, x, y: s.m(x), F.gelu, {}, {"m": nn.GELU()}),
    ("nn.GELU-tanh", lambda s, x, y: s.m(x), F.gelu, {"approximate": "tanh"}, {"m": nn.GELU("tanh")}),
    ("F.silu", lambda s, x, y: F.silu(x), F.silu, {}, {}),
    ("F.silu-inplace", lambda s, x, y: F.silu(x * 1.5, inplace=True), F.silu, {}, {}),
    ("nn.SiLU", lambda s, x, y: s.m(x), F.silu, {}, {"m": nn.SiLU()}),
    ("F.leaky_relu", lambda s, x, y: F.leaky_relu(x), F.leaky_relu, {}, {}),
    ("F.leaky_relu-slope", lambda s, x, y: F.leaky_relu(x, 0.2), F.leaky_relu, {"negative_slope": 0.2}, {}),
    ("F.leaky_relu-inplace", lambda s, x, y: F.leaky_relu(x * 1.5, negative_slope=0.3, inplace=True),
     F.leaky_relu, {"negative_slope": 0.3}, {}),
    ("F.leaky_relu_", lambda s, x, y: F.leaky_relu_(x * 1.5, 0.25), F.leaky_relu, {"negative_slope": 0.25}, {}),
    ("nn.LeakyReLU", lambda s, x, y: s.m(x), F.leaky_relu, {"negative_slope": 0.1}, {"m": nn.LeakyReLU(0.1)}),
    ("F.elu", lambda s, x, y: F.elu(x), F.elu, {}, {}),
    ("F.elu-alpha", lambda s, x, y: F.elu(x, alpha=0.5), F.elu, {"alpha": 0.5}, {}),
    ("F.elu_", lambda s, x, y: F.elu_(x * 1.5, 2.0), F.elu, {"alpha": 2.0}, {}),
    ("nn.ELU-inplace", lambda s, x, y: s.m(x * 1.5), F.elu, {"alpha": 0.7}, {"m": nn.ELU(0.7, inplace=True)}),
    ("F.softplus", lambda s, x, y: F.softplus(x), F.softplus, {}, {}),
    ("F.softplus-params", lambda s, x, y: F.softplus(x * 4, beta=2, threshold=5), F.softplus,
     {"beta": 2, "threshold": 5}, {}),
    ("nn.Softplus", lambda s, x, y: s.m(x), F.softplus, {"beta": 0.5}, {"m": nn.Softplus(beta=0.5)}),
    ("F.celu", lambda s, x, y: F.celu(x, 0.5), F.celu, {"alpha": 0.5}, {}),
    ("F.celu-inplace", lambda s, x, y: F.celu(x * 1.5, 0.5, True), F.celu, {"alpha": 0.5}, {}),
    ("torch.celu_", lambda s, x, y: torch.celu_(x * 1.5, 0.5), F.celu, {"alpha": 0.5}, {}),
    ("nn.CELU", lambda s, x, y: s.m(x), F.celu, {"alpha": 2.0}, {"m": nn.CELU(2.0)}),
    ("F.softsign", lambda s, x, y: F.softsign(x), F.softsign, {}, {}),
    ("nn.Softsign", lambda s, x, y: s.m(x), F.softsign, {}, {"m": nn.Softsign()}),
    ("F.logsigmoid", lambda s, x, y: F.logsigmoid(x), F.logsigmoid, {}, {}),
    ("nn.LogSigmoid", lambda s, x, y: s.m(x), F.logsigmoid, {}, {"m": nn.LogSigmoid()}),
    ("F.tanhshrink", lambda s, x, y: F.tanhshrink(x), F.tanhshrink, {}, {}),
    ("nn.Tanhshrink", lambda s, x, y: s.m(x), F.tanhshrink, {}, {"m": nn.Tanhshrink()}),
    ("F.hardshrink", lambda s, x, y: F.hardshrink(x, 0.3), F.hardshrink, {"lambd": 0.3}, {}),
    ("nn.Hardshrink", lambda s, x, y: s.m(x), F.hardshrink, {"lambd": 0.4}, {"m": nn.Hardshrink(0.4)}),
    ("F.softshrink", lambda s, x, y: F.softshrink(x, lambd=0.3), F.softshrink, {"lambd": 0.3}, {}),
    ("nn.Softshrink", lambda s, x, y: s.m(x), F.softshrink, {"lambd": 0.2}, {"m": nn.Softshrink(0.2)}),
    ("F.threshold", lambda s, x, y: F.threshold(x, 0.1, -2.0), F.threshold, {"threshold": 0.1, "value": -2.0}, {}),
    ("F.threshold-inplace", lambda s, x, y: F.threshold(x * 1.5, 0.1, -2.0, inplace=True), F.threshold,
     {"threshold": 0.1, "value": -2.0}, {}),
    ("F.threshold_", lambda s, x, y: F.threshold_(x * 1.5, 0.1, -2.0), F.threshold, {"value": -2.0}, {}),
    ("nn.Threshold", lambda s, x, y: s.m(x), F.threshold, {"threshold": 0.2, "value": 0.0},
     {"m": nn.Threshold(0.2, 0.0)}),
    # where
    ("torch.where", lambda s, x, y: torch.where(x > 0, x, y), torch.where, {}, {}),
    ("torch.where-scalar", lambda s, x, y: torch.where(x > y, x, 0.0), torch.where, {}, {}),
    ("x.where", lambda s, x, y: x.where(x < y, y), torch.where, {}, {}),
]


def _iadd(a, b):
    a += b
    return a


@pytest.mark.parametrize("fn,canonical,kwargs,modules", [s[1:] for s in SPELLINGS], ids=[s[0] for s in SPELLINGS])
def test_spelling_becomes_canonical(fn, canonical, kwargs, modules):
    model = Fn2(fn, **modules).eval()
    x, y = torch.randn(3, 7), torch.randn(3, 7)
    gm = normalized(model, x, y)
    assert_all_canonical(gm)
    hits = [n for n in calls(gm) if n.target is canonical]
    assert hits, f"{canonical} not in {targets(gm)}"
    for key, value in kwargs.items():
        assert any(n.kwargs.get(key) == value for n in hits), (key, value, [dict(n.kwargs) for n in hits])
    if canonical is F.gelu and not kwargs:
        assert all(n.kwargs.get("approximate", "none") == "none" for n in hits)
    with torch.no_grad():   # the normalized graph alone computes what the model computes
        torch.testing.assert_close(gm(x, y), model(x.clone(), y.clone()), rtol=1e-6, atol=1e-6, equal_nan=True)
    opt = fxfuse.optimize(model, (x, y), strict=True)
    assert_matches_eager(opt, model, x, y, equal_nan=True)
    assert_fast_path(opt)


def test_alpha_becomes_one_multiply_add():
    """Eager computes x + alpha * y as one fma: `x + y * alpha` would round twice (fuzz34e)."""
    gm = normalized(Fn2(lambda s, x, y: torch.add(x, y, alpha=2)).eval(), torch.randn(4), torch.randn(4))
    assert targets(gm) == [add_scaled] and calls(gm)[0].kwargs == {"alpha": 2}


def test_rsub_swaps_operands():
    gm = normalized(Fn2(lambda s, x, y: torch.rsub(x, 3.0)).eval(), torch.randn(4), torch.randn(4))
    (sub,) = calls(gm)
    assert sub.target is operator.sub and sub.args[0] == 3.0 and sub.args[1].op == "placeholder"


@pytest.mark.parametrize("fn,in_dtype,out_dtype", [
    (lambda s, x: x.float(), torch.float16, torch.float32),
    (lambda s, x: x.to(torch.float16), torch.float32, torch.float16),
    (lambda s, x: x.half(), torch.float32, torch.float16),
    (lambda s, x: x.to(dtype=torch.float16), torch.float32, torch.float16),
    (lambda s, x: x.type(torch.float16), torch.float32, torch.float16),
    (lambda s, x: x.double(), torch.float32, torch.float64),
], ids=["float", "to", "half", "to-dtype-kw", "type", "double"])
def test_cast_spellings(fn, in_dtype, out_dtype):
    model = Fn(fn).eval()
    x = torch.randn(5, 6).to(in_dtype)
    gm = normalized(model, x)
    (node,) = calls(gm)
    assert node.target is cast and node.args[1] == out_dtype
    opt = fxfuse.optimize(model, x, strict=True)
    out = assert_matches_eager(opt, model, x, rtol=0, atol=0)
    assert out.dtype == out_dtype


def test_noop_cast_vanishes():
    model = Fn(lambda s, x: x.float() * 2).eval()
    gm = normalized(model, torch.randn(3, 3))
    assert targets(gm) == [operator.mul]


def test_cast_chain_in_kernel_rounds_like_eager():
    model = Fn(lambda s, x: (x.to(torch.float16) * 3).float() + x).eval()
    x = torch.randn(9, 11)
    gm = normalized(model, x)
    assert targets(gm).count(cast) == 2
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x, rtol=0, atol=0)


# ---- layers ---------------------------------------------------------------------------------

def test_linear_becomes_linear_plus_bias_add():
    model = nn.Sequential(nn.Linear(6, 4)).eval()
    x = torch.randn(3, 6)
    gm = normalized(model, x)
    lin, add = calls(gm)
    assert lin.target is F.linear and len(lin.args) == 2 and not lin.kwargs
    assert add.target is operator.add and add.args[0] is lin and add.args[1].op == "get_attr"
    torch.testing.assert_close(gm(x), model(x))


def test_linear_without_bias_is_plain_linear():
    model = nn.Sequential(nn.Linear(6, 4, bias=False)).eval()
    gm = normalized(model, torch.randn(3, 6))
    (lin,) = calls(gm)
    assert lin.target is F.linear and len(lin.args) == 2


def test_functional_linear_bias_split():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 6))
            self.b = nn.Parameter(torch.randn(5))

        def forward(self, x):
            return F.linear(x, self.w, self.b)

    model = M().eval()
    x = torch.randn(2, 6)
    gm = normalized(model, x)
    assert targets(gm) == [F.linear, operator.add]
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)


@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_keeps_conv_with_bias_split(bias):
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1, stride=2, bias=bias)).eval()
    x = torch.randn(2, 3, 9, 9)
    gm = normalized(model, x)
    convs = [n for n in calls(gm) if n.target is F.conv2d]
    assert len(convs) == 1 and convs[0].args[2] is None
    if bias:
        (add,) = [n for n in calls(gm) if n.target is operator.add]
        assert add.args[0] is convs[0]
        assert tuple(add.args[1].meta["tensor_meta"].shape) == (5, 1, 1)
    else:
        assert targets(gm) == [F.conv2d]
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)


def _randomized_bn(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return bn.eval()


def _no_batchnorm(gm):
    return not any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.modules.batchnorm._BatchNorm)
                   for n in gm.graph.nodes)


@pytest.mark.parametrize("conv_bias", [True, False])
def test_batchnorm_after_conv_folded(conv_bias):
    model = nn.Sequential(nn.Conv2d(3, 6, 3, bias=conv_bias), _randomized_bn(nn.BatchNorm2d(6)), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    gm = normalized(model, x)
    assert _no_batchnorm(gm)
    assert [t for t in targets(gm) if t is F.conv2d] == [F.conv2d]
    assert operator.mul not in targets(gm)          # folded into the weights, not a mul-add
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)
    # the user's model is never modified
    assert isinstance(model[1], nn.BatchNorm2d) and model[0].weight.shape == (6, 3, 3, 3)


def test_batchnorm_after_linear_folded():
    model = nn.Sequential(nn.Linear(7, 5), _randomized_bn(nn.BatchNorm1d(5)), nn.Tanh()).eval()
    x = torch.randn(4, 7)
    gm = normalized(model, x)
    assert _no_batchnorm(gm)
    assert targets(gm).count(F.linear) == 1 and operator.mul not in targets(gm)
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)


def test_batchnorm_without_affine_folded():
    model = nn.Sequential(nn.Conv2d(2, 4, 1), _randomized_bn(nn.BatchNorm2d(4, affine=False))).eval()
    x = torch.randn(1, 2, 5, 5)
    gm = normalized(model, x)
    assert _no_batchnorm(gm)
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)


def test_standalone_batchnorm_becomes_mul_add():
    model = nn.Sequential(_randomized_bn(nn.BatchNorm2d(3))).eval()
    x = torch.randn(2, 3, 4, 5)
    gm = normalized(model, x)
    assert _no_batchnorm(gm)
    assert targets(gm) == [operator.sub, operator.mul, operator.add]   # the mean first (fuzz47f)
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1


def test_batchnorm_after_shared_conv_is_mul_add():
    """The conv output has another reader, so folding would change it: per-channel mul-add."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = _randomized_bn(nn.BatchNorm2d(4))

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y

    model = M().eval()
    x = torch.randn(2, 3, 6, 6)
    gm = normalized(model, x)
    assert _no_batchnorm(gm) and operator.mul in targets(gm)
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)


def test_batchnorm1d_on_3d_input():
    model = nn.Sequential(_randomized_bn(nn.BatchNorm1d(4))).eval()
    x = torch.randn(2, 4, 7)
    gm = normalized(model, x)
    assert _no_batchnorm(gm)
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)


@pytest.mark.parametrize("drop", [nn.Dropout(0.5), nn.Dropout2d(0.3), nn.AlphaDropout(0.2), nn.Identity()],
                         ids=["Dropout", "Dropout2d", "AlphaDropout", "Identity"])
def test_eval_dropout_removed(drop):
    model = nn.Sequential(nn.ReLU(), drop, nn.Sigmoid()).eval()
    x = torch.randn(2, 3, 4, 4)
    gm = normalized(model, x)
    assert targets(gm) == [torch.relu, torch.sigmoid]
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x)


def test_functional_dropout_with_self_training_removed():
    class M(nn.Module):
        def forward(self, x):
            return F.dropout(x.relu(), 0.5, self.training) * 2

    model = M().eval()
    gm = normalized(model, torch.randn(3, 3))
    assert targets(gm) == [torch.relu, operator.mul]


def test_shape_arithmetic_folds_to_constants():
    model = Fn(lambda s, x: x.view(x.size(0), -1) * x.shape[1]).eval()
    x = torch.randn(2, 3, 4)
    gm = normalized(model, x)
    assert not any(n.op == "call_method" and n.target == "size" for n in gm.graph.nodes)
    assert not any(n.target is getattr for n in gm.graph.nodes)
    mul = [n for n in calls(gm) if n.target is operator.mul]
    assert len(mul) == 1 and mul[0].args[1] == 3
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_integer_exponent_keeps_the_dtype(dtype):
    """x ** 2 and torch.square(x) on an int64 tensor are int64 in eager: the exponent stays an int."""
    model = Fn2(lambda s, x, y: x ** 2 + torch.square(y) + x.pow(3)).eval()
    x, y = (torch.randint(-5, 6, (3, 7)).to(dtype) for _ in range(2))
    gm = normalized(model, x, y)
    pows = [n for n in calls(gm) if n.target is operator.pow]
    assert len(pows) == 3 and all(type(n.args[1]) is int for n in pows)
    opt = fxfuse.optimize(model, (x, y), strict=True)
    out = assert_matches_eager(opt, model, x, y)
    assert out.dtype == dtype
    if dtype.is_floating_point:      # integer results stay library ops
        assert_fast_path(opt)
