"""The layer forms normalize produces: Linear and Conv as a library product plus a pointwise
bias add, whatever the spelling (an nn.Linear, F.linear with a bias, x @ W.T + b, addmm).

Why split the bias off: the pointwise passes fuse it with what follows (activation, residual),
and the Linear passes (fused GEMM, fused MLP, Strassen, the cost model) look for F.linear
nodes: every spelling of the same product must reach them as the same two nodes.
"""
import inspect
import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fxfuse.gemm_kernel import broadcasts_to
from fxfuse.node_meta import fetch_attr, get_attr_quietly, tensor_meta
from fxfuse.state_writes import written_attributes

from .contraction_forms import einsum_operands, inner_or_tensordot, stored_weight
from .spellings import CONV_FUNCTIONS

aten = torch.ops.aten


def register_constant(gm, stem: str, tensor: torch.Tensor) -> str:
    name = "fxfuse_" + stem.replace(".", "_")
    k = 0
    while hasattr(gm, name + (f"_{k}" if k else "")):
        k += 1
    name += f"_{k}" if k else ""
    gm.register_buffer(name, tensor.detach(), persistent=False)
    return name


MATMULS = {operator.matmul, torch.matmul, torch.mm, aten.mm.default, aten.matmul.default, torch.linalg.matmul,
           aten.mm, aten.matmul}   # (the packets, no overload named: fuzz43b)
MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
ADDMMS = {torch.addmm, aten.addmm.default, aten.addmm}


def _swaps(dims) -> bool:
    """Two dimensions of a 2-D tensor, one each: (0, 1), (1, 0), (-1, 0), (1, -2) ..."""
    return isinstance(dims, tuple) and len(dims) == 2 and all(isinstance(d, int) and -2 <= d < 2 for d in dims) \
        and {d % 2 for d in dims} == {0, 1}


def _reverses(dims) -> bool:
    """A permute of a 2-D tensor that swaps its dimensions: (1, 0), (-1, 0), (1, -2), (-1, -2);
    (0, 1) and (-2, -1) keep them (fuzz34a: `W.permute(0, 1)` was read as W.T)."""
    return _swaps(dims) and (dims[0] % 2, dims[1] % 2) == (1, 0)


def _transposed_weight(node):
    """W where node is W.T / W.t() / torch.t(W) / W.transpose(0, 1) (or -1, -2) / W.permute(1, 0)
    of a 2-D constant of the model (a get_attr), else None."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    w, rest = node.args[0], tuple(node.args[1:]) + tuple(node.kwargs.values())
    real = isinstance(w, torch.fx.Node) and not getattr(w.meta.get("tensor_meta"), "dtype", torch.complex64).is_complex
    rest = tuple(tuple(r) if isinstance(r, list) else r for r in rest)    # permute([1, 0])
    swaps = _swaps(rest)
    transposes = (
        (node.op == "call_function" and node.target is getattr and rest in (("T",), ("mT",)))
        or (node.op == "call_method" and node.target == "t" and not rest)
        or (node.op == "call_function" and node.target is getattr and rest in (("mH",), ("H",)) and real)
        or (node.op == "call_method" and node.target == "adjoint" and not rest and real)   # (fuzz43b)
        or (node.op == "call_function" and node.target in (torch.t, aten.t.default, aten.numpy_T.default,
                                                           aten.mT.default, aten.t) and not rest)   # export's W.T, W.mT
        or (node.op == "call_function" and node.target in (torch.adjoint, aten.adjoint.default, aten.mH.default)
            and not rest and real)   # (export's W.mH, W.adjoint(): fuzz45d)
        or (node.op == "call_method" and node.target in ("movedim", "moveaxis") and swaps)
        or (node.op == "call_function" and node.target in (torch.movedim, torch.moveaxis, aten.movedim.int,
                                                           aten.moveaxis.int) and swaps)
        or (node.op == "call_method" and node.target in ("transpose", "swapaxes", "swapdims") and swaps)
        or (node.op == "call_function" and node.target in (torch.transpose, torch.swapaxes, torch.swapdims,
                                                           aten.transpose.int, aten.swapaxes.default,
                                                           aten.swapdims.default) and swaps)
        or (node.op == "call_method" and node.target == "permute" and _reverses(rest[0] if len(rest) == 1 else rest))
        or (node.op == "call_function" and node.target in (torch.permute, aten.permute.default)
            and len(rest) == 1 and _reverses(rest[0])))
    meta = w.meta.get("tensor_meta") if isinstance(w, torch.fx.Node) else None
    if transposes and w.op == "get_attr" and meta is not None and len(meta.shape) == 2:
        return w
    return None


def _transposed_copy(gm, w):
    """A get_attr of W.T as a contiguous constant of gm: `x @ W` with W stored [in, out] is
    F.linear(x, W.T). One copy per weight however often the graph reads it; the copy is
    derived from the model's tensor, so the runtime watches W's version counter and rebuilds
    after an in-place edit (api.tensors_read), as for BatchNorm folding."""
    copies = gm.meta.setdefault("fxfuse_transposed_weights", {})   # W's target -> (copy's name, W)
    if w.target not in copies:
        weight = fetch_attr(gm, w.target)
        copies[w.target] = (register_constant(gm, f"{w.target}.T", weight.detach().t().contiguous()), weight)
    with gm.graph.inserting_after(w):
        node = gm.graph.get_attr(copies[w.target][0])
    meta = w.meta["tensor_meta"]
    node.meta["tensor_meta"] = meta._replace(shape=torch.Size(reversed(meta.shape)), stride=(meta.shape[0], 1),
                                             requires_grad=False)
    return node


def _weight_operand(other, transposed: bool):
    """(W, copy) for the product `x @ other` (transposed=False) or `F.linear(x, other)`
    (transposed=True), where other is a constant W of the model or W.T of one: F.linear needs
    W itself (copy False) or its transposed copy (copy True, W stored [in, out]); None where
    other is neither."""
    w = _transposed_weight(other)
    if w is not None:
        return w, transposed
    w = stored_weight(other)
    return (w, not transposed) if w is not None else None


def matmul_as_linear(gm, node) -> bool:
    """The same product spelled as a Linear, so the Linear passes (fused GEMM, fused MLP,
    Strassen, the cost model) see it: `x @ W.T`, `torch.matmul(x, W.t())`,
    `x.mm(W.transpose(0, 1))`, `torch.einsum("bi,oi->bo", x, W)` -> F.linear(x, W);
    `torch.addmm(b, x, W.t())` -> F.linear(x, W) + b (b + x @ W.T and x @ W.T + b are the same
    sum). A weight stored [in, out] (`x @ W`, `torch.addmm(b, x, W)`, `einsum("bi,io->bo")`,
    `F.linear(x, W.t())`) reads a transposed copy made at optimize time."""
    bias, weight = None, None
    if node.op == "call_function" and node.target in MATMULS or node.op == "call_method" and node.target in MATMUL_METHODS:
        args = dict(zip(("input", "other"), node.args), **node.kwargs)   # torch.mm(x, mat2=W.T) (fuzz43b)
        args = {"other" if k == "mat2" else k: v for k, v in args.items()}
        if set(args) == {"input", "other"} and len(node.args) <= 2:
            x, other = args["input"], args["other"]
            weight = _weight_operand(other, transposed=False)
    elif node.op == "call_function" and node.target in ADDMMS or node.op == "call_method" and node.target == "addmm":
        args = dict(zip(("input", "mat1", "mat2", "beta", "alpha"), node.args), **node.kwargs)
        if set(args) == {"input", "mat1", "mat2"} | ({"beta", "alpha"} & set(args)) \
                and all(type(args.get(k, 1)) in (int, float) and args.get(k, 1) == 1 for k in ("beta", "alpha")):
            bias, x, other = args["input"], args["mat1"], args["mat2"]   # beta=1, alpha=1 spelled out too (fuzz34a)
            weight = _weight_operand(other, transposed=False)
    elif node.op == "call_function" and node.target in (F.linear, aten.linear.default):
        args = dict(zip(("input", "weight", "bias"), node.args), **node.kwargs)
        if set(args) - {"input", "weight", "bias"} or not {"input", "weight"} <= set(args):
            return False
        x, bias = args["input"], args.get("bias")   # F.linear(x, W) is canonical already:
        if _transposed_weight(args["weight"]) is not None:   # split_layer splits its bias off
            weight = _weight_operand(args["weight"], transposed=True)
        elif node.kwargs:   # F.linear(input=x, weight=W): the positional form the Linear passes read
            weight = (args["weight"], False)
    elif (einsum := einsum_operands(node)) is not None:
        x, w, stored_out_in = einsum
        weight = (w, not stored_out_in)
    elif (contracted := inner_or_tensordot(node)) is not None:   # torch.inner(x, W), tensordot(x, W, ([-1], [1]))
        x, other, as_linear = contracted                              # (fuzz45d: not planned as Linears)
        weight = _weight_operand(other, transposed=as_linear)
    if weight is None:
        return False
    w, copy = weight
    x_meta, w_meta = tensor_meta(x), tensor_meta(w)
    if node.kwargs and node.target in (F.linear, aten.linear.default):
        pass           # F.linear(input=x, weight=W) of any W: the same call, positional
    elif x_meta is None or w_meta is None or len(x_meta.shape) < 1 or x_meta.dtype != w_meta.dtype \
            or len(w_meta.shape) != 2 or x_meta.shape[-1] != w_meta.shape[0 if copy else 1]:
        return False   # not a product eager computes: it raises, and so does the graph
    if node.target in (torch.mm, aten.mm.default, "mm") and len(x_meta.shape) != 2:
        return False
    if copy and w.target in written_attributes(gm):
        return False   # W written in forward: a copy made now would go stale (review35)
    if copy:
        w = _transposed_copy(gm, w)
    g = gm.graph
    with g.inserting_before(node):
        out = g.call_function(F.linear, (x, w))
        out.meta = dict(node.meta)
        if bias is not None:
            out = g.call_function(operator.add, (out, bias))
            out.meta = dict(node.meta)
            out.meta[LINEAR_BIAS] = True    # addmm / F.linear add it before their one rounding
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return True


LINEAR_BIAS = "fxfuse_linear_bias"   # node.meta key of a bias add split off a Linear, addmm or F.linear,
#                                     whose eager op added it before rounding once (linear_epilogue)


def split_layer(gm, node) -> bool:
    """Linear -> F.linear(x, W) + b ; ConvNd -> F.convNd(x, W, None, ...) + b.view(C, 1, ...).
    The exact classes only: a subclass may compute its weight (a weight_norm parametrization,
    timm's StdConv2d) or override forward, and stays a call of its own."""
    g = gm.graph
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if type(mod) is nn.Linear and len(node.args) == 1 and not node.kwargs \
                and _bias_keeps_shape(node, None if mod.bias is None else mod.bias.shape):
            with g.inserting_before(node):
                w = get_attr_quietly(g, f"{node.target}.weight")
                out = g.call_function(F.linear, (node.args[0], w))
                if mod.bias is not None:
                    out.meta = dict(node.meta)
                    out = g.call_function(operator.add, (out, get_attr_quietly(g, f"{node.target}.bias")))
        elif type(mod) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and mod.padding_mode == "zeros" \
                and len(node.args) == 1 and not node.kwargs:
            nd = int(type(mod).__name__[-2])
            with g.inserting_before(node):
                w = get_attr_quietly(g, f"{node.target}.weight")
                out = g.call_function(CONV_FUNCTIONS[nd], (node.args[0], w, None, mod.stride,
                                                           mod.padding, mod.dilation, mod.groups))
                if mod.bias is not None:
                    out.meta = dict(node.meta)
                    shape = (-1,) + (1,) * nd
                    b = g.get_attr(register_constant(gm, f"{node.target}.bias", mod.bias.view(shape)))
                    out = g.call_function(operator.add, (out, b))
        else:
            return False
    elif node.op == "call_function" and node.target in (F.linear, aten.linear.default):
        args = dict(zip(("input", "weight", "bias"), node.args), **node.kwargs)
        bias = tensor_meta(args.get("bias"))
        if args.get("bias") is None or not _bias_keeps_shape(node, getattr(bias, "shape", None)):
            return False
        with g.inserting_before(node):
            out = g.call_function(F.linear, (args["input"], args["weight"]))
            out.meta = dict(node.meta)
            out = g.call_function(operator.add, (out, args["bias"]))
    else:
        return False
    out.meta = dict(node.meta)
    if out.target is operator.add and out.args[0].target is F.linear:
        out.meta[LINEAR_BIAS] = True    # nn.Linear and F.linear add it before their one rounding
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return True


def _bias_keeps_shape(node, bias_shape) -> bool:
    """Whether `F.linear(x, W) + b` has the layer's shape: ATen folds a [1, N] bias into a 1-D
    input's product ([N]), the add would broadcast it up a rank ([1, N], fuzz50c)."""
    out = tensor_meta(node)
    if bias_shape is None or not hasattr(out, "shape"):
        return bias_shape is None or len(bias_shape) <= 1
    return broadcasts_to(tuple(bias_shape), tuple(out.shape))


def keywords_to_positions(gm, node) -> None:
    """A module call's keyword arguments that are the next positional parameters of its
    forward() (`self.bn(input=h)`, `self.conv(input=x)`) become positional: the layer passes
    (BatchNorm folding, Linear splitting) read args[0]."""
    try:
        params = list(inspect.signature(gm.get_submodule(node.target).forward).parameters.values())
    except (TypeError, ValueError):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    following = names[len(node.args):len(node.args) + len(node.kwargs)]
    if set(following) == set(node.kwargs) and len(following) == len(node.kwargs):
        node.args = tuple(node.args) + tuple(node.kwargs[n] for n in following)
        node.kwargs = {}


UNIT_VIEW_METHODS = {"unsqueeze", "view", "reshape"}
UNIT_VIEW_FUNCTIONS = {operator.getitem, torch.unsqueeze, torch.reshape, aten.unsqueeze.default,
                       aten.view.default, aten.reshape.default}


def unit_view_of_constant(node):
    """The constant (get_attr) that node views with leading unit dimensions added and nothing
    else changed (`g[None]`, `b[None, :]`, `g.unsqueeze(0)`, `g.view(1, -1)`, `g.reshape(1, n)`),
    else None."""
    is_view = (node.op == "call_method" and node.target in UNIT_VIEW_METHODS
               or node.op == "call_function" and node.target in UNIT_VIEW_FUNCTIONS)
    if not is_view or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if node.target is operator.getitem and not only_unit_indices(node.args[1]):
        return None      # table[None, idx] looks up rows, whatever its shape says
    base = node.args[0]
    while base.op != "get_attr" and unit_view_of_constant(base) is not None:   # g[None][None]
        base = base.args[0]
    shapes = [n.meta.get("tensor_meta") for n in (base, node)]
    if base.op != "get_attr" or not all(isinstance(m, torch.fx.passes.shape_prop.TensorMetadata) for m in shapes):
        return None
    before, after = (tuple(m.shape) for m in shapes)
    extra = len(after) - len(before)
    # a 0-dim constant promotes dtypes as a scalar does, and its [1] view as a tensor does: kept
    return base if before and extra > 0 and after == (1,) * extra + before else None


def only_unit_indices(index) -> bool:
    """An index of None, ... and whole slices only (g[None], b[None, :], g[..., None, :])."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)


def broadcast_drops_unit_view(node, is_pointwise) -> bool:
    """`h * g[None]` is `h * g` where g is a constant: a view adding leading unit dimensions to
    an operand of pointwise ops changes nothing where another operand of each of them has at
    least the view's rank (broadcasting adds those dimensions anyway). The fused kernels take
    such constants as epilogue vectors, the view not (it split a Linear's epilogue off into a
    kernel of its own). Replaces the view by the constant; the view is left dead."""
    base = unit_view_of_constant(node)
    if base is None or not node.users:
        return False
    rank = len(node.meta["tensor_meta"].shape)

    def other_rank(user):
        ranks = [len(a.meta["tensor_meta"].shape) for a in user.all_input_nodes
                 if a is not node and isinstance(a.meta.get("tensor_meta"), torch.fx.passes.shape_prop.TensorMetadata)]
        return max(ranks, default=-1)
    if not all(u.op == "call_function" and is_pointwise(u.target) and other_rank(u) >= rank for u in node.users):
        return False
    node.replace_all_uses_with(base)
    return True


# ops that return a tuple of parts (a reader takes one) and the other slicing ops, by every spelling
PART_METHODS = {"chunk", "split", "tensor_split", "unbind", "hsplit", "vsplit", "dsplit",
                "split_with_sizes"}   # (fuzz43b)
PART_FUNCTIONS = {torch.chunk, torch.split, torch.tensor_split, torch.unbind, torch.hsplit, torch.vsplit, torch.dsplit,
                  aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
                  aten.tensor_split.sections, aten.tensor_split.indices,   # export's (fuzz38b)
                  *(getattr(aten, f"{d}split").int for d in "hvd"), *(getattr(aten, f"{d}split").array for d in "hvd"),
                  torch.split_with_sizes}
SLICING_METHODS = PART_METHODS | {"narrow", "select"}
SLICING_FUNCTIONS = PART_FUNCTIONS | {torch.narrow, torch.select, aten.slice.Tensor, aten.narrow.default,
                                      aten.select.int}


def _selects_part(index) -> bool:
    """A basic index that selects part of a tensor (`W[:16]`, `W[::2]`, `b[3]`, `W[:, :8]`):
    slices, ints, None and ... only; not g[None] alone (unit_view_of_constant's form)."""
    items = index if isinstance(index, tuple) else (index,)
    basic = all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool)
                for i in items)
    return basic and not only_unit_indices(index) and all(
        not isinstance(i, slice) or all(v is None or type(v) is int for v in (i.start, i.stop, i.step)) for i in items)


# a weight kept flat and viewed in forward (`F.linear(x, self.w.view(out, in))`, fuzz37d): a view too
RESHAPING_METHODS = {"view", "reshape", "unflatten"}
RESHAPING_FUNCTIONS = {torch.reshape, torch.unflatten, aten.view.default, aten.reshape.default,
                       aten._unsafe_view.default}   # export's spellings (fuzz40d)


def _reshaped_weight(node) -> bool:
    """A reshape read only as F.linear's weight: anywhere else (returned, a view's source) the
    node's own view keeps eager's requires_grad and _base (review29's round trips)."""
    return (node.op == "call_method" and node.target in RESHAPING_METHODS
            or node.op == "call_function" and node.target in RESHAPING_FUNCTIONS) and bool(node.users) and all(
        u.op == "call_function" and u.target in (F.linear, torch.ops.aten.linear.default)
        and len(u.args) > 1 and u.args[1] is node and node not in (*u.args[:1], *u.args[2:], *u.kwargs.values())
        for u in node.users)


def fold_constant_slice(gm, node) -> bool:
    """`F.linear(x, W[:16], b[:16])`, `w_q, w_kv = W.split([e, 2 * e])` (nn.MultiheadAttention's
    packed projection for cross-attention), `W.chunk(3)[0]`: a part of a parameter or buffer
    sliced in forward() becomes a constant of its own, registered as a view of the model's
    tensor (the same storage, so in-place edits are seen as for the tensor itself). The Linear
    passes then see a weight the model holds (a get_attr) instead of a weight computed in the
    graph, which kept such layers library GEMMs with their bias and activation unfused."""
    is_slicing = (node.op == "call_method" and node.target in SLICING_METHODS
                  or node.op == "call_function" and node.target in SLICING_FUNCTIONS
                  or node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2
                  and _selects_part(node.args[1]) or _reshaped_weight(node))
    if not is_slicing or not node.args or not isinstance(node.args[0], torch.fx.Node) \
            or node.args[0].op != "get_attr" or any(isinstance(a, torch.fx.Node) for a in node.args[1:]) \
            or any(isinstance(a, torch.fx.Node) for a in node.kwargs.values()):
        return False
    base = fetch_attr(gm, node.args[0].target)
    if not isinstance(base, torch.Tensor) or not base.dtype.is_floating_point or base.device.type == "meta":
        return False
    call = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
    try:
        with torch.no_grad():
            part = call(base, *node.args[1:], **node.kwargs)
    except Exception:   # noqa: BLE001 -- an index eager would refuse: left for the graph to raise
        return False
    parts = part if isinstance(part, (tuple, list)) else None
    if parts is None:
        return _replace_by_view(gm, node, node, part)
    users = list(node.users)
    if not all(u.op == "call_function" and u.target is operator.getitem and type(u.args[1]) is int
               and -len(parts) <= u.args[1] < len(parts) for u in users):
        return False   # the tuple itself is used (returned, unpacked by a call): left as it is
    done = [_replace_by_view(gm, u, node, parts[u.args[1]]) for u in users]
    if not node.users:
        gm.graph.erase_node(node)
    return any(done)


def _replace_by_view(gm, node, source, part) -> bool:
    """node -> a get_attr of `part`, a view of source's constant registered in gm."""
    if not isinstance(part, torch.Tensor) or part._base is None:
        return False   # a copy would not see in-place edits of the model's tensor
    with gm.graph.inserting_before(node):
        const = gm.graph.get_attr(register_constant(gm, f"{source.args[0].target}.part", part))
    const.meta["tensor_meta"] = _extract_tensor_metadata(part)
    node.replace_all_uses_with(const)
    gm.graph.erase_node(node)
    return True


GLU_FUNCTIONS = {F.glu, torch._C._nn.glu, aten.glu, aten.glu.default}


def glu_as_gate(gm, node) -> bool:
    """fp32 `F.glu(x, dim)` / `nn.GLU(dim)` -> `a, b = x.chunk(2, dim); a * torch.sigmoid(b)`:
    pointwise ops (and a slice, which hoist_slices moves above what made x), so a conv's bias
    and the gate share one kernel, where glu was a library op between two kernels (fuzz32d).
    fp16/bf16 stay glu: eager computes a * sigmoid(b) in fp32 and rounds once."""
    if node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.GLU and len(node.args) == 1:
        x, dim = node.args[0], gm.get_submodule(node.target).dim
    elif node.op == "call_function" and node.target in GLU_FUNCTIONS:
        args = dict(zip(("input", "dim"), node.args), **node.kwargs)
        x, dim = args.get("input"), args.get("dim", -1)
    else:
        return False
    meta = x.meta.get("tensor_meta") if isinstance(x, torch.fx.Node) else None
    if getattr(meta, "dtype", None) != torch.float32 or type(dim) is not int \
            or not -len(meta.shape) <= dim < len(meta.shape) or meta.shape[dim] % 2:
        return False
    g = gm.graph
    with g.inserting_before(node):
        parts = g.call_method("chunk", (x, 2, dim))
        gate = g.call_function(torch.sigmoid, (g.call_function(operator.getitem, (parts, 1)),))
        out = g.call_function(operator.mul, (g.call_function(operator.getitem, (parts, 0)), gate))
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return True


TRUNC_DIVISIONS = {torch.div, torch.divide, torch.ops.aten.div.Tensor_mode, torch.ops.aten.div.Scalar_mode}


def trunc_division_as_trunc(gm, node) -> bool:
    """fp32 `torch.div(a, b, rounding_mode="trunc")` -> `torch.trunc(a / b)`: ATen's float trunc division, as
    pointwise ops where it was a library call between two kernels (fuzz49g). On CUDA, for a number b,
    `torch.trunc(a * r)` with r = 1/b computed in fp32, as BinaryDivTruncKernel.cu does (not true
    division's reciprocal, divide_as_cuda_does': on an H200 -2.0 // 0.001 is -1999 there). fp16/bf16
    stay: eager divides in fp32 there and truncates before rounding."""
    if node.op == "call_method" and node.target in ("div", "divide") or node.op == "call_function" \
            and node.target in TRUNC_DIVISIONS:
        args = dict(zip(("input", "other"), node.args), **node.kwargs)
    else:
        return False
    meta = node.meta.get("tensor_meta")
    if args.pop("rounding_mode", None) != "trunc" or set(args) != {"input", "other"} or len(node.args) > 2 \
            or getattr(meta, "dtype", None) != torch.float32 or not isinstance(args["input"], torch.fx.Node):
        return False
    g, other = gm.graph, args["other"]
    op, on_cuda = operator.truediv, getattr(node.meta.get("fxfuse", {}).get("device"), "type", None) == "cuda"
    if on_cuda and isinstance(other, torch.fx.Node) and len(getattr(other.meta.get("tensor_meta"), "shape", (0,))) == 0:
        return False   # a 0-d tensor divisor (CUDA reads a CPU one as a number: its own reciprocal; review49r1)
    if on_cuda and type(other) in (int, float):
        op, other = operator.mul, (torch.ones(()) / torch.tensor(float(other), dtype=torch.float32)).item()
    with g.inserting_before(node):
        quotient = g.call_function(op, (args["input"], other))
        out = g.call_function(torch.trunc, (quotient,))
    quotient.meta = {k: dict(v) if isinstance(v, dict) else v for k, v in node.meta.items()}
    out.meta = node.meta
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return True


def prelu_or_rrelu_as_pointwise(gm, node) -> bool:
    """`nn.PReLU` / `F.prelu(x, w)` -> `torch.where(x > 0, x, x * w)`, ATen's formula with w viewed
    along the channel dim (a view of the parameter: edits reach it); eval-mode `nn.RReLU` /
    `F.rrelu(training=False)` -> leaky_relu with slope (lower + upper) / 2, as ATen computes it.
    Both were library calls between two kernels (fuzz35f). An in-place RReLU (`F.rrelu_`,
    `inplace=True`) becomes `F.leaky_relu(x, slope, inplace=True)` in its place, and returns False:
    the normalize loop then reads it as any in-place leaky_relu (kept only where the write shows)."""
    g, mod = gm.graph, gm.get_submodule(node.target) if node.op == "call_module" else None
    in_place = (F.rrelu_, torch.rrelu_, torch.ops.aten.rrelu_.default)
    if type(mod) is nn.RReLU and len(node.args) == 1 and not node.kwargs or node.op == "call_function" and \
            node.target in (F.rrelu, torch.rrelu, torch.ops.aten.rrelu.default, *in_place):
        names = ("input", "lower", "upper", "training", "inplace" if node.target is F.rrelu else "generator")
        bound = dict(zip(names, node.args), **node.kwargs)   # aten's: torch.export's spelling (fuzz39a)
        lower, upper = (mod.lower, mod.upper) if mod is not None else (bound.get("lower", 1 / 8), bound.get("upper", 1 / 3))
        if bound.get("training", False) is not False or bound.get("generator") is not None or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lower, upper)):
            return False
        if bound.get("inplace", False) is True or node.target in in_place or mod is not None and mod.inplace:
            node.op, node.target = "call_function", F.leaky_relu
            node.args, node.kwargs = (bound["input"], (lower + upper) / 2, True), {}
            return False
        with g.inserting_before(node):
            out = g.call_function(F.leaky_relu, (bound["input"],), {"negative_slope": (lower + upper) / 2})
    elif type(mod) is nn.PReLU and len(node.args) == 1 and not node.kwargs or \
            (node.op == "call_function" and node.target in (F.prelu, torch.prelu, torch.ops.aten.prelu.default)
             or node.op == "call_method" and node.target == "prelu") and len(node.args) == 2 and not node.kwargs:
        x = node.args[0]
        meta = tensor_meta(x) if isinstance(x, torch.fx.Node) else None
        weight = mod.weight if mod is not None else None
        w_meta = tensor_meta(node.args[1]) if mod is None and isinstance(node.args[1], torch.fx.Node) else None
        channels = weight.numel() if weight is not None else (w_meta.shape.numel() if w_meta is not None else None)
        if meta is None or channels is None or not meta.dtype.is_floating_point or \
                channels != 1 and (len(meta.shape) < 2 or meta.shape[1] != channels):
            return False
        with g.inserting_before(node):
            w = get_attr_quietly(g, f"{node.target}.weight") if mod is not None else node.args[1]
            if channels != 1 or not meta.shape:   # a 0-dim x: w as 0-dim too, or x * w is [1] (fuzz39a)
                w = g.call_method("view", (w, *([channels] + [1] * (len(meta.shape) - 2) if meta.shape else [()])))
            out = g.call_function(torch.where, (g.call_function(operator.gt, (x, 0)), x,
                                                g.call_function(operator.mul, (x, w))))
    else:
        return False
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return True
