"""Stop 35: lerp, addcmul and addcdiv join fused kernels (they stayed library calls), in every spelling."""
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
                   or "addc" in str(n.target) for n in opt.specializations[next(iter(opt.specializations))].gm.graph.nodes
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


class _Gated(nn.Module):
    """A pointwise chain, a view adding size-1 dims, and a reader that broadcasts it."""

    def __init__(self, f):
        super().__init__()
        self.f = f
        self.A, self.b = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6))

    def forward(self, x, h):
        return self.f(self, x, h)


UNIT_VIEWS = {
    "mamba_dt": lambda s, x, h: torch.exp(s.A * F.softplus(x + s.b).unsqueeze(-1)),
    "none_index": lambda s, x, h: h * torch.sigmoid(x * 2)[..., None],
    "view": lambda s, x, h: h + torch.tanh(x).view(x.shape[0], 6, 1),
    "reshape": lambda s, x, h: h + torch.tanh(x).reshape(-1, 6, 1) * 3,
    "fresh_inplace": lambda s, x, h: h + torch.relu_(x * 2).unsqueeze(-1),
    "zero_dim_operand": lambda s, x, h: h + (x * torch.tensor(2.0)).unsqueeze(-1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(UNIT_VIEWS))
def test_a_view_adding_size_one_dims_before_a_broadcast_does_not_split_the_chain(name, dtype):
    """The view moves above the ops it reads (hoist_permutes.is_unit_view): one kernel, where
    there were two (fuzz34j)."""
    torch.manual_seed(0)
    model = _Gated(UNIT_VIEWS[name]).eval().to(dtype)
    opt = fxfuse.optimize(model, (torch.randn(3, 6, dtype=dtype), torch.randn(3, 6, 4, dtype=dtype)), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    for batch in (3, 5):
        x, h = torch.randn(batch, 6, dtype=dtype), torch.randn(batch, 6, 4, dtype=dtype)
        with torch.no_grad():
            torch.testing.assert_close(opt(x.clone(), h.clone()), model(x, h), rtol=1e-5 if dtype == torch.float32
                                       else 1e-3, atol=1e-5 if dtype == torch.float32 else 1e-3)


def test_an_op_with_another_reader_stays_before_the_view():
    model = _Gated(lambda s, x, h: (h + torch.tanh(x).unsqueeze(-1), torch.tanh(x))).eval()
    x, h = torch.randn(3, 6), torch.randn(3, 6, 4)
    opt = fxfuse.optimize(model, (x, h), strict=True)
    with torch.no_grad():
        for got, want in zip(opt(x, h), model(x, h)):
            torch.testing.assert_close(got, want)


class _DiTModulate(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ada = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x, c):
        shift, scale = self.ada(F.silu(c)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class _UNetTimeEmbedding(nn.Module):
    def __init__(self, ch=8, t=16):
        super().__init__()
        self.emb = nn.Linear(t, ch)
        self.norm = nn.GroupNorm(2, ch)

    def forward(self, h, temb):
        h = F.silu(self.norm(h)) + self.emb(F.silu(temb))[:, :, None, None]
        return F.silu(h) * 2


@pytest.mark.parametrize("cls,shapes", [(_DiTModulate, [(2, 5, 16), (2, 16)]),
                                        (_UNetTimeEmbedding, [(2, 8, 4, 4), (2, 16)])])
def test_a_bias_nothing_pointwise_reads_goes_into_its_library_call(cls, shapes):
    """DiT's adaLN chunks and a UNet's `emb(t)[:, :, None, None]`: the Linear's bias add was a
    kernel of its own (fuzz34j); linear_epilogue now leaves it in the library call (on the GPU
    where that measures no slower than the GEMM plus a kernel)."""
    torch.manual_seed(0)
    model = cls().eval()
    opt = fxfuse.optimize(model, tuple(torch.randn(*s) for s in shapes), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 2, fxfuse.explain(opt)   # silu(c), then the modulation
    assert "nothing pointwise reads the sum" in fxfuse.explain(opt)
    args = tuple(torch.randn(*s) for s in shapes)
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))


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


_WRITES_INTO_NEW = {
    "sum": lambda x: (lambda s: s.clamp_(min=0.1).sigmoid() * x)(x.sum(-1, keepdim=True)),
    "router_topk": lambda x: (lambda w: (w.div_(w.sum(-1, keepdim=True)) * 2.5).relu())(torch.topk(x, 2)[0]),
    "max_values": lambda x: (lambda s: x / s.clamp_(min=1e-5) * 3)(x.max(-1, keepdim=True).values),
    "norm": lambda x: (lambda s: x / s.clamp_(min=1e-6) + 1)(x.norm(dim=-1, keepdim=True)),
    "cumsum": lambda x: x.cumsum(-1).mul_(2).tanh() + 1,
    "gather_index": lambda x: (lambda r: r[torch.tensor([0, 2, 1, 0])] * x[torch.tensor([0, 2, 1, 0])] + 1)(
        x.abs().add(1).pow(-0.5).masked_fill_(x > 2, 0)),
}


@pytest.mark.parametrize("name", sorted(_WRITES_INTO_NEW))
def test_a_write_into_a_new_tensor_from_a_reduction_or_gather_fuses_and_keeps_the_cuda_graph(name):
    """fuzz35b: the write was kept as if into an input: the chain split, and on CUDA the whole
    model's graph went off (writes_an_input)."""
    from fxfuse.specialization import writes_an_input
    torch.manual_seed(0)
    model = _Fn(_WRITES_INTO_NEW[name]).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True)
    gm = next(iter(opt.specializations.values())).gm
    assert not writes_an_input(gm) and fxfuse.stats(opt)["fused_kernels"] >= 1, fxfuse.explain(opt)
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(opt(x.clone()), model(x.clone()))


def test_a_zero_dim_tensor_index_is_a_view_and_its_write_reaches_the_base():
    class Model(nn.Module):
        def forward(self, x):
            h = x * 2
            row = h[torch.tensor(1)]
            row.mul_(10)
            return h + 1

    model = Model().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 4), strict=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


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


@pytest.mark.parametrize("attr", ["T", "mT"])
def test_an_augmented_assignment_through_a_transpose_attribute_writes_the_base(attr):
    """`t = v.T; t -= c` was recorded as `t = t - c` (torch.fx's attribute proxy has no `-=`):
    v lost the write, silently with verify=False (fuzz35a)."""
    class Model(nn.Module):
        def forward(self, x):
            v = x * 2
            t = getattr(v, attr)
            t -= 0.25
            return v + 1

    model = Model().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 5), strict=True, verify=False)
    x = torch.randn(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


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


class _WindowPartition(nn.Module):   # Swin: view, permute, contiguous between pointwise ops, then a view
    def forward(self, x):
        b, h, w, c = x.shape
        y = (x * 2 + 1).view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).contiguous()
        return (torch.relu(y) - 0.5).view(-1, 2, 2, c)


@pytest.mark.parametrize("dtype,options", [(torch.float32, {}), (torch.float64, {}),
                                           (torch.float32, {"use_kernels": False})])
def test_contiguous_after_a_permute_does_not_split_the_chain(dtype, options):
    """fuzz35b: `.permute(...).contiguous()` between pointwise ops was two kernels and a copy.
    The readers write eager's (row-major) layout, kernel or reference, so the view after works;
    where they are no kernel (float64), the copy stays."""
    torch.manual_seed(0)
    model = _WindowPartition().eval()
    x = torch.randn(2, 4, 6, 3, dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True, **options)
    if dtype == torch.float32 and not options:
        assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    x = torch.randn(2, 4, 6, 3, dtype=dtype)
    with torch.no_grad():
        got, want = opt(x), model(x)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()


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


def test_a_write_into_a_reduction_read_through_a_later_view_fuses():
    """fuzz35e: `y = x.norm(dim=-1); y.clamp_(min=1); x / y[:, None]` kept the clamp_ (a view of y
    was read after the write)."""
    def f(x):
        y = x.norm(dim=-1)
        y.clamp_(min=1)
        return x / y[:, None] + 1
    model = _Fn(f).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True)
    gm = next(iter(opt.specializations.values())).gm
    assert not gm.meta.get("fxfuse_inplace_kept"), fxfuse.explain(opt)
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_row_of_an_elementwise_max_is_a_view_that_sees_a_later_write():
    """review35b: every getitem of torch.max counted as new memory (the (values, indices) form);
    `torch.max(a, b)[0]` is a row of a tensor, and `m.add_(1)` after it must show through."""
    def f(a, b, c):
        m = torch.max(a, b)
        v = m[0]
        m.add_(1)
        return v * 2 + c
    model = _Three(f).eval()
    args = tuple(torch.randn(4, 8) for _ in range(3))
    opt = fxfuse.optimize(model, args, verify=False)
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))


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
    names = [str(n.target) for n in next(iter(opt.specializations.values())).gm.graph.nodes]
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


def test_a_list_index_holding_a_slice_is_a_view():
    """review35c: `y[[0, slice(None)]]` (deprecated, a tuple index) is a view; a write through it
    was made functional and lost."""
    def f(x):
        y = x * 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row = y[[0, slice(None)]]
        row.add_(1)
        return y + 0.5
    model = _Fn(f).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxfuse.optimize(model, torch.randn(3, 4), verify=False)
        x = torch.randn(3, 4)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


def test_a_functional_twin_write_read_through_a_later_view_fuses():
    """review35c: `s.tril_(); s.view(-1) * 2` kept the tril_ in place (a view of s read after the
    write), so the multiply stayed a library call; a view taken before the write still sees it."""
    def later(x):
        s = x @ x.t()
        s.tril_()
        return s.view(-1) * 2

    def earlier(x):
        s = x @ x.t()
        v = s.view(-1)
        s.tril_()
        return v * 2

    for f, kept in ((later, False), (earlier, True)):
        model = _Fn(f).eval()
        opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True)
        gm = next(iter(opt.specializations.values())).gm
        assert bool(gm.meta.get("fxfuse_inplace_kept")) == kept, fxfuse.explain(opt)
        x = torch.randn(4, 6)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
