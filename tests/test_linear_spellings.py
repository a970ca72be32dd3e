"""Products that are a Linear whatever their spelling: a weight stored [in, out] (`x @ W`,
`torch.addmm(b, x, W)`, `F.linear(x, W.t())`) and einsum equations (`bi,oi->bo`,
`...i,io->...o`) reach the Linear passes as F.linear, so the fused GEMM, the fused MLP and
Strassen apply to them too (normalize_layers.matmul_as_linear). Checked against eager on
fresh inputs, with the rewrite asserted (no matmul left, the kernels counted), the weight
copy watched after an in-place edit, and equations that are not a Linear left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from benchmarks.blocks import GPT2MLP

SPELLINGS = {
    "x @ W": lambda x, w, wt, b: x @ w + b,
    "matmul(x, W)": lambda x, w, wt, b: torch.matmul(x, w) + b,
    "x.matmul(W)": lambda x, w, wt, b: x.matmul(w) + b,
    "addmm(b, x, W)": lambda x, w, wt, b: torch.addmm(b, x, w),
    "F.linear(x, W.t(), b)": lambda x, w, wt, b: F.linear(x, w.t(), b),
    "F.linear(x, W.T) + b": lambda x, w, wt, b: F.linear(x, w.T) + b,
    "x @ Wt.permute([1, 0]) + b": lambda x, w, wt, b: x @ wt.permute([1, 0]) + b,
    "x @ Wt.swapaxes(0, 1) + b": lambda x, w, wt, b: x @ wt.swapaxes(0, 1) + b,
    "x @ torch.swapdims(Wt, -1, 0) + b": lambda x, w, wt, b: x @ torch.swapdims(wt, -1, 0) + b,
    "x @ Wt.transpose(1, -2) + b": lambda x, w, wt, b: x @ wt.transpose(1, -2) + b,
    "einsum bi,io->bo": lambda x, w, wt, b: torch.einsum("bi,io->bo", x, w) + b,
    "einsum bi,oi->bo": lambda x, w, wt, b: torch.einsum("bi,oi->bo", x, wt) + b,
    "einsum oi,bi->bo": lambda x, w, wt, b: torch.einsum("oi,bi->bo", wt, x) + b,
    "einsum ...i,io->...o": lambda x, w, wt, b: torch.einsum("...i,io->...o", x, w) + b,
    "einsum [list] b i, o i -> b o": lambda x, w, wt, b: torch.einsum("b i, o i -> b o", [x, wt]) + b,
}


class Chain(nn.Module):
    """Three layers of widths 7 -> 12 -> 12 -> 5, each spelled `spelling`; `w*` stored
    [in, out], `wt*` [out, in]."""
    def __init__(self, spelling):
        super().__init__()
        self.product = SPELLINGS[spelling]
        sizes = [(7, 12), (12, 12), (12, 5)]
        for i, (k, n) in enumerate(sizes):
            w = torch.randn(k, n) / k ** 0.5
            self.register_parameter(f"w{i}", nn.Parameter(w))
            self.register_parameter(f"wt{i}", nn.Parameter(w.t().contiguous()))
            self.register_parameter(f"b{i}", nn.Parameter(torch.randn(n)))

    def forward(self, x):
        for i in range(3):
            x = self.product(x, getattr(self, f"w{i}"), getattr(self, f"wt{i}"), getattr(self, f"b{i}"))
            x = torch.tanh(x) if i < 2 else x
        return x


def _checked(model, example, calls, **options):
    """fxfuse.optimize(model.eval(), example) compared with eager on each call's fresh input."""
    model = model.eval()
    opt = fxfuse.optimize(model, example, strict=True, **options)
    with torch.no_grad():
        for x in calls:
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    return opt


def _node_targets(opt):
    spec = next(iter(opt._specializations.values()))
    return [str(n.target) for n in spec.gm.graph.nodes]


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_spellings_of_a_linear_run_as_fused_gemms(spelling):
    opt = _checked(Chain(spelling), torch.randn(5, 7), [torch.randn(9, 7)], gemm="force")
    names = _node_targets(opt)
    assert sum(n.startswith("fused_gemm") for n in names) == 3, names
    assert not any(t in ("addmm", "mm", "matmul", "einsum") or "linear" in t for t in names), names


@pytest.mark.parametrize("spelling", ["x @ W", "einsum bi,io->bo", "F.linear(x, W.t(), b)", "einsum bi,oi->bo"])
def test_spellings_of_a_linear_chain_make_one_fused_mlp(spelling):
    opt = _checked(Chain(spelling), torch.randn(5, 7), [torch.randn(4, 7)], fused_mlp="force")
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0


def test_a_weight_stored_in_out_edited_in_place_is_read_anew():
    """The transposed copy is derived from W: an in-place edit after optimize rebuilds."""
    model, x = Chain("x @ W"), torch.randn(5, 7)
    opt = _checked(model, x, [x], gemm="force")
    assert fxfuse.stats(opt)["fused_kernels"] == 3   # the three products are generated GEMMs
    with torch.no_grad():
        model.w0.mul_(-2.0)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(opt._specializations) == 1 and fxfuse.stats(opt)["fused_kernels"] == 3   # rebuilt, still rewritten


def test_a_weight_read_twice_is_copied_once():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8) / 3)

        def forward(self, x):
            return torch.relu(torch.relu(x @ self.w) @ self.w)

    opt = _checked(Twice(), torch.randn(3, 8), [torch.randn(6, 8)], gemm="force")
    spec = next(iter(opt._specializations.values()))
    assert fxfuse.stats(opt)["fused_kernels"] == 2
    assert len(spec.gm.meta["fxfuse_transposed_weights"]) == 1


@pytest.mark.parametrize("equation", ["bi,io->ob", "bi,oi->ob", "bi,oi", "bi,ii->bi", "bj,ij->bi"])
def test_einsums_that_are_not_a_plain_linear_stay_correct(equation):
    """Transposed outputs, implicit outputs and diagonals stay einsum calls (or are correct)."""
    class Eq(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 6) / 3)

        def forward(self, x):
            return torch.einsum(equation, x, self.w).sigmoid()

    opt = _checked(Eq(), torch.randn(6, 6), [torch.randn(6, 6)], gemm="force")
    linear = equation == "bj,ij->bi"    # j contracted, W's other index i last: a Linear with W [out, in]
    assert ("einsum" in " ".join(_node_targets(opt))) != linear


def test_a_three_d_input_through_x_at_w():
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 10) / 3)

        def forward(self, x):
            return F.gelu(x @ self.w)

    opt = _checked(Seq(), torch.randn(2, 3, 6), [torch.randn(2, 3, 6)], gemm="force")
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0


def test_gpt2_conv1d_layers_become_generated_gemms():
    """GPT-2's Conv1D (Hugging Face transformers): addmm(b, x.view(-1, k), W) with W [in, out]."""
    opt = _checked(GPT2MLP(12), torch.randn(2, 5, 12), [torch.randn(3, 7, 12)], gemm="force")
    names = _node_targets(opt)
    assert sum(n.startswith("fused_gemm") for n in names) == 2 and "addmm" not in " ".join(names)


def _buffer_names(opt):
    return [name for name, _ in next(iter(opt._specializations.values())).gm.named_buffers()]


def test_library_layers_read_a_weight_stored_in_out_through_a_view():
    """Layers that stay library GEMMs read W.t(), a view, as eager does: a transposed copy
    would double the memory of every such weight (passes/weight_views.py)."""
    model = GPT2MLP(12)
    opt = _checked(model, torch.randn(2, 5, 12), [torch.randn(3, 7, 12)])
    gm = next(iter(opt._specializations.values())).gm
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 2 and "addmm" not in " ".join(_node_targets(opt))   # normalized...
    assert all(n.args[1].op == "call_method" and n.args[1].target == "t" for n in linears)   # ...through a view
    assert not any(name.endswith("_T") for name in _buffer_names(opt)), _buffer_names(opt)
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        model.c_fc.weight.mul_(-1.5)   # read live: no copy to go stale, no rebuild
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert next(iter(opt._specializations.values())).gm is gm



def test_library_layers_read_weights_of_a_parameter_list_through_views():
    """Weights in a ParameterList, read only by `x @ w`: the passes drop the list's module once
    no node reads it, and the view reads W registered again (the same tensor: edits are seen)."""
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.ParameterList([nn.Parameter(torch.randn(16, 16) / 4) for _ in range(3)])

        def forward(self, x):
            for w in self.w:
                x = torch.relu(x @ w)
            return x

    model = Chain()
    opt = _checked(model, torch.randn(4, 16), [torch.randn(6, 16)])
    assert sum(n.target is F.linear for n in next(iter(opt._specializations.values())).gm.graph.nodes) == 3
    assert not any(name.endswith("_T") for name in _buffer_names(opt)), _buffer_names(opt)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model.w[1].mul_(2.0)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"gemm": "force"}, {"fused_mlp": "force"}, {"strassen": "force"}])
@pytest.mark.parametrize("spelling", ["input=, weight=, bias=", "x, weight=", "1-D weight="])
def test_f_linear_with_keyword_arguments(spelling, options):
    """review29: F.linear(input=x, weight=W) crashed fuse_mlp (it read args[0]); keyword calls
    become the positional form, so the Linear passes take them too."""
    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b, self.v = (nn.Parameter(torch.randn(5, 6) / 2), nn.Parameter(torch.randn(5)),
                                      nn.Parameter(torch.randn(6)))

        def forward(self, x):
            if spelling == "input=, weight=, bias=":
                return torch.relu(F.linear(input=x, weight=self.w, bias=self.b))
            if spelling == "x, weight=":
                return torch.relu(F.linear(x, weight=self.w))
            return torch.relu(F.linear(input=x, weight=self.v)) + 1.0

    opt = _checked(Kw(), torch.randn(3, 6), [torch.randn(7, 6)], **options)
    gm = next(iter(opt._specializations.values())).gm
    assert not any(n.kwargs for n in gm.graph.nodes if n.target is F.linear)
    if options and spelling != "1-D weight=":   # a generated kernel took the Linear
        assert fxfuse.stats(opt)["fused_kernels"] >= 1 and not any(n.target is F.linear for n in gm.graph.nodes)
