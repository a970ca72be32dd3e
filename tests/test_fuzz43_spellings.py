"""Stop 43, fuzz43b / fuzz43d: other spellings of ops fxfuse fuses (Linear products, splits,
eval-mode dropouts, in-place functions, identities) read as their common spelling, and an
integer add with a large alpha."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict

aten = torch.ops.aten


class Product(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin, self.fn = nn.Linear(16, 24), fn

    def forward(self, x):
        return torch.relu(self.fn(self, x)) * 0.5 + 1.0


LINEAR_SPELLINGS = {
    "W.mH": lambda s, x: x @ s.lin.weight.mH + s.lin.bias,
    "torch.adjoint": lambda s, x: x @ torch.adjoint(s.lin.weight) + s.lin.bias,
    "movedim": lambda s, x: x @ s.lin.weight.movedim(1, 0) + s.lin.bias,
    "W.data.T": lambda s, x: x @ s.lin.weight.data.T + s.lin.bias,
    "matmul other=": lambda s, x: torch.matmul(x, other=s.lin.weight.T) + s.lin.bias,
    "mm mat2=": lambda s, x: torch.mm(x, mat2=s.lin.weight.T) + s.lin.bias,
    "linalg.matmul": lambda s, x: torch.linalg.matmul(x, s.lin.weight.T) + s.lin.bias,
    "Tensor.addmm": lambda s, x: s.lin.bias.addmm(x, s.lin.weight.T),
    "aten.addmm packet": lambda s, x: aten.addmm(s.lin.bias, x, s.lin.weight.T),
    "aten.t packet": lambda s, x: x @ aten.t(s.lin.weight) + s.lin.bias,
}


@pytest.mark.parametrize("name", LINEAR_SPELLINGS)
def test_other_spellings_of_a_linear_make_one_generated_gemm(name):
    """Each stayed a library matmul and an epilogue kernel of its own (library_calls 2-3)."""
    model = Product(LINEAR_SPELLINGS[name]).eval()
    opt = optimize_strict(model, torch.randn(8, 16), gemm="force")
    s = fxfuse.stats(opt)
    assert (s["fused_kernels"], s["library_calls"]) == (1, 0), s
    assert_matches_eager(opt, model, torch.randn(8, 16))


class Chain(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        a = x * 1.5 + 0.5
        return torch.relu(self.fn(a) * 2) - 0.25


ONE_KERNEL = {
    "+a": operator.pos,
    "a.__pos__()": lambda a: a.__pos__(),
    "a[0:4]": lambda a: a[0:4],
    "a[:100]": lambda a: a[:100],
    "a[-4:, 0:16]": lambda a: a[-4:, 0:16],
    "a.data": lambda a: a.data,
    "a.resolve_conj()": lambda a: a.resolve_conj(),
    "a.conj()": lambda a: a.conj(),
    "a.real": lambda a: a.real,
    "torch.square_": torch.square_,
    "torch.neg_": torch.neg_,
    "torch.negative_": torch.negative_,
    "torch.fix_": torch.fix_,
    "torch.clip_": lambda a: torch.clip_(a, -0.5, 0.5),
    "torch.dropout": lambda a: torch.dropout(a, 0.3, False),
    "torch.alpha_dropout": lambda a: torch.alpha_dropout(a, 0.3, False),
    "torch.feature_dropout_": lambda a: torch.feature_dropout_(a.unsqueeze(-1), 0.3, False).squeeze(-1),
    "F.dropout(p=0, training=True)": lambda a: F.dropout(a, p=0.0, training=True),
}


@pytest.mark.parametrize("name", ONE_KERNEL)
def test_spellings_of_identities_and_in_place_functions_join_the_kernel(name):
    """Each split the chain in two (or kept an in-place op and its readers out of fusion)."""
    model = Chain(ONE_KERNEL[name]).eval()
    opt = optimize_strict(model, torch.randn(4, 16))
    s = fxfuse.stats(opt)
    assert (s["fused_kernels"], s["library_calls"]) == (1, 0), s
    assert_matches_eager(opt, model, torch.randn(4, 16))


class Gate(nn.Module):
    def __init__(self, split):
        super().__init__()
        self.split = split

    def forward(self, x):
        p = self.split(x * 1.5 + 0.1)
        return torch.relu(p[0] * p[1].sigmoid())


@pytest.mark.parametrize("split", [lambda h: h.split_with_sizes([8, 8], -1),
                                   lambda h: torch.split_with_sizes(h, [8, 8], -1)])
def test_split_with_sizes_is_read_like_split(split):
    model = Gate(split).eval()
    opt = optimize_strict(model, torch.randn(4, 16))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(4, 16))


class SizeBranchDropout(nn.Module):   # torch.export traces it (a branch on a size)
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        h = x * 1.5 + 0.5
        h = self.fn(h) if x.shape[0] > 2 else h
        return torch.relu(h) - 0.25


@pytest.mark.parametrize("fn", [lambda h: F.dropout(h, 0.3, False, inplace=True),
                                lambda h: F.alpha_dropout(h, 0.3, False),
                                lambda h: F.dropout(h, p=0.0, training=True),
                                torch.special.round])
def test_exports_spellings_of_eval_dropout_and_special_round(fn):
    model = SizeBranchDropout(fn).eval()
    opt = optimize_strict(model, torch.randn(4, 16))
    assert "torch.export" in fxfuse.explain(opt)
    s = fxfuse.stats(opt)
    assert (s["fused_kernels"], s["library_calls"]) == (1, 0), s
    assert_matches_eager(opt, model, torch.randn(4, 16))


class AddScaled(nn.Module):
    def __init__(self, other, alpha):
        super().__init__()
        self.other, self.alpha = other, alpha

    def forward(self, x):
        return torch.add(x, self.other, alpha=self.alpha) * 2


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_an_integer_add_whose_scaled_number_wraps(dtype):
    """fuzz43d: normalize multiplied other * alpha in Python (2**64), which no torch Scalar holds:
    "internal error while optimizing"; eager's int64 product wraps to 0."""
    model = AddScaled(2 ** 62, 4).eval()
    x = torch.randint(-100, 100, (4, 8), dtype=dtype)
    opt = optimize_strict(model, x)
    x = torch.randint(-100, 100, (4, 8), dtype=dtype)
    assert torch.equal(opt(x), model(x))


AS_COMMON = {   # (spelling, its common spelling)
    "aten.cat packet": (lambda a: aten.cat([a * 2, a + 1], -1), lambda a: torch.cat([a * 2, a + 1], -1)),
    "aten.bitwise_not packet": (lambda a: torch.where(aten.bitwise_not(a > 0), a, -a),
                                lambda a: torch.where(~(a > 0), a, -a)),
    "aten._to_copy packet": (lambda a: aten._to_copy(a, dtype=torch.float16).float(), lambda a: a.half().float()),
    "torch.max all keywords": (lambda a: torch.max(input=a, other=a * 0.5), lambda a: torch.max(a, a * 0.5)),
    "type(dtype=)": (lambda a: a.type(dtype=torch.float16).float(), lambda a: a.type(torch.float16).float()),
    "1 / torch.numel": (lambda a: a / torch.numel(a), lambda a: a / a.numel()),
    "stride": (lambda a: a * a.stride(0), lambda a: a * 16),
    "element_size": (lambda a: a * a.element_size(), lambda a: a * 4),
    "dtype.itemsize": (lambda a: a * a.dtype.itemsize, lambda a: a * 4),
}


@pytest.mark.parametrize("name", AS_COMMON)
def test_packets_keywords_and_metadata_reads_fuse_as_their_common_spelling(name):
    spelled, common = AS_COMMON[name]
    counts = []
    for fn in (spelled, common):
        model = Chain(fn).eval()
        opt = optimize_strict(model, torch.randn(4, 16))
        s = fxfuse.stats(opt)
        counts.append((s["fused_kernels"], s["library_calls"]))
        assert_matches_eager(opt, model, torch.randn(4, 16))
    assert counts[0] == counts[1] and counts[0][1] == 0, counts


class MambaGate(nn.Module):   # Mamba-2: (y + x * D) over heads, merged, gated by silu(z)
    def __init__(self):
        super().__init__()
        self.D = nn.Parameter(torch.randn(2))

    def forward(self, y, x, z):
        b, length, heads, p = y.shape
        y = y + x * self.D[:, None]
        return y.reshape(b, length, heads * p) * F.silu(z)


class Produced(nn.Module):
    def forward(self, a, c):
        return (a * 2).reshape(6, 4) * (c * 3)


class HeadMerge(nn.Module):   # (y * 2 + 1).transpose(1, 2).reshape(b, n, c) * gate: copies, as .contiguous().view
    def __init__(self, flatten):
        super().__init__()
        self.flatten = flatten

    def forward(self, a, c):
        h = (a * 2 + 1).transpose(1, 2)
        return (h.flatten(2) if self.flatten else h.reshape(2, 9, 8)) * torch.tanh(c)


@pytest.mark.parametrize("make,shapes", [
    (MambaGate, [(2, 5, 2, 3), (2, 5, 2, 3), (2, 5, 6)]),
    (Produced, [(2, 3, 4), (6, 4)]),
    (lambda: HeadMerge(False), [(2, 2, 9, 4), (2, 9, 8)]),
    (lambda: HeadMerge(True), [(2, 2, 9, 4), (2, 9, 8)]),
])
def test_a_reshape_between_pointwise_results_keeps_one_kernel(make, shapes):
    """fuzz43a: a reshape between two pointwise results (the other operand computed too) split the
    chain in two kernels; a copying reshape (transpose, then reshape) gave two kernels and a copy."""
    model = make().eval()
    args = [torch.randn(*s) for s in shapes]
    opt = optimize_strict(model, *args)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, *args)


class MixedInPlace(nn.Module):   # an fp16 residual stream with an fp32 addend, then more in-place ops
    def forward(self, x, y):
        h = x * 2
        h += y
        h *= 3
        return h + 1


def test_in_place_ops_after_an_in_place_op_that_keeps_a_narrower_dtype_fuse():
    """fuzz43d: the cast back to fp16 after `h += y_fp32` carried fp32 metadata, so `h *= 3` after
    it was kept in place and everything after it stayed unfused."""
    model = MixedInPlace().eval()
    x, y = torch.randn(4, 8).half(), torch.randn(4, 8)
    opt = optimize_strict(model, x, y)
    s = fxfuse.stats(opt)
    assert (s["fused_kernels"], s["library_calls"]) == (1, 0), s
    assert torch.equal(opt(x, y), model(x, y))


class IntegerMasks(nn.Module):
    def forward(self, a, b, x):
        keep = torch.logical_and(a, b) | torch.logical_not(torch.isnan(a)) & torch.logical_xor(a, b)
        return torch.where(keep, x * 2, x - 1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_zero_and_nan_tests_of_wide_integers_fuse(dtype):
    """fuzz43d: they only ask whether a value is zero (or NaN), which fp32 keeps for any integer."""
    model = IntegerMasks().eval()
    a, b = (torch.randint(-2, 3, (4, 8), dtype=dtype) * 2 ** 40 % (2 ** 31 - 1) for _ in range(2))
    a[0, 0], b[0, 1] = 2 ** 31 - 1, 0
    x = torch.randn(4, 8)
    opt = optimize_strict(model, a, b, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert torch.equal(opt(a, b, x), model(a, b, x))


class DeadRaise(nn.Module):
    def forward(self, x, d):
        unused = x % d   # noqa: F841 -- raises for d == 0 in eager, and is dead code
        return x * 2.5


def test_a_model_raising_in_dead_code_on_the_example_is_named():
    """fuzz43d: "internal error while optimizing (RuntimeError: ZeroDivisionError)"."""
    x, d = torch.randint(-50, 50, (4, 8), dtype=torch.int16), torch.tensor(0, dtype=torch.int16)
    with pytest.raises(fxfuse.FxfuseError, match="DeadRaise itself raises on the example input"):
        fxfuse.optimize(DeadRaise().eval(), (x, d), strict=True)


class DataUnderExport(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        w = self.lin.weight.data
        if x.shape[0] > 2:   # symbolic_trace cannot take it: torch.export traces
            return torch.relu(x @ w.T) + 1
        return x


def test_data_under_torch_export_is_named_in_the_refusal():
    """fuzz43b: the advice said to remove code reading a tensor's value."""
    with pytest.raises(fxfuse.FxfuseError, match=r"`\.data`"):
        fxfuse.optimize(DataUnderExport().eval(), torch.randn(4, 8), strict=True)


class IndexUnsqueeze(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 24)

    def forward(self, x):
        return torch.relu(self.lin(x)[:, None]) * 0.5 + 1.0


def test_an_unsqueeze_spelled_as_an_index_keeps_the_gemm_epilogue():
    """fuzz43b: `lin(x)[:, None]` put its epilogue in a kernel of its own; `.unsqueeze(1)` did not."""
    model = IndexUnsqueeze().eval()
    opt = optimize_strict(model, torch.randn(8, 16), gemm="force")
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(8, 16))


class FlattenedHidden(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.lin, self.lin2, self.where = nn.Linear(16, 24), nn.Linear(24, 8), where

    def forward(self, x):
        h = self.lin(x)
        if self.where == "before relu":
            return self.lin2(torch.relu(h.view(-1, 24)))
        return self.lin2(torch.relu(h).flatten(0, 1))


@pytest.mark.parametrize("where", ["before relu", "after relu"])
def test_a_hidden_state_flattened_between_linears_stays_one_fused_mlp(where):
    """fuzz43b: a view of the hidden state between two Linears split the fused MLP in two kernels."""
    model = FlattenedHidden(where).eval()
    opt = optimize_strict(model, torch.randn(2, 4, 16), fused_mlp="force")
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(2, 4, 16))
    assert_matches_eager(opt, model, torch.randn(3, 5, 16))


class FloatSubBigInts(nn.Module):
    def forward(self, x):
        return x.sub(2 ** 40, alpha=2 ** 40) * 1e-20


def test_a_float_add_with_integer_number_and_alpha_multiplies_in_fp32():
    """review43f: the integer path's int64 wrap of `other * alpha` reached float tensors (x - 0)."""
    model = FloatSubBigInts().eval()
    opt = optimize_strict(model, torch.randn(4, 8))
    assert_matches_eager(opt, model, torch.randn(4, 8))


class ReadTwice(nn.Module):
    def forward(self, y, z):
        s = torch.sigmoid(y * 2).reshape(4, 6)
        a = torch.tanh(z)
        return torch.addcmul(s, a, a)


def test_an_operand_read_twice_past_a_view_is_computed_once(recwarn):
    """review43f: hoisted twice and erased twice (torch.fx warned of erasing an erased node)."""
    model = ReadTwice().eval()
    opt = optimize_strict(model, torch.randn(4, 2, 3), torch.randn(4, 6))
    assert not [w for w in recwarn if "erase" in str(w.message)]
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(4, 2, 3), torch.randn(4, 6))


PACKETS = {
    "view": (lambda x: aten.view(x * 2, [-1]) + 1, lambda x: aten.view.default(x * 2, [-1]) + 1),
    "reshape": (lambda x: aten.reshape(x * 2, [3, 4]) + 1, lambda x: aten.reshape.default(x * 2, [3, 4]) + 1),
    "to": (lambda x: aten.to(x * 2, torch.float16) + 1, lambda x: aten.to.dtype(x * 2, torch.float16) + 1),
    "split": (lambda x: aten.split(x * 2, 2, 1)[1] + 1, lambda x: aten.split.Tensor(x * 2, 2, 1)[1] + 1),
}


@pytest.mark.parametrize("name", PACKETS)
def test_view_and_split_packets_resolve_quietly(name, recwarn):
    counts = []
    for fn in PACKETS[name]:
        model = Chain(fn).eval()
        opt = optimize_strict(model, torch.randn(3, 4))
        counts.append(fxfuse.stats(opt)["fused_kernels"])
        assert_matches_eager(opt, model, torch.randn(3, 4))
    assert counts[0] == counts[1]
    assert not [w for w in recwarn if "parametric" in str(w.message)]


class VectorWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, h):
        return torch.sigmoid(F.linear(torch.relu(h * 2).flatten(0, 1), self.w)) * 3


def test_a_linear_with_a_vector_weight_past_a_view():
    model = VectorWeight().eval()
    opt = optimize_strict(model, torch.randn(2, 3, 4))
    assert_matches_eager(opt, model, torch.randn(2, 3, 4))
    assert_matches_eager(opt, model, torch.randn(5, 3, 4))


class Dist2BBox(nn.Module):   # YOLOv8
    def forward(self, lt, rb, anchors, strides):
        x1y1, x2y2 = anchors - lt, anchors + rb
        return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * strides


class JoinThenOps(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x, s):
        if self.how == "cat":
            return torch.relu(torch.cat([x, torch.sin(x), torch.cos(x)], -1) * 2.0 + s) - 1   # s: [n, 1]
        if self.how == "stack":
            return torch.stack([x * 2, x + 1], 0) * s + 1   # s: [n, d], not reaching the stack dim
        return torch.cat([x * 2, x + 1], -1) * s   # s varies along the cat dim: left as it is


@pytest.mark.parametrize("make,shapes,kernels", [
    (Dist2BBox, [(2, 2, 39), (2, 2, 39), (1, 2, 39), (1, 39)], 1),
    (lambda: JoinThenOps("cat"), [(5, 7), (5, 1)], 1),
    (lambda: JoinThenOps("stack"), [(5, 7), (5, 7)], 1),
    (lambda: JoinThenOps("varies"), [(5, 7), (5, 14)], 2),
])
def test_pointwise_ops_after_a_join_are_applied_to_its_pieces(make, shapes, kernels):
    """fuzz43e, fuzz43i: an op reading a cat the kernel writes ran as a second kernel over the
    whole joined tensor."""
    model = make().eval()
    args = [torch.randn(*s) for s in shapes]
    opt = optimize_strict(model, *args)
    assert fxfuse.stats(opt)["fused_kernels"] == kernels
    assert_matches_eager(opt, model, *args)


class ChannelScaleAfterFlatten(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.w, self.how = nn.Parameter(torch.randn(4)), how

    def forward(self, x):
        h = torch.relu(x * 2)
        if self.how == "flatten":
            return h.flatten(2) + self.w[:, None]
        if self.how == "view":
            return h.view(x.shape[0], 4, -1) * self.w.view(1, 4, 1)
        return h.reshape(x.shape[0], 4, 3, 10) * self.w[:, None, None] - 1   # a split dim, the operand constant there


@pytest.mark.parametrize("how", ["flatten", "view", "split"])
def test_a_per_channel_operand_past_a_view_moves_with_it(how):
    """fuzz43j: `(x * 2).flatten(2) + w[:, None]` (and conv(x).flatten(2) * w[:, None]) split the
    chain in two kernels: the view could not move below an operand broadcast against it."""
    model = ChannelScaleAfterFlatten(how).eval()
    opt = optimize_strict(model, torch.randn(2, 4, 5, 6))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(2, 4, 5, 6))
    assert_matches_eager(opt, model, torch.randn(3, 4, 5, 6))


class HandLeaky(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(8, 16), nn.Linear(16, 8), how

    def forward(self, x):
        h = self.fc1(x)
        if self.how == "gt":
            h = torch.where(h > 0, h, 0.01 * h)
        else:
            h = torch.where(h >= 0.0, h, h * 0.2)
        return self.fc2(h) + x


@pytest.mark.parametrize("how", ["gt", "ge"])
def test_a_hand_written_leaky_relu_stays_in_the_fused_mlp(how):
    """fuzz43j: `where(h > 0, h, 0.01 * h)` split a forced fused MLP into 4 kernels (a bool mask
    does not join it); it is F.leaky_relu bit for bit, NaN and -0.0 included."""
    model = HandLeaky(how).eval()
    opt = optimize_strict(model, torch.randn(5, 8), fused_mlp="force")
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(5, 8))
    from test_join_outputs import Wrap
    chain = Wrap(lambda a: torch.where(a > 0, a, 0.01 * a) * 1.5)
    x = torch.tensor([[0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, -3.0]] * 2)
    opt = optimize_strict(chain.eval(), x)
    with torch.no_grad():
        got, want = opt(x), chain(x)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


class SliceThenTranspose(nn.Module):
    def __init__(self, take):
        super().__init__()
        self.take = take

    def forward(self, x):
        h = x * 2
        v = self.take(h)
        h.t_()
        return v + 1


@pytest.mark.parametrize("take", [lambda h: h[0:4], lambda h: h[:], lambda h: h.narrow(0, 0, 4), lambda h: h.data,
                                  lambda h: h.T])
@pytest.mark.parametrize("verify", [True, False])
def test_a_whole_view_taken_before_its_source_is_transposed_in_place(take, verify):
    """fuzz43h: the whole slice (or `.data`) was dropped as h itself, and `h.t_()` after it then
    transposed what the slice's readers read (with verify=False silently: 2 to 7 off); torch.fx
    recorded `h.data` where it was first used, after the transpose."""
    model = SliceThenTranspose(take).eval()
    opt = optimize_strict(model, torch.randn(4, 4), verify=verify)
    assert_matches_eager(opt, model, torch.randn(4, 4))


class TransposedInPlaceThenContiguous(nn.Module):
    def forward(self, x):
        h = x * 2
        h.t_()
        return h.contiguous() + 1


def test_contiguous_after_an_in_place_transpose_keeps_eagers_strides():
    """fuzz43h: `.contiguous()` was dropped (h's metadata said contiguous, from before `t_()`), and
    the result came back with transposed strides: `.view(-1)` of it raised."""
    model = TransposedInPlaceThenContiguous().eval()
    opt = optimize_strict(model, torch.randn(4, 4))
    x = torch.randn(4, 4)
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert got.stride() == want.stride() and torch.equal(got, want)


class HeadMergeBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(12))

    def forward(self, x):
        b, h, n, d = x.shape
        return torch.tanh((x * 0.5 + 1).transpose(1, 2).reshape(b, n, h * d) + self.bias)


def test_a_bias_after_a_head_merge_is_split_as_the_heads():
    """The bias [h * d] varies along the dim the merge makes: read as [h, d] against the heads, the
    whole chain is one kernel (two and a copy before)."""
    model = HeadMergeBias().eval()
    opt = optimize_strict(model, torch.randn(2, 3, 5, 4))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(2, 3, 5, 4))
    assert_matches_eager(opt, model, torch.randn(1, 3, 7, 4))


class VStackOfVectors(nn.Module):
    def forward(self, x):
        return torch.vstack([x * 2, x + 1])   # [n] pieces -> [2, n]: a stack, not a cat along dim 0


class KeywordCat(nn.Module):
    def forward(self, x, c):
        return torch.cat(tensors=[x * 2, x + 1], dim=1) * c


def test_vstack_of_vectors_and_a_keyword_cat():
    """review43k: vstack of 1-D pieces was read as a cat along dim 0 (piece k written at k * n * n:
    past the output's end, with verify=False wrong values and a crash); a cat given its pieces by
    keyword, then a pointwise op, was an internal error."""
    model = VStackOfVectors().eval()
    opt = optimize_strict(model, torch.randn(5), verify=False)
    assert_matches_eager(opt, model, torch.randn(5))
    model = KeywordCat().eval()
    opt = optimize_strict(model, torch.randn(3, 4), torch.randn(3, 1))
    assert_matches_eager(opt, model, torch.randn(3, 4), torch.randn(3, 1))


class LeakyAfterWrite(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        h = x * 2
        if self.how == "mask then write":
            m = h > 0
            h.neg_()
            return torch.where(m, h, 0.2 * h)
        if self.how == "negative slope, >=":
            return torch.where(h >= 0, h, -0.5 * h)
        if self.how == "item written, export":
            m = h > 0
            h[0] = -h[0]
            return torch.where(m, h, 0.2 * h)
        o = 0.2 * h
        o.sub_(1)
        return torch.where(h > 0, h, o)


@pytest.mark.parametrize("how", ["mask then write", "negative slope, >=", "slope term written", "item written, export"])
def test_a_where_that_is_no_leaky_relu_stays_a_where(how):
    """review43k: the LeakyReLU reading took where(h > 0, h, slope * h) with h (or the mask, or the
    slope term) written in between, and `>=` with a negative slope (which flips a zero's sign)."""
    model = LeakyAfterWrite(how).eval()
    opt = optimize_strict(model, torch.randn(4, 8), verify=False)
    x = torch.randn(4, 8)
    x[0, :2] = torch.tensor([0.0, -0.0])
    with torch.no_grad():
        got, want = opt(x.clone()), model(x.clone())
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
