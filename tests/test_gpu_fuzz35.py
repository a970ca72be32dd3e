"""Stop 35: torch's random ops in an optimized CUDA model (CUDA graph replays must draw anew)."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


class _Reparametrize(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu, self.logvar = nn.Linear(64, 32), nn.Linear(64, 32)

    def forward(self, x):
        mu, logvar = self.mu(x), self.logvar(x)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return F.dropout(z.relu(), p=0.25, training=True) * 2 + 1


def test_random_ops_in_a_cuda_graph_draw_anew_and_as_eager_under_the_same_seed():
    torch.manual_seed(0)
    model, x = _Reparametrize().cuda().eval(), torch.randn(8, 64, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        torch.manual_seed(11)
        got = [opt(x).clone() for _ in range(3)]
        torch.manual_seed(11)
        want = [model(x) for _ in range(3)]
    assert not torch.equal(got[0], got[1]) and not torch.equal(got[1], got[2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class _Three(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, a, b, c):
        return self.f(a, b, c)


TERNARY = {
    "lerp_small": lambda a, b, c: torch.lerp(a, b, 0.3) * 2,
    "lerp_large": lambda a, b, c: torch.lerp(a, b, 0.7) * 2,
    "lerp_tensor": lambda a, b, c: torch.lerp(a, b, c) * 2,
    "addcmul": lambda a, b, c: torch.addcmul(a, b, c, value=0.3) * 2,
    "addcdiv": lambda a, b, c: torch.addcdiv(a, b, c, value=-1.7) * 2,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TERNARY))
def test_lerp_addcmul_addcdiv_kernels_against_cuda_eager(name, dtype):
    """Fused: ATen's formulas in fp32 opmath, one rounding at the end (as CUDA's kernel, then
    the * 2, which is exact). Edge weights and values included."""
    torch.manual_seed(0)
    special = torch.tensor([0.0, 1.0, 0.5, -0.5, 2.0, float("inf"), float("nan"), 1e-30, -3.0], device="cuda")
    a, b = (torch.randn(4096, device="cuda") * 10).to(dtype), (torch.randn(4096, device="cuda") * 10).to(dtype)
    c = torch.cat([special, torch.rand(4096 - special.numel(), device="cuda") * 2 - 0.5]).to(dtype)
    model = _Three(TERNARY[name]).eval()
    opt = fxfuse.optimize(model, (a, b, c), verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        got, want = opt(a, b, c), model(a, b, c)
    if dtype != torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, equal_nan=True)
        return
    # one rounding per multiply-add, as CUDA's fma: bit for bit but for rare double-rounding ties
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.float().mean() > 0.999, (got[~same][:8], want[~same][:8])
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=1e-30, equal_nan=True)


class _DiTModulate(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.ada = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x, c):
        shift, scale = self.ada(F.silu(c)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class _Mamba(nn.Module):
    def __init__(self, d=64, n=16):
        super().__init__()
        self.A, self.b = nn.Parameter(-torch.rand(d, n)), nn.Parameter(torch.randn(d))

    def forward(self, x, h):
        return h * torch.exp(self.A * F.softplus(x + self.b).unsqueeze(-1)) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_views_before_a_broadcast_and_lone_biases_on_cuda(dtype):
    """The adaLN Linear's bias (read by a chunk only) in its library call, or added where the
    GPU measured that faster; Mamba's dt chain in the kernel that broadcasts it."""
    torch.manual_seed(0)
    dit = _DiTModulate().cuda().eval().to(dtype)
    args = (torch.randn(4, 64, 256, device="cuda", dtype=dtype), torch.randn(4, 256, device="cuda", dtype=dtype))
    opt = fxfuse.optimize(dit, args)
    assert fxfuse.stats(opt)["fused_kernels"] <= 3
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), dit(*args), **tol)
    mamba = _Mamba().cuda().eval().to(dtype)
    args = (torch.randn(8, 64, device="cuda", dtype=dtype), torch.randn(8, 64, 16, device="cuda", dtype=dtype))
    opt = fxfuse.optimize(mamba, args)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), mamba(*args), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prelu_and_binary_max_against_cuda_eager(dtype):
    """Stop 35's new spellings: PReLU as where(x > 0, x, x * w) and torch.max(a, b) as maximum, bit for bit."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.PReLU(16)

        def forward(self, x):
            return torch.max(self.act(x * 2 + 1), torch.tensor(-0.75, device=x.device, dtype=x.dtype)) - 0.5

    model = Model().cuda().eval().to(dtype)
    with torch.no_grad():
        model.act.weight.uniform_(-0.5, 0.5)
    x = torch.randn(4, 16, 8, 8, device="cuda", dtype=dtype)
    x[0, 0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0, equal_nan=True)
