"""Split-K through the library's batched GEMM (passes/linear_epilogue.py, fxfuse/library_choice.py).

On the CPU the measured choice says "no GPU" and never splits, so these tests force it, as the
other library-spelling tests do, and check the rewrite against eager: the split call is there,
its S partials are summed in the fused epilogue kernel, and the answer matches.
"""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
import fxfuse.passes.linear_epilogue as pass_module
from conftest import relative_error as rel_err
from fxfuse.demo import seed_network
from fxfuse.library_choice import split_k_library_gemm, split_k_mm, split_k_slices


def _split_calls(opt):
    gm = next(iter(opt._specializations.values())).gm
    return [n for n in gm.graph.nodes if n.target is pass_module.split_k_partials]


def _is_partial(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is operator.getitem \
        and node.args[0].target is pass_module.split_k_partials


def _force(monkeypatch, splits):
    monkeypatch.setattr(pass_module, "split_k_library_gemm", lambda *a: (splits, "split-K: forced by the test"))


def test_split_k_mm_sums_to_the_product():
    x, w = torch.randn(5, 24), torch.randn(13, 24)
    for s in (1, 2, 3, 4, 6):
        parts = split_k_mm(x, w, s)
        assert parts.shape == (s, 5, 13)
        torch.testing.assert_close(parts.sum(0), x @ w.t(), rtol=1e-5, atol=1e-5)
    xt = torch.randn(24, 5).t()           # rows not contiguous: copied, same answer
    torch.testing.assert_close(split_k_mm(xt, w, 4).sum(0), xt @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 24)])
def test_forced_split_k_matches_eager_and_fuses_the_sum(monkeypatch, shape):
    _force(monkeypatch, 4)
    model = nn.Sequential(nn.Linear(24, 20), nn.ReLU(), nn.Linear(20, 13), nn.GELU()).eval()
    opt = fxfuse.optimize(model, torch.randn(*shape), strict=True, fused_mlp="off", gemm="off")
    calls = _split_calls(opt)
    assert len(calls) == 2 and all(c.args[2] == 4 for c in calls)
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] == 2 and s["library_calls"] == 2     # one split GEMM + one epilogue kernel a layer
    gm = next(iter(opt._specializations.values())).gm
    kernels = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [sum(_is_partial(a) for a in k.args) for k in kernels] == [4, 4]   # each kernel sums 4 partials
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(*shape)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    report = fxfuse.explain(opt)
    assert "split-K: forced by the test" in report


def test_split_k_not_taken_where_slices_do_not_divide_k(monkeypatch):
    _force(monkeypatch, 4)
    model = nn.Sequential(nn.Linear(10, 6), nn.ReLU()).eval()     # K = 10: 4 does not divide it
    opt = fxfuse.optimize(model, torch.randn(3, 10), strict=True, fused_mlp="off", gemm="off")
    assert not _split_calls(opt)
    with torch.no_grad():
        x = torch.randn(3, 10)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


def test_the_timed_epilogue_computes_what_the_layer_does():
    """The split-K choice times a hand-written stand-in for the generated epilogue, in chains
    of dependent layers: each step must compute relu(y @ W.T + b), split or not, and a step
    must never write what it reads (interpreted here)."""
    from fxfuse.library_choice import _gemm_and_epilogue_step
    x, w, b = torch.randn(5, 24), torch.randn(24, 24) / 5, torch.randn(24)
    layer = lambda y: torch.relu(F.linear(y, w, b))  # noqa: E731
    for s in (1, 2, 4):
        step = _gemm_and_epilogue_step(x, w, b, s)
        y = x
        for i in range(3):
            y = step(y, i)
        torch.testing.assert_close(y, layer(layer(layer(x))), rtol=1e-5, atol=1e-5)


def test_no_split_k_without_a_gpu_or_in_half_precision():
    cpu = torch.device("cpu")
    assert split_k_slices(1024, 1024, 1024, torch.float32, cpu) == ()
    assert split_k_library_gemm(1024, 1024, 1024, torch.float32, cpu, False) == (1, "")
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        assert split_k_slices(1024, 1024, 1024, torch.float16, gpu) == ()
        assert split_k_slices(8192, 1024, 8192, torch.float32, gpu) == ()     # tiles already fill the GPU
        assert split_k_slices(1024, 1024, 1024, torch.float32, gpu) == (2, 4, 8)
        assert split_k_slices(64, 96, 1024, torch.float32, gpu) == ()         # K / 2 < 64


@pytest.mark.cuda
@pytest.mark.usefixtures("ieee_fp32")
def test_forced_split_k_on_gpu_captured_and_safe(monkeypatch):
    _force(monkeypatch, 4)
    model = seed_network(512, 3).cuda()
    x1, x2 = torch.randn(96, 512, device="cuda"), torch.randn(96, 512, device="cuda")
    opt = fxfuse.optimize(model, x1, strict=True, fused_mlp="off", gemm="off", strassen="off")
    spec = next(iter(opt._specializations.values()))
    assert len(_split_calls(opt)) == 3 and spec.cuda_graph_note.startswith("captured")
    with torch.no_grad():
        out1 = opt(x1)
        kept = out1.clone()
        out2 = opt(x2)
        assert torch.equal(out1, kept), "call 2 overwrote call 1's output"
        assert rel_err(out1, model(x1)) < 1e-6 and rel_err(out2, model(x2)) < 1e-6


@pytest.mark.cuda
@pytest.mark.usefixtures("ieee_fp32")
def test_split_k_measured_choice_on_gpu():
    """The measured choice runs and says why, whichever way it goes."""
    for batch, width in ((256, 1024), (1024, 1024), (64, 4096)):
        splits, reason = split_k_library_gemm(batch, width, width, torch.float32, torch.device("cuda"), False)
        assert splits in (1, 2, 4, 8) and "measured" in reason


def test_forced_split_k_leaves_a_bias_free_linear_alone(monkeypatch):
    """Only a Linear + bias splits (its bias add is where the partials are summed): with the
    split forced, the functional spelling with a bias splits, a bias-free Linear keeps its GEMM."""
    _force(monkeypatch, 2)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16) / 4)
            self.b = nn.Parameter(torch.randn(16))
            self.free = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.free(torch.relu(F.linear(x, self.w, self.b)))

    model = Net().eval()
    opt = fxfuse.optimize(model, torch.randn(6, 16), strict=True, fused_mlp="off", gemm="off")
    calls = _split_calls(opt)
    assert len(calls) == 1 and calls[0].args[1].target == "w"
    gm = next(iter(opt._specializations.values())).gm
    assert [n.target for n in gm.graph.nodes].count(F.linear) == 1     # the bias-free one, unsplit
    with torch.no_grad():
        fresh = torch.randn(6, 16)
        torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-5, atol=1e-5)


def test_forced_split_k_other_spellings(monkeypatch):
    """F.linear with a bias, a weight shared by two layers, a non-contiguous input and a Linear
    read by two consumers: split where legal, and always eager's answer."""
    _force(monkeypatch, 2)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(12, 12) / 4)
            self.b = nn.Parameter(torch.randn(12))
            self.shared = nn.Linear(12, 12)

        def forward(self, x):
            h = torch.sigmoid(F.linear(x, self.w, self.b))
            h = self.shared(torch.relu(self.shared(h)))
            return h * 3 + self.shared(x)          # a third use of the shared layer

    model = Net().eval()
    base = torch.randn(12, 9)
    x = base.t()                                     # [9, 12], columns contiguous: not row-major
    opt = fxfuse.optimize(model, x, strict=True, fused_mlp="off", gemm="off")
    assert len(_split_calls(opt)) == 4
    with torch.no_grad():
        for _ in range(2):
            fresh = torch.randn(12, 9).t()
            torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-5, atol=1e-5)


def test_forced_split_k_skips_empty_k_and_a_vector_weight(monkeypatch):
    """Review: K = 0 and F.linear with a 1-D weight (a matrix-vector product whose output's last
    dimension is the batch) are left unsplit, and build and match eager."""
    _force(monkeypatch, 2)

    class VectorWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(256)), nn.Parameter(torch.randn(5))

        def forward(self, x):
            return torch.relu(F.linear(x, self.w) + self.b)

    for model, x in ((nn.Sequential(nn.Linear(0, 5), nn.ReLU()), torch.randn(3, 0)),
                     (VectorWeight(), torch.randn(5, 256))):
        opt = fxfuse.optimize(model.eval(), x, strict=True, fused_mlp="off", gemm="off")
        assert not _split_calls(opt)
        with torch.no_grad():
            fresh = torch.randn_like(x)
            torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-5, atol=1e-5)
