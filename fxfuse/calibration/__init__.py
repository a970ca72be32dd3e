"""Calibration files: where they live, what they are called, and reading and validating them.

The cost model (fxfuse/cost_model.py) corrects its roofline with efficiencies measured by
`python -m benchmarks.autotune`; the measurements are JSON files, one per GPU model and
software versions, shipped in this folder (README.md here describes the format and which file
is used). This module knows the file schema and nothing about estimating: it must not import
fxfuse.cost_model, which re-exports every public name defined here.
"""
import functools
import importlib.metadata
import json
import math
import re
from pathlib import Path

import torch

from ..errors import FxfuseWarning

SCHEMA = 1
ENV_VAR = "FXFUSE_CALIBRATION"
CALIBRATION_DIR = Path(__file__).parent     # this folder: the shipped *.json files
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
GEMM_AXES = ("m", "h")
TABLE_AXES = {"linear": GEMM_AXES, "linear_bias": GEMM_AXES, "gemm_epilogue": GEMM_AXES, "gemm_tf32x3": GEMM_AXES,
              "bmm7": GEMM_AXES, "bmm49": GEMM_AXES, "bmm7_tf32x3": GEMM_AXES, "bmm49_tf32x3": GEMM_AXES, "pointwise": ("bytes",), "mlp": ("m", "width"),
              **{f"strassen{lv}_{part}": GEMM_AXES for lv in (1, 2) for part in ("prefix", "fused", "suffix")}}


class CalibrationWarning(FxfuseWarning):
    """A calibration file was asked for but could not be used: estimates use the roofline."""


class CalibrationError(ValueError):
    """A calibration file or dict does not follow the schema (validate_calibration says how)."""


def device_slug(device: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


def calibration_name(device: str, torch_version: str, triton_version: str | None) -> str:
    """`<gpu-slug>__torch-<ver>__triton-<ver>.json`, local version parts (+cu130) dropped."""
    def ver(v):
        return (v or "none").split("+")[0]
    return f"{device_slug(device)}__torch-{ver(torch_version)}__triton-{ver(triton_version)}.json"


def validate_calibration(data) -> list:
    """Problems with a calibration dict (empty: valid). Unknown tables are ignored, so files of
    a newer autotune stay readable."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    problems = [f"missing key {k!r}" for k in ("schema", "device", "ceilings", "tables") if k not in data]
    if problems:
        return problems
    if data["schema"] != SCHEMA:
        problems.append(f"schema {data['schema']!r}, this fxfuse reads {SCHEMA}")
    if not isinstance(data["device"], str) or not data["device"].strip():
        problems.append(f"device {data['device']!r} is not a GPU's name")
    c, tables = data["ceilings"], data["tables"]
    if not isinstance(c, dict) or not isinstance(c.get("matmul_tflops"), dict) or not isinstance(tables, dict):
        return problems + ["ceilings must hold a matmul_tflops object, tables must be an object"]
    problems += [f"ceiling {k}={v!r} is not a positive number" for k, v in
                 [*c["matmul_tflops"].items(), ("copy_gbps", c.get("copy_gbps")),
                  ("launch_us_graph", c.get("launch_us_graph"))] if not _positive(v)]
    for name, per_dtype in tables.items():
        if name in TABLE_AXES:
            for dt, entry in (per_dtype.items() if isinstance(per_dtype, dict) else [("?", None)]):
                problems += [f"{name}/{dt}: {p}" for p in _grid_problems(dt, entry, TABLE_AXES[name])]
    return problems


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _grid_problems(dt, entry, axes) -> list:
    if dt not in DTYPE_NAMES.values():
        return [f"unknown dtype {dt!r}"]
    if not isinstance(entry, dict) or any(a not in entry for a in (*axes, "us")):
        return [f"needs keys {[*axes, 'us']}"]
    if not all(isinstance(v, list) and v and all(map(_positive, v)) and sorted(set(v)) == v
               for v in (entry[a] for a in axes)) or not _positive(entry.get("layers", 1)):
        return ["axes must be non-empty ascending lists of positive numbers"]

    def fits(us, depth):
        ok = isinstance(us, list) and len(us) == len(entry[axes[depth]])
        if depth == len(axes) - 1:
            return ok and all(x is None or _positive(x) for x in us)
        return ok and all(fits(u, depth + 1) for u in us)
    return [] if fits(entry["us"], 0) else ["us does not match the axes (or holds a non-positive time)"]


@functools.lru_cache(maxsize=16)
def _read_file(path: str, stamp: tuple):
    """Parse and validate one file (cached per path and modification stamp): dict or error text."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"cannot read {path}: {type(e).__name__}: {e}"
    problems = validate_calibration(data)
    return f"invalid calibration {path}: {'; '.join(problems[:5])}" if problems else data


def _shipped_file(device_name: str, directory: Path) -> Path | None:
    """The calibration for this GPU: the one for these torch/triton versions, else the newest name."""
    files = sorted(directory.glob(f"{device_slug(device_name)}__*.json"))
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    exact = directory / calibration_name(device_name, torch.__version__, triton_version)
    return exact if exact in files else (files[-1] if files else None)
