"""Runtime on the CPU: signatures, specializations by stride and scalar args, inputs never
mutated, outputs of one call independent of the next, and the Linear-bias placement pass."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.runtime import describe_mismatch, signature  # noqa: E402


class Residual(nn.Module):
    def __init__(self, n=13):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


def test_signature_names_the_mismatch():
    a = signature((torch.randn(3, 4),))
    b = signature((torch.randn(5, 4),))
    assert "shape" in describe_mismatch(a, b) and "(5, 4)" in describe_mismatch(a, b)
    c = signature((torch.randn(3, 4).half(),))
    assert "dtype" in describe_mismatch(a, c)
    d = signature((torch.randn(4, 3).t(),))
    assert "stride" in describe_mismatch(a, d)


def test_strided_input_gets_its_own_specialization_and_right_answer():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(6, 13), strict=True)
    x = torch.randn(13, 6).t()          # same shape, other strides
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    s = fxfuse.stats(opt)
    assert s["specializations"] == 2 and s["reference_fallbacks"] == 0


def test_inputs_not_mutated_and_outputs_independent():
    model = nn.Sequential(nn.Linear(9, 9), nn.ReLU(inplace=True), nn.Linear(9, 9), nn.ReLU(inplace=True)).eval()
    x1, x2 = torch.randn(4, 9), torch.randn(4, 9)
    opt = fxfuse.optimize(model, x1, strict=True)
    keep1, keep2 = x1.clone(), x2.clone()
    with torch.no_grad():
        out1 = opt(x1)
        snapshot = out1.clone()
        out2 = opt(x2)
    assert torch.equal(x1, keep1) and torch.equal(x2, keep2)
    assert torch.equal(out1, snapshot) and not torch.equal(out1, out2)
    assert fxfuse.stats(opt)["kernel_launches"] > 0


def test_scalar_argument_is_specialized_and_guarded():
    class Scale(nn.Module):
        def forward(self, x, k: float):
            return torch.relu(x * k + 1)

    opt = fxfuse.optimize(Scale().eval(), (torch.randn(3, 5), 2.0), strict=True)
    x = torch.randn(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, 2.0), Scale()(x, 2.0))
        torch.testing.assert_close(opt(x, 3.0), Scale()(x, 3.0))   # other value: new specialization
    assert fxfuse.stats(opt)["specializations"] == 2


def test_cuda_graphs_option_on_cpu_is_harmless():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 13), cuda_graphs=False, strict=True)
    assert "off" in next(iter(opt.specializations.values())).cuda_graph_note
    with torch.no_grad():
        x = torch.randn(2, 13)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


def test_unknown_option_is_a_clear_error():
    with pytest.raises(fxfuse.FxfuseError, match="unknown option"):
        fxfuse.optimize(Residual().eval(), torch.randn(2, 13), fuse_everything=True)


def test_bias_moved_into_library_gemm_when_measured_faster(monkeypatch):
    import fxfuse.passes.linear_epilogue as pass_module

    monkeypatch.setattr(pass_module, "bias_in_library_gemm", lambda *a: (True, "bias in the library GEMM: test"))
    model = nn.Sequential(nn.Linear(11, 7), nn.ReLU(), nn.Linear(7, 5), nn.Tanh()).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 11), strict=True, fused_mlp="off")  # narrow: would be one kernel
    gm = next(iter(opt.specializations.values())).gm
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 2 and all(len(n.args) == 3 for n in linears)
    assert fxfuse.stats(opt)["fused_kernels"] == 2      # relu, tanh alone
    with torch.no_grad():
        x = torch.randn(3, 11)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert "bias in the library GEMM" in fxfuse.explain(opt)


def test_quiet_by_default(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(Residual().eval(), torch.randn(2, 13), strict=True)
        with torch.no_grad():
            opt(torch.randn(2, 13))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
