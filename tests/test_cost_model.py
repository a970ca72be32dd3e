"""The cost model (fxfuse/cost_model.py) on the CPU: estimates, chain decisions from synthetic
calibrations, and the fallback to the roofline when a calibration file cannot be used.

Synthetic tables are built from simple formulas at grid points, where the model returns the
measurement exactly, so each test states plainly which candidate should win where."""
import json
import math
import warnings

import pytest
import torch

from fxfuse.cost_model import (CALIBRATION_DIR, CANDIDATES, ENV_VAR, SCHEMA, CalibrationError, CalibrationWarning,
                               CostModel, Estimate, LinearLayer, calibration_name, validate_calibration)
from fxfuse.chain_plan import plan_chain

M = [1, 16, 64, 256, 1024, 4096]
H = [128, 256, 512, 1024, 2048, 4096, 8192]
WIDTHS = [64, 128, 256, 512]
F32 = torch.float32


def lib_us(m, h):
    """A cuBLAS-like layer: 2 us, then 40 TFLOP/s."""
    return 2.0 + 2.0 * m * h * h / 40e12 * 1e6


def grid(f, axes=("m", "h"), values=(M, H)):
    return {axes[0]: list(values[0]), axes[1]: list(values[1]),
            "us": [[f(a, b) for b in values[1]] for a in values[0]]}


def calibration(**tables) -> dict:
    """A valid calibration dict: library tables and a pointwise line by default, plus `tables`."""
    base = {"linear": grid(lib_us), "linear_bias": grid(lib_us),
            "pointwise": {"bytes": [1e3, 1e10], "us": [2.0, 2.0 + 1e10 / 2.5e12 * 1e6]}}
    base.update(tables)
    return {"schema": SCHEMA, "device": "Synthetic GPU", "torch": torch.__version__, "triton": None,
            "cuda": None, "created": "now", "command": "test",
            "ceilings": {"matmul_tflops": {"float32": 50.0}, "copy_gbps": 3000.0, "launch_us_graph": 1.0,
                         "launch_us_eager": 8.0},
            "tables": {name: {"float32": t} for name, t in base.items()}, "skipped": []}


def chain(m, h, layers, **kw):
    return [LinearLayer(m, h, h, F32, **kw) for _ in range(layers)]


def everything_legal(layers, without=()):
    """All but the fused MLP (given separately) and gemm_x3 (opt-in: tests/test_tf32x3.py)."""
    return [{c: None for c in CANDIDATES if c not in ("mlp", "gemm_x3") and c not in without} for _ in layers]


# ---------------------------------------------------------------------------- Estimate

def test_estimates_add_up():
    a = Estimate(1.5, flops=10, bytes=100, launches=1, source="calibration")
    b = Estimate(2.0, flops=5, bytes=50, launches=2)
    total = a + b
    assert (total.us, total.flops, total.bytes, total.launches) == (3.5, 15, 150, 3)
    assert total.source == "calibration+roofline"
    assert sum([a, b]) == total and sum([a]) == a
    assert "3.5 us" in str(total) and "3 launches" in str(total)


# ---------------------------------------------------------------------------- roofline

def test_roofline_is_monotone_and_near_the_ceilings():
    model = CostModel.roofline()
    for c in ("library", "gemm", "strassen1", "strassen2"):
        times = [model.estimate(c, LinearLayer(m, 1024, 1024, F32)).us for m in M[1:]]   # m = 1: padded
        assert times == sorted(times), (c, times)
        times = [model.estimate(c, LinearLayer(256, 1024, n, F32)).us for n in H]
        assert times == sorted(times), (c, times)
    big = model.estimate("library", LinearLayer(4096, 8192, 8192, F32))
    assert big.source == "roofline" and big.flops == 2 * 4096 * 8192 ** 2
    assert 0.95 < big.us / (big.flops / 51.6e12 * 1e6) < 1.05      # FLOP-bound at the fp32 ceiling
    tiny = model.estimate("gemm", LinearLayer(1, 64, 64, F32))
    assert tiny.launches == 1 and tiny.us < 2.0                       # one launch from a CUDA graph
    s2 = model.estimate("strassen2", LinearLayer(4096, 8192, 8192, F32))
    assert s2.us < big.us and s2.launches == 3                        # 49/64 of the FLOPs + 2 kernels


def test_roofline_alone_orders_the_narrow_mlp_and_the_wide_one():
    model = CostModel.roofline()
    for h, fused in ((128, True), (1024, False)):
        layers = chain(1, h, 8)
        plans = plan_chain(model, layers, everything_legal(layers), lambda i, j: None)
        assert (plans[0].choice == "mlp") == fused, (h, plans[0].reasons)


def test_eager_launches_cost_more_than_graph_replays():
    layer = LinearLayer(1, 128, 128, F32, epilogue_ops=2)
    graphed, eager = CostModel.roofline(), CostModel.roofline(cuda_graphs=False)
    assert eager.estimate("library", layer).us > graphed.estimate("library", layer).us + 10


# ---------------------------------------------------------------------------- decisions flip

def test_strassen2_only_above_its_batch_and_size_thresholds():
    cheap = grid(lambda m, h: lib_us(m, h) * (0.6 if h >= 4096 and m >= 1024 else 1.5))
    model = CostModel.from_dict(calibration(bmm49=cheap))
    for m in (256, 1024, 4096):
        for h in (1024, 2048, 4096, 8192):
            layers = chain(m, h, 4)
            plans = plan_chain(model, layers, everything_legal(layers, without=("strassen1",)))
            want = "strassen2" if h >= 4096 and m >= 1024 else "library"
            assert [p.choice for p in plans] == [want] * 4, (m, h, plans[0].reasons)
            if want == "strassen2":
                assert plans[1].estimates["strassen2"].source == "calibration"


def test_fused_mlp_only_for_narrow_widths():
    mlp = grid(lambda m, w: 8 * lib_us(m, w) * (0.3 if w <= 256 else 3.0), ("m", "width"), (M, WIDTHS))
    model = CostModel.from_dict(calibration(mlp={**mlp, "layers": 8}))
    for w in (64, 128, 256, 512, 1024):
        layers = chain(16, w, 8)
        plans = plan_chain(model, layers, everything_legal(layers, without=("gemm",)), lambda i, j: None)
        if w <= 256:
            assert all(p.choice == "mlp" and p.segment == (0, 7) for p in plans), (w, plans[0].reasons)
        else:
            assert all(p.choice == "library" for p in plans), (w, plans[0].reasons)
            assert plans[3].reasons["mlp"].startswith("est ")


def strassen_boundary_model():
    """library 100 us; strassen1 standalone 15 + 80 + 15 = 110 us, but two in a row share
    one 5 us boundary kernel: 15 + 80 + 5 + 80 + 15 = 195 us < 200 us."""
    const = {name: grid(lambda m, h, v=v: v) for name, v in (("linear", 100.0), ("linear_bias", 100.0),
                                                             ("bmm7", 80.0), ("strassen1_prefix", 15.0),
                                                             ("strassen1_suffix", 15.0), ("strassen1_fused", 5.0))}
    const["pointwise"] = {"bytes": [1e3, 1e12], "us": [1.0, 1.0]}
    return CostModel.from_dict(calibration(**const))


def test_chain_beats_greedy_where_the_boundary_fuses():
    model = strassen_boundary_model()
    legal = [{"library": None, "strassen1": None}] * 2
    one = plan_chain(model, chain(1024, 1024, 1), legal[:1])
    assert one[0].choice == "library" and "est 110.0 us vs 100.0 us" in one[0].reasons["strassen1"]
    layers = chain(1024, 1024, 2)
    greedy = [min(("library", "strassen1"), key=lambda c: model.estimate(c, L).us) for L in layers]
    plans = plan_chain(model, layers, legal)
    assert greedy == ["library", "library"] and [p.choice for p in plans] == ["strassen1", "strassen1"]
    assert plans[0].estimates["strassen1"].us == pytest.approx(100.0)   # prefix + bmm + shared boundary
    assert plans[1].estimates["strassen1"].us == pytest.approx(95.0)    # no prefix: paid by layer 0
    assert plans[0].chain_us["strassen1"] == pytest.approx(195.0)
    assert plans[0].chain_us["library"] == pytest.approx(200.0)
    assert "chain with library here 200.0 us vs 195.0 us" in plans[0].reasons["library"]
    # a reader of y elsewhere makes the boundary kernel store it too: more bytes, more time
    read = LinearLayer(1024, 1024, 1024, F32, output_read_elsewhere=True)
    assert model.estimate("strassen1", read, None, "strassen1").bytes > plans[0].estimates["strassen1"].bytes


def test_plan_total_is_the_sum_of_estimates_in_context():
    model = CostModel.roofline()
    layers = [LinearLayer(4096, 4096, 8192, F32), LinearLayer(4096, 8192, 8192, F32),
              LinearLayer(4096, 8192, 4096, F32), LinearLayer(4096, 4096, 256, F32)]
    plans = plan_chain(model, layers, everything_legal(layers))
    names = [p.choice for p in plans]
    total = sum(model.estimate(c, L, names[i - 1] if i else None, names[i + 1] if i + 1 < len(names) else None)
                for i, (c, L) in enumerate(zip(names, layers)))
    assert total.us == pytest.approx(min(p.chain_us[p.choice] for p in plans))
    assert all(p.chain_us[p.choice] == pytest.approx(total.us) for p in plans)
    assert all(t >= total.us - 1e-6 for p in plans for t in p.chain_us.values())


def test_illegal_candidates_are_never_chosen_and_keep_their_reason():
    model = CostModel.from_dict(calibration(bmm49=grid(lambda m, h: 0.1 * lib_us(m, h))))
    layers = chain(4096, 8192, 3)
    reason = "error 3e-3 over the tolerance 1e-4 on the example input"
    legal = [{"library": None, "gemm": "dtype float64 has no fused GEMM kernel", "strassen2": reason}] * 3
    plans = plan_chain(model, layers, legal, mlp_legal=lambda i, j: "width 8192 > 1024 does not fit on chip")
    assert all(p.choice == "library" for p in plans)
    assert plans[1].reasons["strassen2"] == reason and "strassen2" not in plans[1].estimates
    assert plans[1].reasons["gemm"].startswith("dtype float64")
    assert plans[1].reasons["strassen1"] == "not offered by the pass"
    assert plans[1].reasons["mlp"] == "width 8192 > 1024 does not fit on chip"
    assert set(plans[0].reasons) == set(CANDIDATES) - {"library"}
    with pytest.raises(ValueError, match="no plan"):
        plan_chain(model, layers[:1], [{"gemm": "no"}])


def test_a_related_measurement_beats_extrapolating_into_another_regime():
    """A Strassen kernel table measured only at large (bandwidth-bound, L2-hot) sizes says
    nothing about a launch-bound tiny kernel: there the pointwise kernel measured at the same
    bytes counts. A Triton GEMM past its grid extrapolates its own efficiency, not cuBLAS's."""
    big = {"m": [1024, 4096], "h": [2048, 8192], "us": [[5.0, 30.0], [30.0, 120.0]]}
    pointwise = {"bytes": [1e3, 1e6, 1e9], "us": [3.0, 3.5, 400.0]}
    slow_gemm = grid(lambda m, h: 3 * lib_us(m, h), values=(M, H[:6]))          # measured up to h = 4096
    model = CostModel.from_dict(calibration(strassen1_prefix=big, pointwise=pointwise, gemm_epilogue=slow_gemm))
    assert model._head("strassen1", LinearLayer(16, 128, 128, F32), None).us == pytest.approx(3.0, rel=0.1)
    assert model._head("strassen1", LinearLayer(1024, 2048, 2048, F32), None).us == pytest.approx(5.0)
    assert model.estimate("gemm", LinearLayer(4096, 8192, 8192, F32)).us == pytest.approx(3 * lib_us(4096, 8192),
                                                                                          rel=0.05)


# ---------------------------------------------------------------------------- calibration files

def write(tmp_path, data, name="calibration.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def load_warns(**kw):
    """CostModel.load(**kw), asserting it fell back to the roofline with exactly one warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = CostModel.load(**kw)
    ours = [w for w in caught if issubclass(w.category, CalibrationWarning)]
    assert len(ours) == 1 and len(caught) == 1, [str(w.message) for w in caught]
    assert model.tables == {} and model.description.startswith("roofline")
    return str(ours[0].message)


def test_missing_file_falls_back_with_one_warning(tmp_path):
    assert "cannot read" in load_warns(path=tmp_path / "nope.json")


def test_corrupt_files_fall_back_with_one_warning(tmp_path):
    assert "JSONDecodeError" in load_warns(path=write(tmp_path, "{not json"))
    bad = calibration()
    bad["tables"]["linear"]["float32"]["us"] = [[1.0]]
    assert "does not match the axes" in load_warns(path=write(tmp_path, bad, "shape.json"))
    assert "schema" in load_warns(path=write(tmp_path, {**calibration(), "schema": 99}, "schema.json"))
    assert "not a JSON object" in load_warns(path=write(tmp_path, [1, 2], "list.json"))
    assert "missing key 'tables'" in load_warns(path=write(tmp_path, {"schema": 1, "device": "x", "ceilings": {}},
                                                            "keys.json"))
    with pytest.raises(CalibrationError):
        CostModel.from_dict({**calibration(), "ceilings": {"matmul_tflops": {"float32": -1}}})


def test_environment_variable_and_device_lookup(tmp_path, monkeypatch):
    path = write(tmp_path, calibration())
    monkeypatch.setenv(ENV_VAR, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CostModel.load().tables and "calibration.json" in CostModel.load().description
        monkeypatch.delenv(ENV_VAR)
        name = calibration_name("Synthetic GPU", "9.9.9+cu999", "1.0")
        assert name == "synthetic-gpu__torch-9.9.9__triton-1.0.json"
        write(tmp_path, calibration(), name)
        assert "synthetic-gpu" in CostModel.load(device_name="Synthetic GPU", directory=tmp_path).description
        assert CostModel.load(device_name="Other GPU", directory=tmp_path).tables == {}   # none: quietly roofline


def test_unknown_tables_are_ignored_and_holes_interpolate_around():
    data = calibration(future_table={"float32": {"anything": 1}})
    data["tables"]["linear"]["float32"]["us"][2][3] = None       # a skipped cell
    assert validate_calibration(data) == []
    model = CostModel.from_dict(data)
    est = model.estimate("library", LinearLayer(64, 1024, 1024, F32, epilogue_ops=0))
    assert est.source == "calibration" and math.isfinite(est.us) and est.us > 0


@pytest.mark.parametrize("path", sorted(CALIBRATION_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_calibration_is_valid_and_loads(path):
    assert validate_calibration(json.loads(path.read_text())) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = CostModel.load(path)
    for m, h in ((1, 128), (64, 1024), (4096, 8192)):
        for c in CANDIDATES:
            est = model.estimate(c, LinearLayer(m, h, h, F32))
            assert math.isfinite(est.us) and est.us > 0
        assert model.estimate("library", LinearLayer(m, h, h, F32)).source == "calibration"


def test_autotune_writes_a_file_the_model_loads(tmp_path):
    """The CPU smoke run of benchmarks.autotune (library sections only: no Triton needed)."""
    from benchmarks import autotune
    argv = ["--device", "cpu", "--out", str(tmp_path), "--sections", "linear,bmm", "--m", "1,8", "--h", "64,128",
            "--min-rep-ms", "1"]
    assert autotune.main(argv) == 0
    (path,) = tmp_path.glob("cpu__torch-*.json")
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["complete"] and {"linear", "bmm7", "bmm49"} <= set(data["tables"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = CostModel.load(path)
    assert model.estimate("strassen1", LinearLayer(8, 128, 128, F32)).source.startswith("calibration")


def test_optimize_with_a_missing_calibration_warns_once_and_still_optimizes(tmp_path):
    import warnings

    import torch.nn as nn

    import fxfuse
    from fxfuse.cost_model import CalibrationWarning

    bad = tmp_path / "corrupt.json"
    bad.write_text("{ not json")
    model = nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 5)).eval()
    x = torch.randn(3, 12)
    for path in (str(tmp_path / "missing.json"), str(bad)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = fxfuse.optimize(model, x, calibration=path)
        assert [w.category for w in caught] == [CalibrationWarning]
        assert issubclass(CalibrationWarning, fxfuse.FxfuseWarning)
        assert isinstance(opt, fxfuse.OptimizedModule)
        gm = next(iter(opt._specializations.values())).gm
        assert "roofline" in gm.meta["fxfuse_cost_model"]
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


def test_a_calibration_without_a_kernels_table_never_picks_that_kernel(tmp_path):
    """autotune --sections gemm writes a file with the GEMM table only: the fused MLP (which
    the roofline would rank first at width 64) stays unchosen, with the reason; the GEMM,
    measured fast here, is chosen."""
    import torch.nn as nn

    import fxfuse

    gemm_only = calibration(gemm_epilogue=grid(lambda m, h: 0.5 * lib_us(m, h)))
    path = write(tmp_path, gemm_only)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)]).eval()
    x = torch.randn(3, 64)
    opt = fxfuse.optimize(model, x, calibration=str(path))
    gm = next(iter(opt._specializations.values())).gm
    plans = gm.meta["fxfuse_plans"]
    assert len(plans) == 4
    assert all(p["choice"] == "gemm" for p in plans), [p["choice"] for p in plans]
    assert all("no 'mlp' table" in p["reasons"]["mlp"] for p in plans)
    assert fxfuse.stats(opt)["library_calls"] == 0
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_merge_calibration_rows():
    """Re-measured rows replace those of the same m, new ones go in order; a row measured at some
    points of the other axis keeps the old values at the rest; a point old lacks is an error."""
    from benchmarks.merge_calibration import merge_rows
    old = {"m": [1, 16, 64], "h": [128, 256], "us": [[1, 2], [3, 4], [5, 6]]}
    merged = merge_rows(old, {"m": [32, 64], "h": [128, 256], "us": [[7, 8], [9, 10]]})
    assert merged == {"m": [1, 16, 32, 64], "h": [128, 256], "us": [[1, 2], [3, 4], [7, 8], [9, 10]]}
    partial = merge_rows(old, {"m": [16, 32], "h": [256], "us": [[11], [12]]})
    assert partial["us"] == [[1, 2], [3, 11], [None, 12], [5, 6]]
    skipped = merge_rows(old, {"m": [16], "h": [128, 256], "us": [[None, 13]]})   # a cell the new run skipped
    assert skipped["us"][1] == [3, 13]
    with pytest.raises(ValueError, match="axes differ"):
        merge_rows(old, {"m": [32], "h": [512], "us": [[7]]})
    mlp = {"m": [1, 16], "width": [64], "us": [[1], [2]], "layers": 8}   # keys beside the axes stay
    assert merge_rows(mlp, {"m": [16], "width": [64], "us": [[3]], "layers": 8})["layers"] == 8


def test_merge_calibration_refuses_a_row_with_no_measurement(tmp_path, capsys):
    """An autotune run whose cells all failed (every value null) must not replace a measured row."""
    from benchmarks.merge_calibration import main as merge_main
    meta = {"schema": 1, "device": "GPU X", "torch": "2.11.0", "triton": "3.6.0"}
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({**meta, "tables": {"strassen1_fused": {"float32": {
        "m": [256, 1024], "h": [2048], "us": [[5.0], [9.0]]}}}}))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({**meta, "tables": {"strassen1_fused": {"float32": {
        "m": [256], "h": [2048], "us": [[None]]}}}}))
    before = shipped.read_text()
    assert merge_main([str(new), "--into", str(shipped), "--table", "strassen1_fused", "--dtype", "float32",
                       "--why", "test"]) == 1
    assert "hold no measurement" in capsys.readouterr().err
    assert shipped.read_text() == before


H100_FILE = CALIBRATION_DIR / "nvidia-h100-80gb-hbm3__torch-2.11.0__triton-3.6.0.json"


def test_strassen_below_1024_rows_only_where_its_kernels_were_calibrated():
    """fp16/bf16 have no Strassen kernel tables on the H100: 256 rows stays below their threshold."""
    from fxfuse.options import Options
    from passes.plan_linears import STRASSEN_MIN_ROWS_UNMEASURED, _legal
    model = CostModel.load(H100_FILE)
    options = Options(strassen="auto", strassen_levels=2)
    assert _legal(LinearLayer(256, 2048, 2048, F32), options, model)["strassen2"] is None
    for dtype in (torch.float16, torch.bfloat16):
        for rows, legal in ((256, False), (STRASSEN_MIN_ROWS_UNMEASURED, True)):
            reason = _legal(LinearLayer(rows, 2048, 2048, dtype), options, model)["strassen1"]
            assert (reason is None) == legal, (dtype, rows, reason)
    roofline = CostModel.roofline()
    assert "below 1024 x" in _legal(LinearLayer(256, 2048, 2048, F32), options, roofline)["strassen2"]


def test_strassen_from_256_rows_needs_its_kernels_timed_there():
    """A calibration whose Strassen kernels start at 1024 rows (an older file, autotune --quick)
    keeps the 1024-row threshold: 256 rows would be extrapolation labelled as calibration."""
    from fxfuse.options import Options
    from passes.plan_linears import _legal
    data = json.loads(H100_FILE.read_text())
    for name in [t for t in data["tables"] if t.startswith("strassen")]:
        entry = data["tables"][name]["float32"]
        keep = [i for i, m in enumerate(entry["m"]) if m >= 1024]
        entry["m"], entry["us"] = [entry["m"][i] for i in keep], [entry["us"][i] for i in keep]
    older = CostModel.from_dict(data)
    options = Options(strassen="auto", strassen_levels=2)
    assert "below 1024 x" in _legal(LinearLayer(256, 2048, 2048, F32), options, older)["strassen2"]
    assert _legal(LinearLayer(1024, 2048, 2048, F32), options, older)["strassen2"] is None


def test_plan_fuses_only_identical_narrow_layers_in_the_fp32_loop_regime():
    """fp32 past 512 rows: an mlp run must be >= 2 layers computing the same epilogue, <= 128 wide."""
    from fxfuse.options import Options
    from passes.plan_linears import _mlp_legal
    model, options = CostModel.load(H100_FILE), Options()
    relu = (("add", ("node", "node"), ()), ("relu", ("node",), ()))
    sigmoid = (("add", ("node", "node"), ()), ("sigmoid", ("node",), ()))

    def plan(width, epilogues, rows=1100):
        layers = [LinearLayer(rows, width, width, F32, epilogue_ops=2, epilogue=e) for e in epilogues]
        legal = [{"library": None} for _ in layers]
        return [p.choice for p in plan_chain(model, layers, legal,
                                             lambda i, j: _mlp_legal(layers[i:j + 1], options, model))]
    assert plan(128, [relu] * 6) == ["mlp"] * 6
    assert "mlp" not in plan(128, [relu, sigmoid] * 3)
    assert "mlp" not in plan(256, [relu] * 6)
    single = [LinearLayer(1100, 128, 128, F32, epilogue=relu)]
    assert "identical layers" in _mlp_legal(single, options, model)
    assert _mlp_legal([LinearLayer(64, 128, 128, F32, epilogue=e) for e in (relu, sigmoid)], options, model) is None


@pytest.mark.parametrize("m, h, want", [
    (256, 2048, "strassen2"),    # measured 387 us against 440 classical (mlp_20261125-190911)
    (256, 8192, "strassen2"),    # 5145 against 5542
    (1024, 2048, "strassen2"),
    (256, 1024, "library"),      # narrower than STRASSEN_MIN_WIDTH: Strassen not a candidate
    (64, 8192, "library"),       # fewer rows than STRASSEN_MIN_ROWS: 2075 / 4373 us against 1655 measured
    (1024, 128, "mlp"),          # the looped fused MLP: 25.9 us against 42.4 (mlp_20261125-192509)
    (4096, 128, "mlp"),          # 40.1 against 75.4
])
def test_shipped_h100_plan_for_the_seed_chain(m, h, want):
    """The decisions the shipped H100 calibration makes for 8 x (Linear, ReLU), strassen="auto"
    (the fused MLP allowed over any run of layers up to 1024 wide, as plan_linears allows it)."""
    from fxfuse.options import Options
    from passes.plan_linears import MLP_MAX_WIDTH, STRASSEN_MIN_ROWS, _legal
    model = CostModel.load(H100_FILE)
    layers = [LinearLayer(m, h, h, F32, epilogue_ops=2, output_read_elsewhere=i == 7) for i in range(8)]
    legal = [_legal(layer, Options(strassen="auto", strassen_levels=2), model) for layer in layers]
    plans = plan_chain(model, layers, legal, lambda i, j: None if h <= MLP_MAX_WIDTH else "too wide")
    assert [p.choice for p in plans] == [want] * 8, plans[0].reasons
    if m < STRASSEN_MIN_ROWS:
        assert f"below {STRASSEN_MIN_ROWS} x" in legal[0]["strassen2"]
    if want == "strassen2":
        assert plans[0].estimates["strassen2"].source == "calibration"
