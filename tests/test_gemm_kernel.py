"""The epilogue-fused GEMM (fxfuse/gemm_kernel.py): y = act(x @ W.T + b) as one kernel, with
serial split-K. CPU tensors under the Triton interpreter; marked cuda: compiled on a GPU.
Irregular sizes hit every mask; split-K is forced at tiny sizes so its fix-up path runs."""
import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from fxfuse.gemm_kernel import (EpilogueGemm, GemmSpec, _rowwise_stages, choose_gemm_config,  # noqa: E402
                                generate_gemm, why_not_gemm)
from fxfuse.mlp_kernel import Pointwise  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
ACT_OPS = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.GELU: "gelu", nn.Tanh: "tanh", nn.SiLU: "silu"}


pytestmark = pytest.mark.usefixtures("kernel_backend")   # conftest.py: interpreter or GPU


def layer(k, n, act, dtype, device="cpu", **config):
    """(model, EpilogueGemm) for Linear(k, n) + act; config fields override the chosen ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, n), act()).eval().to(device=device, dtype=dtype)
    spec = GemmSpec(k, n, dtype, (Pointwise(1, "add", (("value", 0), ("vector", 0))),
                                  Pointwise(2, ACT_OPS[act], (("value", 1),))), 2)
    m = config.pop("m", 16)
    cfg = choose_gemm_config(m, spec, **config)
    mod = EpilogueGemm(spec, model[0].weight, [model[0].bias], torch.fx.symbolic_trace(model), (), config=cfg)
    return model, mod


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def check(model, mod, x):
    with torch.no_grad():
        got, want, ref = mod(x), model(x), copy.deepcopy(model).double()(x.double())
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, ref) < TOL[x.dtype] + 2 * rel_err(want, ref), (rel_err(got, ref), rel_err(want, ref))
    assert mod.fallbacks == 0 and mod.launches >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 13, 7), (5, 37, 24), (37, 100, 130)])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("rowwise", [False, True, "pipelined"])
def test_irregular_sizes_and_split_k(m, k, n, split_k, dtype, rowwise):
    blocks = dict(block_m=8, block_n=32) if rowwise else {}   # batch 37: several row tiles
    pipelined = rowwise == "pipelined"
    model, mod = layer(k, n, nn.ReLU, dtype, split_k=split_k, block_k=16, rowwise=bool(rowwise), pipelined=pipelined,
                       **blocks)
    assert mod.config.rowwise == bool(rowwise) and ("tl.dot" in mod.source) != bool(rowwise)
    assert ("in tl.range(" in mod.source) == pipelined
    check(model, mod, torch.randn(m, k, dtype=dtype))
    if split_k > 1:
        assert int(mod.counters.abs().sum()) == 0        # reset for the next launch
        check(model, mod, torch.randn(m, k, dtype=dtype))  # and the next launch is right too


@pytest.mark.parametrize("m,k,n,block_m", [(40, 70, 45, 16), (64, 70, 45, 32), (64, 1024, 12, 64),
                                            (150, 33, 20, 64)])
def test_row_wise_chosen_past_16_rows(m, k, n, block_m):
    """fp32 batches 17..256 take the row-wise form with 16, 32 or 64 rows per program: several
    row tiles, the last one partial at another batch."""
    model, mod = layer(k, n, nn.GELU, torch.float32, m=m)
    assert mod.config.rowwise and mod.config.block_m == block_m and "tl.dot" not in mod.source
    check(model, mod, torch.randn(m, k))
    check(model, mod, torch.randn(m + 9, k))


@pytest.mark.parametrize("budget", [4096, 128, 1])
def test_row_wise_weight_prefetch_steps(budget, monkeypatch):
    """W tiles of the first steps are loaded before gdc_wait, the rest in the loop: every split
    of the budget between the two gives the same result (K = 100: the last step is masked)."""
    import fxfuse.gemm_kernel as gk
    monkeypatch.setattr(gk, "PREFETCH_ELEMENTS", budget)
    model, mod = layer(100, 12, nn.ReLU, torch.float32, m=3, block_n=4, block_k=16, split_k=2)
    steps = gk.prefetch_steps(mod.config, 64)
    assert steps == {4096: 4, 128: 2, 1: 1}[budget] and f"w_pre{steps - 1} = tl.load" in mod.source
    check(model, mod, torch.randn(3, 100))


@pytest.mark.parametrize("rowwise", [False, True])
def test_no_name_changes_type_inside_the_split_k_block(rowwise):
    """Compiled Triton rejects a name that an `if` block redefines with another type (the
    interpreter does not): inside the split-K fix-up only `acc` may be assigned again, and it
    keeps its type. (The epilogue's vectors k0, k1 once clashed with the prefetched K offsets.)"""
    import ast
    _, mod = layer(100, 40, nn.GELU, torch.float32, m=20 if not rowwise else 3, split_k=2, block_k=16,
                   rowwise=rowwise)
    kernel = next(f for f in ast.parse(mod.source).body if isinstance(f, ast.FunctionDef) and f.name == mod.kernel_name)
    names = lambda stmts: {t.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Assign)
                           for t in n.targets if isinstance(t, ast.Name)}
    fixup = next(s for s in kernel.body if isinstance(s, ast.If) and "count" in ast.unparse(s.test))
    before = names(kernel.body[:kernel.body.index(fixup)])
    assert names(fixup.body) & before == {"acc"}


@pytest.mark.parametrize("act", list(ACT_OPS))
def test_activations_padded_columns_masked(act):
    model, mod = layer(24, 13, act, torch.float32, split_k=2, block_k=16)   # sigmoid(0) != 0 past column 13
    check(model, mod, torch.randn(37, 24))


def test_leading_dims_strides_and_empty_batch():
    model, mod = layer(24, 13, nn.GELU, torch.float32)
    check(model, mod, torch.randn(2, 3, 24))
    check(model, mod, torch.randn(24, 5).t())
    assert mod(torch.randn(0, 24)).shape == (0, 13)


def test_reference_when_kernels_are_off():
    model, mod = layer(24, 13, nn.ReLU, torch.float32)
    mod.use_kernel = False
    x = torch.randn(3, 24)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), model(x))
    assert mod.fallbacks == 1 and mod.launches == 0


def test_config_choice_splits_k_for_small_batch_only():
    spec = GemmSpec(1024, 1024, torch.float32)
    small, large = choose_gemm_config(1, spec, rowwise=False), choose_gemm_config(4096, spec)
    assert small.split_k > 1 and large.split_k == 1
    assert choose_gemm_config(64, spec, allow_tf32=True).precision == "tf32"
    assert why_not_gemm(spec, small) is None
    assert "split_k" in why_not_gemm(spec, choose_gemm_config(1, spec, split_k=3))
    assert "powers of two" in why_not_gemm(spec, choose_gemm_config(1, spec, block_n=3))


@pytest.mark.parametrize("m,dtype,rowwise,block_m", [
    (1, torch.float32, True, 1), (3, torch.float32, True, 4), (16, torch.float32, True, 16),
    (17, torch.float32, True, 16), (64, torch.float32, True, 64), (256, torch.float32, True, 64),
    (257, torch.float32, False, 64),
    (16, torch.float16, True, 16), (17, torch.float16, False, 32)])
def test_config_row_wise_for_small_batch(m, dtype, rowwise, block_m):
    """Small batch: the GEMV form, batch rounded up to a power of two (past 16 rows, fp32 IEEE
    only: 16, 32 or 64 rows per program), W spread over >= 128 programs at width 1024; narrow
    layers get one column per program; tensor-core dtypes leave it past 16 rows."""
    spec = GemmSpec(1024, 1024, dtype)
    cfg = choose_gemm_config(m, spec)
    assert (cfg.rowwise, cfg.block_m) == (rowwise, block_m) and why_not_gemm(spec, cfg) is None
    if rowwise:
        assert -(-1024 // cfg.block_n) * cfg.split_k >= 128
        assert cfg.block_m * cfg.block_n * cfg.block_k <= 2048 * cfg.num_warps
        assert cfg.pipelined and cfg.num_stages >= 2   # the K loop's loads go through shared memory
        assert "in tl.range(" in generate_gemm(spec, (), cfg)[0]
    assert choose_gemm_config(1, GemmSpec(128, 128, torch.float32)).block_n == 1
    assert not choose_gemm_config(17, spec, allow_tf32=True).rowwise
    for m, n, tile in ((1, 2048, (4, 512)), (16, 2048, (8, 128)), (16, 4096, (8, 128)), (16, 1024, (4, 128)),
                       (16, 512, (4, 128))):   # up to 16 rows: few columns, long K steps (rowwise_probe)
        wide = choose_gemm_config(m, GemmSpec(n, n, torch.float32))
        assert (wide.block_n, wide.block_k) == tile


def test_row_wise_stages_bounded_by_shared_memory():
    """Four K steps in flight where the staged tiles fit 64 KB; fewer for wide tiles; none
    (a plain loop) where one step alone would not fit."""
    assert _rowwise_stages(16, 8, 128, torch.float32) == 4      # 12 KB a step
    assert _rowwise_stages(64, 64, 64, torch.float32) == 2      # 32 KB a step
    assert _rowwise_stages(64, 64, 256, torch.float32) == 0
    cfg = choose_gemm_config(16, GemmSpec(1024, 1024, torch.float32), block_k=1024, pipelined=False)
    assert "in tl.range(" not in generate_gemm(GemmSpec(1024, 1024, torch.float32), (), cfg)[0]


def test_config_checks():
    spec = GemmSpec(1024, 1024, torch.float32)
    bad = GemmSpec(8, 8, torch.float32, (Pointwise(1, "relu", (("value", 2),)),), 1)
    assert "cannot see" in why_not_gemm(bad)
    assert 'input_precision="ieee"' in layer(24, 13, nn.ReLU, torch.float32, m=257)[1].source


@pytest.mark.cuda   # each case compiles its own kernel: kept few
@pytest.mark.parametrize("m,k,n,dtype", [(1, 1024, 1024, torch.float32), (64, 1024, 1024, torch.float32),
                                         (37, 100, 130, torch.float32), (4096, 512, 256, torch.float32),
                                         (1, 1024, 1024, torch.float16), (64, 512, 256, torch.bfloat16)])
def test_gpu_epilogue_gemm(m, k, n, dtype):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model, mod = layer(k, n, nn.GELU, dtype, device="cuda", m=m)
        for _ in range(3):   # repeated launches: the split-K counters must reset every time
            check(model, mod, torch.randn(m, k, dtype=dtype, device="cuda"))
        assert int(mod.counters.abs().sum()) == 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("m,k,dtype,keep", [(16, 2048, torch.float32, True), (9, 4096, torch.float32, True),
                                            (1, 2048, torch.float32, False), (16, 1024, torch.float32, False),
                                            (64, 2048, torch.float32, False), (16, 2048, torch.float16, False)])
def test_row_wise_keeps_x_in_l2_from_k_2048(m, k, dtype, keep):
    """2-16 fp32 rows and K >= X_KEPT_FROM_K (where it was measured): x's loads carry
    evict_last (the rule's config only; the kernel is checked at a tiny shape below)."""
    spec = GemmSpec(k, 64, dtype)
    cfg = choose_gemm_config(m, spec)
    assert cfg.rowwise and cfg.keep_x == keep
    assert ('eviction_policy="evict_last"' in generate_gemm(spec, (), cfg)[0]) == keep


@pytest.mark.parametrize("m", [1, 7])
def test_row_wise_kept_x_computes_the_same(m):
    model, mod = layer(37, 24, nn.ReLU, torch.float32, m=m, keep_x=True, block_k=16)
    assert 'eviction_policy="evict_last"' in mod.source
    check(model, mod, torch.randn(m, 37))
