"""Differential tests: fxfuse.optimize against eager on a zoo of small models, run through the
generated kernels under the Triton interpreter (fresh random inputs, fp32 tolerance ~1e-5)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from conftest import NO_MLP, assert_fast_path, assert_matches_eager

ACTIVATIONS = [nn.ReLU(), nn.ReLU(inplace=True), nn.GELU(), nn.GELU("tanh"), nn.SiLU(), nn.Sigmoid(), nn.Tanh(),
               nn.LeakyReLU(0.1), nn.ELU(0.7), nn.Softplus(beta=2.0, threshold=3.0), nn.Hardtanh(-0.5, 2.0),
               nn.ReLU6(), nn.Mish(), nn.SELU(), nn.Hardsigmoid(), nn.Hardswish()]
ACT_IDS = ["relu", "relu-inplace", "gelu", "gelu-tanh", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "softplus",
           "hardtanh", "relu6", "mish", "selu", "hardsigmoid", "hardswish"]
MODES = [pytest.param({}, id="default"), pytest.param(NO_MLP, id="no-fused-mlp")]


def optimize(model, *example, **options):
    return fxfuse.optimize(model, example if len(example) > 1 else example[0], strict=True, **options)


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
def test_mlp_every_activation(act, options):
    model = nn.Sequential(nn.Linear(13, 37), act, nn.Linear(37, 7), act).eval()
    x = torch.randn(5, 13) * 3
    opt = optimize(model, x, **options)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


class Residual(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


def test_residual_is_one_matmul_and_one_kernel():
    model = Residual(13).eval()
    x = torch.randn(6, 13)
    opt = optimize(model, x, **NO_MLP)
    s = fxfuse.stats(opt)
    assert (s["library_calls"], s["fused_kernels"]) == (1, 1), s
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


@pytest.mark.parametrize("options", MODES)
def test_deep_residual_mlp(options):
    model = nn.Sequential(*[Residual(16) for _ in range(3)], nn.Linear(16, 3)).eval()
    x = torch.randn(4, 16)
    opt = optimize(model, x, **options)
    if options.get("fused_mlp") == "off":
        s = fxfuse.stats(opt)
        assert (s["library_calls"], s["fused_kernels"]) == (4, 3), s   # 3 bias+gelu+residual; the last
        #                                                                bias in its library call (stop 35)
    assert_matches_eager(opt, model, x)


class FFN(nn.Module):
    """Pre-norm transformer FFN block: x + fc2(dropout(gelu(fc1(ln(x)))))."""

    def __init__(self, d=16, hidden=40):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(self.drop(F.gelu(self.fc1(self.ln(x))))))


@pytest.mark.parametrize("options", MODES)
def test_transformer_ffn_block(options):
    model = FFN().eval()
    x = torch.randn(2, 5, 16)
    opt = optimize(model, x, **options)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


def test_conv_bn_relu_cnn():
    def block(cin, cout):
        bn = nn.BatchNorm2d(cout)
        with torch.no_grad():
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), bn, nn.ReLU(inplace=True))

    model = nn.Sequential(block(3, 8), block(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
    x = torch.randn(2, 3, 9, 9)
    opt = optimize(model, x)
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] >= 2, s
    assert_matches_eager(opt, model, x, rtol=1e-5, atol=1e-5)
    assert_fast_path(opt)


class MnistNet(nn.Module):
    """The classic PyTorch MNIST example (fc1 is 9216 -> 128 for 1x28x28 inputs)."""

    def __init__(self, size=28):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * ((size - 4) // 2) ** 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


@pytest.mark.parametrize("batch,size", [(1, 12), (3, 12), (2, 28)])
def test_mnist_cnn(batch, size):
    model = MnistNet(size).eval()
    x = torch.randn(batch, 1, size, size)
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)
    text = fxfuse.explain(opt, kernels=True)
    assert "MnistNet" in text and "@triton.jit" in text


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("batch", [1, 7, 37])
def test_prime_sizes_mlp(batch, options):
    model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 7)).eval()
    x = torch.randn(batch, 7)
    opt = optimize(model, x, **options)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


class PointwiseChain(nn.Module):
    def forward(self, x):
        return torch.tanh(x * 2 + 1).sigmoid() * x - 0.5 + (F.gelu(x).abs() + 1).sqrt()  # sqrt away from 0


def test_large_irregular_pointwise_chain():
    model = PointwiseChain().eval()
    x = torch.randn(1823, 781)
    opt = optimize(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


@pytest.mark.parametrize("shape", [(1,), (1, 1), (7,), (13, 1), (1, 37), (3, 1, 5), (2, 3, 5, 7)])
def test_pointwise_chain_small_shapes(shape):
    model = PointwiseChain().eval()
    x = torch.randn(*shape)
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(13, 6).t(),                  # transposed
    lambda: torch.randn(6, 26)[:, ::2],              # strided slice
    lambda: torch.randn(9, 13)[2:8],                 # offset slice (contiguous rows, storage offset)
    lambda: torch.randn(6, 20)[:, 3:16],             # row slice: padded rows
    lambda: torch.randn(1, 13).expand(6, 13),        # broadcast view (stride 0)
], ids=["transposed", "step-slice", "row-offset", "col-slice", "expanded"])
def test_non_contiguous_inputs(make):
    model = Residual(13).eval()
    x = make()
    assert x.shape == (6, 13)
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x)
    assert_matches_eager(opt, model, x, fresh=False)
    assert fxfuse.stats(opt)["specializations"] == 1


def test_non_contiguous_pointwise_only():
    model = PointwiseChain().eval()
    x = torch.randn(11, 7, 3).permute(2, 0, 1)
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(9, 9)

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h), torch.sigmoid(h) * 2, h


class DictOut(TupleOut):
    def forward(self, x):
        a, b, h = super().forward(x)
        return {"relu": a, "nested": (b, [h - 1]), "x": x}


@pytest.mark.parametrize("cls", [TupleOut, DictOut])
def test_tuple_and_dict_outputs(cls):
    model = cls().eval()
    x = torch.randn(4, 9)
    opt = optimize(model, x, **NO_MLP)
    out = assert_matches_eager(opt, model, x)
    with torch.no_grad():
        assert type(out) is type(model(x))
    assert_fast_path(opt)


@pytest.mark.parametrize("options", MODES)
def test_fp16_mlp(options):
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 8), nn.SiLU()).eval().half()
    x = torch.randn(5, 16).half()
    opt = optimize(model, x, **options)
    out = assert_matches_eager(opt, model, x, rtol=2e-3, atol=2e-3)
    assert out.dtype == torch.float16
    assert_fast_path(opt)


def test_fp16_pointwise_single_op_is_exact():
    model = nn.Sequential(nn.Sigmoid()).eval()
    x = torch.randn(7, 33).half()
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x, rtol=1e-3, atol=1e-3)
    assert_fast_path(opt)


class InfNan(nn.Module):
    def forward(self, x):
        a = torch.clamp(x, min=-math.inf, max=0.5)
        b = torch.where(x > 0, x, -math.inf)
        c = x * math.inf
        d = x + math.nan
        e = torch.maximum(x, x * 0 + math.nan)
        f = (x.relu() - math.inf).exp()                  # exp(-inf) == 0
        return a, b, c, d, e, f


def test_inf_nan_constants():
    model = InfNan().eval()
    x = torch.randn(5, 7)
    x[0, 0] = 0.0        # 0 * inf = nan
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x, equal_nan=True)
    assert_matches_eager(opt, model, x, fresh=False, equal_nan=True)
    assert_fast_path(opt)


def test_nan_propagates_through_relu_and_clamp():
    model = nn.Sequential(nn.ReLU(), nn.Hardtanh(), nn.ReLU6(), nn.LeakyReLU()).eval()
    x = torch.randn(4, 8)
    x[1, 2], x[3, 3], x[0, 0] = math.nan, math.inf, -math.inf
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x, fresh=False, equal_nan=True)


class ChannelBias(nn.Module):
    def __init__(self, c=6):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(c, 1, 1))
        self.scale = nn.Parameter(torch.randn(c))

    def forward(self, x):
        return torch.relu(x * self.scale.view(1, -1, 1, 1) + self.bias) - self.bias * 0.5


def test_per_channel_bias_on_nchw():
    model = ChannelBias().eval()
    x = torch.randn(2, 6, 5, 7)
    opt = optimize(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


class SizeArith(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 5 * 5, 6)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h = h.view(h.size(0), -1)
        h = self.fc(h) * (h.shape[1] ** -0.5)
        return h.reshape(x.shape[0], 2, h.size(-1) // 2).sigmoid()


def test_size_arithmetic():
    model = SizeArith().eval()
    x = torch.randn(3, 3, 7, 7)
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)
    gm = next(iter(opt._specializations.values())).gm
    assert not any(n.op == "call_method" and n.target == "size" for n in gm.graph.nodes)


class SoftmaxMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 12)

    def forward(self, x):
        h = F.softmax(self.fc(x) * 0.5, dim=-1)
        return h * 2 + 1 - h.mean(dim=-1, keepdim=True)


def test_reductions_stay_library_calls():
    model = SoftmaxMix().eval()
    x = torch.randn(3, 10)
    opt = optimize(model, x, **NO_MLP)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


def test_two_inputs_broadcast():
    class M(nn.Module):
        def forward(self, x, y):
            return torch.tanh(x + y) * y

    model = M().eval()
    x, y = torch.randn(4, 1, 7), torch.randn(3, 1)
    opt = optimize(model, x, y)
    out = assert_matches_eager(opt, model, x, y)
    assert out.shape == (4, 3, 7)
    assert_fast_path(opt)


class MixedDtypes(nn.Module):
    def forward(self, x, i):
        return (x > 0, (x * 2 > 1).float() + i.float(), torch.add(x, 2, alpha=3),
                torch.rsub(x, x * 3, alpha=2), x * torch.tensor(2.5), i.to(torch.float16) + 1)


def test_bool_int_and_constant_tensor_operands():
    model = MixedDtypes().eval()
    x, i = torch.randn(3, 5), torch.randint(-5, 5, (3, 5))
    opt = optimize(model, x, i)
    out = assert_matches_eager(opt, model, x, i)
    assert out[0].dtype == torch.bool and out[5].dtype == torch.float16
    assert_fast_path(opt)


def test_duplicate_and_passthrough_outputs():
    class M(nn.Module):
        def forward(self, x):
            y = x.relu()
            return y, y, x

    model = M().eval()
    x = torch.randn(3, 5)
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x)


class IntCompare(nn.Module):
    def forward(self, ids, x):
        return torch.where(ids > 16777216, x, -x), ids != 16777217


def test_integer_comparisons_are_exact():
    model = IntCompare().eval()
    x = torch.randn(8)
    opt = optimize(model, torch.arange(8), x)              # verify passes on small ids
    ids = torch.tensor([16777217, 16777216, 16777218, 3, -5, 16777217, 0, 1 << 40])
    with torch.no_grad():
        torch.testing.assert_close(opt(ids, x), model(ids, x), rtol=0, atol=0)
