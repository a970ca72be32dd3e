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


class FloatSubBigInts(nn.Module):
    def forward(self, x):
        return x.sub(2 ** 40, alpha=2 ** 40) * 1e-20


def test_a_float_add_with_integer_number_and_alpha_multiplies_in_fp32():
    """review43f: the integer path's int64 wrap of `other * alpha` reached float tensors (x - 0)."""
    model = FloatSubBigInts().eval()
    opt = optimize_strict(model, torch.randn(4, 8))
    assert_matches_eager(opt, model, torch.randn(4, 8))


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
