"""3xTF32 (option tf32x3, fxfuse/tf32x3.py) on the CPU: the split, the numerics guard, the plan's
candidate and the kernel config it builds. The interpreter ignores input_precision, so the
kernel's own numerics are checked by the GPU test (tests/test_gpu_tf32x3.py)."""
import warnings

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.cost_model import CostModel, LinearLayer
from fxfuse.errors import OptionError
from fxfuse.gemm_kernel import EpilogueGemm, GemmSpec, choose_gemm_config
from fxfuse.tf32x3 import measure_tf32x3, round_to_tf32, split_tf32, tf32x3_linear, truncate_to_tf32

from test_cost_model import calibration, grid, lib_us, write


def test_split_keeps_21_bits_and_leaves_specials_alone():
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-20, 20, 4096)
    hi, lo = split_tf32(x)
    assert torch.equal(round_to_tf32(hi), hi) and torch.equal(truncate_to_tf32(lo), lo)   # both are TF32 values
    assert ((hi + lo - x).abs() / x.abs()).max() < 2.0 ** -20
    assert not torch.equal(hi, x)                                                        # the split did something
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    hi, lo = split_tf32(special)
    assert torch.equal(hi[:2], special[:2]) and hi[2].isnan() and torch.equal(lo, torch.zeros(5))
    assert round_to_tf32(torch.tensor([1.0 + 2.0 ** -11])).item() == 1.0 + 2.0 ** -10    # ties away from zero


def test_truncated_split_of_x_keeps_20_bits_and_never_overflows():
    """split_dot_step truncates x's high part (no rounding add, nothing rounds to inf); the
    guard's emulation splits x the same way."""
    from fxfuse.tf32x3 import truncated_parts
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-20, 20, 4096)
    hi, lo = truncated_parts(x)
    assert torch.equal(truncate_to_tf32(hi), hi) and torch.equal(truncate_to_tf32(lo), lo)
    assert ((hi + lo - x).abs() / x.abs()).max() < 2.0 ** -19 and not torch.equal(hi, x)
    big = torch.tensor([3.4028235e38, -3.4028235e38, float("inf"), float("nan")])
    hi, lo = truncated_parts(big)
    assert hi[:2].isfinite().all() and hi[2].isinf() and hi[3].isnan() and torch.equal(lo[2:], torch.zeros(2))


def test_emulation_is_fp32_accurate_where_tf32_is_not():
    torch.manual_seed(1)
    x, w = torch.randn(37, 300), torch.randn(53, 300)
    ref = x.double() @ w.double().t()
    err = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    tf32 = torch.nn.functional.linear(round_to_tf32(x), round_to_tf32(w))
    assert err(tf32x3_linear(x, w)) < 1e-6 < 1e-4 < err(tf32)
    rec = measure_tf32x3(x, w)
    assert rec["ok"] and rec["tolerance"] == 1e-5 and rec["error"] < 1e-6
    assert not measure_tf32x3(x, w, tolerance=0.0)["ok"]


def test_option_values():
    with pytest.raises(OptionError, match="tf32x3"):
        fxfuse.optimize(nn.Linear(4, 4), torch.randn(2, 4), tf32x3="on")


def test_config_uses_tensor_core_tiles_past_the_row_wise_batches():
    spec = GemmSpec(2048, 2048, torch.float32)
    at256 = choose_gemm_config(256, spec, tf32x3=True)
    assert at256.precision == "tf32x3" and at256.split_weights and (at256.block_m, at256.block_n) == (64, 64)
    big = choose_gemm_config(4096, GemmSpec(4096, 4096, torch.float32), tf32x3=True)
    assert big.split_weights and (big.block_m, big.block_n) == (128, 128)
    at64 = choose_gemm_config(64, GemmSpec(1024, 1024, torch.float32), tf32x3=True)
    assert at64.block_m == 64 and not at64.split_weights and at64.precision == "tf32x3"
    assert (at64.block_n, at64.block_k, at64.split_k) == (32, 128, 4)      # long K steps (x3_small_probe)
    wide = choose_gemm_config(64, GemmSpec(4096, 4096, torch.float32), tf32x3=True)
    assert (wide.block_n, wide.block_k, wide.split_k) == (64, 64, 4)      # two programs per SM
    narrow = choose_gemm_config(64, GemmSpec(512, 512, torch.float32), tf32x3=True)
    assert (narrow.block_n, narrow.block_k) == (64, 32)
    small = choose_gemm_config(8, spec, tf32x3=True)
    assert small.rowwise and small.precision == "ieee"             # <= 16 rows: the row-wise GEMV form
    assert choose_gemm_config(256, spec, allow_tf32=True, tf32x3=True).precision == "tf32"
    assert choose_gemm_config(256, GemmSpec(64, 64, torch.float16), tf32x3=True).precision == "ieee"   # unused there


def x3_calibration(factor=0.5):
    """gemm_x3 measured at `factor` x the library, the IEEE GEMM at 2x."""
    return calibration(gemm_epilogue=grid(lambda m, h: 2 * lib_us(m, h)),
                       gemm_tf32x3=grid(lambda m, h: factor * lib_us(m, h)))


def test_cost_model_prices_gemm_x3_from_its_own_table():
    model = CostModel.from_dict(x3_calibration())
    layer = LinearLayer(256, 1024, 1024, torch.float32)
    assert model.estimate("gemm_x3", layer).us < model.estimate("library", layer).us < model.estimate("gemm", layer).us


def _plans(opt):
    return next(iter(opt._specializations.values())).gm.meta["fxfuse_plans"]


def _gemms(opt):
    gm = next(iter(opt._specializations.values())).gm
    return [m for m in gm.modules() if isinstance(m, EpilogueGemm)]


def seed(h=48, layers=3):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(h, h), nn.ReLU())]).eval()


@pytest.mark.parametrize("batch", [40, 19])
def test_auto_plans_and_builds_tf32x3_gemms(tmp_path, batch):
    """Where its table says so, every layer runs as one 3xTF32 GEMM; results match eager; the
    plan table and the decision line say it, with the guard's error."""
    model = seed(h=48, layers=3)
    x = torch.randn(batch, 48)
    opt = fxfuse.optimize(model, x, tf32x3="auto", fused_mlp="off", calibration=str(write(tmp_path, x3_calibration())))
    assert [p["choice"] for p in _plans(opt)] == ["gemm_x3"] * 3
    gemms = _gemms(opt)
    assert len(gemms) == 3 and all(g.config.precision == "tf32x3" and not g.config.rowwise for g in gemms)
    assert fxfuse.stats(opt)["library_calls"] == 0
    with torch.no_grad():
        fresh = torch.randn(batch, 48)
        torch.testing.assert_close(opt(fresh), model(fresh))
    report = fxfuse.explain(opt)
    assert "gemm_x3" in report and "3xTF32 (error" in report and "tf32x3" in report


def test_off_by_default_and_the_reason_is_shown(tmp_path):
    model, x = seed(), torch.randn(40, 48)
    opt = fxfuse.optimize(model, x, fused_mlp="off", calibration=str(write(tmp_path, x3_calibration())))
    assert all(p["choice"] != "gemm_x3" for p in _plans(opt))
    assert all("tf32x3='off'" in p["reasons"]["gemm_x3"] for p in _plans(opt))
    assert all(g.config.precision == "ieee" for g in _gemms(opt))


def test_unmeasured_table_is_never_chosen_but_force_builds_it(tmp_path):
    model, x = seed(), torch.randn(40, 48)
    path = str(write(tmp_path, calibration(gemm_epilogue=grid(lambda m, h: 0.5 * lib_us(m, h)))))
    opt = fxfuse.optimize(model, x, tf32x3="auto", fused_mlp="off", calibration=path)
    assert all("no 'gemm_tf32x3' table" in p["reasons"]["gemm_x3"] for p in _plans(opt))
    assert all(g.config.precision == "ieee" for g in _gemms(opt)) and len(_gemms(opt)) == 3
    forced = fxfuse.optimize(model, x, tf32x3="force", gemm="force", fused_mlp="off", calibration=path)
    assert len(_gemms(forced)) == 3 and all(g.config.precision == "tf32x3" for g in _gemms(forced))
    with torch.no_grad():
        torch.testing.assert_close(forced(x), model(x))


def test_guard_failure_keeps_ieee_and_says_why(tmp_path):
    """tolerance=0: 3xTF32's error cannot pass; the planned layers go to the library (auto) or
    to the IEEE GEMM (gemm='force'), and explain() says why."""
    model, x = seed(), torch.randn(40, 48)
    path = str(write(tmp_path, x3_calibration()))
    opt = fxfuse.optimize(model, x, tf32x3="auto", fused_mlp="off", tolerance=0.0, calibration=path)
    assert _gemms(opt) == [] and fxfuse.stats(opt)["library_calls"] == 3
    assert "no 3xTF32: its error exceeds" in fxfuse.explain(opt)
    forced = fxfuse.optimize(model, x, tf32x3="auto", gemm="force", fused_mlp="off", tolerance=0.0, calibration=path)
    assert len(_gemms(forced)) == 3 and all(g.config.precision == "ieee" for g in _gemms(forced))


def test_tf32_allowed_or_half_precision_never_uses_it(tmp_path):
    path = str(write(tmp_path, x3_calibration()))
    model, x = seed(), torch.randn(40, 48)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        opt = fxfuse.optimize(model, x, tf32x3="auto", fused_mlp="off", calibration=path)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert all("TF32 is allowed" in p["reasons"]["gemm_x3"] for p in _plans(opt))
    assert all(g.config.precision == "tf32" for g in _gemms(opt))
    half = fxfuse.optimize(seed().half(), x.half(), tf32x3="force", fused_mlp="off", calibration=path)
    assert all("float16 runs on tensor cores" in p["reasons"]["gemm_x3"] for p in _plans(half))


def test_residual_chain_and_odd_sizes(tmp_path):
    """A residual MLP block with odd widths and a 3-D input: 3xTF32 GEMMs where planned, the
    skip in the epilogue, results as eager."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(37, 37), nn.Linear(37, 29)

        def forward(self, x):
            return self.b(x + torch.tanh(self.a(x)))
    torch.manual_seed(3)
    model, x = Block().eval(), torch.randn(3, 11, 37)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, x, tf32x3="auto", fused_mlp="off", calibration=str(write(tmp_path, x3_calibration())))
    assert [p["choice"] for p in _plans(opt)] == ["gemm_x3", "gemm_x3"]
    assert all(g.config.precision == "tf32x3" for g in _gemms(opt)) and len(_gemms(opt)) == 2
    with torch.no_grad():
        fresh = torch.randn(3, 11, 37)
        torch.testing.assert_close(opt(fresh), model(fresh))


def test_row_wise_batches_keep_the_ieee_gemv(tmp_path):
    model, x = seed(), torch.randn(5, 48)
    opt = fxfuse.optimize(model, x, tf32x3="auto", fused_mlp="off", calibration=str(write(tmp_path, x3_calibration())))
    assert all("row-wise GEMV" in p["reasons"]["gemm_x3"] for p in _plans(opt))
    assert all(g.config.precision == "ieee" for g in _gemms(opt))


# ---------------------------------------------------------------------------- Strassen's products

def _targets(opt):
    gm = next(iter(opt._specializations.values())).gm
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_batched_kernel_matches_bmm_on_odd_sizes_and_strides():
    from fxfuse.tf32x3 import bmm_tf32x3, tf32x3_bmm
    torch.manual_seed(4)
    a, b = torch.randn(7, 37, 50), torch.randn(7, 50, 29)
    torch.testing.assert_close(bmm_tf32x3(a, b), torch.bmm(a, b))
    torch.testing.assert_close(tf32x3_bmm(a, b), torch.bmm(a, b))
    at = torch.randn(3, 70, 33).transpose(1, 2)           # [3, 33, 70], not contiguous
    bt = torch.randn(3, 20, 70).transpose(1, 2)           # [3, 70, 20]
    torch.testing.assert_close(bmm_tf32x3(at, bt), torch.bmm(at, bt))
    assert bmm_tf32x3(torch.randn(2, 0, 5), torch.randn(2, 5, 3)).shape == (2, 0, 3)
    torch.testing.assert_close(bmm_tf32x3(torch.randn(2, 4, 0), torch.randn(2, 0, 3)), torch.zeros(2, 4, 3))
    half = torch.randn(2, 4, 8).half()
    torch.testing.assert_close(bmm_tf32x3(half, half.transpose(1, 2)), torch.bmm(half, half.transpose(1, 2)))



def test_batched_kernel_from_stored_parts_keeps_eagers_nan_and_inf():
    """The split form (B's TF32 parts made once) computes a tile again with the low products'
    NaN masked where it saw NaN: inf in A gives eager's inf, not NaN, and NaN stays NaN."""
    from fxfuse.tf32x3 import bmm_tf32x3, stored_parts
    torch.manual_seed(5)
    a, b = torch.randn(3, 40, 37), torch.randn(3, 37, 45)
    a[0, 3, 2], a[1, 30, 36], a[2, 17, 0] = float("inf"), -float("inf"), float("nan")
    hi, lo = stored_parts(b)
    got, want = bmm_tf32x3(a, hi, lo), torch.bmm(a, b)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite])

@pytest.mark.parametrize("levels", [1, 2])
def test_forced_strassen_runs_its_products_in_tf32x3(levels):
    from fxfuse.tf32x3 import bmm_tf32x3
    model, x = seed(h=44, layers=2), torch.randn(2, 19, 44)
    opt = fxfuse.optimize(model, x, strassen="force", strassen_levels=levels, tf32x3="force", fused_mlp="off",
                          gemm="off")
    targets = _targets(opt)
    assert targets.count(bmm_tf32x3) == 2 and torch.bmm not in targets
    assert "3xTF32 batched GEMM" in fxfuse.explain(opt)
    with torch.no_grad():
        fresh = torch.randn(2, 19, 44)
        torch.testing.assert_close(opt(fresh), model(fresh))
    plain = fxfuse.optimize(model, x, strassen="force", strassen_levels=levels, fused_mlp="off", gemm="off")
    assert _targets(plain).count(torch.bmm) == 2 and bmm_tf32x3 not in _targets(plain)


def test_cost_model_prices_strassen_products_from_the_tf32x3_tables():
    fast = calibration(bmm7=grid(lambda m, h: 10 * lib_us(m, h)), bmm49=grid(lambda m, h: 10 * lib_us(m, h)),
                       bmm7_tf32x3=grid(lambda m, h: 0.1 * lib_us(m, h)),
                       bmm49_tf32x3=grid(lambda m, h: 0.1 * lib_us(m, h)))
    model = CostModel.from_dict(fast)
    ieee, x3 = LinearLayer(1024, 4096, 4096, torch.float32), LinearLayer(1024, 4096, 4096, torch.float32, x3_products=True)
    for c in ("strassen1", "strassen2"):
        assert model.estimate(c, x3).us < model.estimate("library", x3).us < model.estimate(c, ieee).us


def test_strassen_x3_products_are_charged_like_gemm_x3():
    """gemm_x3 alone carried X3_PREFERENCE: a near-tie between gemm_x3 and Strassen with 3xTF32
    products went to Strassen (H100, 8 x 4096 at batch 256: 960 us against gemm_x3's 876)."""
    from fxfuse.cost_model import X3_PREFERENCE
    same = calibration(bmm7_tf32x3=grid(lambda m, h: 0.5 * lib_us(m, h)), bmm49_tf32x3=grid(lambda m, h: 0.5 * lib_us(m, h)))
    model = CostModel.from_dict(same)
    x3 = LinearLayer(1024, 4096, 4096, torch.float32, x3_products=True)
    body = model._body("strassen1", x3).us
    raw = CostModel.from_dict(same)
    import fxfuse.cost_model as cm
    try:
        cm.X3_PREFERENCE = 1.0
        assert body == pytest.approx(X3_PREFERENCE * raw._body("strassen1", x3).us)
    finally:
        cm.X3_PREFERENCE = X3_PREFERENCE


def test_plan_marks_layers_for_tf32x3_products_only_where_measured(tmp_path):
    from fxfuse.options import Options
    from passes.plan_linears import _with_tf32x3_products
    layer = LinearLayer(1024, 4096, 4096, torch.float32)
    tables = dict(bmm7_tf32x3=grid(lib_us), bmm49_tf32x3=grid(lib_us))
    measured, unmeasured = CostModel.from_dict(calibration(**tables)), CostModel.from_dict(calibration())
    assert _with_tf32x3_products(layer, Options(strassen="auto", tf32x3="auto"), measured).x3_products
    assert not _with_tf32x3_products(layer, Options(strassen="auto", tf32x3="auto"), unmeasured).x3_products
    assert _with_tf32x3_products(layer, Options(strassen="auto", tf32x3="force"), unmeasured).x3_products
    assert not _with_tf32x3_products(layer, Options(strassen="auto"), measured).x3_products
    half = LinearLayer(1024, 4096, 4096, torch.float16)
    assert not _with_tf32x3_products(half, Options(strassen="auto", tf32x3="force"), measured).x3_products


def test_strassen_stores_its_tf32x3_operand_k_major():
    from fxfuse.tf32x3 import bmm_tf32x3
    model, x = seed(h=44, layers=1), torch.randn(19, 44)
    opt = fxfuse.optimize(model, x, strassen="force", tf32x3="force", fused_mlp="off", gemm="off")
    gm = next(iter(opt._specializations.values())).gm
    (call,) = [n for n in gm.graph.nodes if n.target is bmm_tf32x3]
    hi, lo = (getattr(gm, a.target) for a in call.args[1:])
    assert hi.stride(1) == 1 and hi.stride(2) == hi.shape[1] and lo.stride() == hi.stride()
    assert torch.equal(split_tf32(hi + lo)[0], hi)        # the TF32 parts of R


@pytest.mark.parametrize("special", [False, True])
def test_split_weight_form_past_256_rows(special):
    """300 rows: the GEMM takes W's TF32 parts made once (split_weights) and splits x in the
    kernel; results as eager, inf and NaN in x included (the low products' NaN of 0 * inf is
    not eager's and is dropped)."""
    torch.manual_seed(5)
    model, x = seed(h=40, layers=2), torch.randn(300, 40)
    opt = fxfuse.optimize(model, x, gemm="force", tf32x3="force", fused_mlp="off")
    gemms = _gemms(opt)
    assert len(gemms) == 2 and all(g.config.split_weights for g in gemms)
    w, w_hi, w_lo = model[0].weight.detach(), gemms[0].weight, gemms[0].weight_lo
    assert not torch.equal(w_hi, w) and ((w_hi + w_lo - w).abs() <= 2.0 ** -21 * w.abs()).all()
    fresh = torch.randn(300, 40)
    if special:
        fresh[3, 5], fresh[7, 1], fresh[9] = float("inf"), float("nan"), 1.0
    with torch.no_grad():
        torch.testing.assert_close(opt(fresh), model(fresh), equal_nan=True)


@pytest.mark.parametrize("k", [96, 301])
def test_split_form_with_split_k_redoes_only_nan_tiles_and_keeps_eagers_inf(k):
    """The split-weights GEMM runs plain K steps and computes a tile again with the low
    products' NaN masked only where its sum came out NaN; with split-K each split does so on
    its own K range. inf in x and in W must come out as eager's inf, finite tiles unchanged."""
    torch.manual_seed(0)
    lin = nn.Linear(k, 24, bias=False).eval()
    with torch.no_grad():
        lin.weight[5, 7] = float("inf")
        lin.weight[6, ::5] = 0.0
    cfg = choose_gemm_config(260, GemmSpec(k, 24, torch.float32), tf32x3=True)
    assert cfg.split_weights and cfg.split_k > 1, cfg
    mod = EpilogueGemm(GemmSpec(k, 24, torch.float32), lin.weight, [], torch.fx.symbolic_trace(lin), (), config=cfg)
    assert "nan_in(acc)" in mod.source and "MASK_NAN=True" in mod.source
    x = torch.randn(260, k)
    x[3, 2], x[100, k - 1], x[200, 40] = float("inf"), -float("inf"), float("nan")
    with torch.no_grad():
        got, want = mod(x), lin(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    ok = want.isfinite()
    assert (got[ok] - want[ok]).abs().max() <= 1e-5 * want[ok].abs().max()


def test_in_place_weight_edit_after_optimize_reaches_the_split_copies():
    """The split-weights GEMM holds TF32 parts of W (copies): an in-place edit of W after
    optimize() must not leave them stale (the runtime rebuilds, with its one warning)."""
    torch.manual_seed(6)
    model, x = seed(h=40, layers=2), torch.randn(300, 40)
    opt = fxfuse.optimize(model, x, gemm="force", tf32x3="force", fused_mlp="off")
    assert all(g.config.split_weights for g in _gemms(opt))
    with torch.no_grad():
        model[0].weight.mul_(-2.0)
        fresh = torch.randn(300, 40)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(opt(fresh), model(fresh))


# ---------------------------------------------------------------------------- fuzz26's findings

def test_force_reaches_layers_the_plan_left_to_the_library(tmp_path):
    """tf32x3='force' with gemm='force': every fp32 GEMM runs 3xTF32, also where the plan (which
    runs with the default fused_mlp='auto') chose the library for the layer."""
    model = nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 48)).eval()
    slow = str(write(tmp_path, calibration(gemm_tf32x3=grid(lambda m, h: 3 * lib_us(m, h)))))
    for kw in ({}, {"calibration": slow}):
        opt = fxfuse.optimize(model, torch.randn(300, 48), tf32x3="force", gemm="force", **kw)
        assert [g.config.precision for g in _gemms(opt)] == ["tf32x3", "tf32x3"]


def test_row_wise_gemm_under_force_does_not_claim_tf32x3():
    model = nn.Sequential(nn.Linear(40, 40), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(8, 40), gemm="force", tf32x3="force", fused_mlp="off")
    assert [g.config.precision for g in _gemms(opt)] == ["ieee"]
    assert "3xTF32 (error" not in fxfuse.explain(opt)


def test_fp64_reason_names_the_dtype(tmp_path):
    model = seed().double()
    opt = fxfuse.optimize(model, torch.randn(40, 48, dtype=torch.float64), tf32x3="force", fused_mlp="off",
                          calibration=str(write(tmp_path, x3_calibration())))
    assert all("float64: 3xTF32 stands in for fp32" in p["reasons"]["gemm_x3"] for p in _plans(opt))


def test_values_next_to_the_fp32_limit_stay_finite():
    """|x| within 2^-11 of the largest fp32 would round to inf in the split: truncated instead."""
    assert torch.isfinite(split_tf32(torch.tensor([3.4028e38, -3.4025e38]))[0]).all()
    model = nn.Linear(40, 8).eval()
    with torch.no_grad():
        model.weight.mul_(1e-3)
    opt = fxfuse.optimize(model, torch.randn(300, 40), gemm="force", tf32x3="force", fused_mlp="off")
    assert all(g.config.split_weights for g in _gemms(opt))
    x = torch.randn(300, 40)
    x[4, 3] = 3.4025e38
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want)


def test_one_level_strassen_needs_only_the_one_level_table():
    from fxfuse.options import Options
    from passes.plan_linears import _with_tf32x3_products
    layer = LinearLayer(1024, 4096, 4096, torch.float32)
    model = CostModel.from_dict(calibration(bmm7_tf32x3=grid(lib_us)))
    assert _with_tf32x3_products(layer, Options(strassen="auto", strassen_levels=1, tf32x3="auto"), model).x3_products
    assert not _with_tf32x3_products(layer, Options(strassen="auto", tf32x3="auto"), model).x3_products


# ---------------------------------------------------------------------------- review26's findings

def test_inf_in_the_weight_gives_eagers_inf_not_nan():
    """The stored low part of an inf is NaN, so the kernel drops that step's low products (a
    low part of 0 gave a_lo * inf of either sign, NaN where eager has inf)."""
    from fxfuse.gemm_kernel import GemmSpec as Spec
    from fxfuse.tf32x3 import bmm_tf32x3, stored_parts
    torch.manual_seed(0)
    lin = nn.Linear(40, 8, bias=False).eval()
    with torch.no_grad():
        lin.weight[2, 7] = float("inf")
    cfg = choose_gemm_config(300, Spec(40, 8, torch.float32), tf32x3=True)
    mod = EpilogueGemm(Spec(40, 8, torch.float32), lin.weight, [], torch.fx.symbolic_trace(lin), (), config=cfg)
    x = torch.randn(300, 40)
    with torch.no_grad():
        got, want = mod(x), lin(x)
    assert cfg.split_weights and mod.launches == 1
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    b = torch.randn(2, 40, 8)
    b[1, 7, 2] = -float("inf")
    hi, lo = stored_parts(b)
    got = bmm_tf32x3(x[:64].reshape(2, 32, 40), hi, lo)
    want = torch.bmm(x[:64].reshape(2, 32, 40), b)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


@pytest.mark.parametrize("m,k,n", [(40, 1100, 24), (70, 2100, 72)])
def test_long_k_step_tiles_with_split_k_match_the_product(m, k, n):
    """Past 32 rows and from width 1024 the 3xTF32 GEMM takes 128- or 64-wide K steps with
    split-K; odd K and N leave partial steps and columns (the interpreter computes in fp32)."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False).eval()
    spec = GemmSpec(k, n, torch.float32)
    cfg = choose_gemm_config(m, spec, tf32x3=True)
    assert cfg.precision == "tf32x3" and cfg.block_k in (64, 128) and cfg.split_k > 1, cfg
    mod = EpilogueGemm(spec, lin.weight, [], torch.fx.symbolic_trace(lin), (), config=cfg)
    with torch.no_grad():
        for _ in range(2):                          # the second call: the split-K counters were reset
            x = torch.randn(m, k)
            got, want = mod(x), lin(x)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert mod.launches == 2


def test_guard_measures_only_what_is_built(tmp_path):
    """tf32x3='force' with gemm='auto': a layer the plan leaves to the library, or one of <= 16
    rows, is not measured (a float64 product per layer, and a run of the graph, for nothing)."""
    import passes.fuse_gemm as fg
    calls = []
    real = fg.measure_tf32x3
    fg.measure_tf32x3 = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        slow = str(write(tmp_path, calibration(gemm_tf32x3=grid(lambda m, h: 3 * lib_us(m, h)))))
        for rows in (8, 300):
            opt = fxfuse.optimize(seed(), torch.randn(rows, 48), tf32x3="force", calibration=slow, fused_mlp="off")
            assert [p["choice"] for p in _plans(opt)] == ["library"] * 3 and _gemms(opt) == []
    finally:
        fg.measure_tf32x3 = real
    assert not calls


def test_strassen_without_kernels_keeps_torch_bmm_and_counts_both_parts():
    from fxfuse.tf32x3 import bmm_tf32x3
    model, x = seed(h=44, layers=1), torch.randn(19, 44)
    off = fxfuse.optimize(model, x, strassen="force", tf32x3="force", fused_mlp="off", gemm="off", use_kernels=False)
    assert torch.bmm in _targets(off) and bmm_tf32x3 not in _targets(off)
    on = fxfuse.optimize(model, x, strassen="force", tf32x3="force", fused_mlp="off", gemm="off")
    gm_on, gm_off = (next(iter(o._specializations.values())).gm for o in (on, off))
    rec = lambda gm: next(n.meta["fxfuse"] for n in gm.graph.nodes if n.meta.get("fxfuse", {}).get("extra_weight_bytes"))  # noqa: E731
    assert rec(gm_on)["extra_weight_bytes"] == 2 * rec(gm_off)["extra_weight_bytes"]


def test_nan_in_the_example_says_the_error_cannot_be_measured():
    model, x = seed(), torch.randn(40, 48)
    x[2, 3] = float("nan")
    opt = fxfuse.optimize(model, x, gemm="force", tf32x3="force", fused_mlp="off", verify=False)
    assert "error cannot be measured" in fxfuse.explain(opt)
    assert all(g.config.precision == "ieee" for g in _gemms(opt))
