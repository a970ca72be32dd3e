"""The fused-kernel IR: a small expression DAG over an N-d iteration space.

A kernel iterates over every point i = (i_0, ..., i_{d-1}) of `shape`. Leaves load an input
tensor at an affine address `offset + sum(i_k * strides[k])` (in elements): the identity map
of a contiguous tensor, a bias broadcast over rows (stride 0), a non-contiguous view, a block
offset such as "row + B/2", or one slice t of a `[7, B/2, N/2]` tensor are all such maps.
Inner nodes are scalar ops from fxfuse.ops; roots store through their own maps into outputs.

The IR knows nothing of torch.fx, so any pass (pointwise fusion, Strassen prefix/suffix) can
describe its kernels with it and the one code generator (fxfuse.codegen) prints them all.
"""
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class IndexMap:
    """Element address = offset + sum(i_k * strides[k]) over the kernel's iteration dims."""
    offset: int
    strides: tuple

    @staticmethod
    def broadcast(tensor_shape, tensor_strides, iter_shape, offset=0) -> "IndexMap":
        """Map of a tensor broadcast (right-aligned, as torch does) to the iteration space."""
        pad = len(iter_shape) - len(tensor_shape)
        if pad < 0:
            raise ValueError(f"tensor of shape {tuple(tensor_shape)} is larger than the "
                             f"iteration space {tuple(iter_shape)}")
        strides = [0] * pad
        for size, stride, it in zip(tensor_shape, tensor_strides, iter_shape[pad:]):
            if size != it and size != 1:
                raise ValueError(f"shape {tuple(tensor_shape)} does not broadcast to {tuple(iter_shape)}")
            strides.append(stride if size == it and size != 1 else 0)
        return IndexMap(offset, tuple(strides))


@dataclass(frozen=True)
class Instr:
    """One SSA value. op is 'load', 'const' or a name from fxfuse.ops.BY_NAME.

    args are indices of earlier instrs; params are (name, value) pairs: for 'load'
    (('input', k), ('index', IndexMap)), for 'const' (('value', number),), for ops their
    constant parameters (exponent, negative_slope, dtype, ...).
    """
    op: str
    args: tuple = ()
    params: tuple = ()

    def param(self, name, default=None) -> Any:
        return dict(self.params).get(name, default)


@dataclass(frozen=True)
class Store:
    output: int
    index: IndexMap
    value: int


@dataclass(frozen=True)
class OutputSpec:
    shape: tuple
    dtype: torch.dtype
    strides: tuple | None = None   # None: contiguous; else the layout eager gives (channels_last ...)


@dataclass(frozen=True)
class KernelIR:
    shape: tuple                 # iteration space
    inputs: tuple                # torch dtypes of the pointer inputs, in argument order
    outputs: tuple               # OutputSpec per output, allocated by the caller with its strides
    instrs: tuple
    stores: tuple

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def index_maps(self):
        for ins in self.instrs:
            if ins.op == "load":
                yield ins.param("index")
        for st in self.stores:
            yield st.index

    def coalesced(self) -> "KernelIR":
        """Drop size-1 dims and merge neighbours that every index map walks contiguously.

        A contiguous elementwise kernel becomes 1-d (no div/mod per element); a bias over the
        last dim of [B, S, N] becomes 2-d [B*S, N]. Purely an index rewrite: same addresses.
        """
        dims = [k for k, s in enumerate(self.shape) if s != 1]
        maps = list(self.index_maps())
        shape = [self.shape[k] for k in dims]
        strides = [[m.strides[k] for k in dims] for m in maps]
        k = len(shape) - 1
        while k > 0:
            if all(st[k - 1] == st[k] * shape[k] for st in strides):
                shape[k - 1] *= shape[k]
                del shape[k]
                for st in strides:
                    st[k - 1] = st[k]
                    del st[k]
            k -= 1
        new_maps = iter([IndexMap(m.offset, tuple(st)) for m, st in zip(maps, strides)])
        instrs = tuple(
            Instr(i.op, i.args, tuple((n, next(new_maps)) if n == "index" else (n, v) for n, v in i.params))
            if i.op == "load" else i for i in self.instrs)
        stores = tuple(Store(s.output, next(new_maps), s.value) for s in self.stores)
        return KernelIR(tuple(shape), self.inputs, self.outputs, instrs, stores)


def _exact(value):
    """A key that tells apart what == merges: -0.0 and 0 and False (1.0 / where(c, x, -0.0) became
    1.0 / where(c, x, 0) when a comparison with 0 came first: +inf for -inf), 1 and 1.0 and True."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, tuple):
        return tuple(_exact(v) for v in value)
    return value


class IRBuilder:
    """Appends instrs with value numbering, so a value loaded or computed twice exists once."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.inputs: list = []
        self.outputs: list = []
        self.instrs: list = []
        self.stores: list = []
        self._memo: dict = {}

    def _add(self, instr: Instr) -> int:
        key = (instr.op, instr.args, _exact(instr.params))
        if key not in self._memo:
            self._memo[key] = len(self.instrs)
            self.instrs.append(instr)
        return self._memo[key]

    def add_input(self, dtype) -> int:
        self.inputs.append(dtype)
        return len(self.inputs) - 1

    def load(self, input_index: int, index: IndexMap) -> int:
        return self._add(Instr("load", (), (("input", input_index), ("index", index))))

    def const(self, value) -> int:
        return self._add(Instr("const", (), (("value", value),)))

    def op(self, name: str, args, **params) -> int:
        return self._add(Instr(name, tuple(args), tuple(sorted(params.items()))))

    def store(self, value: int, dtype, index: IndexMap | None = None, shape=None, strides=None) -> int:
        """Store value into a new output of `shape` (default: the iteration space), laid out with
        `strides` (default: contiguous), through `index` (default: the map of that layout)."""
        shape = tuple(shape if shape is not None else self.shape)
        strides = tuple(strides) if strides is not None else None
        out = self.joined_output(shape, dtype, strides)
        if index is None:
            layout = strides if strides is not None else torch.empty(shape, device="meta").stride()
            index = IndexMap.broadcast(shape, layout, self.shape)
        self.store_into(out, value, index)
        return out

    def joined_output(self, shape, dtype, strides=None) -> int:
        """A new output (contiguous unless `strides`) that one or several stores fill, each through
        its own map (the pieces of a stack or cat: passes/join_outputs.py)."""
        self.outputs.append(OutputSpec(tuple(shape), dtype, strides))
        return len(self.outputs) - 1

    def store_into(self, out: int, value: int, index: IndexMap) -> None:
        self.stores.append(Store(out, index, value))

    def build(self) -> KernelIR:
        return KernelIR(self.shape, tuple(self.inputs), tuple(self.outputs),
                        tuple(self.instrs), tuple(self.stores))
