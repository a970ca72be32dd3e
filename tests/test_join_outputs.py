"""A stack or cat of a fused kernel's results is written by the kernel itself
(passes/join_outputs.py): one output, no library copy after the kernel."""
import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_fast_path, assert_matches_eager, optimize_warned, optimized_graph

JOIN_TARGETS = {torch.stack, torch.cat, torch.concat, torch.concatenate, torch.hstack, torch.vstack, torch.column_stack,
                torch.ops.aten.stack.default, torch.ops.aten.cat.default}


def rotate_every_two(x):   # GPT-J's rotary embedding: pairs (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    x1, x2 = x.view(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([x1 * 0.6 - x2 * 0.8, x2 * 0.6 + x1 * 0.8], -1).flatten(-2)


JOINED = {
    "rotary stack": (rotate_every_two, (3, 5, 8)),
    "sin cos cat": (lambda x: torch.cat([torch.sin(x * 3), torch.cos(x * 3)], -1), (4, 7)),
    "encoding with the input": (lambda x: torch.cat([x] + [f(x * 2 ** k) for k in range(3)
                                                       for f in (torch.sin, torch.cos)], -1), (5, 3)),
    "stack dim 0": (lambda x: torch.stack((x.relu(), x.sigmoid(), x * 2)), (4, 6)),
    "stack by keyword": (lambda x: torch.stack(tensors=[x.relu(), x.tanh()], dim=1), (4, 6)),
    "cat dim 0": (lambda x: torch.cat([x.relu(), (x + 1).exp()], dim=0), (4, 6)),
    "concat middle dim": (lambda x: torch.concat([x.relu(), x.tanh()], 1), (2, 3, 5)),
    "concatenate axis": (lambda x: torch.concatenate([x.relu(), x.tanh()], axis=-2), (2, 3, 5)),
    "one piece twice": (lambda x: (lambda a: torch.stack([a, a], -1))(x.exp()), (4, 6)),
    "fp16 pieces": (lambda x: torch.cat([x.half().relu(), (x.half() * 2).sigmoid()], -1), (4, 6)),
    "hstack": (lambda x: torch.hstack([x.relu(), x.tanh()]), (4, 6)),
    "vstack": (lambda x: torch.vstack((x * 2, x.exp())), (2, 3, 5)),
    "column_stack": (lambda x: torch.column_stack([x.relu(), x + 1]), (4, 6)),
}


class Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _joins_left(opt) -> int:
    return sum(n.op == "call_function" and n.target in JOIN_TARGETS for n in optimized_graph(opt).graph.nodes)


@pytest.mark.parametrize("name", JOINED)
def test_the_kernel_writes_the_stack_or_cat(name):
    fn, shape = JOINED[name]
    model = Wrap(fn).eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(*shape))
    assert not messages and _joins_left(opt) == 0
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    for _ in range(2):
        got = assert_matches_eager(opt, model, torch.randn(*shape))
        assert got.is_contiguous()
    assert_fast_path(opt)
    other = (shape[0] + 3,) + shape[1:]   # another specialization, built for its own shape
    assert_matches_eager(opt, model, torch.randn(*other))
    assert "pointwise ops; writes " in fxfuse.explain(opt)


class PiecesOfTwoKernels(nn.Module):
    def forward(self, x):   # relu(x^T) and flip(x)^T * 2 are two kernels: the second's result comes later
        return torch.cat([x.t().relu(), x.flip(0).t() * 2], -1)   # (x.t() twice is one view now: one kernel)


class PieceWrittenLater(nn.Module):
    def forward(self, x):
        a = x.exp()
        x.mul_(3)   # the stack reads x after the write
        return torch.stack([a, x], 0)


class PieceOfOtherShape(nn.Module):
    def forward(self, x):
        return torch.cat([x.relu(), x[:, :2].exp()], -1)


@pytest.mark.parametrize("make", [PiecesOfTwoKernels, PieceWrittenLater, PieceOfOtherShape])
def test_a_join_the_kernel_cannot_write_stays_a_library_call(make):
    model = make().eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(4, 6))
    assert isinstance(opt, fxfuse.OptimizedModule) and not messages
    assert _joins_left(opt) == 1
    for _ in range(2):
        x = torch.randn(4, 6)
        x_eager, x_opt = x.clone(), x.clone()
        with torch.no_grad():
            torch.testing.assert_close(opt(x_opt), model(x_eager))
        torch.testing.assert_close(x_opt, x_eager)   # the in-place write on the input, as eager


def test_a_piece_also_read_elsewhere_is_stored_twice():
    class Model(nn.Module):
        def forward(self, x):
            a = x.relu()
            return torch.cat([a, a * 2], -1), a.sum(0)
    model = Model().eval()
    with torch.no_grad():
        opt, _ = optimize_warned(model, torch.randn(4, 6))
    assert _joins_left(opt) == 0
    for _ in range(2):
        assert_matches_eager(opt, model, torch.randn(4, 6))


def test_a_concat_written_in_place_afterwards_is_still_written_by_the_kernel():
    # fuzz42g: torch.concat's result was taken for a view of its pieces (only cat and stack were fresh)
    model = Wrap(lambda x: (lambda j: j.add_(1) * 2)(torch.concat([x.relu(), x.sin()], 1))).eval()
    with torch.no_grad():
        opt, messages = optimize_warned(model, torch.randn(4, 6))
        assert not messages and _joins_left(opt) == 0
        for _ in range(2):
            assert_matches_eager(opt, model, torch.randn(4, 6))
