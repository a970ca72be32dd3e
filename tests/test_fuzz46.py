"""Stop 46: GPT-J's rotary (rotate_every_two: a stack of the odd and even halves, flattened) is one
kernel with `q * cos` next to it: the add after the flatten moves above it, the broadcast cos read
regrouped as [.., d/2, 2]."""
import pytest
import torch
from torch import nn

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
