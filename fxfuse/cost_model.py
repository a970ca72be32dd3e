"""Cost model: how long each way of running a chain of Linear layers takes, and which to pick.

Why it exists (DESIGN.md, "Cost model"): legality lives in the passes, profitability here.
A pass describes each layer as plain data (`LinearLayer`) and says which candidates are
legal; this module estimates each candidate and chooses for the whole chain at once, because
a choice at layer i changes what fuses at the boundary with layer i+1.

Candidates (CANDIDATES):
  library    cuBLAS F.linear + one generated pointwise kernel for the epilogue (or the bias
             in cuBLASLt's epilogue: both spellings are costed, the cheaper one counts)
  gemm       one Triton GEMM with the epilogue fused (fxfuse.gemm_kernel.EpilogueGemm)
  gemm_x3    the same GEMM in fp32 on tensor cores, 3xTF32 (option tf32x3, fxfuse/tf32x3.py)
  strassenL  prefix kernel -> torch.bmm of 7**L products -> suffix kernel (passes/strassen.py);
             the products in 3xTF32 where the layer says so (LinearLayer.x3_products)
  mlp        layers i..j as ONE kernel (fxfuse.mlp_kernel.FusedMLP)

Where a number comes from: every cost is a roofline (FLOPs at the matmul ceiling, bytes at
the copy bandwidth, one CUDA-graph launch per kernel) divided by an *efficiency*, measured
by `python -m benchmarks.autotune` on a grid of shapes (efficiency = roofline / measured
time). Efficiencies are interpolated linearly in log coordinates (log m, log sqrt(k*n));
outside the grid the nearest measured efficiency scales the roofline. At a measured point
the estimate is the measurement. Where no table covers a component the efficiency falls
back to a related table (a Triton GEMM to cuBLAS-with-bias, a bmm to cuBLAS, a Strassen
kernel to the pointwise kernel at the same bytes), and without any calibration to 1: the
plain roofline, optimistic for small GEMMs, but ordered sensibly.

Strassen boundaries: between two consecutive layers with the same level, the suffix of layer
i, its epilogue and the prefix of layer i+1 are ONE kernel. Its cost is charged to the
EARLIER layer (layer i's tail); layer i+1 then has no prefix cost.
"""
import bisect
import itertools
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

# Calibration files (schema, names, reading, validating) live in fxfuse.calibration; these
# names are re-exported here so `from fxfuse.cost_model import ...` keeps working.
from fxfuse.errors import warn
from fxfuse.mlp_spec import ROWWISE_MAX_BATCH as MLP_ROWWISE_MAX, ROWWISE_TC_MAX_BATCH as MLP_ROWWISE_TC_MAX
from fxfuse.calibration import (CALIBRATION_DIR, DTYPE_NAMES, ENV_VAR, GEMM_AXES, SCHEMA,  # noqa: F401
                                TABLE_AXES, CalibrationError, CalibrationWarning, _grid_problems, _positive,
                                _read_file, _shipped_file, calibration_name, device_slug, validate_calibration)

CANDIDATES = ("library", "gemm", "gemm_x3", "strassen1", "strassen2", "mlp")
SIBLING_DTYPE = {"float16": "bfloat16", "bfloat16": "float16"}   # same tensor-core rate and size
X3_PREFERENCE = 1.10    # 3xTF32 products (gemm_x3, Strassen's with x3_products) are charged 10% more: IEEE wins near-ties. H100, 8 x 1024 at batch 64:
#                         3xTF32 measured 8.7 vs 8.9 us per layer alone, 76.2 vs 68.7 us in the chain (the
#                         row-wise IEEE GEMM streams its weights before the previous layer ends, PDL)
MLP_BLOCK_M = 16        # mlp_spec.choose_config: one program per row up to MLP_ROWWISE_MAX rows, then 16
logger = logging.getLogger("fxfuse.cost_model")


@dataclass(frozen=True)
class Estimate:
    """A cost: time and what it is made of. Estimates add up; sum() starts from 0."""
    us: float
    flops: float = 0.0
    bytes: float = 0.0
    launches: int = 0
    source: str = "roofline"      # "roofline", "calibration", or both joined by "+"

    def __add__(self, other):
        if isinstance(other, (int, float)) and other == 0:
            return self
        if not isinstance(other, Estimate):
            return NotImplemented
        source = "+".join(sorted({s for s in (self.source + "+" + other.source).split("+") if s}))
        return Estimate(self.us + other.us, self.flops + other.flops, self.bytes + other.bytes,
                        self.launches + other.launches, source)

    __radd__ = __add__

    def __str__(self):
        return (f"{self.us:.1f} us ({self.launches} launch{'es' * (self.launches != 1)}, "
                f"{self.flops / 1e9:.2f} GFLOP, {self.bytes / 1e6:.2f} MB; {self.source or 'nothing'})")


ZERO = Estimate(0.0, source="")


@dataclass(frozen=True)
class LinearLayer:
    """One Linear and its pointwise epilogue, as a pass describes it."""
    m: int                                  # rows (batch, flattened leading dims)
    k: int                                  # in features
    n: int                                  # out features
    dtype: torch.dtype
    epilogue_ops: int = 1                   # pointwise ops after the GEMM (bias add counts)
    output_read_elsewhere: bool = False     # y is read by something besides the next layer
    bias: bool = True                       # one of the epilogue ops is a bias add
    epilogue: tuple = ()                    # what those ops compute (passes/plan_linears._epilogue_key)
    epilogue_reads: int = 0                 # other [m, n] tensors the epilogue reads (a residual's skip)
    epilogue_reads_outside: int = 0         # how many of those the generated GEMM cannot read at its tile
    mlp_reads_outside: int = 0              # ... and a fused MLP (it reads only its Linears' inputs)
    bias_in_gemm: bool = False              # the library GEMM takes the bias (a half type's Linear bias:
    #                                         one rounding, as eager; passes/linear_epilogue)
    x3_products: bool = False               # Strassen's product call runs in 3xTF32 (option tf32x3)

    @property
    def elt(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


# ---------------------------------------------------------------------------- roofline

@dataclass(frozen=True)
class Work:
    """What a kernel must do: the roofline's inputs."""
    flops: float = 0.0
    bytes: float = 0.0
    launches: int = 1
    triton: bool = False          # a generated GEMM: runs at triton_gemm_fraction of cuBLAS's rate
    rate_fraction: float = 1.0    # share of the SMs the kernel keeps busy
    sm_bytes: float = 0.0         # bytes one SM must stream by itself (fused MLP: all weights)


@dataclass(frozen=True)
class Ceilings:
    """Peak rates. Defaults: measured on an H100 (DESIGN.md), except the two marked assumed."""
    matmul_tflops: dict = field(default_factory=lambda: {"float32": 51.6, "bfloat16": 700.0, "float16": 700.0})
    copy_gbps: float = 3000.0
    launch_us_graph: float = 1.2      # per kernel replayed from a CUDA graph
    launch_us_eager: float = 10.0     # per eager launch (CPU side)
    sms: int = 132
    sm_gbps: float = 100.0            # assumed: what one SM streams from L2/HBM alone
    triton_gemm_fraction: float = 0.8  # assumed: a generated GEMM's rate relative to cuBLAS

    @classmethod
    def from_dict(cls, d: dict) -> "Ceilings":
        base = cls()
        known = {k: d[k] for k in ("copy_gbps", "launch_us_graph", "launch_us_eager", "sms", "sm_gbps",
                                   "triton_gemm_fraction") if k in d}
        return cls(matmul_tflops={**base.matmul_tflops, **d.get("matmul_tflops", {})}, **known)

    def time_us(self, w: Work, dtype_name: str) -> float:
        rate = self.matmul_tflops.get(dtype_name, self.matmul_tflops["float32"]) * 1e12 * w.rate_fraction
        rate *= self.triton_gemm_fraction if w.triton else 1.0
        busy = max(w.flops / rate if w.flops else 0.0, w.bytes / (self.copy_gbps * 1e9),
                   w.sm_bytes / (self.sm_gbps * 1e9))
        return busy * 1e6 + w.launches * self.launch_us_graph


def _ceil_to(x: int, s: int) -> int:
    return -(-x // s) * s


def gemm_work(m, k, n, elt, bias=False, triton=False) -> Work:
    return Work(2.0 * m * k * n, elt * (m * k + k * n + m * n + (n if bias else 0)), 1, triton)


def bmm_work(level, m, k, n, elt) -> Work:
    """r = 7**L products of [m/s, k/s] x [k/s, n/s], s = 2**L, sizes padded to multiples of s."""
    s, r = 1 << level, 7 ** level
    bm, bk, bn = -(-m // s), -(-k // s), -(-n // s)
    return Work(2.0 * r * bm * bk * bn, elt * r * (bm * bk + bk * bn + bm * bn))


def strassen_kernel_work(part, level, m, k, n, elt, stores_y=False) -> Work:
    """Bytes moved by the pointwise kernels around the bmm: prefix reads x [mp, kp] and writes
    r blocks; the fused boundary reads the r products and writes the next layer's r blocks
    (and y only if something else reads it); the suffix reads the products and writes y."""
    s, r = 1 << level, 7 ** level
    mp, kp, np_ = _ceil_to(m, s), _ceil_to(k, s), _ceil_to(n, s)
    products = r * (mp // s) * (np_ // s)
    moved = {"prefix": mp * kp + r * (mp // s) * (kp // s),
             "fused": 2 * products + n + (m * n if stores_y else 0),
             "suffix": products + n + mp * np_,
             "pad": m * k + mp * kp}[part]
    return Work(bytes=elt * moved)


def mlp_work(m, dims, elt, sms) -> Work:
    """One kernel for Linear layers of (k, n) dims: weights read once from HBM, but every
    program streams all of them through its own SM (one program per row up to MLP_ROWWISE_MAX
    rows in fp32, MLP_ROWWISE_TC_MAX in fp16/bf16, then per 16 rows), and few programs leave
    most SMs idle."""
    weights = sum(k * n + n for k, n in dims)
    programs = m if m <= (MLP_ROWWISE_MAX if elt == 4 else MLP_ROWWISE_TC_MAX) else -(-m // MLP_BLOCK_M)
    return Work(2.0 * m * sum(k * n for k, n in dims), elt * (weights + m * dims[0][0] + m * dims[-1][1]), 1,
                triton=True, rate_fraction=min(1.0, programs / sms),
                sm_bytes=-(-programs // sms) * weights * elt)


def _table_work(name, coords, elt, entry, sms) -> Work:
    """The Work of one measured point of table `name` (what autotune ran there)."""
    if name == "pointwise":
        return Work(bytes=coords[0])
    if name == "mlp":
        return mlp_work(coords[0], [(coords[1], coords[1])] * int(entry.get("layers", 8)), elt, sms)
    m, h = coords
    if name in ("linear", "linear_bias", "gemm_epilogue", "gemm_tf32x3"):
        return gemm_work(m, h, h, elt, bias=name != "linear", triton=name.startswith("gemm"))
    if name.startswith("bmm"):
        return bmm_work({"bmm7": 1, "bmm49": 2}[name.split("_")[0]], m, h, h, elt)
    level, part = int(name[8]), name.split("_")[1]
    return strassen_kernel_work(part, level, m, h, h, elt)


# ---------------------------------------------------------------------------- tables

def _bracket(axis: tuple, x: float) -> list:
    """[(index, weight)] of the one or two grid points around x (clamped at the ends)."""
    if x <= axis[0]:
        return [(0, 1.0)]
    if x >= axis[-1]:
        return [(len(axis) - 1, 1.0)]
    i = bisect.bisect_right(axis, x) - 1
    t = (x - axis[i]) / (axis[i + 1] - axis[i])
    return [(i, 1.0 - t), (i + 1, t)]


@dataclass(frozen=True)
class Table:
    """log(efficiency) at measured grid points; missing cells (skipped by autotune) are holes."""
    axes: tuple          # per axis: ascending log coordinates
    log_eff: dict        # index tuple -> log(roofline / measured)

    @classmethod
    def from_entry(cls, name, entry, elt, ceilings: Ceilings, dtype_name) -> "Table":
        names = TABLE_AXES[name]
        values = [list(map(float, entry[a])) for a in names]
        log_eff = {}
        for idx in itertools.product(*(range(len(v)) for v in values)):
            us = entry["us"]
            for i in idx:
                us = us[i]
            if us is not None and us > 0:
                coords = tuple(v[i] for v, i in zip(values, idx))
                log_eff[idx] = math.log(ceilings.time_us(_table_work(name, coords, elt, entry, ceilings.sms),
                                                         dtype_name) / us)
        return cls(tuple(tuple(math.log(x) for x in v) for v in values), log_eff)

    def lookup(self, coords) -> tuple | None:
        """(log(efficiency), whether coords lie inside the measured range): multilinear
        interpolation in log coordinates, holes left out; None for an empty table."""
        if not self.log_eff:
            return None
        logs = [math.log(max(c, 1e-30)) for c in coords]
        inside = all(a[0] - 1e-9 <= x <= a[-1] + 1e-9 for a, x in zip(self.axes, logs))
        total = acc = 0.0
        for combo in itertools.product(*(_bracket(a, x) for a, x in zip(self.axes, logs))):
            idx, w = tuple(i for i, _ in combo), math.prod(w for _, w in combo)
            if idx in self.log_eff and w > 0:
                total, acc = total + w, acc + w * self.log_eff[idx]
        if total > 0:
            return acc / total, inside
        nearest = min(self.log_eff, key=lambda idx: sum((a[i] - x) ** 2 for a, i, x in zip(self.axes, idx, logs)))
        return self.log_eff[nearest], inside


# ---------------------------------------------------------------------------- the model

_WARNED: set = set()   # calibration problems already warned about (CostModel.load)


def _warn_once(message: str) -> None:
    """One CalibrationWarning per problem and process (every build loads the file again), at
    the user's line."""
    if message not in _WARNED:
        _WARNED.add(message)
        warn(message, CalibrationWarning)


class CostModel:
    """Estimates candidates from ceilings and (optionally) calibration tables. Immutable."""

    def __init__(self, ceilings: Ceilings, tables: dict, description: str, cuda_graphs: bool = True):
        self.ceilings, self.tables, self.description, self.cuda_graphs = ceilings, tables, description, cuda_graphs

    def __repr__(self):
        return f"CostModel({self.description})"

    @classmethod
    def roofline(cls, device_name=None, cuda_graphs: bool = True) -> "CostModel":
        return cls(Ceilings(), {}, f"roofline, H100 ceilings ({device_name or 'device unknown'})", cuda_graphs)

    @classmethod
    def from_dict(cls, data: dict, description: str = "calibration", cuda_graphs: bool = True) -> "CostModel":
        """Build from a calibration dict; CalibrationError if it does not follow the schema."""
        problems = validate_calibration(data)
        if problems:
            raise CalibrationError("; ".join(problems[:5]))
        ceilings = Ceilings.from_dict(data["ceilings"])
        tables = {}
        for name, per_dtype in data["tables"].items():
            if name in TABLE_AXES:
                elt = {dt: torch.empty((), dtype=getattr(torch, dt)).element_size() for dt in per_dtype}
                tables[name] = {dt: Table.from_entry(name, e, elt[dt], ceilings, dt) for dt, e in per_dtype.items()}
        return cls(ceilings, tables, description, cuda_graphs)

    @classmethod
    def load(cls, path=None, device_name: str | None = None, *, directory=None,
             cuda_graphs: bool = True) -> "CostModel":
        """path None: $FXFUSE_CALIBRATION, else the shipped file for device_name (default: the
        current CUDA device), else the roofline. A file that was asked for (path, environment,
        or shipped for this GPU) but cannot be used gives the roofline and ONE CalibrationWarning."""
        path = path or os.environ.get(ENV_VAR) or None
        if device_name is None and path is None and torch.cuda.is_available():
            device_name = torch.cuda.get_device_name()
        if path is None and device_name:
            path = _shipped_file(device_name, Path(directory) if directory else CALIBRATION_DIR)
        if path is None:
            logger.info("no calibration for %s: roofline estimates", device_name or "this device")
            return cls.roofline(device_name, cuda_graphs)
        try:
            path = os.fsdecode(path)   # (a path-like's str() need not be its path: fuzz45g)
            st = os.stat(path)
            got = _read_file(path, (st.st_mtime_ns, st.st_size))
        except Exception as e:  # noqa: BLE001 -- a path Python cannot use (a NUL byte), JSON nested past the
            got = f"cannot read {path!r}: {type(e).__name__}: {e}"   # recursion limit, a number too large (fuzz34k)
        if not isinstance(got, str):
            desc = (f"calibration {Path(path).name} ({got['device']}, torch {got.get('torch')}, "
                    f"triton {got.get('triton')})")
            try:
                model = cls.from_dict(got, desc, cuda_graphs)
            except Exception as e:  # noqa: BLE001 - a bad file must never break optimize()
                got = f"cannot use {path}: {type(e).__name__}: {e}"
            else:
                here = torch.cuda.get_device_name() if torch.cuda.is_available() else None
                if here and got["device"] != here:   # asked for by path or environment: used, but said once
                    _warn_once(f"fxfuse: calibration {path} was measured on {got['device']!r}, this GPU is "
                               f"{here!r}; its figures may not fit here (benchmarks.autotune measures this one)")
                return model
        _warn_once(f"fxfuse: {got}; cost estimates fall back to the roofline")
        return cls.roofline(device_name, cuda_graphs)

    # -- components ----------------------------------------------------------------------
    def measured(self, table: str, dtype) -> bool:
        """Whether the calibration holds `table` for this dtype (or its same-rate sibling)."""
        dt = DTYPE_NAMES.get(dtype, dtype)
        per_dtype = self.tables.get(table, {})
        return dt in per_dtype or SIBLING_DTYPE.get(dt) in per_dtype

    def smallest_measured(self, table: str, dtype) -> float | None:
        """The smallest first-axis value (rows) with a measurement in `table` for this dtype (or
        its sibling), or None: where a candidate's own kernels were timed, not extrapolated."""
        dt = DTYPE_NAMES.get(dtype, dtype)
        per_dtype = self.tables.get(table, {})
        found = [t for t in (per_dtype.get(dt), per_dtype.get(SIBLING_DTYPE.get(dt))) if t is not None and t.log_eff]
        return min((math.exp(t.axes[0][idx[0]]) for t in found for idx in t.log_eff), default=None)

    def _lookup(self, table: str, dtype_name: str, coords) -> tuple | None:
        per_dtype = self.tables.get(table, {})
        names = [dtype_name, SIBLING_DTYPE.get(dtype_name)] + (list(per_dtype) if table == "pointwise" else [])
        hits = [per_dtype[n].lookup(coords) for n in names if n in per_dtype]
        return next((h for h in hits if h is not None), None)

    def _component(self, dtype, work: Work, tables=(), prefer_inside=True) -> Estimate:
        """One kernel: its roofline over an efficiency from `tables` ((name, coords) pairs, own
        table first, then related ones). prefer_inside: the first table whose measured range
        holds this size wins (a tiny launch-bound kernel is better judged by a related kernel
        measured that small than by extrapolating bandwidth-bound ones), else the first with
        data. Without it simply the first with data: for a Triton GEMM past its grid its own
        efficiency extrapolates better than cuBLAS's."""
        dt = DTYPE_NAMES.get(dtype, "float32")
        us, source = self.ceilings.time_us(work, dt), "roofline"
        hits = [h for h in (self._lookup(name, dt, coords) for name, coords in tables) if h is not None]
        if hits:
            log_eff = next((h for h in hits if h[1]), hits[0])[0] if prefer_inside else hits[0][0]
            us, source = us / math.exp(log_eff), "calibration"
        if not self.cuda_graphs:   # eager: the CPU cannot launch faster than this
            us = max(us, work.launches * self.ceilings.launch_us_eager)
        return Estimate(us, work.flops, work.bytes, work.launches, source)

    def _pointwise(self, dtype, work: Work, first=()) -> Estimate:
        return self._component(dtype, work, tuple(first) + (("pointwise", (work.bytes,)),))

    def _library(self, L: LinearLayer) -> Estimate:
        m, k, n, elt, h = L.m, L.k, L.n, L.elt, math.sqrt(L.k * L.n)
        plain = self._component(L.dtype, gemm_work(m, k, n, elt), [("linear", (m, h))])
        if L.epilogue_ops <= 0:
            return plain
        reads = elt * m * n * L.epilogue_reads
        best = plain + self._pointwise(L.dtype, Work(bytes=elt * (2 * m * n + (n if L.bias else 0)) + reads))
        if L.bias:   # the bias in cuBLASLt's epilogue; any other op still needs the pointwise kernel
            fused = self._component(L.dtype, gemm_work(m, k, n, elt, bias=True), [("linear_bias", (m, h))])
            if L.epilogue_ops > 1:
                fused = fused + self._pointwise(L.dtype, Work(bytes=elt * 2 * m * n + reads))
            best = fused if L.bias_in_gemm else min(best, fused, key=lambda e: e.us)
        return best

    # -- per layer: head (depends on prev) + body + tail (depends on next) ------------------
    def _head(self, c: str, L: LinearLayer, prev: str | None) -> Estimate:
        level = _level(c)
        if not level or _fuses(prev, c):
            return ZERO
        s, coords = 1 << level, (L.m, math.sqrt(L.k * L.n))
        pad = ZERO
        if L.m % s or L.k % s:
            pad = self._pointwise(L.dtype, strassen_kernel_work("pad", level, L.m, L.k, L.n, L.elt))
        work = strassen_kernel_work("prefix", level, L.m, L.k, L.n, L.elt)
        return pad + self._pointwise(L.dtype, work, [(f"strassen{level}_prefix", coords)])

    def _body(self, c: str, L: LinearLayer) -> Estimate:
        h = math.sqrt(L.k * L.n)
        if c == "library":
            return self._library(L)
        if c in ("gemm", "gemm_x3"):   # gemm_x3 only from its own table (plan_linears: legal where measured)
            work = gemm_work(L.m, L.k, L.n, L.elt, bias=L.bias, triton=True)
            # x and the other tensors the epilogue reads (a residual's skip), loaded at the output tile
            inside = L.epilogue_reads - L.epilogue_reads_outside
            work = replace(work, bytes=work.bytes + L.elt * L.m * L.n * inside)
            tables = ([("gemm_tf32x3", (L.m, h))] if c == "gemm_x3"
                      else [("gemm_epilogue", (L.m, h)), ("linear_bias", (L.m, h))])
            gemm = self._component(L.dtype, work, tables, prefer_inside=False)
            if L.epilogue_reads_outside:   # the ops from there on: a kernel after the GEMM (fuse_pointwise)
                gemm = gemm + self._pointwise(L.dtype, Work(bytes=L.elt * L.m * L.n * (2 + L.epilogue_reads_outside)))
            return replace(gemm, us=gemm.us * X3_PREFERENCE) if c == "gemm_x3" else gemm
        if c == "mlp":
            return self.estimate_mlp([L])
        level = _level(c)
        work = bmm_work(level, L.m, L.k, L.n, L.elt)
        if L.x3_products:   # unmeasured (tf32x3="force"): cuBLAS's bmm efficiency, not the bare roofline
            bmm = self._component(L.dtype, work, [(f"bmm{7 ** level}_tf32x3", (L.m, h)), (f"bmm{7 ** level}", (L.m, h)),
                                                  ("linear", (L.m, h))], prefer_inside=False)
            return replace(bmm, us=bmm.us * X3_PREFERENCE)   # charged as gemm_x3 is: else a near-tie went
            #                                                  to Strassen (8 x 4096 at batch 256: 960 vs 876 us)
        return self._component(L.dtype, work, [(f"bmm{7 ** level}", (L.m, h)), ("linear", (L.m, h))])

    def _tail(self, c: str, L: LinearLayer, next_: str | None) -> Estimate:
        level = _level(c)
        if not level:
            return ZERO
        part = "fused" if _fuses(c, next_) else "suffix"
        work = strassen_kernel_work(part, level, L.m, L.k, L.n, L.elt, stores_y=L.output_read_elsewhere)
        return self._pointwise(L.dtype, work, [(f"strassen{level}_{part}", (L.m, math.sqrt(L.k * L.n)))])

    def estimate(self, candidate: str, layer: LinearLayer, prev: str | None = None,
                 next: str | None = None) -> Estimate:  # noqa: A002 - the name the passes use
        """Cost of `layer` run as `candidate` between neighbours run as prev / next (None at the
        chain's ends). A Strassen layer after one of the same level has no prefix; before one,
        its tail is the shared boundary kernel (charged here, to the earlier layer)."""
        if candidate not in CANDIDATES:
            raise ValueError(f"unknown candidate {candidate!r}; expected one of {CANDIDATES}")
        return self._head(candidate, layer, prev) + self._body(candidate, layer) + self._tail(candidate, layer, next)

    def estimate_mlp(self, layers: list) -> Estimate:
        """Layers as one fused kernel: reads x and the weights, writes the last y, one launch;
        where a layer's epilogue reads another tensor (a pre-norm block's residual stream), the
        kernel ends there and the ops from there on are a kernel after it."""
        first = layers[0]
        dims = [(L.k, L.n) for L in layers]
        work = mlp_work(first.m, dims, first.elt, self.ceilings.sms)
        est = self._component(first.dtype, work, [("mlp", (first.m, max(max(d) for d in dims)))])
        for L in layers:
            if L.mlp_reads_outside:
                est = est + self._pointwise(L.dtype, Work(bytes=L.elt * L.m * L.n * (2 + L.mlp_reads_outside)))
        return est


def _level(c: str | None) -> int:
    return int(c[8:]) if c and c.startswith("strassen") else 0


def _fuses(a: str | None, b: str | None) -> bool:
    """Whether a layer run as `a` and the next run as `b` share one boundary kernel."""
    return bool(_level(a)) and a == b
