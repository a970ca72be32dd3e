"""Fuzzing, fourth round (CPU): writes. Augmented assignments (`v += y`, which torch.fx alone
records as `v = v + y`), writes the example input does not show, a forward() that writes its
own state or asks for grad mode. Each test is a finding that gave a wrong answer before its fix."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402


class WriteThroughView(nn.Module):
    def forward(self, x):
        h = (x * 2).relu()
        v = h[:, :4]
        v += torch.where(x[:, :4] > 3.0, 100.0, 0.0)   # eager writes into h through the view
        return h


class WriteThroughAlias(nn.Module):
    def forward(self, x):
        h = x.relu() * 3
        g = h
        g *= torch.where(x > 3.0, -1.0, 1.0)
        return h.sigmoid() + h


class WriteThroughReshape(nn.Module):
    def forward(self, x):
        h = (x * 2).relu()
        flat = h.reshape(-1)
        flat -= 1
        return h + 1


class SizeRebinding(nn.Module):
    def forward(self, x):
        n = x.shape[1]
        n += 1                     # an int: `+=` rebinds
        return nn.functional.pad(x, (0, 1)).relu() * n


@pytest.mark.parametrize("model_class", [WriteThroughView, WriteThroughAlias, WriteThroughReshape, SizeRebinding])
def test_augmented_assignment_through_a_view_or_alias_writes_as_eager(model_class):
    """Fuzz: torch.fx ran `v += y` as `v = v + y`, so a write through a view or an alias was
    lost: a silent wrong answer where the example input (all < 3) did not show it."""
    model = model_class().eval()
    opt = fxfuse.optimize(model, torch.rand(2, 8), strict=True)
    with torch.no_grad():
        for x in (torch.rand(2, 8) * 5, torch.randn(3, 8) * 4):
            torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


def test_residual_augmented_assignment_still_fuses():
    """`out += identity` on a fresh tensor (ResNet's block) becomes the functional add and fuses
    with the ReLU after it."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            out = self.lin(x)
            out += x
            out *= 0.5
            return torch.relu(out)

    model = Block().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 8), strict=True, gemm="off", fused_mlp="off")
    with torch.no_grad():
        x = torch.randn(5, 8)
        torch.testing.assert_close(opt(x), model(x))
    spec = next(iter(opt._specializations.values()))
    fused = [m for m in spec.gm.modules() if type(m).__name__ == "FusedKernel"]
    assert len(fused) == 1 and len(fused[0].members) == 4   # bias add, += x, *= 0.5, relu


class WriteIntoDataDependentAlias(nn.Module):
    def forward(self, x):
        p = x[x > 0]               # its shape depends on the values
        q = p
        q += x[0, 0].clamp(min=0)  # eager: p changes too
        return p.sum().reshape(1)


class WriteAfterKeptInPlace(nn.Module):
    def forward(self, x):
        h = x * 2
        g = h.div_(3, rounding_mode="floor")   # kept in place (no canonical form): g IS h
        h += x[:, :1].clamp(min=0)             # eager: g sees this write
        return g


@pytest.mark.parametrize("model_class", [WriteIntoDataDependentAlias, WriteAfterKeptInPlace])
def test_writes_the_example_does_not_show_are_kept(model_class):
    """Fuzz: `+=` on a value of data-dependent shape was taken for a size (its tensor_meta is
    dropped) and rebound; `+=` after a kept in-place op that returned an alias was made
    functional. Both silently wrong where the example adds 0 (x[0, 0] < 0)."""
    model = model_class().eval()
    example = torch.randn(4, 8) * 5
    example[:, 0] = -1.0
    opt = fxfuse.optimize(model, example, strict=True)
    with torch.no_grad():
        x = torch.randn(4, 8) * 5
        x[:, 0] = 2.0
        torch.testing.assert_close(opt(x.clone()), model(x.clone()))
    spec = next(iter(opt._specializations.values()))
    if model_class is not WriteIntoDataDependentAlias:   # x[x > 0] is a gather, new memory (stop 35): its
        assert any(n.startswith("iadd") for n in spec.gm.meta["fxfuse_inplace_kept"])   # write may be functional


class PlainTensorCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = torch.zeros(4)            # a plain attribute, not a buffer

    def forward(self, x):
        t = self.t
        t += 1
        return x + t


class BiasNudge(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        b = self.lin.bias
        b += 0.1
        return self.lin(x)


@pytest.mark.parametrize("model_class,example", [(PlainTensorCounter, (2, 4)), (BiasNudge, (3, 8))])
def test_forward_writing_its_own_state_is_refused_and_the_state_kept(model_class, example):
    """Fuzz: torch.fx ran `t += 1` on a plain tensor attribute at trace time and froze it as a
    constant (the build changed it twice, and later calls drifted from eager); a parameter
    written in forward() was refused but left changed by the build's six runs."""
    model = model_class().eval()
    before = [t.detach().clone() for t in list(model.parameters()) + [getattr(model, "t", torch.zeros(0))]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, torch.randn(*example))
    assert opt is model
    assert len(caught) == 1 and "changes the module's state" in str(caught[0].message)
    after = list(model.parameters()) + [getattr(model, "t", torch.zeros(0))]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(fxfuse.UnsupportedError, match="state"):
        fxfuse.optimize(model, torch.randn(*example), strict=True)


class MorePowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))

    def forward(self, x):
        h = x * 3
        h **= 2
        h += x
        m = x * 1
        m @= self.w.T              # torch has no __imatmul__: a rebinding, and a Linear
        return h.sum(1, keepdim=True) + m.sum(1, keepdim=True), h


def test_power_and_matmul_augmented_assignments_fuse():
    """Fuzz: `h **= 2` on a fresh value stayed in place (so did the `+=` after it), and `m @= W.T`
    counted as a write."""
    model = MorePowers().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 4), strict=True)
    with torch.no_grad():
        x = torch.randn(6, 4)
        for got, want in zip(opt(x), model(x)):
            torch.testing.assert_close(got, want)
    spec = next(iter(opt._specializations.values()))
    assert spec.gm.meta["fxfuse_inplace_kept"] == []
    assert any("linear" in str(n.target) for n in spec.gm.graph.nodes)


class GradModeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if not torch.is_grad_enabled():   # an inference-only path
            h = h * 2
        return h.relu()


def test_a_forward_that_asks_for_grad_mode_runs_the_original_with_grad_on():
    """Fuzz: builds trace under no_grad, so the no-grad branch was baked in, and a frozen model
    called with grad mode on ran it: a silent wrong answer."""
    model = GradModeBranch().eval().requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(3, 4))
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(opt(x), model(x))        # grad mode on: the original
    assert len(caught) == 1 and "is_grad_enabled" in str(caught[0].message)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
