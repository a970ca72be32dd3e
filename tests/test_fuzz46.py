"""Stop 46: GPT-J's rotary (rotate_every_two: a stack of the odd and even halves, flattened) is one
kernel with `q * cos` next to it: the add after the flatten moves above it, the broadcast cos read
regrouped as [.., d/2, 2]."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import fxfuse

from conftest import assert_matches_eager, optimize_strict


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class GPTJRotary(nn.Module):
    def forward(self, q, sin, cos):
        return q * cos + rotate_every_two(q) * sin


class GPTJRotaryTables(nn.Module):
    """HF GPT-J: sin / cos from a buffer, each frequency repeated twice (repeat_interleave)."""
    def __init__(self, dim=6, positions=5):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.arange(positions).float()[:, None] * inv[None]
        self.register_buffer("sincos", torch.cat((angles.sin(), angles.cos()), -1), persistent=False)

    def forward(self, q):
        sin, cos = torch.split(self.sincos[: q.shape[1]], q.shape[-1] // 2, dim=-1)
        sin = torch.repeat_interleave(sin[None, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[None, :, None, :], 2, 3)
        return (q * cos) + (rotate_every_two(q) * sin)


def test_gptj_rotate_every_two_is_one_kernel():
    q, sin, cos = torch.randn(2, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    model = GPTJRotary().eval()
    opt = optimize_strict(model, q, sin, cos)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    assert_matches_eager(opt, model, q, sin, cos)


def test_gptj_rotary_with_tables_matches_eager():
    q = torch.randn(2, 5, 3, 6)
    model = GPTJRotaryTables().eval()
    opt = optimize_strict(model, q)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    assert_matches_eager(opt, model, q)


@pytest.mark.parametrize("computed", [False, True])
def test_broadcast_operand_next_to_a_flattened_stack(computed):
    """`x * w + stack(..).flatten(-2)`: the add moves into the stack's kernel; a broadcast operand
    that is itself computed stays where it is (a reshape of it would sit between two kernels)."""
    class M(nn.Module):
        def forward(self, x, w):
            w = w * 2 if computed else w
            return x * w + torch.stack((x[..., ::2].sigmoid(), x[..., 1::2]), -1).flatten(-2)
    x, w = torch.randn(3, 2, 6), torch.randn(2, 1)
    model = M().eval()
    opt = optimize_strict(model, x, w)
    assert fxfuse.stats(opt)["fused_kernels"] == (2 if computed else 1), fxfuse.explain(opt)
    assert_matches_eager(opt, model, x, w)


class MaskedScores(nn.Module):
    """HF-style: an int64 attention mask compared with a number (fuzz46h: a library call)."""
    def __init__(self, compare):
        super().__init__()
        self.compare = compare

    def forward(self, s, mask):
        return torch.softmax(s.masked_fill(self.compare(mask), -1e9) * 0.5 + 1, -1)


@pytest.mark.parametrize("compare", [lambda m: m == 0, lambda m: m != 0, lambda m: m > 0, lambda m: 1 >= m,
                                     lambda m: m.lt(-3), lambda m: m == 2 ** 24 - 1],
                         ids=["eq0", "ne0", "gt0", "rge1", "lt-3", "eq2**24-1"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_an_integer_mask_compared_with_a_number_is_fused(compare, dtype):
    s, mask = torch.randn(2, 8), torch.randint(-5, 5, (2, 8), dtype=dtype)
    model = MaskedScores(compare).eval()
    opt = optimize_strict(model, s, mask)
    assert fxfuse.stats(opt)["library_calls"] == 1, fxfuse.explain(opt)   # the softmax
    assert_matches_eager(opt, model, s, mask, fresh=False)
    big = torch.tensor([[2 ** 24 - 1, 2 ** 24, 2 ** 24 + 1, -(2 ** 31), 2 ** 31 - 1, 0, -1, 1]], dtype=dtype)
    assert_matches_eager(opt, model, torch.randn(1, 8), big, fresh=False)


def test_an_integer_compared_with_a_number_fp32_cannot_hold_stays_in_the_library():
    class M(nn.Module):
        def forward(self, s, ids):
            return s * (ids == 2 ** 24 + 1)
    s, ids = torch.randn(1, 4), torch.tensor([[2 ** 24, 2 ** 24 + 1, 2 ** 24 + 2, 3]])
    model = M().eval()
    opt = optimize_strict(model, s, ids)
    assert_matches_eager(opt, model, s, ids, fresh=False)


ZEROS_ONES = {
    "zeros varargs": lambda x: torch.zeros(x.shape[0], x.shape[1]) + 0.5,
    "zeros tuple": lambda x: torch.zeros((x.shape[0], x.shape[1]), dtype=x.dtype),
    "zeros size=": lambda x: torch.zeros(size=(1, x.shape[1])) - 2,
    "ones shape": lambda x: torch.ones(x.shape) * 3,
    "ones row": lambda x: torch.ones(x.shape[-1], device=x.device),
}


class ScanState(nn.Module):
    """An SSM's initial state: `h = torch.zeros(b, d)`, then pointwise updates (fuzz46a)."""
    def __init__(self, state):
        super().__init__()
        self.state = state

    def forward(self, x):
        h = self.state(x)
        return torch.sigmoid(x) * h + x


@pytest.mark.parametrize("name", list(ZEROS_ONES))
def test_zeros_and_ones_read_by_pointwise_ops_are_constants(name):
    model, x = ScanState(ZEROS_ONES[name]).eval(), torch.randn(3, 5)
    opt = optimize_strict(model, x)
    stats = fxfuse.stats(opt)
    assert stats["fused_kernels"] == 1 and stats["library_calls"] == 0, fxfuse.explain(opt)
    assert_matches_eager(opt, model, x)


def test_zeros_written_in_place_or_returned_stay_tensors():
    class M(nn.Module):
        def forward(self, x):
            h = torch.zeros(x.shape[0], 4)
            h[:, 1] = x[:, 0]
            z = torch.ones(2, 2)
            return h * 2, z
    model, x = M().eval(), torch.randn(3, 5)
    opt = optimize_strict(model, x)
    got = assert_matches_eager(opt, model, x)
    got[1].add_(1)   # a tensor of its own, as eager's
    assert torch.equal(opt(x)[1], torch.ones(2, 2))


class GPT2CausalMask(nn.Module):
    """HF GPT-2: a sliced bool buffer, and the fill value as a 0-d torch.full (fuzz46d)."""
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(8, 8, dtype=torch.bool)).view(1, 1, 8, 8), persistent=False)

    def forward(self, w):
        ql, kl = w.size(-2), w.size(-1)
        mask = self.bias[:, :, kl - ql:kl, :kl]
        fill = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
        return torch.where(mask, w * 2, fill)


def test_gpt2_causal_mask_fill_is_a_constant():
    model, w = GPT2CausalMask().eval(), torch.randn(2, 3, 5, 6)
    opt = optimize_strict(model, w)
    stats = fxfuse.stats(opt)
    assert stats["fused_kernels"] == 1 and stats["library_calls"] == 0, fxfuse.explain(opt)
    assert_matches_eager(opt, model, w)


MATH_WRITES = {
    "fmod_": lambda h: h.fmod_(0.7),
    "remainder_": lambda h: h.remainder_(0.3),
    "sinh_": lambda h: h.sinh_(),
    "atan_": lambda h: h.atan_(),
    "hypot_": lambda h: h.hypot_(h * 0 + 0.5),
    "copysign_": lambda h: h.copysign_(-1.0),
    "div_ floor": lambda h: h.div_(0.4, rounding_mode="floor"),
    "logit_ eps": lambda h: h.sigmoid().logit_(1e-3),
}


@pytest.mark.parametrize("name", list(MATH_WRITES))
def test_in_place_math_on_a_fresh_tensor_lets_the_next_op_fuse(name):
    class M(nn.Module):
        def forward(self, x):
            h = x * 2
            h = MATH_WRITES[name](h) if name == "logit_ eps" else (MATH_WRITES[name](h), h)[1]
            return h + 1
    model, x = M().eval(), torch.randn(4, 6)
    opt = optimize_strict(model, x)
    assert not [n for n in opt_graph_nodes(opt) if str(n.target).endswith("_")], fxfuse.explain(opt)
    assert_matches_eager(opt, model, x)


def opt_graph_nodes(opt):
    from conftest import optimized_graph
    return [n for n in optimized_graph(opt).graph.nodes if n.op in ("call_method", "call_function")]


def test_in_place_math_that_would_promote_stays_in_place():
    class M(nn.Module):
        def forward(self, x, y):
            h = x * 2
            h.fmod_(y)   # fp64 y: the write keeps h's fp32, the out-of-place fmod would be fp64
            return h + 1
    model = M().eval()
    x, y = torch.randn(4, 6), torch.rand(4, 6, dtype=torch.float64) + 0.5
    opt = optimize_strict(model, x, y)
    assert any(str(n.target) == "fmod_" for n in opt_graph_nodes(opt))
    got = assert_matches_eager(opt, model, x, y)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("bound", ["min", "max"])
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.float32, torch.float16),
                                    (torch.float32, torch.float64)], ids=str)
def test_clamp_by_one_tensor_of_another_dtype_is_fused(bound, dtypes):
    class M(nn.Module):
        def forward(self, x, t):
            return (x * 1.5).clamp(**{bound: t}) + 1
    x = torch.randn(4, 8).to(dtypes[0])
    t = torch.randn(()).to(dtypes[1])
    model = M().eval()
    opt = optimize_strict(model, x, t)
    if dtypes[1] != torch.float64:   # (a 0-d fp64 beside fp32 is read as fp32, beside fp16 it stays out)
        assert fxfuse.stats(opt)["library_calls"] == 0, fxfuse.explain(opt)
    x[0, :3] = torch.tensor([float("nan"), 0.0, -0.0])
    got = assert_matches_eager(opt, model, x, t, fresh=False, equal_nan=True, rtol=1e-3, atol=1e-3)
    assert got.dtype == model(x, t).dtype


class ConvNeXtLayerScale(nn.Module):
    """timm's ConvNeXt block tail: Linear on channels-last, permuted back, scaled and added in place."""
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.gamma = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        y = self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        y.mul_(self.gamma.reshape(1, -1, 1, 1))
        y += x
        return y


WHOLE_VIEWS = {   # each with an operand of the view's shape, added in place after the scale
    "permute": (lambda y: y.permute(1, 0), lambda x: x[:, :4].t()),
    "torch.permute": (lambda y: torch.permute(y, (1, 0)), lambda x: x[:, :4].t()),
    "T": (lambda y: y.T, lambda x: x[:, :4].t()),
    "torch.transpose": (lambda y: torch.transpose(y, 0, 1), lambda x: x[:, :4].t()),
    "torch.movedim": (lambda y: torch.movedim(y, 0, 1), lambda x: x[:, :4].t()),
    "y[None]": (lambda y: y[None], lambda x: x[None, :, :4]),   # (fuzz46j: unit indexes, view chains)
    "y[:, None]": (lambda y: y[:, None], lambda x: x[:, None, :4]),
    "t().unsqueeze": (lambda y: y.t().unsqueeze(-1), lambda x: x[:, :4].t()[..., None]),
    "y[None][0]": (lambda y: y[None][0], lambda x: x[:, :4]),
}


@pytest.mark.parametrize("name", list(WHOLE_VIEWS))
def test_in_place_ops_on_a_whole_view_of_a_fresh_tensor_are_fused(name):
    view, operand = WHOLE_VIEWS[name]

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4)

        def forward(self, x):
            y = view(self.lin(x))
            y.mul_(2)
            y += operand(x)
            return y
    model, x = M().eval(), torch.randn(5, 6)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    got = assert_matches_eager(opt, model, x)
    assert got.stride() == model(x).stride()


def test_in_place_layer_scale_on_a_permuted_linear_output_is_fused():
    model, x = ConvNeXtLayerScale().eval(), torch.randn(2, 8, 3, 5)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    got = assert_matches_eager(opt, model, x)
    assert got.stride() == model(x).stride()


def test_in_place_write_into_a_view_whose_source_is_read_elsewhere_stays():
    class M(nn.Module):
        def forward(self, x):
            h = x * 2
            y = h.t()
            y.mul_(3)
            return h + 1, y   # h sees the write
    model, x = M().eval(), torch.randn(4, 5)
    opt = optimize_strict(model, x)
    got = assert_matches_eager(opt, model, x)
    assert got[1].stride() == model(x)[1].stride()


@pytest.mark.parametrize("op", [torch.relu, lambda h: h * 0.5, torch.sigmoid, lambda h: F.gelu(h, approximate="tanh"),
                                lambda h: 1 - h], ids=["relu", "scale", "sigmoid", "gelu", "1 - h"])
@pytest.mark.parametrize("join", ["cat", "stack"])
def test_the_same_activation_of_each_piece_runs_once_after_the_join(op, join):
    class M(nn.Module):
        def forward(self, a, b, c):
            pieces = [op(a @ a.transpose(-1, -2)), op(b.mm(b.t())), op(torch.mm(c, c.t()))]
            return torch.cat(pieces, 1) if join == "cat" else torch.stack(pieces, -1)
    model = M().eval()
    args = [torch.randn(4, 3) for _ in range(3)]
    opt = optimize_strict(model, *args)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    assert_matches_eager(opt, model, *args)


def test_pieces_of_other_ops_or_read_elsewhere_stay():
    class M(nn.Module):
        def forward(self, a, b):
            ra, rb = torch.relu(a.mm(a.t())), torch.relu(b.mm(b.t()))
            return torch.cat([ra, torch.sigmoid(b.mm(b.t()))], 1), torch.cat([ra, rb], 0), rb * 2
    model = M().eval()
    args = [torch.randn(4, 3), torch.randn(4, 3)]
    opt = optimize_strict(model, *args)
    assert_matches_eager(opt, model, *args)


@pytest.mark.parametrize("force, why", [({"gemm": "force"}, "no fused GEMM: torch.float64"),
                                        ({"fused_mlp": "force"}, "not a fused MLP: dtype torch.float64")],
                         ids=["gemm", "fused_mlp"])
def test_a_force_that_does_not_apply_says_why_on_the_node(force, why):
    model = nn.Sequential(nn.Linear(17, 17), nn.ReLU(), nn.Linear(17, 17)).double().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 17, dtype=torch.float64), **force)
    report = fxfuse.explain(opt)
    assert fxfuse.stats(opt)["fused_kernels"] == 0
    assert " ".join(report.split()).count(why) == 2, report


READS_OF_A_JOIN = {
    "h * sigmoid(h)": lambda h: h * torch.sigmoid(h),
    "h * h": lambda h: h * h,
    "sigmoid(h) + tanh(h)": lambda h: torch.sigmoid(h) + torch.tanh(h),
    "(h + 1) * (h - 1)": lambda h: (h + 1) * (h - 1),
}


@pytest.mark.parametrize("name", list(READS_OF_A_JOIN))
@pytest.mark.parametrize("join", ["cat", "stack"])
def test_ops_reading_a_kernel_written_join_several_times_run_per_piece(name, join):
    class M(nn.Module):
        def forward(self, x, w):
            pieces = [x * 2, x.sin()]
            h = torch.cat(pieces, -1) if join == "cat" else torch.stack(pieces, 1)
            return READS_OF_A_JOIN[name](h) + w
    x = torch.randn(3, 4)
    w = torch.randn(3, 8) if join == "cat" else torch.randn(3, 2, 4)
    model = M().eval()
    opt = optimize_strict(model, x, w)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    assert_matches_eager(opt, model, x, w)


def test_a_join_read_by_a_group_then_a_linear():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 5)

        def forward(self, x):
            h = torch.cat([x * 2, x.cos()], -1)
            a = h * torch.sigmoid(h)
            return self.lin(a), a.sum(-1)
    model, x = M().eval(), torch.randn(3, 4)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    assert_matches_eager(opt, model, x)


def test_a_join_also_read_by_a_library_op_or_with_two_results_stays():
    class M(nn.Module):
        def forward(self, x):
            h = torch.cat([x * 2, x.cos()], -1)
            s = torch.sigmoid(h)
            return h * s, s + 1, h.sum(0)
    model, x = M().eval(), torch.randn(3, 4)
    opt = optimize_strict(model, x)
    assert_matches_eager(opt, model, x)


EINSUM_PRODUCTS = {
    "bld,dn->bldn": [(2, 3, 4), (4, 5)],
    "bld,bln,bld->bldn": [(2, 3, 4), (2, 3, 5), (2, 3, 4)],
    "i,j->ij": [(3,), (4,)],
    "bi,j->bij": [(2, 3), (4,)],
    "ij,jk->ikj": [(2, 3), (3, 4)],      # eager's result is not row-major either
    "ij,j->ji": [(2, 3), (3,)],          # eager's result is not row-major: stays an einsum
    "ij,jk->ik": [(2, 3), (3, 4)],       # a contraction: not a product
    "ii->i": [(3, 3)],
    "...i,i->...i": [(2, 3), (3,)],
}


@pytest.mark.parametrize("equation", list(EINSUM_PRODUCTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_einsum_that_sums_nothing_is_a_fused_product(equation, dtype):
    class M(nn.Module):
        def forward(self, *xs):
            return torch.exp(torch.einsum(equation, *xs) * 0.5)
    args = [torch.randn(*s).to(dtype) for s in EINSUM_PRODUCTS[equation]]
    model = M().eval()
    opt = optimize_strict(model, *args)
    inputs, out = equation.split("->")
    sums_nothing = "." not in equation and set(inputs.replace(",", "")) == set(out) and equation not in (
        "ij,j->ji", "ii->i", "ij,jk->ikj")
    if sums_nothing:
        assert fxfuse.stats(opt)["library_calls"] == 0, fxfuse.explain(opt)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    got = assert_matches_eager(opt, model, *args, rtol=tol, atol=tol)
    assert got.stride() == model(*args).stride()


@pytest.mark.parametrize("verify", [True, False])
def test_a_write_into_a_tuple_part_read_twice_is_seen_by_both_reads(verify):
    class M(nn.Module):
        def forward(self, x):
            r = (x @ x.t()).topk(2, -1)
            r[0].mul_(2)
            v = r.values.unsqueeze(0)
            v.add_(1)
            return r[0] + 1, r.values * 3
    model, x = M().eval(), torch.randn(3, 8)
    opt = fxfuse.optimize(model, x, verify=verify, strict=True)
    assert_matches_eager(opt, model, x)


def test_a_scale_in_place_after_an_einsum_is_fused():
    class M(nn.Module):
        def forward(self, q, k):
            scores = torch.einsum("bnik,bnjk->bnij", q, k)
            scores /= 2.0
            return torch.softmax(scores, -1)
    model = M().eval()
    q, k = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    opt = optimize_strict(model, q, k)
    assert fxfuse.stats(opt)["library_calls"] <= 2, fxfuse.explain(opt)
    assert_matches_eager(opt, model, q, k)
