"""GPU tests of 3xTF32 (option tf32x3): the real tensor-core kernel's error against float64 stays
at fp32's level (the interpreter cannot show it: it ignores input_precision), and the shipped
calibration makes "auto" choose it where it measured faster.

Run on a CUDA machine with the interpreter off: TRITON_INTERPRET=0 python -m pytest tests -m cuda
"""
import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.cost_model import CostModel
from fxfuse.demo import seed_network
from fxfuse.gemm_kernel import EpilogueGemm

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def _gemms(opt):
    gm = next(iter(opt._specializations.values())).gm
    return [m for m in gm.modules() if isinstance(m, EpilogueGemm)]


def _errors(opt, model, x):
    """(fxfuse's, eager fp32's) relative error against the float64 model."""
    ref = model.double()(x.double())
    model.float()
    err = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    return err(opt(x)), err(model(x))


@pytest.mark.parametrize("batch,hidden", [(256, 1024), (100, 300), (4096, 512), (64, 1024), (48, 2048)])
def test_forced_tf32x3_gemms_are_fp32_accurate(batch, hidden):
    torch.manual_seed(0)
    model = seed_network(hidden, 4).cuda()
    x = torch.randn(batch, hidden, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, gemm="force", tf32x3="force", fused_mlp="off")
    gemms = _gemms(opt)
    assert len(gemms) == 4 and all(g.config.precision == "tf32x3" for g in gemms)
    with torch.no_grad():
        for _ in range(2):
            fresh = torch.randn_like(x)
            ours, eager = _errors(opt, model, fresh)
            assert ours < max(3 * eager, 1e-6), (ours, eager)   # plain TF32 would be ~1e-3
    s = fxfuse.stats(opt)
    assert s["library_calls"] == 0 and s["reference_fallbacks"] == 0


def test_auto_takes_tf32x3_where_the_calibration_measured_it_faster():
    """The seed network at batch 1024, hidden 2048 (3xTF32 measured ~1.7x cuBLAS fp32 on the
    H100): "auto" plans gemm_x3 for every layer; results within fp32's error."""
    if "gemm_tf32x3" not in CostModel.load().tables:
        pytest.skip("no gemm_tf32x3 table in this GPU's calibration")
    torch.manual_seed(0)
    model = seed_network(2048, 3).cuda()
    x = torch.randn(1024, 2048, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, tf32x3="auto")
    plans = next(iter(opt._specializations.values())).gm.meta["fxfuse_plans"]
    assert [p["choice"] for p in plans] == ["gemm_x3"] * 3
    with torch.no_grad():
        ours, eager = _errors(opt, model, torch.randn_like(x))
    assert ours < max(3 * eager, 1e-6)
    assert "3xTF32 (error" in fxfuse.explain(opt)


def test_residual_block_three_d():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(200, 200), nn.Linear(200, 136)

        def forward(self, x):
            return self.b(x + torch.nn.functional.gelu(self.a(x)))
    torch.manual_seed(1)
    model, x = Block().cuda().eval(), torch.randn(5, 77, 200, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, gemm="force", tf32x3="force", fused_mlp="off")
    assert len(_gemms(opt)) == 2 and all(g.config.precision == "tf32x3" for g in _gemms(opt))
    with torch.no_grad():
        ours, eager = _errors(opt, model, torch.randn_like(x))
    assert ours < max(3 * eager, 1e-6)


@pytest.mark.parametrize("levels", [1, 2])
def test_strassen_products_in_tf32x3_on_gpu(levels):
    """Strassen with its product call in 3xTF32: as accurate as Strassen with cuBLAS's fp32 bmm."""
    from fxfuse.tf32x3 import bmm_tf32x3
    torch.manual_seed(2)
    model = seed_network(2048, 3).cuda()
    x = torch.randn(512, 2048, device="cuda")
    kw = dict(strict=True, strassen="force", strassen_levels=levels, fused_mlp="off", gemm="off")
    x3 = fxfuse.optimize(model, x, tf32x3="force", **kw)
    ieee = fxfuse.optimize(model, x, **kw)
    gm = next(iter(x3._specializations.values())).gm
    assert sum(n.target is bmm_tf32x3 for n in gm.graph.nodes) == 3
    with torch.no_grad():
        fresh = torch.randn_like(x)
        ours, eager = _errors(x3, model, fresh)
        theirs, _ = _errors(ieee, model, fresh)
    assert ours < max(3 * theirs, 3 * eager, 1e-6), (ours, theirs, eager)


def test_split_weight_form_keeps_inf_and_nan_as_eager():
    torch.manual_seed(3)
    model = seed_network(512, 2).cuda()
    x = torch.randn(1024, 512, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, gemm="force", tf32x3="force", fused_mlp="off")
    assert all(g.config.split_weights for g in _gemms(opt)) and len(_gemms(opt)) == 2
    fresh = torch.randn_like(x)
    fresh[3, 5], fresh[7, 1], fresh[9] = float("inf"), float("nan"), 1.0
    with torch.no_grad():
        got, want = opt(fresh), model(fresh)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    ok = want.isfinite()
    assert ((got[ok] - want[ok]).abs() <= 1e-4 * want[ok].abs().max()).all()
