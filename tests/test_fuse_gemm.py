"""The fuse_gemm pass: Linear + epilogue -> one generated GEMM (CPU, Triton interpreter).

Differential against eager on fresh random inputs at irregular sizes, and every test asserts
the rewrite happened (kernel launches of the fused GEMMs, no library linear left)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.gemm_kernel import EpilogueGemm  # noqa: E402
from fxfuse.kernel import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU kernels need TRITON_INTERPRET=1")


def gemms(opt):
    return [m for spec in opt._specializations.values() for m in spec.gm.modules() if isinstance(m, EpilogueGemm)]


def library_linears(opt):
    gm = next(iter(opt._specializations.values())).gm
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.linear]


def check(model, example, **options):
    opt = fxfuse.optimize(model, example, strict=True, gemm="force", fused_mlp="off", **options)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn_like(example)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    return opt


def test_chain_of_linears_with_activations():
    model = nn.Sequential(nn.Linear(37, 24), nn.GELU(), nn.Linear(24, 13), nn.ReLU(), nn.Linear(13, 5)).eval()
    opt = check(model, torch.randn(5, 37))
    assert len(gemms(opt)) == 3 and not library_linears(opt)
    assert all(g.launches >= 2 and g.fallbacks == 0 for g in gemms(opt))
    assert fxfuse.stats(opt)["fused_kernels"] == 3


class Residual(nn.Module):
    def __init__(self, width_in=19, width_out=19):
        super().__init__()
        self.fc = nn.Linear(width_in, width_out)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * 0.5


@pytest.mark.parametrize("rows,config", [(7, {}), (300, {}), (40, {"split_k": 2, "rowwise": False})])
def test_residual_of_the_input_joins_the_epilogue(rows, config, monkeypatch):
    """x + f(x @ W.T) of a square layer: the kernel reads x at the output tile (operand
    "input"), so the layer is one launch (row-wise at 7 rows, tl.dot past 256, split-K)."""
    if config:
        import fxfuse.passes.fuse_gemm as pass_module
        real = pass_module.choose_gemm_config
        monkeypatch.setattr(pass_module, "choose_gemm_config",
                            lambda m, spec, tf32, **kw: real(m, spec, tf32, block_m=16, block_n=16, block_k=16, **config, **kw))
    opt = check(Residual().eval(), torch.randn(rows, 19))
    (g,) = gemms(opt)
    assert [s.op for s in g.spec.epilogue] == ["add", "tanh", "mul", "add"]   # bias, tanh, * 0.5, + x
    assert ("input", 0) in g.spec.epilogue[-1].operands and "xin = tl.load" in g.source
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and g.launches >= 2 and g.fallbacks == 0
    if config:
        assert g.config.split_k == 2 and not g.config.rowwise


def test_input_of_another_width_stays_outside_the_gemm():
    """x [.., 19] cannot be read at a [.., 11] output tile: x * mean(...) style ops of another
    width stay out (here x is only read by a later op of the input's width)."""
    class Narrowing(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(19, 11)

        def forward(self, x):
            return torch.relu(self.fc(x)).sum(-1, keepdim=True) + x

    opt = check(Narrowing().eval(), torch.randn(6, 19))
    (g,) = gemms(opt)
    assert all(kind != "input" for s in g.spec.epilogue for kind, _ in s.operands)


class PreNorm(nn.Module):
    """A pre-norm transformer MLP: the residual stream h is no input of the second Linear."""
    def __init__(self, width=19, hidden=29):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


@pytest.mark.parametrize("rows,config", [(5, {}), (300, {}), (40, {"split_k": 2, "rowwise": False})])
def test_residual_of_another_tensor_joins_the_epilogue(rows, config, monkeypatch):
    """h + fc2(...): the skip h is read at fc2's output tile (operand "skip"), so the block is
    LayerNorm + two launches, at batch x tokens of 2 x rows (row-wise, tl.dot, split-K)."""
    if config:
        import fxfuse.passes.fuse_gemm as pass_module
        real = pass_module.choose_gemm_config
        monkeypatch.setattr(pass_module, "choose_gemm_config",
                            lambda m, spec, tf32, **kw: real(m, spec, tf32, block_m=16, block_n=16, block_k=16, **config, **kw))
    model = PreNorm().eval()
    opt = check(model, torch.randn(2, rows, 19))
    first, second = gemms(opt)
    assert ("skip", 0) in second.spec.epilogue[-1].operands and "sk0 = tl.load" in second.source
    assert fxfuse.stats(opt)["fused_kernels"] == 2 and fxfuse.stats(opt)["library_calls"] == 1   # the LayerNorm
    assert second.launches >= 2 and second.fallbacks == 0
    with torch.no_grad():   # another batch: the same kernels
        h = torch.randn(3, rows, 19)
        torch.testing.assert_close(opt(h), model(h), rtol=1e-5, atol=1e-5)


class Skips(nn.Module):
    """Skips of other layouts: a transposed input (strides (1, rows)), a per-row scale [rows, 1]
    (stride 0 along the columns) and a third tensor, past MAX_SKIPS, which stays outside."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(13, 11)

    def forward(self, x, a, c):
        s = x.norm(dim=-1, keepdim=True)
        return ((self.fc(x) + a.t()) * s - c.sigmoid()).relu() + a.t().exp()


def test_skips_of_other_layouts_and_the_limit():
    model = Skips().eval()
    args = (torch.randn(9, 13), torch.randn(11, 9), torch.randn(9, 11))
    opt = fxfuse.optimize(model, args, strict=True, gemm="force", fused_mlp="off")
    (g,) = gemms(opt)
    kinds = [kind for step in g.spec.epilogue for kind, _ in step.operands]
    assert kinds.count("skip") == 2 and len({ref for step in g.spec.epilogue for kind, ref in step.operands
                                             if kind == "skip"}) == 2
    with torch.no_grad():
        for _ in range(2):
            args = (torch.randn(9, 13), torch.randn(11, 9), torch.randn(9, 11))
            torch.testing.assert_close(opt(*args), model(*args), rtol=1e-5, atol=1e-5)
    assert g.launches >= 2 and g.fallbacks == 0


class Gated(nn.Module):
    """Skips broadcast over the tokens ([B, 1, N] gate) and over the batch ([T, N] table)."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10)

    def forward(self, x, gate, table):
        return self.fc(x) * gate.sigmoid() + table * 0.5


def test_skips_broadcast_over_tokens_or_batch_are_read_in_place():
    from fxfuse.gemm_kernel import skip_view
    model = Gated().eval()
    args = (torch.randn(3, 5, 12), torch.randn(3, 1, 10), torch.randn(5, 10))
    opt = fxfuse.optimize(model, args, strict=True, gemm="force", fused_mlp="off")
    (g,) = gemms(opt)
    assert len({ref for step in g.spec.epilogue for kind, ref in step.operands if kind == "skip"}) == 2
    with torch.no_grad():
        args = (torch.randn(3, 5, 12), torch.randn(3, 1, 10), torch.randn(5, 10))
        torch.testing.assert_close(opt(*args), model(*args), rtol=1e-5, atol=1e-5)
    assert g.fallbacks == 0 and g.launches >= 1
    for skip in (torch.randn(3, 1, 10), torch.randn(5, 10), torch.randn(3, 5, 10).transpose(0, 1)[:, :, :]):
        lead = (3, 5) if skip.shape[0] != 5 or skip.dim() == 2 else (5, 3)
        view, rows = skip_view(skip, lead, 10)
        assert view.untyped_storage().data_ptr() == skip.untyped_storage().data_ptr()   # no copy
        expected = skip.expand(lead + (10,)).reshape(-1, 10)
        torch.testing.assert_close(view.reshape(-1, rows, 10)[torch.arange(15) // rows, torch.arange(15) % rows],
                                   expected)


def test_skip_computed_from_the_product_stays_outside():
    """y + softmax(y): the skip depends on the product, so the add cannot be in y's epilogue."""
    class SelfSkip(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 7)

        def forward(self, x):
            y = self.fc(x)
            return y + torch.softmax(y, -1)

    opt = check(SelfSkip().eval(), torch.randn(4, 10))
    (g,) = gemms(opt)
    assert all(kind != "skip" for step in g.spec.epilogue for kind, _ in step.operands)


def test_product_read_twice_is_stored_once():
    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(11, 9)

        def forward(self, x):
            y = self.fc(x)
            return torch.relu(y), y.sigmoid()

    model = TwoReaders().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 11), strict=True, gemm="force", fused_mlp="off")
    with torch.no_grad():
        x = torch.randn(3, 11)
        for got, want in zip(opt(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (g,) = gemms(opt)
    assert g.launches >= 1 and not library_linears(opt)


def test_three_d_input_and_fp16():
    model = nn.Sequential(nn.Linear(16, 24), nn.SiLU()).eval().half()
    x = torch.randn(2, 3, 16, dtype=torch.float16)
    opt = fxfuse.optimize(model, x, strict=True, gemm="force", fused_mlp="off")
    with torch.no_grad():
        x = torch.randn_like(x)
        torch.testing.assert_close(opt(x), model(x), rtol=5e-3, atol=5e-3)
    assert len(gemms(opt)) == 1 and gemms(opt)[0].launches >= 1


def test_auto_explains_its_no():
    model = nn.Sequential(nn.Linear(13, 7), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 13), strict=True, fused_mlp="off")
    assert not gemms(opt) and len(library_linears(opt)) == 1
    (linear,) = library_linears(opt)
    assert linear.meta["fxfuse"]["decision"].startswith("cost model: library")
    assert "no 'gemm_epilogue' table" in linear.meta["fxfuse"]["plan"]["reasons"]["gemm"]


def test_bad_mode_is_a_clear_error():
    with pytest.raises(fxfuse.FxfuseError, match="gemm="):
        fxfuse.optimize(nn.Linear(3, 3).eval(), torch.randn(2, 3), strict=True, gemm="always")
