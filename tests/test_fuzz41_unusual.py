"""Stop 41 (fuzz41a, fuzz41e): unusual ops inside forward(): complex augmented assignments,
function transforms and forward-mode AD, functional_call, random-state calls, log10, lerp's
bool weight."""
import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_warned


class InputRotate(nn.Module):
    """Rotate a complex signal stored as [..., 2] in place (the write shows through the input)."""

    def forward(self, x):
        z = torch.view_as_complex(x)
        z *= 2j
        return x + 1


class ComplexSliceAdd(nn.Module):
    def forward(self, z):
        h = z[0]
        h += 1
        return z * 2


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("make, example", [(InputRotate, lambda: torch.randn(3, 5, 2)),
                                           (ComplexSliceAdd, lambda: torch.randn(3, 5, dtype=torch.cfloat))])
def test_a_complex_augmented_assignment_is_kept(make, example, verify):
    # before: the write was dropped as dead code (verify=False: off by up to 14, the input unwritten;
    # verify=True: refused)
    model = make().eval()
    opt, messages = optimize_warned(model, example(), verify=verify)
    assert isinstance(opt, fxfuse.OptimizedModule) and not messages
    x = example()
    x_eager, x_opt = x.clone(), x.clone()
    with torch.no_grad():
        torch.testing.assert_close(opt(x_opt), model(x_eager))
    torch.testing.assert_close(x_opt, x_eager)   # the caller's input written as eager writes it


class JVPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, v):
        y, dy = torch.func.jvp(lambda z: self.net(z), (x,), (v,))
        return y + dy


class DualNet(JVPNet):
    def forward(self, x, v):
        with fwAD.dual_level():
            p, t = fwAD.unpack_dual(self.net(fwAD.make_dual(x, v)))
        return p + t


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("make, named", [(JVPNet, "torch.func.jvp"), (DualNet, "forward-mode AD")])
def test_forward_mode_ad_in_forward_is_refused_and_leaves_no_transform_behind(make, named, verify):
    # before: an internal error, and functorch's level left pushed: every later backward() raised
    model = make().eval()
    args = (torch.randn(5, 4), torch.randn(5, 4))
    opt, messages = optimize_warned(model, args, verify=verify)
    assert opt is model and len(messages) == 1 and named in messages[0]
    assert torch._C._functorch.maybe_current_level() is None
    w = torch.randn(3, requires_grad=True)
    (w * 2).sum().backward()   # still works in this process
    torch.testing.assert_close(opt(*args), model(*args))


class EMAEval(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 6)
        self.ema = {k: v.detach() * 0.5 for k, v in self.net.named_parameters()}

    def forward(self, x):
        return torch.relu(torch.func.functional_call(self.net, self.ema, (x,))) + 1


@pytest.mark.parametrize("verify", [True, False])
def test_functional_call_in_forward_is_refused(verify):
    # before: the trace read the net's own weights (verify=False: off by 0.7, silently)
    model = EMAEval().eval()
    opt, messages = optimize_warned(model, torch.randn(3, 6), verify=verify)
    assert opt is model and len(messages) == 1 and "functional_call" in messages[0]


class ForkNoise(nn.Module):
    def forward(self, x):
        with torch.random.fork_rng():
            n = torch.randn_like(x)
        return torch.relu(x) + 0.1 * n


class SeededNoise(nn.Module):
    def forward(self, x):
        torch.manual_seed(0)
        return torch.relu(x) + torch.randn_like(x)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("make", [ForkNoise, SeededNoise])
def test_random_state_calls_in_forward_are_refused(make, verify):
    # before: fork_rng's block left the caller's generator advanced (silently, even with verify);
    # manual_seed gave other noise each call with verify=False
    model = make().eval()
    opt, messages = optimize_warned(model, torch.randn(3, 6), verify=verify)
    assert opt is model and len(messages) == 1 and "generator" in messages[0]


class PowerToDb(nn.Module):
    def forward(self, p):
        return 10 * torch.log10(p.clamp_min(1e-10)) - 80, p.log10() + 1


def test_log10_is_fused():
    # before: 2 kernels and a library log10
    model = PowerToDb().eval()
    x = torch.randn(9, 13).abs() * 100
    x[0, :4] = torch.tensor([0.0, 1.0, 10.0, float("inf")])
    x[1, :2] = torch.tensor([-1.0, float("nan")])
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, x, fresh=False, rtol=2e-6, equal_nan=True)
    assert_matches_eager(opt, model, torch.rand(9, 13) * 50 + 1e-3, fresh=False, rtol=2e-6)


class LerpBool(nn.Module):
    def forward(self, x, y):
        return torch.lerp(x.relu(), y, True) * 2 + torch.lerp(x, y, False)


def test_lerp_with_a_bool_weight_fuses():
    # before: an internal error (the bool reached the kernel as a Python int)
    model = LerpBool().eval()
    args = (torch.randn(4, 8), torch.randn(4, 8))
    opt = fxfuse.optimize(copy.deepcopy(model), args, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, *args)


class LoopedThenPointwise(nn.Module):
    """symbolic_trace fails on the loop over a size: torch.export traces it (and swaps the
    module's tensors itself, which must not read as a functional_call in forward())."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(x.shape[0]):
            pass
        return torch.relu(self.lin(x)) * 2 + 1


def test_a_model_only_torch_export_traces_is_still_optimized():
    # the first form of the functional_call refusal counted export's own swaps: every such model was refused
    model = LoopedThenPointwise().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, fxfuse.OptimizedModule) and not messages
    assert fxfuse.explain(opt).count("torch.export") >= 1 and fxfuse.stats(opt)["fused_kernels"] >= 1
    assert_matches_eager(opt, model, torch.randn(4, 8))


class CausalMaskAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, g):
        t = g.shape[1]
        g = torch.relu(self.lin(g))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)   # sizes as separate arguments
        a, _ = self.att(g, g, g, attn_mask=mask, need_weights=False)
        return a + g


def test_factory_sizes_given_as_separate_arguments_trace():
    # before: symbolic_trace failed on torch.ones(T, T); torch.export then refused the masked attention
    model = CausalMaskAttention().eval()
    opt, messages = optimize_warned(model, torch.randn(2, 7, 16))
    assert isinstance(opt, fxfuse.OptimizedModule) and not messages
    assert "symbolic_trace" in fxfuse.explain(opt)
    assert not getattr(torch.ones, "fxfuse_packs_sizes", False)
    assert_matches_eager(opt, model, torch.randn(2, 7, 16))
