"""Stop 34's numerics against CUDA eager (fuzz34e found them on an H100, where the interpreter agrees)."""
import pytest
import torch
import torch.nn as nn

import fxfuse

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)

SPECIAL = [float("nan"), -0.0, 0.0, -2.5, -0.5, 0.5, 1.5, 2.5, float("inf"), -float("inf"), 3.7, -3.7, 8388609.0,
           0.49999997, 1e-40, -1e-40, -3e-39, 2e-39]


class _Fn(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def _bits(opt, model, x):
    with torch.no_grad():
        got, want = opt(x), model(x)
    got, want = (t if t.is_floating_point() else t.float() for t in (got, want))
    assert torch.equal(got.isnan(), want.isnan()), (x, got, want)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), (x, got, want)


OPS = {"round": torch.round, "trunc": torch.trunc, "frac": torch.frac, "sign": torch.sign, "floor": torch.floor,
       "ceil": torch.ceil, "isnan": torch.isnan, "isinf": torch.isinf, "isfinite": torch.isfinite,
       "eq tiny": lambda h: h == 1e-50, "gt huge": lambda h: h > 1e39, "eq subnormal": lambda h: h == 1e-45,
       "neg": lambda h: 1.0 / -h, "add alpha": lambda h: torch.add(h, h * 3.0, alpha=-0.3333333)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(OPS))
def test_ops_against_cuda_eager_bit_for_bit(name, dtype):
    if dtype == torch.float16 and name == "add alpha":
        pytest.skip("fp16: eager rounds the products to fp16 one by one; fxfuse once (README)")
    f = OPS[name]
    model = _Fn(lambda x: f(x * 1.0)).cuda().eval()
    make = lambda: torch.cat([torch.tensor(SPECIAL), torch.randn(200) * 4, torch.tensor([1e13, -1e13, 1e10])]) \
        .to("cuda", dtype)  # noqa: E731
    opt = fxfuse.optimize(model, make(), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    _bits(opt, model, make())


@pytest.mark.parametrize("e", [-3, 4, -4])
def test_powers_cuda_computes_with_powf(e):
    """x ** -3 was 1 / (x * x * x): 0 where the product overflowed (fuzz34e); now within powf's ulp."""
    model = _Fn(lambda x: (x * 1.0) ** e).cuda().eval()
    make = lambda: torch.cat([torch.randn(200) * 4, torch.tensor([1e13, -1e13, 1e10, 3.3])]).cuda()  # noqa: E731
    opt = fxfuse.optimize(model, make(), strict=True)
    x = make()
    with torch.no_grad():
        got, want = opt(x), model(x)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=0)
    assert torch.equal(got == 0, want == 0) and torch.equal(got.signbit(), want.signbit())


class _Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scores = (q @ k.transpose(-2, -1)) / torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float32, device=x.device))
        return torch.softmax(scores * torch.tensor(0.5, device=x.device), -1)


class _WritesItsOwn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(x)
        h[:, :4] = torch.tanh(h[:, :4])       # a write into a tensor forward() made
        return torch.relu(h) * 2


class _WritesItsInput(nn.Module):
    def forward(self, x):
        x[:, :4] = 0.0
        return torch.relu(x) * 2


@pytest.mark.parametrize("case", ["literal", "own", "input"])
def test_cuda_graph_is_captured_unless_an_input_is_written(case):
    """A number made a tensor in forward() and a write into a tensor forward() made itself kept
    the model out of its CUDA graph (fuzz34b); a write into the caller's input still does."""
    torch.manual_seed(0)
    model = {"literal": _Scores, "own": _WritesItsOwn, "input": _WritesItsInput}[case]().cuda().eval()
    shape = (3, 7, 32) if case == "literal" else (5, 32)
    opt = fxfuse.optimize(model, torch.randn(*shape, device="cuda"), strict=True)
    note = next(iter(opt._specializations.values())).cuda_graph_note
    assert note.startswith("off") == (case == "input"), note
    for _ in range(3):
        x = torch.randn(*shape, device="cuda")
        mine, theirs = x.clone(), x.clone()
        with torch.no_grad():
            torch.testing.assert_close(opt(mine), model(theirs))
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", ["exp2", "log2"])
def test_exp2_and_log2_keep_subnormals_on_the_gpu(name):
    f = {"exp2": torch.exp2, "log2": torch.log2}[name]
    model = _Fn(lambda x: f(x * 1.0)).cuda().eval()
    values = [-140.0, -130.0, -149.0, 1e-40, 1e-45, 3e-39, 0.0, -0.0, 5.5, 127.9, float("inf"), -1.0]
    make = lambda: torch.cat([torch.tensor(values), torch.rand(100) * 20]).cuda()  # noqa: E731
    opt = fxfuse.optimize(model, make(), strict=True)
    x = make()
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=0, equal_nan=True)
