"""Stop 36: fixes from the fuzz36 helper round and the findings left open in stop 35."""
import pytest
import torch
from torch import nn

import fxfuse


def _check(model, *inputs, kernels=None, exact=False):
    opt = fxfuse.optimize(model, inputs, strict=True, verify=False)
    for call in range(2):
        if call:
            inputs = tuple(torch.randn_like(x) if x.is_floating_point() else x for x in inputs)
        got, want = opt(*inputs), model(*inputs)
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want)
    if kernels is not None:
        assert fxfuse.stats(opt)["fused_kernels"] == kernels
    return opt


class TransposeSpellings(nn.Module):
    """`.t()`, `.T`, `.mT` and torch.t between pointwise ops split the chain (stop 35's note)."""
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x, b):
        y = torch.relu(x)
        y = {"t": lambda v: v.t(), "T": lambda v: v.T, "mT": lambda v: v.mT,
             "torch.t": torch.t, "transpose": lambda v: v.transpose(0, 1)}[self.spelling](y)
        return (y * 2 + b).sigmoid()


@pytest.mark.parametrize("spelling", ["t", "T", "mT", "torch.t", "transpose"])
def test_transpose_spellings_do_not_split_a_chain(spelling):
    torch.manual_seed(0)
    _check(TransposeSpellings(spelling).eval(), torch.randn(5, 7), torch.randn(7, 5), kernels=1)


class ExpandThenPointwise(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x, b):
        y = torch.tanh(x) * 3
        if self.spelling == "expand":
            y = y.expand(b.shape[0], -1, -1)
        elif self.spelling == "expand_as":
            y = y.expand_as(b)
        else:
            y = torch.broadcast_to(y, b.shape)
        return torch.relu(y + b) - 1


@pytest.mark.parametrize("spelling", ["expand", "expand_as", "broadcast_to"])
def test_an_expand_read_by_pointwise_ops_is_their_broadcast(spelling):
    torch.manual_seed(0)
    _check(ExpandThenPointwise(spelling).eval(), torch.randn(1, 5, 6), torch.randn(3, 5, 6), kernels=1)


class ExpandTransposedAdd(nn.Module):
    def forward(self, x, b):
        z = torch.relu(x).t() * 2 + 1
        return (z.expand(3, 5, 4) + b).sigmoid().mT.exp()


def test_expand_and_transposes_together_make_one_kernel():
    torch.manual_seed(0)
    _check(ExpandTransposedAdd().eval(), torch.randn(4, 5), torch.randn(3, 5, 4), kernels=1)


class ZeroDimExpand(nn.Module):
    """A 0-dim tensor promotes as a number; expanded, as a tensor: fp32 + fp16 gives fp32 only expanded."""
    def forward(self, s, h):
        return (torch.exp(s).expand(h.shape) + h) * 2


def test_an_expanded_zero_dim_tensor_keeps_its_dtype_promotion():
    torch.manual_seed(0)
    s, h = torch.randn(()), torch.randn(4, 3).half()
    opt = _check(ZeroDimExpand().eval(), s, h)
    assert opt(s, h).dtype == torch.float32


class ExpandReadByUnaryOp(nn.Module):
    def forward(self, x):
        return torch.exp(torch.relu(x).expand(4, 3, 5)) + 1


def test_an_expand_read_by_a_unary_op_stays_as_written():
    torch.manual_seed(0)
    _check(ExpandReadByUnaryOp().eval(), torch.randn(3, 5))


def _ulps(got, truth):
    t = truth.float().abs()
    step = (torch.nextafter(t, torch.tensor(float("inf"))) - t).double()
    return ((got.double() - truth).abs() / step).max().item()


class Pointwise(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x * 1.0)


@pytest.mark.parametrize("fn", [torch.expm1, nn.functional.elu, torch.tanh, nn.functional.mish,
                                lambda t: nn.functional.celu(t, 0.7)], ids=["expm1", "elu", "tanh", "mish", "celu"])
def test_expm1_and_tanh_stay_within_a_few_ulp(fn):
    """fuzz36d: exp(x) - 1 from |x| = 0.1 and (1 - e) / (1 + e) from 0.0625 cancelled: 18 and 7.5 ulp."""
    x = torch.cat([torch.linspace(-1, 1, 2001), torch.linspace(-10, 10, 2001)])
    opt = fxfuse.optimize(Pointwise(fn).eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert _ulps(opt(x), fn(x.double())) < 6


@pytest.mark.parametrize("dtype,exponent", [(torch.float16, 0.5001), (torch.float16, -0.5001),
                                            (torch.float32, 0.50000000001)])
def test_an_exponent_that_only_rounds_to_a_half_is_no_square_root(dtype, exponent):
    """fuzz36d: eager takes sqrt / rsqrt only for a written +-0.5: (-0.0) ** 0.5001 is +0.0, (-inf) ** it inf."""
    model = Pointwise(lambda t: t ** exponent).eval()
    opt = fxfuse.optimize(model, torch.rand(3, dtype=dtype) + 1, strict=True)
    x = torch.tensor([-0.0, float("-inf"), 4.0, 0.3], dtype=dtype)
    got, want = opt(x), model(x)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


def test_hardswish_multiplies_by_a_sixth_as_cuda_eager():
    """fuzz36d: CUDA eager computes x * clamp(x + 3, 0, 6) * fp32(1/6); the kernel divided by 6."""
    x = torch.linspace(-3.5, 3.5, 4001)
    opt = fxfuse.optimize(Pointwise(nn.functional.hardswish).eval(), x, strict=True)
    sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32)
    assert torch.equal(opt(x), x * (x + 3).clamp(0, 6) * sixth)


class SigmoidChain(nn.Module):
    def forward(self, x):
        return (x.sigmoid() * 2 + 1).tanh()


def test_stats_describe_the_specialization_of_the_latest_call():
    """fuzz36e: stats() counted the first specialization's kernels only: an fp64 example (not
    fused) then fp32 calls said fused_kernels 0 next to kernel launches."""
    model = SigmoidChain().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8, dtype=torch.float64))
    assert fxfuse.stats(opt)["fused_kernels"] == 0
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["specializations"] == 2
    opt(torch.randn(4, 8, dtype=torch.float64))
    assert fxfuse.stats(opt)["fused_kernels"] == 0


def test_fuse_false_means_no_generated_kernel_and_explain_says_so():
    """fuzz36e: with fuse=False explain() said "bias fused into the pointwise kernel" and "not
    one of the pointwise ops fxfuse fuses"; gemm/fused_mlp='force' were dropped in silence while
    strassen='force' still built kernels."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(4, 8)
    for forced in ("gemm", "fused_mlp", "strassen", "tf32x3"):
        with pytest.raises(fxfuse.OptionError, match=f"fuse=False .* {forced}='force'"):
            fxfuse.optimize(model, x, fuse=False, **{forced: "force"})
    opt = fxfuse.optimize(model, x, fuse=False, strassen="auto", strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["fused_kernels"] == 0 and fxfuse.stats(opt)["library_calls"] == 4   # 2 GEMMs with bias
    text = fxfuse.explain(opt)
    assert "bias fused into" not in text and "not one of the pointwise ops" not in text
    assert "not fused: fuse=False" in text


class ReturnsSizes(nn.Module):
    def forward(self, x):
        n = x.shape[0]
        return x.relu() * 2, x.shape[1:], torch.Size((n, 4)), x.shape, x.size(-1)


def test_sizes_returned_next_to_a_tensor_stay_sizes():
    """fuzz36e: `x.shape[1:]` came back as a tuple; the output check refused the model."""
    model = ReturnsSizes().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8, 3), strict=True)
    x = torch.randn(4, 8, 3)
    got, want = opt(x), model(x)
    assert [type(v) for v in got] == [type(v) for v in want] and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, want))
    assert fxfuse.stats(opt)["fused_kernels"] == 1


class Scaled(nn.Module):
    def forward(self, x, scale=1.0, n=2):
        return (x * scale).sigmoid().reshape(n, -1)


def test_a_numpy_scalar_argument_is_refused_with_the_way_out():
    """fuzz36e: np.float32 / np.int64 arguments were refused with "example argument 1 ... a int64".
    Taking them as Python numbers (tried this stop) returned Python floats where eager returned numpy
    scalars, changed complex ones' dtypes and crashed on the export path (review36b): refused,
    saying how to pass them."""
    import numpy as np
    model = Scaled().eval()
    with pytest.warns(fxfuse.FxfuseWarning, match=r"argument 1 is \(or holds\) a numpy.float32 scalar.*float\(v\)"):
        opt = fxfuse.optimize(model, (torch.randn(4, 6), np.float32(0.3), 4))
    assert opt is model
    opt = fxfuse.optimize(model, (torch.randn(4, 6), 0.3, 4))
    with pytest.warns(fxfuse.FxfuseWarning, match=r"argument 2 is \(or holds\) a numpy.int64 scalar"):
        x = torch.randn(4, 6)
        torch.testing.assert_close(opt(x, 0.3, np.int64(4)), model(x, 0.3, np.int64(4)))


class HyperVmap(nn.Module):
    def __init__(self):
        super().__init__()
        self.hyper = nn.Linear(3, 4 * 5 + 5)

    def forward(self, x, z):
        params = self.hyper(z)
        w, b = params[:, :20].reshape(-1, 5, 4), params[:, 20:]
        return torch.vmap(nn.functional.linear)(x, w, b).relu()


def test_vmap_in_forward_is_named_in_the_fallback_warning():
    """fuzz36c: the warning said to check the example's shapes and dtypes."""
    model, x, z = HyperVmap().eval(), torch.randn(2, 7, 4), torch.randn(2, 3)
    with pytest.warns(fxfuse.FxfuseWarning, match="torch.vmap") as record:
        opt = fxfuse.optimize(model, (x, z))
    assert len(record) == 1 and opt is model


class ThroughExport(nn.Module):
    """forward(*args): fxfuse traces it with torch.export, which records aten spellings."""
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


EXPORT_SPELLINGS = {
    "T": (lambda x, y: (x * 2).T + y, (4, 6), (6, 4)),
    "mT": (lambda x, y: (x * 2).mT + y, (3, 4, 6), (3, 6, 4)),
    "swapaxes": (lambda x, y: (x * 2).swapaxes(1, 2) + y, (3, 4, 6), (3, 6, 4)),
    "movedim": (lambda x, y: (x * 2).movedim(2, 1) + y, (3, 4, 6), (3, 6, 4)),
    "expand_as": (lambda x, y: (y * 2).expand_as(x) + x, (3, 4, 6), (4, 6)),
    "broadcast_to": (lambda x, y: (y * 2).broadcast_to(3, 4, 6) + x, (3, 4, 6), (4, 6)),
    "two layout ops": (lambda x, y: (x * 2).transpose(0, 1).permute(2, 1, 0) + y, (2, 4, 6), (6, 2, 4)),
}


@pytest.mark.parametrize("name", sorted(EXPORT_SPELLINGS))
def test_layout_ops_in_exports_spellings_and_in_a_row_do_not_split_a_chain(name):
    """review36: aten.numpy_T / mT / swapaxes / movedim / expand_as / broadcast_to (torch.export's
    spellings) and two layout ops in a row split the chain into 2 kernels."""
    fn, a, b = EXPORT_SPELLINGS[name]
    torch.manual_seed(0)
    _check(ThroughExport(fn).eval(), torch.randn(*a), torch.randn(*b), kernels=1)


SIGNED_ZERO_OPS = {"maximum": (torch.maximum, ["+", "+", "+", "-"]), "minimum": (torch.minimum, ["-", "-", "+", "-"]),
                   "relu": (lambda x, y: torch.relu(x), ["+", "+", "+", "+"]),
                   "clamp_min_0": (lambda x, y: torch.clamp(x, min=0.0), ["+", "+", "+", "+"]),
                   "clamp_tensor_max": (lambda x, y: torch.clamp(x, max=y), ["-", "-", "+", "-"])}


@pytest.mark.parametrize("name", sorted(SIGNED_ZERO_OPS))
def test_signed_zeros_follow_cuda_eager(name):
    """maximum(+0, -0) was -0 (stop 35's note). CUDA eager (H100, torch 2.11: .scratch probe in
    stop 36) orders -0 < +0: maximum/clamp-from-below give +0 on a tie of zeros, minimum -0, and
    relu(-0) is +0; CPU eager returns its first operand instead. The kernels follow CUDA."""
    fn, signs = SIGNED_ZERO_OPS[name]
    model = Pointwise(lambda t: fn(t[0], t[1])).eval()
    opt = fxfuse.optimize(model, torch.randn(2, 4), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    got = opt(torch.tensor([[0.0, -0.0, 0.0, -0.0], [-0.0, 0.0, 0.0, -0.0]]))
    assert ["-" if s else "+" for s in got.signbit().tolist()] == signs


class ConstantSizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.shape = torch.Size([2, 12])

    def forward(self, x):
        y = (x.relu() * 2).view(self.shape).reshape(torch.Size([4, 6]))
        return y + 1, torch.Size([3, 4])


def test_a_constant_size_returned_under_symbolic_trace_stays_a_size():
    """review36: torch.fx stores a Size constant as a tuple: the output check refused the model."""
    model = ConstantSizes().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6), strict=True)
    x = torch.randn(4, 6)
    got, want = opt(x), model(x)
    assert type(got[1]) is torch.Size and got[1] == want[1] and torch.equal(got[0], want[0])
    assert fxfuse.stats(opt)["fused_kernels"] == 1


class Float64Scale(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.qkv, self.d = nn.Linear(d, 3 * d), d

    def forward(self, x, k):
        import numpy as np
        q, kk, v = self.qkv(x).chunk(3, -1)
        return nn.functional.scaled_dot_product_attention(q, kk, v, scale=1 / np.sqrt(self.d)) + torch.remainder(x, k)


def test_numpy_float64_constants_reach_the_graph_as_floats():
    """review36c: np.float64 is a float, and its repr (numpy 2) in the generated code raised NameError."""
    import numpy as np
    model = Float64Scale().eval()
    opt = fxfuse.optimize(model, (torch.randn(2, 3, 8), np.float64(0.7)), strict=True)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, np.float64(0.7)), model(x, np.float64(0.7)))


class ReturnsNumpyFloat(nn.Module):
    def __init__(self, exported):
        super().__init__()
        self.exported = exported

    def forward(self, x):
        import numpy as np
        n = int(x.shape[0]) if self.exported else 3   # int() of a size: symbolic_trace fails, torch.export runs
        return x * n, np.float64(0.5)


@pytest.mark.parametrize("exported", [False, True])
def test_a_returned_numpy_float_is_refused_not_turned_into_a_float(exported):
    """review36d: under torch.export its repr broke the generated code (NameError, an internal
    error); recorded as a Python number it would come back as a float (1 / 0 raises)."""
    model = ReturnsNumpyFloat(exported).eval()
    with pytest.warns(fxfuse.FxfuseWarning, match="returns a numpy float64|is float64 np.float64") as record:
        opt = fxfuse.optimize(model, torch.randn(3))
    assert len(record) == 1 and opt is model
