"""benchmarks.model_accuracy: the plan it reports is the pass's plan, from seed-network records only."""
import json

from benchmarks.model_accuracy import DEFAULT_CALIBRATION, measured_cells, plan_for
from fxfuse.cost_model import CostModel


def test_records_of_other_models_are_not_seed_cells(tmp_path):
    cell = {"params": {"layers": 8, "hidden": 256, "batch": 1024},
            "results": {"fxfuse-auto": {"status": "ok", "us": 71.5}}}
    (tmp_path / "mlp_20261126-011709.json").write_text(json.dumps({"command": "python -m benchmarks.mlp",
                                                                   "cells": [cell]}))
    residual = {**cell, "results": {"fxfuse-auto": {"status": "ok", "us": 85.3}}}
    (tmp_path / "mlp_residual_20261125-203613.json").write_text(json.dumps(
        {"command": "python -m benchmarks.mlp --residual", "cells": [residual]}))
    assert measured_cells(tmp_path) == {(8, 256, 1024): [("mlp_20261126-011709", {"fxfuse-auto": 71.5})]}


def test_the_plan_follows_the_passes_legality():
    """fp32 width 256 past the row-wise batches is no fused MLP in plan_linears (mlp_spec.why_slow)."""
    model = CostModel.load(DEFAULT_CALIBRATION)
    assert plan_for(model, 8, 256, 1024)[0] == "library"
    assert plan_for(model, 8, 128, 1)[0] == "mlp"
