"""Stop 43: pointwise ops past views and joins (passes/sink_views.py, passes/join_outputs.py): an
operand computed at a view's source shape, copying reshapes, broadcast operands and Linears moved
with a view, ops applied to a join's pieces, and the views that must stay (a source changed in place)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict


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
        return torch.cat([x * 2, x + 1], -1) * s   # s varies along the cat dim: each piece reads its part (stop 45)


@pytest.mark.parametrize("make,shapes,kernels", [
    (Dist2BBox, [(2, 2, 39), (2, 2, 39), (1, 2, 39), (1, 39)], 1),
    (lambda: JoinThenOps("cat"), [(5, 7), (5, 1)], 1),
    (lambda: JoinThenOps("stack"), [(5, 7), (5, 7)], 1),
    (lambda: JoinThenOps("varies"), [(5, 7), (5, 14)], 1),
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
