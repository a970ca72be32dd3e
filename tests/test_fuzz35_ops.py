"""Stop 35: ops and numerics: lerp/addcmul/addcdiv, c / x, integer hardtanh, logical ops, binary max/min,
PReLU/RReLU, numbers read from tensors in pointwise math."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402

aten = torch.ops.aten


class _Fn(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


class _Three(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, a, b, c):
        return self.f(a, b, c)


SPELLINGS = {
    "lerp_number": lambda a, b, c: torch.lerp(a.relu(), b, 0.3).sigmoid(),
    "lerp_far_end": lambda a, b, c: torch.lerp(a, b * 2, 0.75) * 3,
    "lerp_negative": lambda a, b, c: torch.lerp(a, b, -0.7) + 1,
    "lerp_tensor_weight": lambda a, b, c: torch.lerp(a, b, c.sigmoid() * 1.5 - 0.25) * 2,
    "lerp_method": lambda a, b, c: (a * 2).lerp(b, 0.5) - 1,
    "lerp_inplace": lambda a, b, c: (a * 2).lerp_(b, c) - 1,
    "lerp_keywords": lambda a, b, c: torch.lerp(a * 2, end=b, weight=0.1).abs(),
    "aten_lerp_scalar": lambda a, b, c: aten.lerp.Scalar(a * 2, b, 0.9).abs(),
    "aten_lerp_tensor": lambda a, b, c: aten.lerp.Tensor(a * 2, b, c).abs(),
    "addcmul": lambda a, b, c: torch.addcmul(a, b, c).relu(),
    "addcmul_value": lambda a, b, c: torch.addcmul(a, b, c, value=-0.3).relu(),
    "addcmul_method": lambda a, b, c: (a + 1).addcmul(b, c, value=2).relu(),
    "addcmul_inplace": lambda a, b, c: (a + 1).addcmul_(b, c, value=2).relu(),
    "addcdiv": lambda a, b, c: torch.addcdiv(a, b, c.abs() + 0.1, value=0.5).tanh(),
    "addcdiv_inplace": lambda a, b, c: (a * 1).addcdiv_(b, c.abs() + 0.1).tanh(),
    "aten_addcmul": lambda a, b, c: aten.addcmul.default(a * 1, b, c, value=3).tanh(),
    "broadcast": lambda a, b, c: torch.addcmul(a, b[0], c[:, :1], value=0.5).relu(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_lerp_addcmul_addcdiv_fuse_with_their_neighbours(name, dtype):
    torch.manual_seed(0)
    model = _Three(SPELLINGS[name]).eval()
    example = tuple(torch.randn(3, 5, dtype=dtype) for _ in range(3))
    opt = fxfuse.optimize(model, example, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert not any(n.target in (torch.lerp, torch.addcmul, torch.addcdiv) or "lerp" in str(n.target)
                   or "addc" in str(n.target) for n in opt._specializations[next(iter(opt._specializations))].gm.graph.nodes
                   if n.op != "call_module")   # inside the kernel, not a library call
    for _ in range(2):
        args = tuple(torch.randn(3, 5, dtype=dtype) * 3 for _ in range(3))
        with torch.no_grad():
            got, want = opt(*(a.clone() for a in args)), model(*(a.clone() for a in args))
        torch.testing.assert_close(got, want, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=1e-5 if dtype ==
                                   torch.float32 else 1e-3)


def test_lerp_ends_and_special_weights_as_eager():
    """From the nearer end (ATen's Lerp.h): lerp(a, b, 1) is b exactly, lerp(a, b, 0) is a; each
    branch one rounding (fuzz35b: rounded twice, lerp(-1, -3e38, -0.5) was inf)."""
    a, b = torch.randn(64) * 1e3, torch.randn(64) * 1e-3
    for w in (0.0, 1.0, 0.5, 0.49999997, -2.0, 3.0, float("inf"), float("nan")):
        model = _Three(lambda x, y, z, w=w: torch.lerp(x, y, w) + z).eval()
        z = torch.randn(64)
        opt = fxfuse.optimize(model, (a, b, z), strict=True, verify=False)
        assert fxfuse.stats(opt)["fused_kernels"] == 1
        with torch.no_grad():
            got, want = opt(a, b, z), model(a, b, z)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)   # one fma, as the CPU's kernel
        if w in (0.0, 1.0):
            torch.testing.assert_close(got, (a if w == 0.0 else b) + z, rtol=0, atol=0)


def test_deprecated_addcmul_argument_order_stays_in_the_library():
    """torch.addcmul(x, value, t1, t2) (deprecated) must not be read as (x, t1, t2, value)."""
    model = _Three(lambda a, b, c: torch.addcmul(a, 0.5, b, c).relu()).eval()
    args = tuple(torch.randn(3, 5) for _ in range(3))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch's deprecation warning
            want = model(*args)
    except (TypeError, RuntimeError):
        pytest.skip("this torch has no deprecated addcmul overload")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxfuse.optimize(model, args)
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), want)


@pytest.mark.parametrize("act", [nn.ReLU6(), nn.Hardtanh(-2.5, 2.5), lambda t: F.hardtanh(t), lambda t: F.relu6(t)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])   # uint8: eager refuses negative limits
def test_hardtanh_and_relu6_of_integers_stay_integers(act, dtype):
    """normalize made them torch.clamp with float bounds: a float result, clamped to 2.5
    where eager clamps to 2 (review35: silent where the example stayed inside the bounds)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = act if isinstance(act, nn.Module) else None

        def forward(self, x):
            y = self.act(x) if self.act is not None else act(x)
            return y, y * 0.5

    model = Model().eval()
    small = torch.randint(0, 2, (4, 6)).to(dtype)
    opt = fxfuse.optimize(model, small, strict=True)
    x = torch.randint(0, 20, (4, 6)).to(dtype)
    with torch.no_grad():
        for got, want in zip(opt(x), model(x)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)


def test_multiply_adds_round_once_as_eager_at_the_edges():
    """fuzz35b: built on ordinary data, then edge values: the product rounded before the add gave
    inf (lerp near the fp32 maximum) and 0 where eager's fma keeps the cancelled residue."""
    b, c = torch.tensor([0.1, 0.7]), torch.tensor([0.3, 0.9])
    a = -(b * c)
    cases = {"lerp": (lambda x, y, z: torch.lerp(x, y, -0.5), (torch.tensor([-1.0, 2.0]), torch.tensor([-3e38, 1.0]), c)),
             "lerp_third": (lambda x, y, z: torch.lerp(x, y, 1 / 3), (torch.tensor([1.0, 5.0]), torch.tensor([-2.0, 1.0]), c)),
             "addcmul": (lambda x, y, z: torch.addcmul(x, y, z), (a, b, c))}
    # (value != 1: CUDA computes fma(value, t1 * t2, x), as fxfuse does, the CPU fma(value * t1, t2, x))
    for name, (f, args) in cases.items():
        model = _Three(f).eval()
        opt = fxfuse.optimize(model, tuple(torch.randn(2) for _ in range(3)), strict=True)
        with torch.no_grad():
            got, want = opt(*args), model(*args)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("spelling", ["operator", "frac_after"])
def test_a_number_divided_by_a_tensor_is_a_reciprocal_times_the_number(spelling):
    """`c / x` runs Tensor.__rtruediv__: x.reciprocal() * c, two roundings; one division
    differed in the last bit in a quarter of the elements, and frac() after it by 0.98 (fuzz35a)."""
    f = (lambda x: 7.0 / x) if spelling == "operator" else (lambda x: torch.frac(3000.0 / x))
    model = _Fn(f).eval()
    opt = fxfuse.optimize(model, torch.randn(64), strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    x = torch.randn(1000)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("op", ["and", "or"])
def test_logical_ops_with_a_one_element_operand(op):
    """A one-element tensor is loaded as a scalar; `scalar_mask & block_mask` raised in the
    interpreter (fuzz35a: an internal error, and a crash of the first call with verify=False)."""
    f = (lambda a, b, c: ((a > 0) & (b < 1)).float() + c) if op == "and" else (lambda a, b, c: ((a > 0) | (b < 1)).float() + c)
    model = _Three(f).eval()
    args = (torch.randn(2, 3), torch.randn(1), torch.randn(2, 3))
    opt = fxfuse.optimize(model, args, strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    for b in (torch.tensor([0.5]), torch.tensor([2.0])):
        args = (torch.randn(2, 3), b, torch.randn(2, 3))
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), model(*args), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["reciprocal_of_item", "clamp_by_item"])
def test_a_number_read_from_a_tensor_in_pointwise_math_still_optimizes(name):
    """fuzz35e: `1.0 / s` with s = x.abs().max().item() became reciprocal(s) of a number (an
    internal error); `clamp(x, min=item)` became torch.maximum of a number (an older one)."""
    f = (lambda x: x * (1.0 / x.abs().max().item())) if name == "reciprocal_of_item" else \
        (lambda x: torch.clamp(x, min=x.mean().item()) * 2)
    model = _Fn(f).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_an_unread_dropout_still_draws():
    """fuzz35e: an unused F.dropout(training=True) was dead code to normalize, so the draws after
    it differed from eager's under one seed (silent with verify=False)."""
    def f(x):
        F.dropout(x, 0.5, training=True)
        return torch.rand_like(x) * x
    model = _Fn(f).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True, verify=False)
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.manual_seed(3)
        got = opt(x)
        torch.manual_seed(3)
        torch.testing.assert_close(got, model(x))


def test_lerp_by_a_number_keeps_the_sign_of_zero():
    """fuzz35e: the far-end branch was written (a - b) * (1 - w) + b: +0.0 for lerp(-0.0, -0.0, 0.7)."""
    model = _Three(lambda a, b, c: torch.lerp(a, b, 0.7) + c).eval()
    opt = fxfuse.optimize(model, tuple(torch.randn(3) for _ in range(3)), strict=True, verify=False)
    a = b = torch.tensor([-0.0, -0.0, 1.0])
    c = torch.tensor([-0.0, -0.0, -0.0])
    with torch.no_grad():
        got, want = opt(a, b, c), model(a, b, c)
    assert torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)


@pytest.mark.parametrize("spelling", ["torch.max", "method_min", "other_keyword", "zero_dim"])
def test_binary_max_and_min_fuse_as_maximum_and_minimum(spelling):
    """fuzz35f: torch.max(a, b) of two tensors stayed a library call (OPT's attention clamps its
    scores with torch.max(w, torch.tensor(finfo.min))); the reductions max(x), max(x, dim) stay."""
    fs = {"torch.max": lambda a, b, c: torch.max(a * 2, b) + c,
          "method_min": lambda a, b, c: (a * 2).min(b) + c,
          "other_keyword": lambda a, b, c: torch.max(a * 2, other=b) + c,
          "zero_dim": lambda a, b, c: torch.max(a * 2, torch.tensor(-0.5)) + c + b.max(-1, keepdim=True).values}
    model = _Three(fs[spelling]).eval()
    args = tuple(torch.randn(4, 6) for _ in range(3))
    opt = fxfuse.optimize(model, args, strict=True)
    names = [str(n.target) for n in next(iter(opt._specializations.values())).gm.graph.nodes]
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and not any("built-in method max" in t or "built-in method min" in t
                                                               for t in names), names
    args = tuple(torch.randn(4, 6) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args), rtol=0, atol=0)


class _Act(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return self.act(x * 2 + 1) - 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("make", [lambda: nn.PReLU(), lambda: nn.PReLU(6), lambda: nn.RReLU(0.1, 0.3),
                                  lambda: (lambda t: F.rrelu(t, 0.2, 0.4, training=False)),
                                  lambda: (lambda t: F.prelu(t, torch.full((6,), 0.3, dtype=t.dtype)))],
                         ids=["prelu", "prelu_channels", "rrelu_eval", "F.rrelu", "F.prelu_constant"])
def test_prelu_and_eval_rrelu_fuse(make, dtype):
    """fuzz35f: nn.PReLU / F.prelu and eval-mode RReLU were library calls between two kernels."""
    torch.manual_seed(0)
    act = make()
    model = _Act(act if isinstance(act, nn.Module) else _Fn(act)).eval().to(dtype)
    if isinstance(act, nn.PReLU):
        with torch.no_grad():
            act.weight.uniform_(-0.5, 0.5)
    x = torch.randn(3, 6, 4, 5, dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    x = torch.randn(3, 6, 4, 5, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
        if isinstance(act, nn.PReLU):   # the kernel reads the parameter (a view of it)
            act.weight.mul_(-2)
            torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
