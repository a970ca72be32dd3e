"""The graph surgery of the Strassen pass (passes/strassen.py): per accepted Linear, the prefix
kernel, the one batched GEMM against combined weights, and the suffix kernel fused with the
layer's pointwise epilogue and the next layer's prefix, all built with IRBuilder.

passes/strassen.py decides which layers to rewrite (legality, numerics guard, the cost
model's plan); this module only rewrites the layers it is handed. The module docstring of
passes/strassen.py describes the kernels and the padding.
"""
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F

from fxfuse.ir import IndexMap, IRBuilder, KernelIR, OutputSpec, Store
from fxfuse.node_meta import get_attr_quietly
from fxfuse.kernel import FusedKernel
from fxfuse.ops import POINTWISE, as_layout, is_pointwise_target, keep_eager_layout, row_major
from fxfuse.strassen_tables import block_position, combine_ir, levels, prefix_ref, suffix_ref
from fxfuse.tf32x3 import bmm_tf32x3, stored_parts
from fxfuse.tracing import fetch_attr as _fetch, fxfuse_meta, tensor_meta as _tmeta, tensor_metadata

from .fuse_pointwise import why_not_fusible


def _ceil_to(n: int, s: int) -> int:
    return -(-n // s) * s


@dataclass
class Layer:
    """One Linear that may be rewritten; sizes are the flattened [B, K] x [K, N] product."""
    node: torch.fx.Node
    out_shape: tuple
    B: int
    K: int
    N: int
    dtype: torch.dtype
    levels: int = 0                       # 0: stays classical
    max_levels: int | None = None         # the cost model's choice (None: options.strassen_levels)
    right: torch.Tensor | None = None     # R [7^L, Kp/s, Np/s] once accepted
    tf32x3: bool = False                  # the product call in 3xTF32 (fxfuse.tf32x3.bmm_tf32x3)
    record: dict = field(default_factory=dict)

    @property
    def x(self) -> torch.fx.Node:
        return self.node.args[0]      # read live: an earlier rewrite may have replaced the producer

    s = property(lambda self: 1 << self.levels)                # blocks per side
    Bp = property(lambda self: _ceil_to(self.B, self.s))       # padded sizes
    Kp = property(lambda self: _ceil_to(self.K, self.s))
    Np = property(lambda self: _ceil_to(self.N, self.s))


def _k_major(right: torch.Tensor) -> torch.Tensor:
    """R [r, K, N] with K contiguous (strides (N*K, 1, K)): tf32 tensor-core products take
    both operands K-major; bmm_tf32x3 with R N-major measured 2.2x slower (36 against 79
    TFLOP/s, H100, autotune_bmm_x3_20261126.json)."""
    return right.transpose(1, 2).contiguous().transpose(1, 2)


def _epilogue(layer: Layer, order: dict, mutated: set) -> list:
    """Pointwise nodes after the Linear that one tail kernel can compute per block: each has
    y's shape, reads y or earlier members, and otherwise only numbers and external tensors
    that exist before the Linear (or are constants) and broadcast as a scalar, a row vector
    [N] or a full [.., N] tensor."""
    y = layer.node
    inside = {y}
    members = []
    yshape = tuple(layer.out_shape)
    for node in list(y.graph.nodes)[order[y] + 1:]:
        if node.op != "call_function" or not is_pointwise_target(node.target):
            continue
        if why_not_fusible(node, mutated) is not None or tuple(_tmeta(node).shape) != yshape:
            continue
        operands = node.args[:POINTWISE[node.target].nargs]
        if not any(isinstance(a, torch.fx.Node) and a in inside for a in operands):
            continue
        if all(not isinstance(a, torch.fx.Node) or a in inside or _external_kind(a, layer, order)
               for a in operands):
            inside.add(node)
            members.append(node)
    return members


def _external_kind(a: torch.fx.Node, layer: Layer, order: dict) -> str | None:
    if a.op != "get_attr" and order[a] >= order[layer.node]:
        return None          # computed after the Linear: the kernel could not read it in time
    m = _tmeta(a)
    shape = tuple(m.shape)
    if m.shape.numel() == 1:
        return "scalar"
    if shape == tuple(layer.out_shape):
        return "full"
    if shape and shape[-1] == layer.N and m.shape.numel() == layer.N:
        return "row"
    return None


def _zero_padding(z: torch.Tensor, row_valid: torch.Tensor, col_valid: torch.Tensor) -> torch.Tensor:
    """Reference of the kernels' masking: the next prefix must see exact zeros in padding."""
    return torch.where(row_valid[:, None] & col_valid[None, :], z, torch.zeros((), dtype=z.dtype, device=z.device))


class _Rewriter:
    """Graph surgery for the accepted layers, in graph order."""

    def __init__(self, gm, layers: list, order: dict, mutated: set, use_kernels: bool):
        self.gm, self.g = gm, gm.graph
        self.layers = layers
        self.order, self.mutated, self.use_kernels = order, mutated, use_kernels
        self.fed = {}          # Linear node -> node of its prefix [r, B/s, K/s] made by a previous tail
        self.dead = set()
        self.kernels = 0
        self.fake = {}         # created node -> meta tensor (its shape and strides)
        self.device = layers[0].right.device

    # -- small helpers -------------------------------------------------------------------
    def _const(self, prefix: str, tensor: torch.Tensor) -> torch.fx.Node:
        k = 0
        while hasattr(self.gm, f"{prefix}_{k}"):
            k += 1
        self.gm.register_buffer(f"{prefix}_{k}", tensor)
        node = self.g.get_attr(f"{prefix}_{k}")
        self._set_meta(node, torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"))
        return node

    def _set_meta(self, node, fake: torch.Tensor) -> None:
        """Shapes of created nodes, so later layers of this pass read them like any other."""
        self.fake[node] = fake
        node.meta["tensor_meta"] = tensor_metadata(fake)
        fxfuse_meta(node)["device"] = self.device

    def _meta_of(self, node) -> torch.Tensor:
        if node in self.fake:
            return self.fake[node]
        m = _tmeta(node)
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")

    def _call(self, fn, args, kwargs=None) -> torch.fx.Node:
        node = self.g.call_function(fn, args, kwargs or {})
        metas = [self._meta_of(a) if isinstance(a, torch.fx.Node) else a for a in args]
        if fn in (torch.bmm, bmm_tf32x3):   # torch's meta bmm checks through torch._check, which imports sympy:
            a, b = metas[:2]  # ~3 s in a fresh process on the H100 host (optimize_time_probe)
            assert a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1], (a.shape, b.shape)
            result = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype, device="meta")
        else:
            result = fn(*metas, **(kwargs or {}))
        self._set_meta(node, result)
        return node

    def _module(self, ir: KernelIR, reference, inputs: list, members: tuple, decision: str) -> torch.fx.Node:
        input_meta = tuple((tuple(self._meta_of(a).shape), tuple(self._meta_of(a).stride()),
                            self._meta_of(a).dtype) for a in inputs)
        name = f"strassen_{self.kernels}"
        while hasattr(self.gm, name):
            name += "_"
        self.kernels += 1
        self.gm.add_submodule(name, FusedKernel(ir, reference, input_meta, members, self.use_kernels,
                                                origin="strassen"))
        call = self.g.call_module(name, tuple(inputs))
        call.meta["fxfuse"] = {"kind": "fused kernel", "decision": decision, "strassen_kernel": True}
        return call

    # -- the rewrite -----------------------------------------------------------------------
    def run(self) -> None:
        for layer in self.layers:
            self._rewrite(layer)
        constants = {a for n in self.dead for a in n.all_input_nodes if a.op == "get_attr"}
        for node in reversed(list(self.g.nodes)):
            if node in self.dead:
                assert not node.users, f"{node.name} still read by {list(node.users)}"
                self.g.erase_node(node)
        for node in constants:
            if not node.users:
                self.g.erase_node(node)

    def _next_layer(self, layer: Layer, inside: set) -> Layer | None:
        for other in self.layers:
            if self.order[other.node] > self.order[layer.node] and other.x in inside \
                    and other.levels == layer.levels and other.node not in self.fed:
                return other
        return None

    def _rewrite(self, layer: Layer) -> None:
        lin = layer.node
        self.order = {n: k for k, n in enumerate(self.g.nodes)}   # earlier rewrites added nodes
        members = _epilogue(layer, self.order, self.mutated)
        inside = {lin, *members}
        nxt = self._next_layer(layer, inside)
        z = nxt.x if nxt is not None else None
        stored = [v for v in [lin] + members
                  if any(u not in inside and not (nxt is not None and u is nxt.node and v is z) for u in v.users)]
        with self.g.inserting_before(lin):
            prefix = self.fed.get(lin)
            if prefix is None:
                prefix = self._standalone_prefix(layer)
            if layer.tf32x3:   # R's TF32 parts, made once, K-major (bmm_tf32x3's fast form)
                parts = [self._const("strassen_right", _k_major(p)) for p in stored_parts(layer.right)]
                products = self._call(bmm_tf32x3, (prefix, *parts))
            else:
                products = self._call(torch.bmm, (prefix, self._const("strassen_right", layer.right)))
            products.meta["fxfuse"] = dict(layer.record)
            call, outputs = self._tail(layer, products, members, stored, nxt)
            if nxt is not None:
                self.fed[nxt.node] = outputs.pop(0)
            for v, out in zip(stored, outputs):
                if layer.Bp != layer.B:
                    out = self._call(torch.narrow, (out, 0, 0, layer.B))
                if layer.Np != layer.N:   # columns of a padded buffer: copied out, so y is row-major
                    out = self._call(torch.narrow, (out, 1, 0, layer.N))   # as eager's (contiguous()
                    out = self._call(as_layout, (out, (layer.N, 1)))       # keeps stride Np at 1 row)
                if len(layer.out_shape) != 2:
                    out = self._call(torch.reshape, (out, tuple(layer.out_shape)))
                v.replace_all_uses_with(out, delete_user_cb=lambda u: u not in inside)
                keep_eager_layout(self.gm, out, _tmeta(v), row_major(layer.out_shape))   # suffix: row-major
        self.dead.update(inside)

    def _standalone_prefix(self, layer: Layer) -> torch.fx.Node:
        x = layer.x
        if len(layer.out_shape) != 2:
            x = self._call(torch.reshape, (x, (layer.B, layer.K)))
        if (layer.Bp, layer.Kp) != (layer.B, layer.K):
            x = self._call(F.pad, (x, (0, layer.Kp - layer.K, 0, layer.Bp - layer.B)))
        xm = self._meta_of(x)
        s, L = layer.s, layer.levels
        bh, kh = layer.Bp // s, layer.Kp // s
        s0, s1 = xm.stride()
        b = IRBuilder((bh, kh))
        inp = b.add_input(layer.dtype)
        blocks = []
        for p in range(4 ** L):
            r, c = block_position(p, L)
            blocks.append(b.load(inp, IndexMap(r * bh * s0 + c * kh * s1, (s0, s1))))
        stores = self._prefix_stores(b, blocks, L, bh * kh, kh)
        ir = KernelIR(b.shape, tuple(b.inputs), (OutputSpec((7 ** L, bh, kh), layer.dtype),),
                      tuple(b.instrs), tuple(stores))
        g = torch.fx.Graph()
        xp = g.placeholder("x")
        g.output(g.call_function(prefix_ref, (xp, L), {"out_dtype": layer.dtype}))
        ref = torch.fx.GraphModule(torch.nn.Module(), g)
        call = self._module(ir, ref, [x], (f"prefix of {layer.node.name}",),
                            f"Strassen prefix of {layer.node.name}: {7 ** L} combinations of "
                            f"{4 ** L} blocks of its input")
        self._set_meta(call, torch.empty((7 ** L, bh, kh), dtype=layer.dtype, device="meta"))
        return call

    @staticmethod
    def _prefix_stores(b: IRBuilder, blocks: list, L: int, slice_elems: int, row_stride: int) -> list:
        U = levels(L)[0]
        return [Store(0, IndexMap(t * slice_elems, (row_stride, 1)), combine_ir(b, blocks, U[t]))
                for t in range(U.shape[0])]

    def _prepare_external(self, a: torch.fx.Node, kind: str, layer: Layer) -> torch.fx.Node:
        """a as a tensor the kernel can read at block offsets: [Bp, Np], [Np] or 0-d."""
        B, N, Bp, Np = layer.B, layer.N, layer.Bp, layer.Np
        if a.op == "get_attr":
            t = _fetch(self.gm, a.target).detach()
            unchanged = {"scalar": t.dim() == 0, "row": t.dim() == 1 and Np == N,
                         "full": t.dim() == 2 and (Bp, Np) == (B, N)}[kind]
            if unchanged and t.is_contiguous():
                node = get_attr_quietly(self.g, a.target)   # a fresh read: the original may come after the Linear
                self._set_meta(node, torch.empty(t.shape, dtype=t.dtype, device="meta"))
                return node
            if kind == "scalar":
                t = t.reshape(())
            elif kind == "row":
                t = F.pad(t.reshape(N), (0, Np - N))
            else:
                t = F.pad(t.reshape(B, N), (0, Np - N, 0, Bp - B))
            return self._const("strassen_operand", t.contiguous())
        if kind == "scalar":
            return self._call(torch.reshape, (a, ())) if len(_tmeta(a).shape) else a
        if kind == "row":
            n = self._call(torch.reshape, (a, (N,))) if len(_tmeta(a).shape) != 1 else a
            return self._call(F.pad, (n, (0, Np - N))) if Np != N else n
        n = self._call(torch.reshape, (a, (B, N))) if len(_tmeta(a).shape) != 2 else a
        return self._call(F.pad, (n, (0, Np - N, 0, Bp - B))) if (Bp, Np) != (B, N) else n

    def _tail(self, layer: Layer, products, members: list, stored: list, nxt: Layer | None):
        """One kernel: suffix of `layer` + its epilogue + (nxt's prefix); returns (call, outputs)."""
        L, s = layer.levels, layer.s
        bh, nh = layer.Bp // s, layer.Np // s
        r, q = 7 ** L, 4 ** L
        _, _, W = levels(L)
        b = IRBuilder((bh, nh))
        inputs = [products]
        b.add_input(layer.dtype)
        M = [b.load(0, IndexMap(t * bh * nh, (nh, 1))) for t in range(r)]
        vals = {layer.node: [combine_ir(b, M, W[k]) for k in range(q)]}
        ext = {}
        for m in members:
            op = POINTWISE[m.target]
            for a in m.args[:op.nargs]:
                if isinstance(a, torch.fx.Node) and a not in vals and a not in ext:
                    kind = _external_kind(a, layer, self.order)
                    node = self._prepare_external(a, kind, layer)
                    inputs.append(node)
                    ext[a] = (kind, b.add_input(_tmeta(a).dtype), self._meta_of(node).stride())
            params = dict(zip(op.params, m.args[op.nargs:]))
            params.update(m.kwargs)
            vals[m] = []
            for k in range(q):
                R, C = block_position(k, L)
                args = []
                for a in m.args[:op.nargs]:
                    if isinstance(a, torch.fx.Node) and a in vals:
                        args.append(vals[a][k])
                    elif isinstance(a, torch.fx.Node):
                        kind, idx, st = ext[a]
                        index = (IndexMap(0, (0, 0)) if kind == "scalar" else
                                 IndexMap(C * nh * st[0], (0, st[0])) if kind == "row" else
                                 IndexMap(R * bh * st[0] + C * nh * st[1], (st[0], st[1])))
                        args.append(b.load(idx, index))
                    else:
                        args.append(b.const(a))
                vals[m].append(b.op(op.name, args, **params))
        outputs, stores = [], []
        mask_inputs = []
        if nxt is not None:
            zs = list(vals[nxt.x])
            pad_rows, pad_cols = layer.Bp != layer.B, layer.Np != layer.N
            if pad_rows or pad_cols:
                valid_r = torch.arange(layer.Bp, device=layer.right.device) < layer.B
                valid_c = torch.arange(layer.Np, device=layer.right.device) < layer.N
                mask_inputs = [self._const("strassen_valid_rows", valid_r), self._const("strassen_valid_cols", valid_c)]
                ir_r, ir_c = b.add_input(torch.bool), b.add_input(torch.bool)
                zero = b.const(0.0)
                for k in range(q):
                    R, C = block_position(k, L)
                    if (R + 1) * bh > layer.B:
                        zs[k] = b.op("where", [b.load(ir_r, IndexMap(R * bh, (1, 0))), zs[k], zero])
                    if (C + 1) * nh > layer.N:
                        zs[k] = b.op("where", [b.load(ir_c, IndexMap(C * nh, (0, 1))), zs[k], zero])
            outputs.append(OutputSpec((r, bh, nh), nxt.dtype))
            stores += self._prefix_stores(b, zs, L, bh * nh, nh)
        for v in stored:
            out = len(outputs)
            outputs.append(OutputSpec((layer.Bp, layer.Np), _tmeta(v).dtype))
            for k in range(q):
                R, C = block_position(k, L)
                stores.append(Store(out, IndexMap(R * bh * layer.Np + C * nh, (layer.Np, 1)), vals[v][k]))
        inputs += mask_inputs
        ir = KernelIR(b.shape, tuple(b.inputs), tuple(outputs), tuple(b.instrs), tuple(stores))
        ref = self._tail_reference(layer, members, ext, stored, nxt, bool(mask_inputs))
        described = (f"suffix of {layer.node.name}",) + tuple(
            f"{m.name}={POINTWISE[m.target].name}" for m in members) + (
            (f"prefix of {nxt.node.name}",) if nxt is not None else ())
        decision = (f"Strassen suffix of {layer.node.name}" + (f" + {len(members)} pointwise ops" if members else "")
                    + (f" + prefix of {nxt.node.name}" if nxt is not None else "")
                    + f"; stores {', '.join(v.name for v in stored) or 'no full-size value'}")
        call = self._module(ir, ref, inputs, described, decision)
        metas = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in outputs]
        if len(outputs) == 1:
            self._set_meta(call, metas[0])
            return call, [call]
        call.meta["tensor_meta"] = tuple(tensor_metadata(m) for m in metas)
        items = []
        for k, meta in enumerate(metas):
            item = self.g.call_function(operator.getitem, (call, k))
            self._set_meta(item, meta)
            items.append(item)
        return call, items

    def _tail_reference(self, layer, members, ext, stored, nxt, masked) -> torch.fx.GraphModule:
        """The tail's torch ops on whole padded tensors: the kernel's fallback and reference."""
        g = torch.fx.Graph()
        env = {layer.node: g.call_function(suffix_ref, (g.placeholder("products"), layer.levels),
                                           {"out_dtype": layer.dtype})}
        for a in ext:
            env[a] = g.placeholder(a.name)
        for m in members:
            env[m] = g.node_copy(m, lambda n: env[n])
        outs = []
        if nxt is not None:
            z = env[nxt.x]
            if masked:
                z = g.call_function(_zero_padding, (z, g.placeholder("valid_rows"), g.placeholder("valid_cols")))
            outs.append(g.call_function(prefix_ref, (z, layer.levels), {"out_dtype": nxt.dtype}))
        outs += [env[v] for v in stored]
        g.output(outs[0] if len(outs) == 1 else tuple(outs))
        return torch.fx.GraphModule(torch.nn.Module(), g)
