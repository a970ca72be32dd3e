"""Fuzzing, fourth round (CPU): unseen architectures and spellings. Each test is a finding
that gave a wrong answer, a misleading warning or a missed kernel before its fix."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402


class OwnFusedName(nn.Module):
    """The model's own submodule is called fused_0, the name fuse_pointwise gives its first kernel."""

    def __init__(self):
        super().__init__()
        self.fused_0 = nn.Linear(6, 6)
        self.fused_1 = nn.GRU(6, 6, batch_first=True)

    def forward(self, x):
        y, _ = self.fused_1(self.fused_0(torch.relu(x * 2)))
        return torch.tanh(y) + 1


def test_a_submodule_named_like_a_kernel_keeps_its_name():
    """Fuzz: the first fused kernel replaced the model's own `fused_0` (wrong shape with
    verify=False, an internal error for a Linear)."""
    model = OwnFusedName().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 3, 6), verify=False)
    assert isinstance(opt, fxfuse.OptimizedModule)
    with torch.no_grad():
        x = torch.randn(4, 3, 6)
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] >= 2


class CompareWithNumber(nn.Module):
    def __init__(self, number, op):
        super().__init__()
        self.number, self.op = number, op

    def forward(self, x):
        return self.op(x, self.number).float() * 2 + x.float().sigmoid()


@pytest.mark.parametrize("dtype,number,op", [
    (torch.uint8, 300, torch.eq), (torch.uint8, -1, torch.gt), (torch.int8, 200, torch.lt),
    (torch.int16, 40000, torch.ge)])
def test_comparing_a_narrow_integer_with_a_number_out_of_its_range(dtype, number, op):
    """Fuzz: eager converts the number to the tensor's dtype first (uint8 == 300 compares with
    44); the kernel compared unwrapped: a wrong answer on inputs the example did not show."""
    model = CompareWithNumber(number, op).eval()
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 120)
    opt = fxfuse.optimize(model, torch.randint(lo, hi, (4, 8), dtype=dtype), strict=True)
    with torch.no_grad():
        x = torch.arange(lo, lo + 256, dtype=torch.int32).clamp(max=info.max).to(dtype).view(8, 32)
        torch.testing.assert_close(opt(x), model(x))
        assert fxfuse.stats(opt)["fused_kernels"] >= 1     # the rest still fuses
    assert "outside the torch." in " ".join(str(fxfuse.explain(opt)).split())


class StandardizedConv(nn.Conv2d):
    """timm's StdConv2d: a Conv2d subclass whose forward standardizes its weight."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)


class ShiftedBatchNorm(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) + 1


@pytest.mark.parametrize("layer", [
    lambda: nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 1)),
    lambda: StandardizedConv(3, 4, 3, padding=1),
    lambda: nn.Sequential(nn.Conv2d(3, 4, 1), ShiftedBatchNorm(4))])
def test_subclasses_of_conv_and_batchnorm_keep_their_forward(layer):
    """Fuzz: a weight_norm Conv (a parametrized subclass) matched isinstance(Conv2d) and became
    F.conv2d on `0.weight`: a fallback with two misleading warnings; a subclass overriding
    forward would have lost it."""
    torch.manual_seed(0)
    model = nn.Sequential(layer(), nn.ReLU()).eval()
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, torch.randn(2, 3, 5, 5), strict=True)
    assert not [w for w in caught if "fxfuse" in str(w.message) or "get_attr" in str(w.message)]
    with torch.no_grad():
        x = torch.randn(3, 3, 5, 5)
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


class GRUCellLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 15), nn.Linear(5, 15)

    def forward(self, x, h):
        xr, xz, xn = self.a(x).chunk(3, -1)
        hr, hz, hn = self.b(h).chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        return (1 - z) * torch.tanh(xn + r * hn) + z * h


def test_batch_one_rows_of_a_padded_strassen_output_run_the_kernel():
    """Fuzz: at batch 1 a kernel input had stride (16, 1) (Strassen's padded output) where the
    meta said (15, 1); the stride of a size-1 dimension is never used, but the mismatch sent
    every call to the torch reference."""
    model = GRUCellLike().eval()
    args = (torch.randn(1, 4), torch.randn(1, 5))
    opt = fxfuse.optimize(model, args, strassen="force", strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))
    assert fxfuse.stats(opt)["reference_fallbacks"] == 0 and fxfuse.stats(opt)["fused_kernels"] >= 1
    spec = next(iter(opt._specializations.values()))
    assert any(getattr(m, "origin", "") == "strassen" for m in spec.gm.modules())   # Strassen's kernels ran


class ReturnsShape(nn.Module):
    def forward(self, x):
        h = torch.relu(x * 2)
        return h, h.shape, x.size(), h.shape[0] + 1


def test_a_returned_torch_size_stays_a_size():
    """Fuzz: returning h.shape was refused with a pytree dump (the Size was folded into a tuple)."""
    model = ReturnsShape().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 3), strict=True)
    with torch.no_grad():
        x = torch.randn(2, 3)
        got, want = opt(x), model(x)
    assert type(got[1]) is torch.Size and got[1:] == want[1:]
    torch.testing.assert_close(got[0], want[0])
    assert fxfuse.stats(opt)["fused_kernels"] == 1


def test_a_model_holding_an_optimized_module_is_optimized_through_its_original():
    """Fuzz: tracing ran the inner OptimizedModule's guards on proxies (a warning about a Proxy
    input) and its call counters counted as the model's state (a second, false warning)."""
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    inner = fxfuse.optimize(nn.Sequential(nn.Linear(6, 8), nn.GELU()).eval(), x, strict=True)
    outer = nn.Sequential(inner, nn.Linear(8, 4), nn.ReLU()).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(outer, x, strict=True)
    assert not caught
    with torch.no_grad():
        y = torch.randn(3, 6)
        torch.testing.assert_close(opt(y), outer(y))
        torch.testing.assert_close(inner(y), inner.original(y))   # the inner one still works
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


class CloneThenInPlace(nn.Module):
    def forward(self, x):
        h = x.clone()
        h.relu_()
        g = torch.clone(x)
        g.sigmoid_()
        return h * 2 + g


class AtenSpellings(nn.Module):
    def forward(self, x):
        return torch.ops.aten.relu(x) * 2 + torch.ops.aten.clip.default(x, -0.5, 0.5)


@pytest.mark.parametrize("model_class", [CloneThenInPlace, AtenSpellings])
def test_more_spellings_fuse(model_class):
    """Fuzz: `x.clone().relu_()` was kept unfused ("in-place op on a view"), and the aten packet
    torch.ops.aten.relu and aten.clip ran as library calls."""
    model = model_class().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 4), strict=True)
    with torch.no_grad():
        x = torch.randn(5, 4)
        before = x.clone()
        torch.testing.assert_close(opt(x), model(before.clone()))
        torch.testing.assert_close(x, before)
    spec = next(iter(opt._specializations.values()))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert not [n for n in spec.gm.graph.nodes if "relu" in str(n.target) or "clip" in str(n.target)]


class LinearSpellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(12, 7) / 3), nn.Parameter(torch.randn(12))
        self.w2, self.b2 = nn.Parameter(torch.randn(12, 12) / 3), nn.Parameter(torch.randn(12))
        self.w3 = nn.Parameter(torch.randn(5, 12) / 3)

    def forward(self, x):
        h = (x @ self.w1.T + self.b1).relu()
        h = torch.addmm(self.b2, h, self.w2.t()).sigmoid()
        h = torch.matmul(h, self.w2.transpose(0, 1)) + self.b2
        return h.mm(torch.t(self.w3)).tanh()


@pytest.mark.parametrize("options", [{}, {"gemm": "force"}, {"fused_mlp": "force"}, {"strassen": "force"}])
def test_matmul_spellings_of_a_linear_are_linears(options):
    """Fuzz: `x @ W.T + b`, `torch.addmm(b, x, W.t())`, `torch.matmul(x, W.transpose(0, 1))` and
    `x.mm(torch.t(W))` stayed library matmuls: gemm="force" and fused_mlp="force" did not apply."""
    model = LinearSpellings().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 7), strict=True, **options)
    with torch.no_grad():
        x = torch.randn(6, 7)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    text = str(fxfuse.explain(opt))
    assert "linear_3" in text            # four Linear layers in the cost model's table
    spec = next(iter(opt._specializations.values()))
    names = [str(n.target) for n in spec.gm.graph.nodes]
    if options.get("fused_mlp") == "force":
        assert fxfuse.stats(opt)["fused_kernels"] == 1 and not any("mm" in t for t in names)
    if options.get("gemm") == "force":
        assert not any(t in ("addmm", "mm", "matmul") or "linear" in t for t in names)


class LinearReluResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(17, 17)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


@pytest.mark.parametrize("options", [{"cuda_graphs": False}, {"gemm": "force"}, {"fused_mlp": "force"}])
def test_inputs_with_a_pending_negation_are_read_negated(options):
    """Fuzz: a tensor whose negation is a pending flag (torch._neg_view, z.conj().imag) reached
    the generated kernels as its raw bytes: every value of the wrong sign."""
    model = LinearReluResidual().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 17), strict=True, **options)
    with torch.no_grad():
        x = torch._neg_view(torch.randn(3, 17))
        assert x.is_neg()
        launches = fxfuse.stats(opt)["kernel_launches"]
        torch.testing.assert_close(opt(x), model(x))
        stats = fxfuse.stats(opt)      # the generated kernel read the resolved input
        assert stats["kernel_launches"] > launches and stats["reference_fallbacks"] == 0
        # strided (stride 2): its resolved copy is contiguous, so this one may take the reference
        z = torch.randn(3, 17, dtype=torch.cfloat).conj().imag
        torch.testing.assert_close(opt(z), model(z))


def test_a_nan_number_argument_falls_back_with_a_short_reason():
    """Fuzz: a NaN float argument failed its own value check inside the traced graph, and the
    warning was a multi-line torch.fx assertion dump."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 4)

        def forward(self, x, scale=1.0):
            return self.lin(x) * scale

    opt = fxfuse.optimize(Scaled().eval(), torch.randn(3, 5))
    assert isinstance(opt, fxfuse.OptimizedModule)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            assert opt(torch.randn(3, 5), float("nan")).isnan().all()
    assert len(caught) == 1 and "NaN never equals itself" in str(caught[0].message)
    assert "\n" not in str(caught[0].message)


class FailsForLargeBatches(nn.Module):
    def forward(self, x):
        if x.shape[0] > 4:
            if x.sum() > 0:           # data-dependent: no tracer captures it
                return x * 2
            return x - 1
        if x.shape[0] > 1:
            return torch.relu(x) + 1
        return x


def test_failed_builds_of_many_shapes_warn_once():
    """Fuzz: each new shape whose build failed for the same reason warned again (35 warnings for
    35 shapes), and past 32 failed signatures every call ran the failing build again."""
    opt = fxfuse.optimize(FailsForLargeBatches().eval(), torch.randn(3, 4))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in range(5, 45):
            x = torch.randn(n, 4)
            torch.testing.assert_close(opt(x), FailsForLargeBatches()(x))
    assert len(caught) <= 2, [str(w.message)[:100] for w in caught]   # the cause, then the limit


class KeywordDefaults(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y=None, scale=2.0):
        h = self.lin(x)
        if y is not None:
            h = h + y
        return nn.functional.silu(h * scale)


def test_keyword_calls_at_their_defaults_share_the_positional_specialization():
    """Fuzz: opt(x, y=None) and opt(x, scale=2.0) were guarded as (x, None, 2.0) and built a
    specialization each (on models that need torch.export they always ran the original)."""
    model = KeywordDefaults().eval()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        for kwargs in ({"y": None}, {"scale": 2.0}, {"y": None, "scale": 2.0}):
            torch.testing.assert_close(opt(x, **kwargs), model(x, **kwargs))
        assert fxfuse.stats(opt)["specializations"] == 1
        torch.testing.assert_close(opt(x, y), model(x, y))
        torch.testing.assert_close(opt(x, y=y), model(x, y=y))
        assert fxfuse.stats(opt)["specializations"] == 2


class SignedZeros(nn.Module):
    def forward(self, x):
        return 1.0 / torch.where(x > 0, x, -0.0) + (x * 0 + x * -0.0)


def test_minus_zero_constants_keep_their_sign_in_a_kernel():
    """Fuzz: the kernel builder merged the constant -0.0 with the 0 of `x > 0` (they compare and
    hash equal): 1 / where(x > 0, x, -0.0) gave +inf where eager gives -inf."""
    model = SignedZeros().eval()
    opt = fxfuse.optimize(model, torch.rand(2, 4) + 0.5, strict=True)
    with torch.no_grad():
        x = torch.tensor([[1.5, -2.0, 0.25, -0.5]])
        got, want = opt(x), model(x)
    torch.testing.assert_close(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert fxfuse.stats(opt)["fused_kernels"] == 1


def test_half_add_with_alpha_is_not_split():
    """Fuzz (seen on the H100): fp16 torch.add(x, y, alpha=1000) became x + fp16(y * 1000), which
    overflows where CUDA's add (x + alpha * y in fp32, one rounding) does not. Since stop 44 the
    kernel computes it as one multiply-add in fp32 (add_scaled), as CUDA does."""
    class AddAlpha(nn.Module):
        def forward(self, x, y):
            return torch.add(x, y, alpha=1000).relu() + torch.sub(x, y, alpha=3)

    model = AddAlpha().eval()
    args = (torch.rand(2, 4).half(), torch.rand(2, 4).half())
    opt = fxfuse.optimize(model, args, strict=True)
    spec = next(iter(opt._specializations.values()))
    assert sum(1 for n in spec.gm.graph.nodes if n.target in (torch.add, torch.sub)) == 0
    with torch.no_grad():
        x, y = torch.rand(2, 4).half(), torch.rand(2, 4).half()
        torch.testing.assert_close(opt(x, y), model(x, y))   # (the overflow: test_gpu_fuzz44, against CUDA;
    assert fxfuse.stats(opt)["fused_kernels"] == 1   # CPU eager's scalar loop rounds alpha * y to fp16 first)
