"""Stop 38 on the GPU: calls on two CUDA streams, outputs that alias each other, and the stop's new
kernel ops (logical_xor, fp16 tanhshrink/softsign) against CUDA eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from test_fuzz38 import CustomOpWritesItsInput, ExclusiveOr, HalfComposites, InPlaceMaskOps

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


class Mlp(nn.Module):
    def __init__(self, width=512):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x):
        return self.layers(x) * 2 + 1


@pytest.mark.parametrize("gemm", ["off", "force"])
def test_calls_on_two_streams_each_get_their_own_answer(gemm):
    # the graph copies share static inputs, pools and handed-out outputs: calls on two streams at once
    # raced (review38); a switch of stream now waits for the other stream's work
    torch.manual_seed(0)
    model = Mlp().cuda().eval()
    xs = [torch.randn(64, 512, device="cuda") for _ in range(12)]
    opt = fxfuse.optimize(model, xs[0], strict=True, gemm=gemm)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    with torch.no_grad():
        for k, x in enumerate(xs):
            with torch.cuda.stream(streams[k % 2]):
                big = torch.randn(2048, 2048, device="cuda") @ torch.randn(2048, 2048, device="cuda")  # busy
                outs.append((opt(x), big))
        torch.cuda.synchronize()
        for x, (got, _) in zip(xs, outs):
            torch.testing.assert_close(got, model(x))


class TwoViews(nn.Module):
    def forward(self, x):
        y = torch.relu(x) * 2
        return y, y.view(-1), y[1]


def test_outputs_that_alias_each_other_still_do_once_outputs_are_cloned():
    # each output was cloned by itself: a write into one no longer showed in the other (review38)
    x = torch.randn(4, 8, device="cuda")
    model = TwoViews().eval()
    opt = fxfuse.optimize(model, x, strict=True)
    kept = [opt(torch.randn(4, 8, device="cuda")) for _ in range(8)]   # more than the handout slots
    with torch.no_grad():
        for y, flat, row in kept:
            y.add_(1)
            assert torch.equal(flat.view(4, 8), y) and torch.equal(row, y[1])
        z = torch.randn(4, 8, device="cuda")
        for got, want in zip(opt(z), model(z)):
            torch.testing.assert_close(got, want)


def test_new_ops_against_cuda_eager():
    a, b = torch.randn(3, 5, device="cuda"), torch.randn(5, device="cuda")
    a[0, 0], b[1] = 0.0, 0.5
    opt = fxfuse.optimize(ExclusiveOr().eval(), (a, b), strict=True)
    for got, want in zip(opt(a, b), ExclusiveOr()(a, b)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    x = torch.randn(64, 64, device="cuda").half()
    opt = fxfuse.optimize(HalfComposites().eval(), x, strict=True)
    with torch.no_grad():
        for got, want in zip(opt(x), HalfComposites()(x)):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)   # a tanh ulp may round otherwise
    model = InPlaceMaskOps().eval()
    a, b, given = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda"), \
        torch.rand(4, 8, device="cuda") > 0.5
    opt = fxfuse.optimize(model, (a, b, given.clone()), strict=True)
    given_eager = given.clone()
    with torch.no_grad():
        got, want = opt(a, b, given), model(a, b, given_eager)
    assert torch.equal(got[0], want[0]) and torch.equal(given, given_eager)


def test_a_custom_op_writing_its_input_writes_the_callers_tensor_on_cuda():
    # unseen as a write, the graph was captured and the op wrote the static input copy (review38)
    model = CustomOpWritesItsInput(second=False).eval()
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(8, device="cuda")
    opt = fxfuse.optimize(model, (x.clone(), y), strict=True)
    a = torch.randn(4, 8, device="cuda")
    a_eager = a.clone()
    with torch.no_grad():
        torch.testing.assert_close(opt(a, y), model(a_eager, y))
    torch.testing.assert_close(a, a_eager)
