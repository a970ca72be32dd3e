"""Stop 49: helper findings (fuzz49*) in the passes and kernels (each test fails on the code before its fix)."""
import pytest
import torch
from torch import nn

import fxfuse

from conftest import optimize_strict


class ClampJoin(nn.Module):
    def forward(self, x, y):
        return torch.cat([(x @ x.T).clamp(min=0.0), (y @ y.T).clamp(min=-0.0)], 1)


def test_pieces_with_zeros_of_other_signs_stay_apart():
    """fuzz49c: join_outputs took `clamp(min=-0.0)` for `clamp(min=0.0)` (`0.0 == -0.0`) and moved one clamp
    after the cat: b's clamped entries came back +0.0 where eager gives -0.0."""
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    opt = optimize_strict(ClampJoin().eval(), (x, y))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    for _ in range(3):
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        want, got = ClampJoin()(x, y), opt(x, y)
        torch.testing.assert_close(got, want)
        assert torch.equal(torch.signbit(got), torch.signbit(want))


class SameClampJoin(nn.Module):
    def forward(self, x, y):
        return torch.cat([(x @ x.T).clamp(min=0.5), (y @ y.T).clamp(min=0.5)], 1)


def test_pieces_with_the_same_numbers_still_move_out_of_the_join():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    opt = optimize_strict(SameClampJoin().eval(), (x, y))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    torch.testing.assert_close(opt(x, y), SameClampJoin()(x, y))


@pytest.mark.parametrize("options", [{"gemm": "force"}, {"fused_mlp": "force"}])
@pytest.mark.parametrize("shape", [(5, 17), (2, 3, 17), (17,)])
def test_generated_gemm_and_mlp_outputs_are_no_views(options, shape):
    """fuzz49h: the generated GEMM and fused MLP returned `out.view(lead + (n,))`; a result made under
    no_grad then refused an in-place op with grad (`a view was created in no_grad mode`), where eager's
    Linear output, a fresh tensor, takes it."""
    model = nn.Sequential(nn.Linear(17, 33), nn.ReLU()).eval()
    x = torch.randn(*shape)
    opt = fxfuse.optimize(model, x, **options)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert got._base is None and got.shape == want.shape
    torch.testing.assert_close(got, want)
    p = torch.rand(33, requires_grad=True)
    torch.testing.assert_close(got.mul_(p), want.mul_(p))


class Chomp(nn.Module):
    def __init__(self, inplace):
        super().__init__()
        self.conv, self.act = nn.Conv1d(3, 3, 3, padding=2), nn.ReLU(inplace=inplace)

    def forward(self, x):
        return self.act(self.conv(x)[:, :, :-2].contiguous()) + x


class TransposedCopy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        y = self.lin(x).t().clone()   # (clone of a non-row-major h: rewritten as contiguous())
        return y.mul_(2).add_(1)


@pytest.mark.parametrize("model", [Chomp(True), TransposedCopy()], ids=["chomp", "t-clone"])
def test_inplace_op_on_a_contiguous_copy_fuses(model):
    """fuzz49b: `h.contiguous()` of an h that is not contiguous copies, so an in-place op on it writes
    nothing else; it was kept in place and the chain fused nothing (TCN's Chomp1d + ReLU(inplace=True))."""
    x = torch.randn(2, 3, 8) if isinstance(model, Chomp) else torch.randn(4, 6)
    opt = optimize_strict(model.eval(), x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        for _ in range(2):
            xi = torch.randn_like(x)
            torch.testing.assert_close(opt(xi), model(xi))


class ContiguousAlias(nn.Module):
    def forward(self, x):
        y = (x * 2).t()
        z = y.contiguous()   # y is contiguous where x has one column: z IS y, the write reaches y
        z.add_(1)
        return y * 3, z


@pytest.mark.parametrize("shape", [(5, 1), (5, 3)])
def test_inplace_op_on_contiguous_of_a_contiguous_tensor_writes_it(shape):
    x = torch.randn(*shape)
    opt = optimize_strict(ContiguousAlias().eval(), x)
    for _ in range(2):
        xi = torch.randn_like(x)
        for got, want in zip(opt(xi), ContiguousAlias()(xi)):
            torch.testing.assert_close(got, want)
