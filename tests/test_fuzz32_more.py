"""Stop 32's fixes, part 2: spellings, layouts written by kernels, random streams, detach,
defaults, fp16 BatchNorm with in-place ops, and the review rounds' findings (review32b,
fuzz32j). Part 1 is tests/test_fuzz32.py."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from test_fuzz32 import _outputs  # noqa: E402


SPELLINGS = {
    "abs(h) builtin": lambda s, h: abs(h * 2) + 1,
    "h.square_()": lambda s, h: (h * 2).square_() + 1,
    "clamp(min=tensor)": lambda s, h: (h * 2).clamp(min=s.lo) + 1,
    "clamp_(min=tensor)": lambda s, h: (h * 2).clamp_(min=s.lo) + 1,
    "clamp_max(tensor)": lambda s, h: torch.clamp_max(h * 2, s.lo) + 1,
    "pow_(2)": lambda s, h: (h * 2).pow_(2) + 1,
    "masked_fill_": lambda s, h: (h * 2).masked_fill_(h > 0, 0.5) + 1,
    "relu6(inplace)": lambda s, h: F.relu6(h * 2, inplace=True) + 1,
}


@pytest.mark.parametrize("path", ["symbolic_trace", "export"])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_more_spellings_fuse_on_both_trace_paths(name, path):
    """fuzz32b: these stayed library calls, each splitting its pointwise chain in two."""
    class Sym(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("lo", torch.randn(32) - 0.5)

        def forward(self, x):
            return SPELLINGS[name](self, x)

    class Exported(Sym):   # int(size) stops symbolic_trace: torch.export's graph spells aten overloads
        def forward(self, x):
            return SPELLINGS[name](self, x) * int(x.shape[0])
    torch.manual_seed(0)
    model, x = (Sym if path == "symbolic_trace" else Exported)().eval(), torch.randn(5, 32)
    opt = fxfuse.optimize(model, x, strict=True, verify=False)
    stats, spec = fxfuse.stats(opt), next(iter(opt._specializations.values()))
    assert (stats["fused_kernels"], stats["library_calls"]) == (1, 0), fxfuse.explain(opt)
    assert ("export" in spec.gm.meta["fxfuse_trace"]["tracer"]) == (path == "export")
    fresh = torch.randn(5, 32)
    torch.testing.assert_close(_outputs(opt, (fresh,))[0], _outputs(model, (fresh,))[0])


def test_fp16_hardshrink_reads_lambd_in_fp16():
    """eager rounds lambd to the tensor's dtype (fp16(0.3) = 0.30005) before comparing: an input
    of exactly 0.30005 becomes 0 there, and was kept by the kernel."""
    model = nn.Sequential(nn.Hardshrink(0.3)).eval()
    x = torch.tensor([[0.300048828125, -0.300048828125, 0.2998046875, 0.5]], dtype=torch.float16).repeat(3, 1)
    opt = fxfuse.optimize(model, torch.randn(3, 4, dtype=torch.float16), strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert torch.equal(_outputs(opt, (x,))[0], _outputs(model, (x,))[0])


class MaskedTransposed(nn.Module):
    def forward(self, x):
        y = torch.relu(x.t())
        return (y.masked_fill(y > 1, 0.5) * 2 + 1).view(-1)


class NormTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return (torch.relu(self.bn(torch.sigmoid(x).t())) + 1).view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cls,kernels", [(MaskedTransposed, 1), (NormTransposed, 1)])   # stop 36: sigmoid moves past .t()
def test_eager_layout_is_written_by_the_fused_kernel_itself(cls, kernels, dtype):
    """review31 #4: the copy restoring eager's strides after masked_fill or BatchNorm over a
    transposed tensor was a kernel of its own, splitting the group; `.view()` needs that layout."""
    torch.manual_seed(0)
    model, x = cls().eval().to(dtype), torch.randn(6, 5, dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == kernels
    fresh = torch.randn(6, 5, dtype=dtype)
    torch.testing.assert_close(_outputs(opt, (fresh,))[0], _outputs(model, (fresh,))[0],
                               **({"rtol": 2e-3, "atol": 4e-3} if dtype == torch.float16 else {}))


def test_a_python_random_draw_in_forward_is_refused_and_no_stream_moves():
    """A random flip at test time (`if random.random() < 0.5`) was frozen into the graph as the
    trace's draw; and optimize() moved torch's and Python's streams (its forward runs)."""
    import random

    class Flip(nn.Module):
        def __init__(self, flips):
            super().__init__()
            self.lin, self.flips = nn.Linear(4, 4), flips

        def forward(self, x):
            if self.flips and random.random() < 0.5:
                x = x.flip(-1)
            return torch.relu(self.lin(x)) + torch.rand_like(x) * 0   # a torch draw, in the graph
    x = torch.randn(3, 4)
    for flips in (True, False):
        model = Flip(flips).eval()
        torch.manual_seed(0)
        random.seed(0)
        if flips:
            with pytest.warns(fxfuse.FxfuseWarning, match="draws from Python's random module"):
                assert fxfuse.optimize(model, x) is model
        else:
            assert fxfuse.optimize(model, x, verify=False) is not model
        drawn = torch.rand(3), random.random()
        torch.manual_seed(0)
        random.seed(0)
        assert torch.equal(drawn[0], torch.rand(3)) and drawn[1] == random.random()


def test_a_returned_detach_of_an_input_requires_no_grad_and_dead_debug_reads_go():
    class Debug(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)

        def forward(self, x):
            h = torch.relu(self.lin(x))
            print(h.max().item())        # a debug print: prints a Proxy once, at the trace
            return h * 2, x.detach()
    model, x = Debug().eval(), torch.randn(3, 5, requires_grad=True)
    opt = fxfuse.optimize(model, x.detach(), strict=True)
    report = fxfuse.explain(opt)
    assert ".item()" not in report and ".max()" not in report
    with torch.no_grad():
        y, same = opt(x)
    assert not same.requires_grad and torch.equal(same, x.detach())


def test_abs_of_a_size_stays_a_number_and_a_default_given_again_runs_the_graph():
    """review32: abs(x.size(0) - 5) became torch.abs(-2) (the model was refused); model(x, 1.0)
    with 1.0 the default went through the miss path on every call."""
    class Sized(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, alpha=1.0):
            return torch.relu(self.lin(x)) * abs(x.size(0) - 5) * alpha
    model, x = Sized().eval(), torch.randn(3, 4)
    opt = fxfuse.optimize(model, x, strict=True)
    torch.testing.assert_close(_outputs(opt, (x, 1.0))[0], _outputs(model, (x,))[0])
    runs = next(iter(opt._specializations.values())).calls
    _outputs(opt, (x, 1.0))
    assert next(iter(opt._specializations.values())).calls == runs + 1 and len(opt._trimmed) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_half_batchnorm_then_an_in_place_relu_and_residual_fuse(dtype):
    """fuzz32g: in fp16 BatchNorm is an fp32 multiply-add cast back to fp16; the cast was not
    known to allocate, so `ReLU(inplace=True)` and `out += identity` after it (ResNet's basic
    block) stayed library calls: 7 of them instead of 2."""
    class Basic(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.relu = nn.ReLU(inplace=True)
            for bn in (self.bn1, self.bn2):
                with torch.no_grad():
                    bn.running_mean.normal_()
                    bn.running_var.uniform_(0.5, 2)

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out += x
            return self.relu(out)
    torch.manual_seed(0)
    model, x = Basic().eval().to(dtype), torch.randn(2, 4, 5, 6, dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True, verify=False)
    assert fxfuse.stats(opt)["library_calls"] == 2 and fxfuse.stats(opt)["fused_kernels"] == 2
    fresh = torch.randn(2, 4, 5, 6, dtype=dtype)
    torch.testing.assert_close(_outputs(opt, (fresh,))[0], _outputs(model, (fresh,))[0],
                               **({"rtol": 4e-3, "atol": 4e-3} if dtype == torch.float16 else {}))


def test_an_as_layout_alone_stays_a_library_call():
    """A group of as_layout alone would be a copy kernel on every call; the library op copies
    only where the strides differ at run time (Strassen's padded suffix: 4 kernels, not 5)."""
    from fxfuse.demo import seed_network
    from fxfuse.ops import as_layout
    torch.manual_seed(0)
    model, x = seed_network(34, 3).eval(), torch.randn(30, 34)
    opt = fxfuse.optimize(model, x, strict=True, strassen="force", strassen_levels=2)
    spec = next(iter(opt._specializations.values()))
    assert fxfuse.stats(opt)["fused_kernels"] == 4 and any(n.target is as_layout for n in spec.gm.graph.nodes)
    torch.testing.assert_close(_outputs(opt, (x,))[0], _outputs(model, (x,))[0], rtol=1e-4, atol=1e-5)


def test_review32b_a_tensor_default_an_unused_max_norm_table_and_detach_in_place():
    """A default tensor passed explicitly was remembered by its shape (another tensor of that
    shape then ran the default's graph); an Embedding(max_norm) whose weight is only read was
    refused; `return x.detach_()` kept as a write cost the fusion of ops reading x."""
    class WithDefault(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.zeros(4))

        def forward(self, x, b=None):
            return torch.relu(x + (self.bias if b is None else b))
    model = WithDefault().eval()
    default = torch.zeros(4)
    WithDefault.forward.__defaults__ = (default,)
    try:
        opt = fxfuse.optimize(model, torch.randn(3, 4), strict=True)
        x = torch.randn(3, 4)
        for b in (default, torch.randn(4) * 100, torch.randn(4) * 100):
            torch.testing.assert_close(_outputs(opt, (x, b))[0], _outputs(model, (x, b))[0])
    finally:
        WithDefault.forward.__defaults__ = (None,)

    class TiedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 6, max_norm=1.0)

        def forward(self, h):
            return torch.relu(F.linear(h, self.e.weight)) * 2
    model, h = TiedHead().eval(), torch.randn(3, 6)
    opt = fxfuse.optimize(model, h, strict=True)
    torch.testing.assert_close(_outputs(opt, (h,))[0], _outputs(model, (h,))[0])

    class DetachInPlace(nn.Module):
        def forward(self, x):
            return torch.sigmoid(x) * 2 + 1, x.detach_()
    opt = fxfuse.optimize(DetachInPlace().eval(), torch.randn(3, 4), strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 0


@pytest.mark.parametrize("spelling", ["~m", "m.logical_not()", "torch.logical_not(m)", "torch.bitwise_not(m)",
                                      "torch.logical_not(x)", "~(x > 0)"])
def test_not_of_a_mask_fuses(spelling):
    """fuzz32j: `masked_fill(~mask, -inf)`'s `~mask` was a library call splitting the group."""
    class Masked(nn.Module):
        def forward(self, x, m):
            return torch.softmax(x, -1).masked_fill(eval(spelling), -1.0) * 2

    torch.manual_seed(0)
    model = Masked().eval()
    x, m = torch.randn(3, 5), torch.rand(3, 5) > 0.5
    x[0, 0] = 0.0
    opt = fxfuse.optimize(model, (x, m), strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 1
    torch.testing.assert_close(_outputs(opt, (x, m))[0], _outputs(model, (x, m))[0])


def test_invert_of_integers_stays_a_bitwise_not():
    class Invert(nn.Module):
        def forward(self, x, k):
            return x * (~k).float()
    model, x, k = Invert().eval(), torch.randn(4), torch.tensor([0, 1, -3, 7])
    opt = fxfuse.optimize(model, (x, k), strict=True, verify=False)
    torch.testing.assert_close(_outputs(opt, (x, k))[0], _outputs(model, (x, k))[0])
