"""Slices move above the pointwise ops they read: `a, b = (h + bias).chunk(2, -1)` becomes
`a = h.chunk(2, -1)[0] + bias[:n]`, `b = h.chunk(2, -1)[1] + bias[n:]`, so the bias add joins
the kernel that reads a and b.

Why (fuzz32d #3): a gated unit computed from one packed projection or convolution
(`a, b = conv(x)[..., :T].split(C, 1); torch.tanh(a) * torch.sigmoid(b)` in WaveNet,
`x1, x3 = w13(x).chunk(2, -1); F.silu(x1) * x3` in a packed SwiGLU, a hand-written LSTM or GRU
cell's `(x @ W_ih.T + h @ W_hh.T + b).chunk(4, 1)`, F.glu) puts a slice between the pointwise
ops that make the packed tensor and those that read its parts. A slice is no pointwise op, so
fusion stopped there: the packed tensor was written by one kernel and read back by the next.

An elementwise op commutes with a slice of its (broadcast) operands: op(a, b)[s] is
op(a'[s], b'[s]) with a', b' expanded to op's shape, views both, and the values are the same
bits. The op moves when:
  - every reader of the op is a slice (`h[..., :n]`, narrow, select, or one part of a chunk,
    split, tensor_split or unbind), and every reader of each slice is a pointwise op: the
    slices' own strides are then seen by no one but the fused kernel;
  - those readers' results keep eager's strides (computed on meta tensors);
  - nothing involved is written in place, and the op is not the bias add of a Linear in
    fp16/bf16 (normalize_layers.LINEAR_BIAS), which the GEMM adds before its one rounding as
    eager does.
Each part's op reads only its part of the operands; the parts together may hold no more
elements than the op's result (no overlap), or a stencil (`h[:, 1:] - h[:, :-1]`, repeated)
would compute the ops before it 2^n times (review33). Reshapes and permutes have passes of their own (sink_views, hoist_permutes).
"""
import operator

import torch
import torch.fx
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fxfuse.node_meta import fetch_attr, meta_tensor, single_tensor_meta as _meta
from fxfuse.ops import is_pointwise_target

from .fuse_pointwise import _mutated_values
from .hoist_permutes import _laid_out, _step, meta_operands, readers_keep_strides
from .normalize_layers import (LINEAR_BIAS, PART_FUNCTIONS, PART_METHODS, SLICING_FUNCTIONS, SLICING_METHODS,
                               _selects_part, register_constant)


def _is_slice(node, source) -> bool:
    if not node.args or node.args[0] is not source or any(isinstance(a, torch.fx.Node) for a in node.args[1:]) \
            or any(isinstance(v, torch.fx.Node) for v in node.kwargs.values()):
        return False
    return (node.op == "call_method" and node.target in SLICING_METHODS
            or node.op == "call_function" and node.target in SLICING_FUNCTIONS
            or node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2
            and _selects_part(node.args[1]))


def _returns_parts(node) -> bool:
    return node.op == "call_method" and node.target in PART_METHODS \
        or node.op == "call_function" and node.target in PART_FUNCTIONS


def _chains(op) -> list | None:
    """Every way op's result is read, as chains of slices from op to a slice read only by
    pointwise ops (`[h[..., :T]], split(C, 1), getitem k]`); None where some reader is no
    slice (op's whole result is needed anyway)."""
    chains = []

    def follow(node, chain) -> bool:
        for user in node.users:
            if not _is_slice(user, node):
                return False
            if not _returns_parts(user):
                if not _extend(user, chain + [user]):
                    return False
                continue
            if not user.users:   # a dead `h.hsplit(2)` still reads op: op stays (fuzz37g: erased under it)
                return False
            for item in user.users:
                if not (item.op == "call_function" and item.target is operator.getitem and type(item.args[1]) is int):
                    return False   # the tuple itself is read (returned, unpacked by a call)
                if not _extend(item, chain + [user, item]):
                    return False
        return True

    def _extend(leaf, chain) -> bool:
        if leaf.users and all(u.op == "call_function" and is_pointwise_target(u.target) for u in leaf.users):
            chains.append(chain)
            return True
        return bool(leaf.users) and follow(leaf, chain)

    return chains if follow(op, []) and chains else None


def _part(chain) -> tuple:
    """What a chain selects, whichever nodes spell it: two `h.chunk(2, -1)` nodes' first parts
    are one part (review33b)."""
    return tuple((n.op, n.target, repr(n.args[1:]), repr(sorted(n.kwargs.items()))) for n in chain)


def _numel(meta) -> int:
    return meta.shape.numel() if meta is not None else 1 << 62


def _movable(op, chains, written) -> bool:
    meta = _meta(op)
    if meta is None or op in written or any(isinstance(v, torch.fx.Node) for v in op.kwargs.values()) \
            or any(a in written for a in op.args if isinstance(a, torch.fx.Node)) \
            or (op.meta.get(LINEAR_BIAS, False) and meta.dtype != torch.float32):
        return False
    args = meta_operands(op)
    parts = {_part(chain): _numel(_meta(chain[-1])) for chain in chains}   # the same part read twice counts once
    if args is None or sum(parts.values()) > _numel(meta):
        return False   # overlapping parts would compute op twice; in a stencil, 2^n times (review33)
    for chain in chains:
        leaf = chain[-1]
        out = _meta(leaf)
        if out is None or any(n in written for n in chain) or not leaf.users or not all(
                u.op == "call_function" and is_pointwise_target(u.target) for u in leaf.users):
            return False
        try:
            laid = [a if isinstance(a, torch.Tensor) and a.dim() == 0 else _laid_out(chain, tuple(meta.shape), a)
                    for a in args]
            result = op.target(*laid, **op.kwargs)
        except (RuntimeError, TypeError, ValueError, NotImplementedError, IndexError):
            return False
        if not all(t._base is not None for t in laid if isinstance(t, torch.Tensor) and t.dim()) \
                or not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(out.shape) \
                or result.dtype != out.dtype or not readers_keep_strides(leaf, result):
            return False
    return True


def _sliced(gm, a, chain, shape, cache):
    """Operand `a` of the moved op, expanded to its shape and read through the chain (a view)."""
    g = gm.graph
    if not isinstance(a, torch.fx.Node) or _meta(a).shape == ():
        return a   # a 0-dim tensor stays one: it takes part in type promotion as a number does (fuzz33h)
    if a.op == "get_attr":   # a parameter or buffer: its view, registered once (the same storage: stays live)
        view = _laid_out(chain, shape, fetch_attr(gm, a.target))
        node = g.get_attr(register_constant(gm, f"{a.target}.part", view))
        node.meta["tensor_meta"] = _extract_tensor_metadata(view)
        return node
    fake = meta_tensor(_meta(a))
    if tuple(fake.shape) != shape:
        if (a, "expand") not in cache:
            expanded = g.call_method("expand", (a, shape))
            expanded.meta["tensor_meta"] = _extract_tensor_metadata(fake.expand(shape))
            cache[(a, "expand")] = (expanded, fake.expand(shape))
        a, fake = cache[(a, "expand")]
    for node in chain:   # a chunk of `a` made once, its parts shared by the chains that read them
        key = (a, node)
        if key not in cache:
            make = g.call_method if node.op == "call_method" else g.call_function
            made, value = make(node.target, (a, *node.args[1:]), dict(node.kwargs)), _step(node, fake)
            made.meta["tensor_meta"] = map_aggregate(value, lambda t: _extract_tensor_metadata(t)
                                                     if isinstance(t, torch.Tensor) else t)
            cache[key] = (made, value)
        a, fake = cache[key]
    return a


def _hoist(gm, op, chains) -> None:
    """Replace each chain(op(a, b)) by op(chain(a.expand), chain(b.expand))."""
    g = gm.graph
    shape, cache = tuple(_meta(op).shape), {}
    for chain in chains:
        leaf = chain[-1]
        with g.inserting_before(op):   # before every leaf: a chain may reuse what an earlier one made (fuzz33h)
            args = tuple(_sliced(gm, a, chain, shape, cache) for a in op.args)
            moved = g.call_function(op.target, args, dict(op.kwargs))
        moved.meta = {k: v for k, v in op.meta.items() if k != "tensor_meta"}
        result = op.target(*(meta_tensor(_meta(a)) if isinstance(a, torch.fx.Node) else a for a in args),
                           **op.kwargs)
        moved.meta["tensor_meta"] = _extract_tensor_metadata(result)   # its own strides, not the slice's
        leaf.replace_all_uses_with(moved)
        g.erase_node(leaf)
    for chain in chains:   # the slices between op and the leaves, last first
        for node in reversed(chain[:-1]):
            if not node._erased and not node.users:
                g.erase_node(node)
    operands = [a for a in op.args if isinstance(a, torch.fx.Node)]
    g.erase_node(op)
    for a in operands:   # a bias read only by op: its parts are registered views now
        if a.op == "get_attr" and not a.users:
            g.erase_node(a)


def hoist_slices(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    g = gm.graph
    changed = True
    while changed:   # a sweep from the output up moves an op, then the ops before it, which now
        changed = False   # read the new slices, further on in the same sweep
        written = _mutated_values(gm)
        for node in reversed(list(g.nodes)):
            if node._erased or node.op != "call_function" or not is_pointwise_target(node.target):
                continue
            chains = _chains(node)
            if chains is not None and _movable(node, chains, written):
                _hoist(gm, node, chains)
                changed = True
    g.lint()
    gm.recompile()
    return gm
