"""Stop 35: fusion across views, copies and in-place writes (size-1 views, lone biases, a dropped
.contiguous(), writes into new memory) and where a view must still see a write."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402

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
    gm = next(iter(opt._specializations.values())).gm
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


def test_a_write_into_a_reduction_read_through_a_later_view_fuses():
    """fuzz35e: `y = x.norm(dim=-1); y.clamp_(min=1); x / y[:, None]` kept the clamp_ (a view of y
    was read after the write)."""
    def f(x):
        y = x.norm(dim=-1)
        y.clamp_(min=1)
        return x / y[:, None] + 1
    model = _Fn(f).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True)
    gm = next(iter(opt._specializations.values())).gm
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
        gm = next(iter(opt._specializations.values())).gm
        assert bool(gm.meta.get("fxfuse_inplace_kept")) == kept, fxfuse.explain(opt)
        x = torch.randn(4, 6)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
