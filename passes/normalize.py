"""Normalize: every spelling of an op becomes one canonical node before any matching.

`nn.ReLU()`, `F.relu`, `torch.relu`, `x.relu()`, `x.relu_()`, `F.relu(x, inplace=True)` and
aten's `relu.default` all become `torch.relu(x)`; likewise for every op of fxfuse.ops. Each
spelling is a row of the tables in passes/spellings.py: which canonical op it is, the names of its parameters in
positional order (to bind args and kwargs), and whether it mutates its first operand.

Also here (through passes/normalize_layers.py): `nn.Linear` / `F.linear` with a bias and the
matmul spellings of a Linear (`x @ W.T + b`, addmm) become `F.linear(x, W)` plus a pointwise
bias add (epilogue work for fusion); ConvNd keeps its library call with the bias split out;
eval-mode Dropout and Identity vanish; shape arithmetic (`x.size(0) * 2`) folds to constants
(the runtime guards on shapes); in-place ops become functional when nothing else can observe
the mutation, and otherwise stay as they are, so eager semantics hold either way.
"""
import inspect
import operator

import torch
import torch.fx
import torch.nn.functional as F

from fxfuse.graph_launch import draws_random
from fxfuse.node_meta import meta_tensor, single_tensor_meta
from fxfuse.ops import (POINTWISE, add_number_scaled, add_scaled, cast, is_pointwise_target, keep_eager_layout,
                        masked_fill_layout)
from fxfuse.state_writes import AUGMENTED_NAMES, KEYWORD_OPERATORS, VIEW_METHODS, schema_writes
from fxfuse.tracing import fxfuse_meta

from .contraction_forms import einsum_as_product
from .detach import _detach_readers, _is_detach
from .fold_literals import (cpu_literal_as_number, divide_as_cuda_does, factory_without_template, fold_literal_tensor,
                            fold_constant_mask, fold_pointwise_of_literals, fold_view_of_literal,
                            full_as_expanded_literal)
from .fresh_memory import (FRESH_FUNCTIONS, FRESH_METHODS, FRESH_MODULES, advanced_index,  # noqa: F401
                           copying_contiguous, disjoint_part_of_fresh, part_of_fresh_tuple,
                           whole_view_of_fresh)   # (FRESH_FUNCTIONS: linear_epilogue adds its own)
from .functional_twins import functional_twin, mask_assignment_as_where, whole_write_as_value
from .identity_ops import (atleast_of_enough_dims, copy_as_contiguous, is_no_op_conversion, pixel_shuffle_as_views,
                           read_only_clone, repeat_as_expand, respell_view, squeezed_slice_as_select, whole_slice)
from .implicit_args import explicit_softmax_dim
from .join_outputs import cat_of_unsqueezed_as_stack
from .metadata_spellings import copy_to_own_dtype_as_clone, overload_of, where_as_leaky_relu
from .normalize_layers import (broadcast_drops_unit_view, fold_constant_slice, glu_as_gate, keywords_to_positions,
                               matmul_as_linear, prelu_or_rrelu_as_pointwise, split_layer,
                               trunc_division_as_trunc)
from .spellings import (ARITH, ATEN_SPELLINGS, DROPOUT_FUNCTIONS, DROPOUT_MODULES, EXPORT_ASSERTS,
                        FUNCTION_SPELLINGS, METHOD_SPELLINGS, POSITIVE, SHAPE_ATTRS, SHAPE_METHODS, Spelling,
                        canonical_call, cast_target, spelling_of)

aten = torch.ops.aten


def _produces_fresh_tensor(node) -> bool:
    """True if node's output is a new tensor that no view or parameter shares."""
    if part_of_fresh_tuple(node) or advanced_index(node) or copying_contiguous(node):
        return True
    if node.op == "call_method":   # x.clone(), x.matmul(w): new memory
        return node.target in FRESH_METHODS and node.kwargs.get("out") is None
    if node.op == "call_module":
        return isinstance(node.graph.owning_module.get_submodule(node.target), FRESH_MODULES)
    return node.op == "call_function" and node.kwargs.get("out") is None and (   # out=: the result IS `out`
        (is_pointwise_target(node.target) and (node.target is not cast or _converts(node)))
        or node.target in FRESH_FUNCTIONS or node.target is torch.einsum and (len(node.args) > 2 or len(
            node.args) == 2 and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) > 1))   # two
    #     operands or more: a contraction or a product, new memory (fuzz46j: AutoInt's `scores /= c`)


def _converts(cast_node) -> bool:
    """A cast to another dtype allocates (to() of the same dtype returns its input: an alias)."""
    src = cast_node.args[0] if cast_node.args else None
    return isinstance(src, torch.fx.Node) and _dtype_of(src) is not None and _dtype_of(src) != _dtype_of(cast_node)


def _reads_without_alias(gm, user) -> bool:
    """True if `user` reads its inputs without keeping a view of them. An in-place op normalize
    kept (`g = h.div_(3, rounding_mode="floor")`: no canonical form) returns its operand: g IS h."""
    if user.op == "output":
        return True
    if "kept" in user.meta.get("fxfuse", {}):
        return False
    if user.op == "call_function" and (_produces_fresh_tensor(user) or user.target in FUNCTION_SPELLINGS
                                       or user.target in ATEN_SPELLINGS and not ATEN_SPELLINGS[user.target].inplace):
        return True
    if user.op == "call_method" and (user.target in METHOD_SPELLINGS or user.target in SHAPE_METHODS
                                     or user.target in FRESH_METHODS):
        return True
    if user.op == "call_module":
        mod = gm.get_submodule(user.target)
        return isinstance(mod, FRESH_MODULES) or spelling_of(gm, user) is not None
    return False


def _is_shape_value(node) -> bool:
    """A non-tensor value computed only from shapes (sizes, dims, dtypes), safe to fold."""
    if "value" not in node.meta.get("fxfuse", {}):
        return False
    if node.op == "call_method" and node.target in SHAPE_METHODS:
        return True
    if node.op == "call_function" and node.target is getattr and (node.args[1] in SHAPE_ATTRS or isinstance(
            node.args[0], (torch.dtype, torch.device)) or isinstance(node.args[0], torch.fx.Node)
            and _is_shape_value(node.args[0])):   # x.dtype.itemsize (fuzz43b)
        return True
    if node.op == "call_function" and node.target in (aten.sym_size.int, aten.sym_numel.default, torch.numel):
        return True
    if node.op == "call_function" and node.target is torch.Size:   # tracing's stand-in for a Size constant
        return not node.all_input_nodes
    if node.op == "call_function" and (node.target in ARITH or getattr(node.target, "__module__", None) == "math"):
        return all(_is_shape_value(a) for a in node.all_input_nodes)   # math.sqrt(q.size(-1)): torch.fx
    return False                                                       # records math's functions


def _is_plain_number(arg) -> bool:
    """A literal, or a node whose example value was not a tensor (a size). Not the absence of
    tensor_meta: a value of data-dependent shape has its tensor_meta dropped, and `q += 1` on
    it is a write (tracing.mark_data_dependent_shapes)."""
    if not isinstance(arg, torch.fx.Node):
        return True
    kind = arg.meta.get("type")
    return kind is not None and not issubclass(kind, torch.Tensor)


def _is_tensor_node(node) -> bool:
    return isinstance(node, torch.fx.Node) and "tensor_meta" in node.meta


def _is_identity(gm, node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), DROPOUT_MODULES) and len(node.args) == 1
    if node.op == "call_function" and node.target in DROPOUT_FUNCTIONS:
        training = node.kwargs.get("training", node.kwargs.get("train", node.args[DROPOUT_FUNCTIONS[node.target]]
                                   if len(node.args) > DROPOUT_FUNCTIONS[node.target] else True))
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        return training is False or p == 0
    if whole_slice(node):
        return True
    if node.op in ("call_function", "call_method") and node.target in POSITIVE and len(node.args) == 1:
        meta = single_tensor_meta(node.args[0])   # +x returns x itself (a bool x raises: kept)
        return not node.kwargs and meta is not None and meta.dtype != torch.bool
    return _is_detach(node) or is_no_op_conversion(node) or atleast_of_enough_dims(node)


def normalize(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    g = gm.graph
    order = {n: k for k, n in enumerate(g.nodes)}
    kept_inplace = []
    for node in [n for n in g.nodes if n.op == "call_function"]:   # torch.ops.aten.cat(...): its overload
        node.target = overload_of(node) or node.target
        if (leaky := where_as_leaky_relu(node)) is not None:   # where(h > 0, h, 0.2 * h)
            node.target, node.args = F.leaky_relu, leaky
    for node in list(g.nodes):
        if node.op in ("placeholder", "output", "get_attr") or node._erased:   # a getitem a slicing
            continue                                                           # node's fold took
        if "out" in node.kwargs and node.kwargs["out"] is None:   # torch.sigmoid(x, out=None): the default
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
        if _is_shape_value(node) and node.users:
            value = node.meta["fxfuse"]["value"]
            if isinstance(value, torch.Size) and any(u.op == "output" for u in node.users):
                with g.inserting_before(node):   # torch.fx keeps no Size constant (it makes a tuple of it):
                    size = g.call_function(torch.Size, (tuple(value),))   # built at run time, also where
                for user in [u for u in node.users if u.op == "output"]:   # it is sliced from a folded one
                    user.replace_input_with(node, size)                    # (`x.shape[1:]` came back a tuple; fuzz36e)
            for user in list(node.users):
                user.replace_input_with(node, value if not isinstance(value, torch.Size) else tuple(value))
            g.erase_node(node)   # pure, so erased
            continue
        if node.op == "call_function" and node.target in AUGMENTED_TWINS and (
                _is_plain_number(node.args[0]) or node.target is operator.imatmul):   # torch has no __imatmul__
            node.target = AUGMENTED_TWINS[node.target]   # `n += 1` on a size: a rebinding (and torch.fx
            if node.target is not operator.matmul:        # would print `5 += 1` once n is folded);
                continue                                  # `h @= W.T` may be a Linear
        if node.op == "call_module" and node.kwargs:
            keywords_to_positions(gm, node)   # self.lin(input=x): as self.lin(x), for the layer passes
        explicit_softmax_dim(gm, node)
        respell_view(node)
        if pixel_shuffle_as_views(gm, node):
            continue
        if _is_identity(gm, node):
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            continue
        _detach_readers(node)
        if (node.op == "call_function" and node.target in EXPORT_ASSERTS
                or node.op == "call_module" and node.target == "_guards_fn" and not node.users):
            g.erase_node(node)  # torch.export's dtype/device/shape checks: the runtime guards those on every call
            continue
        if fold_constant_slice(gm, node) or matmul_as_linear(gm, node) or fold_literal_tensor(gm, node) \
                or einsum_as_product(gm, node):
            continue
        if split_layer(gm, node) or glu_as_gate(gm, node) or prelu_or_rrelu_as_pointwise(gm, node) \
                or trunc_division_as_trunc(gm, node):
            continue
        if copy_to_own_dtype_as_clone(node):   # a clone: fresh memory an in-place op after it may write
            continue
        dtype = cast_target(node)
        if dtype is not None:
            src, named = node.args[0], [a for a in node.args[1:] if isinstance(a, torch.fx.Node)]
            if _is_tensor_node(src) and src.meta["tensor_meta"].dtype == dtype:
                node.replace_all_uses_with(src)  # a no-op conversion returns its input
                g.erase_node(node)
            else:
                _replace(g, node, cast, (src, dtype), {})
            for a in named:   # m.type(x.type()): the type name, read by nothing else now
                if not a.users and a.op == "call_method" and a.target == "type":
                    g.erase_node(a)
            continue
        row = spelling_of(gm, node)
        if row is None and (functional_twin(gm, node, order) or mask_assignment_as_where(gm, node, order)
                            or whole_write_as_value(gm, node, order)):
            continue
        if row is None:
            if _mutates(gm, node):   # x.masked_fill_(m, 0), x.zero_(), x[i] = v: fusion must see the write
                fxfuse_meta(node)["kept"] = "in-place op with no canonical form"
                kept_inplace.append(node)
            continue
        if node.op == "call_function" and node.target in POINTWISE and not row.inplace \
                and _already_canonical(row, node):
            continue
        call = canonical_call(row, node)
        if call is None:
            if row.inplace and functional_twin(gm, node, order):   # masked_fill_ of a tensor value
                continue
            if row.inplace or _inplace_flag(row, node) or node.kwargs.get("out") is not None:   # x.div_(y, rounding_mode="floor")
                fxfuse_meta(node)["kept"] = "in-place op with no canonical form"
                kept_inplace.append(node)
            continue
        if row.inplace or _inplace_flag(row, node):
            base = node.args[0] if node.args else node.kwargs.get("input")
            fresh = isinstance(base, torch.fx.Node) and (
                _produces_fresh_tensor(base) or whole_view_of_fresh(base, _produces_fresh_tensor)
                or disjoint_part_of_fresh(base, _produces_fresh_tensor))
            safe = fresh and all(   # a view taken
                u is node or _reads_without_alias(gm, u) or order.get(u, -1) > order[node]   # after the write
                for u in base.users)   # reads the result like any later reader (fuzz35e: y[:, None] after y.clamp_)
            if not safe:
                fxfuse_meta(node)["kept"] = "in-place op on a value that is a view, input or parameter"
                kept_inplace.append(node)
                continue
            want = _dtype_of(node)           # an in-place op keeps its operand's dtype
            got = _call_dtype(call)
            new = _replace(g, node, *call)
            if row.fixed.get("_masked_fill"):   # x.masked_fill_(m, v) keeps x's layout; where may not
                new = masked_fill_layout(gm, new)
            if want is not None and got is not None and got != want:
                # x.gt_(0) stays float, an fp16 x.add_(fp32) stays fp16: cast the functional result back
                with g.inserting_after(new):
                    back = g.call_function(cast, (new, want))
                new.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
                back.meta, meta = dict(new.meta), new.meta.get("tensor_meta")
                if meta is not None:   # each its dtype: the cast back then reads as fresh memory, and a
                    new.meta["tensor_meta"] = meta._replace(dtype=got)   # later in-place op on it is made
                    back.meta["tensor_meta"] = meta._replace(dtype=want)   # functional too (fuzz43d)
                new = back
            _later_readers_read(base, new, node, order)
        else:
            new = _replace(g, node, *call)
            if row.fixed.get("_masked_fill"):
                masked_fill_layout(gm, new)
    for node in [n for n in g.nodes if _copies_onto_itself(n)]:   # torch.export's record of `self.t =
        node.replace_all_uses_with(node.args[0])                    # self.t.to(x.device)`: a write of t into t
        g.erase_node(node)                                         # that bumped t's version each call, and
        kept_inplace = [n for n in kept_inplace if n is not node]  # every call rebuilt (fuzz37h)
    gm.meta["fxfuse_inplace_kept"] = [n.name for n in kept_inplace]
    for node in list(g.nodes):   # after the loop: the pointwise users are canonical now
        if fold_pointwise_of_literals(gm, node, POINTWISE) or fold_view_of_literal(gm, node):
            continue
        if copy_as_contiguous(node) or cat_of_unsqueezed_as_stack(node) or squeezed_slice_as_select(node) \
                or repeat_as_expand(node, is_pointwise_target):
            continue
        factory_without_template(node)   # (then as torch.full:)
        if full_as_expanded_literal(gm, node, is_pointwise_target) or fold_constant_mask(gm, node):
            continue
        if (source := read_only_clone(node, is_pointwise_target)) is not None:
            node.replace_all_uses_with(source)
            g.erase_node(node)
            continue
        cpu_literal_as_number(node, POINTWISE)
        broadcast_drops_unit_view(node, is_pointwise_target)
        divide_as_cuda_does(node)
        _bool_arithmetic_as_logical(node)
    g.eliminate_dead_code(is_impure_node=_is_impure)
    g.lint()
    gm.recompile()
    return gm


def _copies_onto_itself(node) -> bool:
    return node.op == "call_function" and node.target is aten.copy_.default and len(node.args) == 2 \
        and node.args[0] is node.args[1] and not node.kwargs


XORS = {operator.xor, torch.bitwise_xor, aten.bitwise_xor.Scalar, aten.__xor__.Scalar}


def _bool_arithmetic_as_logical(node) -> None:
    """mask_a * mask_b and mask_a + mask_b of two bool tensors are bool results, the logical
    and / or: as those ops they join a kernel (a bool result of * or + is none of the kernel's
    float results; fuzz37c)."""
    twin = {operator.mul: torch.logical_and, operator.add: torch.logical_or}.get(node.target) \
        if node.op == "call_function" and len(node.args) == 2 and not node.kwargs else None
    if twin is not None and all(_is_tensor_node(a) and a.meta["tensor_meta"].dtype == torch.bool
                                for a in (*node.args, node)):
        node.target = twin
    elif node.op == "call_function" and node.target in XORS and len(node.args) == 2 and not node.kwargs \
            and True in [a is True for a in node.args]:
        mask = node.args[0] if node.args[1] is True else node.args[1]   # mask ^ True, True ^ mask: not mask
        if _is_tensor_node(mask) and mask.meta["tensor_meta"].dtype == torch.bool:   # (fuzz45b, review45h: a
            node.target, node.args = torch.logical_not, (mask,)                       # library call between kernels)


def _is_impure(node) -> bool:
    """Dead-code elimination keeps mutating ops and anything not known to be pure."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    if "kept" in node.meta.get("fxfuse", {}):  # a kept in-place op (F.leaky_relu(v, inplace=True) included)
        return True
    if draws_random(node.graph.owning_module, node):   # an unread F.dropout(training=True) moves the generator
        return True                                    # the later draws read (fuzz35e)
    if node.op == "call_function" and (is_pointwise_target(node.target) or node.target in FRESH_FUNCTIONS):
        return False
    if node.op == "call_method" and node.target in PURE_METHODS:
        return False
    return node.is_impure() or node.op in ("call_module", "call_method")


# Tensor methods that only view, describe or reduce their operand: dead, they go (a W.t() whose
# Linear became F.linear(x, W) was kept and counted as a library call; a debug print's h.max().item())
PURE_METHODS = VIEW_METHODS | {"contiguous", "size", "dim", "item", "tolist", "max", "min", "sum", "mean", "amax",
                               "amin", "norm", "std", "var", "any", "all", "abs", "float", "double", "half"}


def _inplace_flag(row: Spelling, node: torch.fx.Node) -> bool:
    """True if the call passes inplace=True (`F.relu(x, inplace=True)`, `F.hardtanh(x, -1, 1, True)`)."""
    if "inplace" not in row.names:
        return False
    k = row.names.index("inplace")
    flag = node.args[k] if len(node.args) > k else node.kwargs.get("inplace", False)
    return flag is True


INPLACE_DUNDERS = {f"__i{name}__" for name in AUGMENTED_NAMES}
AUGMENTED_TWINS = {getattr(operator, f"i{name}"): getattr(operator, name if name not in ("and", "or") else name + "_")
                   for name in AUGMENTED_NAMES}   # the tracer records `v += y` as iadd(v, y)
INPLACE_OPERATORS_UNKNOWN = {operator.iand, operator.ior, operator.ixor, operator.ifloordiv, operator.imod,
                             operator.ilshift, operator.irshift}   # imatmul: always a rebinding (AUGMENTED_TWINS)


INPLACE_ARITHMETIC = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow}


# in-place methods whose out-of-place twin returns the same dtype and shape as self
def _later_readers_read(base, new, node, order) -> None:
    """After an in-place `node` on `base` became the functional `new`: readers of `base` that
    came after the write read `new`."""
    for user in list(base.users):
        if user is not new and order.get(user, -1) > order[node]:
            user.replace_input_with(base, new)


def _mutates(gm, node) -> bool:
    """True if node (one with no canonical form) may write into one of its operands."""
    if node.op == "call_method":   # x.add_(1); x.__ior__(m): the in-place dunders; x.__setitem__(i, v) (fuzz27)
        return (node.target.endswith("_") and not node.target.startswith("_")) or \
            node.target in INPLACE_DUNDERS or node.target == "__setitem__"
    if node.op == "call_module":
        return getattr(gm.get_submodule(node.target), "inplace", False) is True
    if node.op != "call_function":
        return False
    if node.target is operator.setitem or node.kwargs.get("out") is not None or _passes_inplace(node):
        return True
    name = getattr(node.target, "__name__", "")
    if name.endswith("_") and (not name.startswith("_") or name.startswith("_foreach_")) \
            and node.target not in KEYWORD_OPERATORS:   # torch.neg_(x), F.threshold_(x, ...), torch.zero_(x),
        return True   # torch._foreach_add_([a, b], 1) (fuzz42c: dropped as dead code); not `a & b`
    if node.target in INPLACE_OPERATORS_UNKNOWN or node.target in INPLACE_ARITHMETIC:   # the latter: a complex
        return bool(node.args) and _is_tensor_node(node.args[0])   # `z *= 2j` (no spelling row: fuzz41a)
    schema = getattr(node.target, "_schema", None)   # aten overloads from torch.export; custom ops
    return bool(schema is not None and schema.is_mutable) or bool(schema_writes(node))   # through torch.ops


def _passes_inplace(node) -> bool:
    """`F.threshold(h, 0.1, -1.0, inplace=True)`, `F.celu(h, 1.0, True)`: a function with no
    spelling row whose own `inplace` parameter is set (by keyword or by position)."""
    if node.kwargs.get("inplace") is True:
        return True
    if not any(a is True for a in node.args):
        return False
    try:
        return inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments.get("inplace") is True
    except (TypeError, ValueError):   # a builtin without a signature, or one that does not bind
        return False


def _dtype_of(node):
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return getattr(meta, "dtype", None)


def _call_dtype(call):
    """dtype of what a canonical call (target, args, kwargs) computes, from its operands' metadata,
    or None if unknown. Runs the call on one-element CPU tensors of the operands' dtypes and
    ranks (type promotion depends on dtype and on 0-dim or not, never on sizes), and on meta
    tensors of the full shapes where that fails: many meta kernels are Python refs that import
    torch._dynamo on first use, seconds the first time in a process on the H100 host."""
    for device in ("cpu", "meta"):
        got = _dtype_on(call, device)
        if got is not None:
            return got
    return None


def _dtype_on(call, device: str):
    target, args, kwargs = call

    def fake(a):
        if not isinstance(a, torch.fx.Node):
            return a
        meta = a.meta.get("tensor_meta")
        if not hasattr(meta, "dtype"):
            raise LookupError(a.name)
        shape = meta.shape if device == "meta" else [1] * len(meta.shape)
        return torch.empty(shape, dtype=meta.dtype, device=device)

    try:
        if isinstance(target, tuple):                  # ("alpha", add/sub): x op other * alpha
            x, other, alpha = (fake(a) for a in args)
            return torch.add(x, other, alpha=alpha).dtype
        if target == "tensor_clamp":
            x, lo, hi = (fake(a) for a in args)
            return torch.clamp(x, lo, hi).dtype
        if target == "rtruediv":
            x, c = (fake(a) for a in args)
            return (c / x).dtype
        return target(*[fake(a) for a in args], **{k: fake(v) for k, v in kwargs.items()}).dtype
    except Exception:  # noqa: BLE001 -- unknown: leave the node as normalize makes it
        return None


def _already_canonical(row, node) -> bool:
    return row.canonical is node.target and canonical_call(row, node) == (node.target, node.args, dict(node.kwargs))


def _replace(g, node, target, args, kwargs):
    """Insert the canonical call for node and make every user read it instead."""
    with g.inserting_before(node):
        if isinstance(target, tuple):  # add(x, y, alpha=a) -> add_scaled(x, y, alpha=a); sub: -a
            x, other, alpha = args
            if isinstance(other, torch.fx.Node):
                new = g.call_function(add_scaled, (x, other), {"alpha": alpha if target[1] is operator.add else -alpha})
            elif isinstance(other, int) and isinstance(alpha, int) and not getattr(
                    _dtype_of(x), "is_floating_point", True):   # x.sub(1, alpha=2) of an integer x: exact;
                product = (other * alpha + 2 ** 63) % 2 ** 64 - 2 ** 63   # wrapped as eager's int64 multiply (fuzz43d)
                new = g.call_function(target[1], (x, product))
            else:   # fp32: alpha * other + x rounded once, as eager's multiply-add (canonical_call)
                new = g.call_function(add_number_scaled, (x,), {
                    "other": other, "alpha": alpha if target[1] is operator.add else -alpha})
        elif target == "rtruediv":      # c / x -> x.reciprocal() * c, two roundings as eager's
            x, c = args
            inverse = g.call_function(torch.reciprocal, (x,))
            inverse.meta = {k: v for k, v in node.meta.items() if k != "fxfuse"}
            new = g.call_function(operator.mul, (inverse, c))
        elif target == "tensor_clamp":  # clamp with tensor bounds -> maximum / minimum
            x, lo, hi = args
            new = x
            for bound, pick, key in ((lo, torch.maximum, "min"), (hi, torch.minimum, "max")):
                if isinstance(bound, torch.fx.Node):
                    new = g.call_function(pick, (new, bound))
                elif bound is not None:   # a number beside a tensor bound (fuzz39a: torch.minimum(h, 3.0) failed)
                    new = g.call_function(torch.clamp, (new,), {key: bound})
        else:
            new = g.call_function(target, tuple(args), kwargs)
    new.meta = dict(node.meta)
    device = new.meta.pop("fxfuse", {}).get("device")
    if device is not None:
        fxfuse_meta(new)["device"] = device   # the same value on the same device (cast_target reads it)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    if target == "tensor_clamp" and not all(meta_tensor(m).is_contiguous() for m in map(single_tensor_meta, args) if m):
        new = keep_eager_layout(g.owning_module, new, new.meta.get("tensor_meta"), None)   # maximum's layout is
    return new                                                                   # not clamp's (fuzz39e)
