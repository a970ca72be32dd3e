"""Asymmetric fused Strassen (fxfuse/strassen_tables.py, passes/strassen.py) under the Triton
interpreter: the tables are exact, the rewrite happens (kernels and bmm calls counted, the
generated kernels actually ran), a chain of n layers is n+1 kernels, and results match eager
on a fresh random input. Shapes are tiny and irregular so padding and masks are exercised.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.errors import FxfuseError  # noqa: E402
from fxfuse.kernel import FusedKernel  # noqa: E402
from fxfuse.strassen_tables import (ALGORITHMS, block_position, levels, prefix_ref, right_operands,  # noqa: E402
                                    split_blocks, strassen_matmul, suffix_ref)

# ---------------------------------------------------------------------------------- tables


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_brent_equations(name):
    """sum_t U[t,(i,j)] V[t,(j',k)] W[(i',k'),t] = [j == j'][i == i'][k == k'] for 2x2 blocks."""
    U, V, W = levels(1, name)
    for i, j, jj, k, ii, kk in itertools.product(range(2), repeat=6):
        got = sum(U[t, 2 * i + j] * V[t, 2 * jj + k] * W[2 * ii + kk, t] for t in range(7))
        assert got == float(j == jj and i == ii and k == kk)


@pytest.mark.parametrize("n", [0, 1, 2, 3])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_tables_reproduce_matmul_float64(n, name):
    s = 1 << n
    U, V, W = levels(n, name)
    assert U.shape == V.shape == (7 ** n, 4 ** n) and W.shape == (4 ** n, 7 ** n)
    a = torch.randint(-4, 5, (3 * s, 5 * s), dtype=torch.float64)
    b = torch.randint(-4, 5, (5 * s, 2 * s), dtype=torch.float64)
    assert torch.equal(strassen_matmul(a, b, n, name), a @ b)      # small integers: exact
    a, b = torch.randn(3 * s, 5 * s, dtype=torch.float64), torch.randn(5 * s, 2 * s, dtype=torch.float64)
    torch.testing.assert_close(strassen_matmul(a, b, n, name), a @ b, rtol=1e-12, atol=1e-12)


def test_block_numbering_and_pieces():
    assert [block_position(p, 1) for p in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert block_position(5, 2) == (0, 3) and block_position(10, 2) == (3, 0)
    t = torch.arange(64.0).reshape(8, 8)
    blocks = split_blocks(t, 2)
    assert torch.equal(blocks[5], t[0:2, 6:8])
    x, w = torch.randn(8, 12, dtype=torch.float64), torch.randn(12, 20, dtype=torch.float64)
    p = prefix_ref(x, 2)
    assert p.shape == (49, 2, 3) and right_operands(w, 2).shape == (49, 3, 5)
    torch.testing.assert_close(suffix_ref(torch.bmm(p, right_operands(w, 2)), 2), x @ w)


# ------------------------------------------------------------------------------------ pass


def _mlp(widths, act=nn.ReLU):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers).eval()


def _optimize(model, x, levels=1, **options):
    opt = fxfuse.optimize(model, x, strassen=options.pop("strassen", "force"), strassen_levels=levels,
                          strict=True, **options)
    assert isinstance(opt, fxfuse.OptimizedModule)
    return opt


def _graph(opt):
    return next(iter(opt._specializations.values())).gm


def _strassen_kernels(opt):
    return [m for m in _graph(opt).modules() if isinstance(m, FusedKernel) and m.origin == "strassen"]


def _bmm_nodes(opt):
    return [n for n in _graph(opt).graph.nodes if n.op == "call_function" and n.target is torch.bmm]


def _linears(opt):
    return [n for n in _graph(opt).graph.nodes if n.op == "call_function" and n.target is F.linear]


def _check(opt, model, x, layers, kernels, atol=1e-5):
    """The rewrite happened as counted, the kernels ran, and a NEW input matches eager."""
    bmms = _bmm_nodes(opt)
    assert len(bmms) == layers, _graph(opt).graph
    assert all(n.meta["fxfuse"]["strassen"] is True and n.meta["fxfuse"]["levels"] >= 1 for n in bmms)
    assert len(_strassen_kernels(opt)) == kernels, _graph(opt).graph
    fresh = torch.randn_like(x)
    with torch.no_grad():
        expected, got = model(fresh), opt(fresh)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=atol)
    s = fxfuse.stats(opt)
    assert s["kernel_launches"] > 0 and s["reference_fallbacks"] == 0, s
    assert all(k.launches > 0 for k in _strassen_kernels(opt))


@pytest.mark.parametrize("levels", [1, 2])
def test_chain_of_layers_is_n_plus_one_kernels(levels):
    model = _mlp([12, 20, 20, 20])
    x = torch.randn(8, 12)
    opt = _optimize(model, x, levels)
    _check(opt, model, x, layers=3, kernels=4)
    assert not _linears(opt)
    # one prefix, two suffix+epilogue+prefix kernels, one final suffix; no separate pointwise kernel
    members = [k.members for k in _strassen_kernels(opt)]
    assert sum(any(m.startswith("prefix of") for m in ms) and any(m.startswith("suffix of") for m in ms)
               for ms in members) == 2
    assert fxfuse.stats(opt)["fused_kernels"] == 4
    # y never reaches memory between layers: each boundary kernel writes only the next prefix
    middle = [k for k in _strassen_kernels(opt) if len(k.members) > 1 and k.members[-1].startswith("prefix of")]
    assert len(middle) == 2 and all(len(k.ir.outputs) == 1 for k in middle)


@pytest.mark.parametrize("levels", [1, 2])
def test_odd_prime_sizes_are_padded(levels):
    model = nn.Sequential(nn.Linear(13, 11), nn.GELU(), nn.Linear(11, 5), nn.Sigmoid(), nn.Linear(5, 9)).eval()
    x = torch.randn(7, 13)
    opt = _optimize(model, x, levels)
    _check(opt, model, x, layers=3, kernels=4)
    meta = _bmm_nodes(opt)[0].meta["fxfuse"]
    s = 1 << levels
    assert meta["padded"] == tuple(-(-n // s) * s for n in (7, 13, 11))
    assert meta["extra_weight_bytes"] == 7 ** levels * (meta["padded"][1] // s) * (meta["padded"][2] // s) * 4
    assert meta["error"] <= meta["tolerance"] and "padded 7x13x11" in meta["decision"]
    with torch.no_grad():
        assert opt(x).is_contiguous()   # narrowed from a padded buffer, then copied out


@pytest.mark.parametrize("levels", [1, 2])
def test_padded_output_is_contiguous_for_a_view_and_other_batches(levels):
    """The fuzzer's case: Linear(9, 13) then .view(-1), which needs eager's contiguous y."""
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(9, 13, bias=False)

        def forward(self, x):
            return self.lin(x).view(-1)

    model = Flat().eval()
    opt = fxfuse.optimize(model, torch.randn(5, 9), strassen="force", strassen_levels=levels, strict=True)
    assert len(_bmm_nodes(opt)) == 1
    with torch.no_grad():
        for batch in (5, 3):
            x = torch.randn(batch, 9)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("levels", [1, 2])
def test_three_d_input(levels):
    model = _mlp([12, 20, 12], act=nn.SiLU)
    x = torch.randn(2, 5, 12)
    opt = _optimize(model, x, levels)
    _check(opt, model, x, layers=2, kernels=3)


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 20), nn.Linear(20, 6)

    def forward(self, x):
        return self.b(F.leaky_relu(self.a(x.t()), 0.1) * 2.0 + 1.0)


def test_non_contiguous_input_and_constants_in_epilogue():
    model = Transposed().eval()
    x = torch.randn(12, 7)
    opt = _optimize(model, x, 2)
    fresh = torch.randn_like(x)
    with torch.no_grad():
        torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-4, atol=1e-5)
    assert len(_bmm_nodes(opt)) == 2 and len(_strassen_kernels(opt)) == 3
    assert fxfuse.stats(opt)["reference_fallbacks"] == 0


class Residual(nn.Module):
    def __init__(self, width=12, depth=2):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for lin in self.blocks:
            h = h + torch.tanh(lin(h)) * 0.5
        return h


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("rows", [8, 7])
def test_residual_connections(levels, rows):
    model = Residual().eval()
    x = torch.randn(rows, 12)
    opt = _optimize(model, x, levels)
    # h is read by the next layer and by the residual add: stored, and still one kernel per boundary
    _check(opt, model, x, layers=3, kernels=4)


class SoftmaxBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 20), nn.Linear(20, 20), nn.Linear(20, 8)

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(torch.softmax(h, dim=-1))


def test_chain_broken_by_softmax():
    model = SoftmaxBreak().eval()
    x = torch.randn(8, 12)
    opt = _optimize(model, x, 1)
    # a -> b fused at their boundary (3 kernels); softmax is a library op, so c has its own prefix + suffix
    _check(opt, model, x, layers=3, kernels=5)
    assert any(n.target is torch.softmax or "softmax" in str(n.target) for n in _graph(opt).graph.nodes)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.h1, self.h2 = nn.Linear(12, 20), nn.Linear(20, 6), nn.Linear(20, 10)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.h1(h), self.h2(h), self.body(x)


def test_shared_activation_and_returned_linear_output():
    """h feeds two Strassen layers (one fused, one with its own prefix); body(x) is also returned."""
    model = TwoHeads().eval()
    x = torch.randn(6, 12)
    opt = _optimize(model, x, 1)
    assert len(_bmm_nodes(opt)) == 4
    fresh = torch.randn_like(x)
    with torch.no_grad():
        for e, g in zip(model(fresh), opt(fresh)):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert fxfuse.stats(opt)["reference_fallbacks"] == 0


def test_kernels_match_their_reference_bit_for_bit():
    model = _mlp([13, 11, 5])
    x = torch.randn(7, 13)
    opt = _optimize(model, x, 2)
    gm = _graph(opt)
    for kernel in _strassen_kernels(opt):
        inputs = [torch.randn(shape, dtype=dtype) if dtype != torch.bool else torch.rand(shape) > 0.3
                  for shape, _, dtype in kernel.input_meta]
        for node in gm.graph.nodes:   # constants (right operands, masks, biases) as they are
            if node.op == "call_module" and gm.get_submodule(node.target) is kernel:
                for k, a in enumerate(node.args):
                    if a.op == "get_attr":
                        inputs[k] = getattr(gm, a.target) if "." not in a.target else gm.get_parameter(a.target)
        got, want = kernel(*inputs), kernel.reference(*inputs)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_fp16():
    model = _mlp([12, 20, 12]).half()
    x = torch.randn(8, 12).half()
    opt = _optimize(model, x, 1)
    assert len(_bmm_nodes(opt)) == 2 and _bmm_nodes(opt)[0].meta["fxfuse"]["tolerance"] >= 1e-2


# ------------------------------------------------------------------------- options, guard


def _after_strassen(model, x, **options):
    """The graph right after the strassen pass (later passes may rewrite the classical Linears)."""
    from fxfuse.passes.normalize import normalize
    from fxfuse.passes.strassen import strassen
    from fxfuse.tracing import propagate_shapes, trace
    opts = fxfuse.Options.from_kwargs(**options)
    with torch.no_grad():
        gm = normalize(trace(model, (x,)), opts)
        propagate_shapes(gm, (x,))
        gm.meta["fxfuse_example_args"] = (x,)
        return strassen(gm, opts)


def _decisions(gm):
    return [n.meta["fxfuse"] for n in gm.graph.nodes if n.op == "call_function" and n.target is F.linear]


def test_tolerance_keeps_layers_classical():
    model = _mlp([12, 20, 20])
    x = torch.randn(8, 12)
    opt = _optimize(model, x, 2, tolerance=1e-12)
    assert not _bmm_nodes(opt) and not _strassen_kernels(opt)
    metas = _decisions(_after_strassen(model, x, strassen="force", strassen_levels=2, tolerance=1e-12))
    assert len(metas) == 2
    for m in metas:
        assert m["strassen"] is False and m["decision"].startswith("classical: Strassen error")
        assert "exceeds tolerance" in m["decision"] and set(m["errors_by_levels"]) == {1, 2}


def test_guard_falls_back_to_fewer_levels():
    """Between the 1-level and 2-level errors: the layer gets 1 level, not classical."""
    model = _mlp([16, 16])
    x = torch.randn(8, 16)
    errs = _decisions(_after_strassen(model, x, strassen="force", strassen_levels=2, tolerance=1e-12))[0]
    e1, e2 = errs["errors_by_levels"][1], errs["errors_by_levels"][2]
    if not e1 < e2:
        pytest.skip("this draw has a 2-level error below the 1-level one")
    gm = _after_strassen(model, x, strassen="force", strassen_levels=2, tolerance=(e1 + e2) / 2)
    bmm = [n for n in gm.graph.nodes if n.target is torch.bmm]
    assert len(bmm) == 1 and bmm[0].meta["fxfuse"]["levels"] == 1


def test_auto_uses_size_threshold_and_off_is_default():
    model = _mlp([12, 20])
    x = torch.randn(8, 12)
    assert not _bmm_nodes(_optimize(model, x, 1, strassen="off"))
    assert not _bmm_nodes(fxfuse.optimize(model, x, strict=True))
    assert not _bmm_nodes(_optimize(model, x, 1, strassen="auto"))
    (meta,) = _decisions(_after_strassen(model, x, strassen="auto"))
    assert "size threshold until the cost model lands" in meta["decision"]


def test_bad_options():
    model, x = _mlp([12, 20]), torch.randn(8, 12)
    with pytest.raises(FxfuseError):
        fxfuse.optimize(model, x, strassen="sometimes", strict=True)
    with pytest.raises(FxfuseError):
        fxfuse.optimize(model, x, strassen="force", strassen_levels=0, strict=True)


def test_explain_reports_strassen():
    model = _mlp([12, 20, 20])
    opt = _optimize(model, torch.randn(8, 12), 1)
    text = fxfuse.explain(opt)
    assert "Strassen 1 level(s)" in text and "combined weights" in text and "Strassen suffix of" in text


def test_plan_table_under_force_says_why_not_and_that_force_overrides_it():
    """strassen='force' rewrote the layers while the plan table said "library: the only legal
    candidate" with no reason for the others (fuzz27): the table now lists why each candidate
    is not legal and notes the forced option."""
    model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48)).eval()
    opt = fxfuse.optimize(model, torch.randn(18, 48), strassen="force")
    text = fxfuse.explain(opt)
    assert "Strassen 1 level(s)" in text
    assert "not legal: strassen1 (every layer): 18 rows x 48 features" in text
    assert "note: strassen='force': the Strassen pass rewrites every Linear it can" in text


def test_example_with_nan_keeps_layers_classical_and_says_why():
    """A NaN in the example made every measured error NaN: Strassen was off with a decision
    reading 'error nan exceeds tolerance nan' (fuzzing round)."""
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.SiLU(), torch.nn.Linear(33, 9)).eval()
    x = torch.randn(5, 17)
    x[1, 3] = float("nan")
    opt = fxfuse.optimize(model, x, strassen="force")
    assert "the error cannot be measured" in fxfuse.explain(opt)


def test_strassen_levels_without_strassen_is_noted_in_explain():
    """strassen_levels=2 with strassen left 'off' was accepted without a word (fuzz27): the
    plan table notes that it has no effect (not an error: sweeps pass both options)."""
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 12), strassen_levels=2)
    assert "note: strassen_levels=2 has no effect: strassen='off'" in fxfuse.explain(opt)
    assert not _bmm_nodes(opt)
    opt = fxfuse.optimize(model, torch.randn(4, 12), strassen="auto", strassen_levels=2)
    assert "strassen_levels=2 has no effect" not in fxfuse.explain(opt)
