"""Ops that return their input itself (whole-tensor slices, conversions where nothing changes:
normalize drops them, their readers read the input), and views and copies with an uncommon
spelling rewritten as the common one that fusion reads (ravel, adjoint, clone, repeat, a squeezed slice,
pixel shuffles)."""
import operator

import torch
import torch.fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fxfuse.data_dependent import op_name
from fxfuse.node_meta import single_tensor_meta
from fxfuse.ops import is_pointwise_target, row_major
from fxfuse.state_writes import VIEW_FUNCTIONS, VIEW_METHODS
from fxfuse.tracing import fxfuse_meta

aten = torch.ops.aten
METADATA_INPLACE = {"unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "resize_", "resize_as_",
                    "as_strided_", "set_", "detach_", "requires_grad_"}   # in-place ops on a tensor's view of its storage


# views whose result is always another tensor object (flatten may return its input itself)
NEW_OBJECT_VIEWS = VIEW_METHODS - {"flatten"}


def hands_back(user, node) -> bool:
    """Whether user may return node's tensor object itself: any op reading node (positionally or by
    keyword: `out=`, `input=`) but the views, which make another object, and the ops that make new
    memory (normalize._produces_fresh_tensor, an out-of-place pointwise method): an in-place op, a
    cast, cpu(), contiguous(), flatten(1, 1), sum_to_size, +x, eval dropout, a module (review50r1)."""
    from .normalize import _mutates, _produces_fresh_tensor   # (normalize imports this module)
    if user.op not in ("call_function", "call_method", "call_module") or node not in user.all_input_nodes:
        return False
    if user.graph.owning_module is not None and _mutates(user.graph.owning_module, user):   # returns what it
        return node in (user.args[:1] + tuple(user.kwargs.get(k) for k in ("input", "self", "out")))   # writes
    #                                                                                       (not `h.add_(d)`'s d)
    name = op_name(user)
    if user.op == "call_method" and name in NEW_OBJECT_VIEWS or user.op == "call_function" and (
            user.target in VIEW_FUNCTIONS and user.target is not torch.flatten):
        return False
    before, after = single_tensor_meta(node), single_tensor_meta(user)   # the same object: the same shape, dtype
    if before is not None and after is not None and (tuple(before.shape), before.dtype, tuple(before.stride)) != (
            tuple(after.shape), after.dtype, tuple(after.stride)):   # and strides (argmax, any, flatten(0): review50r3)
        return False
    return not (_produces_fresh_tensor(user) or _pointwise_method(user))


def _pointwise_method(node) -> bool:
    """`h.sigmoid()`, `h.mul(2)`: an out-of-place pointwise method, whose result is new memory."""
    fn = getattr(torch, node.target, None) if node.op == "call_method" else None
    return fn is not None and not node.target.endswith("_") and node.target not in CASTS and "out" not in node.kwargs \
        and is_pointwise_target(fn)


CASTS = {"float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char", "to", "type",
         "type_as", "positive", "real", "conj", "resolve_conj", "resolve_neg"}


def same_object_users(node):
    """node's users, and through the ops that may hand node's tensor object back as it is
    (hands_back: `h[:].add_(1)` returns the view), theirs: every op that may see node's very tensor
    object. A whole view (`h[:]`, `h.detach()`) is another object than h: returned or reshaped in
    place through one of those, it must stay (fuzz50c: `x[:].mul_(2)` returned came back as x)."""
    seen, stack, given = {node}, [node], set()
    while stack:
        n = stack.pop()
        for user in n.users:
            if user not in given:
                given.add(user)
                yield user
            if user not in seen and hands_back(user, n):
                seen.add(user)
                stack.append(user)


def object_seen(node, source=None) -> bool:
    """Whether node's tensor object itself is seen: reshaped in place, or returned or stored by the
    graph's write-back where the caller may also hold `source` (an input, a parameter, a value
    returned itself; a fresh intermediate no one else sees may be given back in the view's place:
    review50r1), directly or through ops that return it as it is (same_object_users)."""
    users = list(same_object_users(node))
    if any(op_name(u) in METADATA_INPLACE for u in users):
        return True
    return any(map(returned, users)) and (source is None or held_by_caller(source))


def returned(user) -> bool:
    """user returns its operand's tensor object to the caller, or stores it on the module (the graph's write-back)."""
    from fxfuse.attribute_writes import write_attribute   # (fxfuse imports the passes late)
    return user.op == "output" or user.op == "call_function" and user.target is write_attribute


def held_by_caller(source) -> bool:
    """Whether the caller may hold source's tensor object: all but a fresh intermediate not returned."""
    from .normalize import _mutates, _produces_fresh_tensor   # (normalize imports this module)
    if not isinstance(source, torch.fx.Node) or not (_produces_fresh_tensor(source) or _pointwise_method(source)) \
            or source.graph.owning_module is not None and _mutates(source.graph.owning_module, source):
        return True   # (`F.elu(x, inplace=True)` is x: review50r3)
    whole = source.args[0] if source.op == "call_function" and source.target in (operator.getitem, getattr) \
        and source.args and isinstance(source.args[0], torch.fx.Node) else None   # `torch.max(h, 1)[0]`, `.values`:
    return any(returned(u) for n in ((source, whole) if whole is not None else (source,))   # (the tuple returned)
               for u in same_object_users(n))


def reshaped_in_place(node) -> bool:
    """Whether node's tensor object is reshaped in place (`h.t_()`, `h.float().unsqueeze_(0)`): a view
    taken of it before keeps the old shape, so the view is no alias of h's later self."""
    return isinstance(node, torch.fx.Node) and any(op_name(u) in METADATA_INPLACE for u in same_object_users(node))


def torch_contiguous(shape, stride) -> bool:
    """Tensor.is_contiguous() from a shape and strides: size-1 dims' strides do not count, so `.contiguous()`
    of a [1, N] transpose returns it itself (review44h: read as a copy, it aliased the caller's input)."""
    expected = 1
    for size, st in zip(reversed(tuple(shape)), reversed(tuple(stride))):
        if size == 0:
            return True
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def positional(node, names: tuple) -> list | None:
    """node's arguments by position, the keyword ones among `names` (`torch.clone(input=h)`,
    `h.repeat(repeats=...)`) put in their places; None if a keyword is another or comes twice."""
    args = list(node.args)
    for k, name in enumerate(names):
        if name in node.kwargs:
            if k != len(args):
                return None
            args.append(node.kwargs[name])
    return args if set(node.kwargs) <= set(names) else None


def _is_tensor_node(node) -> bool:
    return isinstance(node, torch.fx.Node) and "tensor_meta" in node.meta


PERMUTES = {"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t"}


def whole_slice(node) -> bool:
    """`h[:, :]`, `h[...]`, `h[:]`, `h[0:n]` of n rows, h.narrow(d, 0, h.size(d)), export's aten.slice over a whole dim,
    a permute that moves nothing: h itself (a view of all of it), which split a kernel in two (fuzz42c). Not
    where eager's view, another tensor, is seen as one: `v.unsqueeze_(0)` (or h.t_() of its source: fuzz43h), a
    caller's on a returned view (fuzz42i); asked last, after the cheap checks (a walk of the users)."""
    if not node.args or not _is_tensor_node(node.args[0]) or node.kwargs:
        return False
    src, out = single_tensor_meta(node.args[0]), single_tensor_meta(node)
    if src is None or out is None or tuple(src.shape) != tuple(out.shape) or tuple(src.stride) != tuple(out.stride):
        return False
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        whole = all(i is Ellipsis or isinstance(i, slice) and all(b is None or type(b) is int for b in (
            i.start, i.stop)) and i.step in (None, 1) for i in index)   # (`pe[:, :T]` with T the table's
        #       length, `h[0:4]` of 4 rows: the same shape and strides, so all of it; fuzz43b)
    elif op_name(node) in PERMUTES and node.op in ("call_function", "call_method"):
        whole = True   # `g.permute(0, 1)`, `g.transpose(1, 1)`, a swap of two size-1 dims: the same shape and
        #                strides, and a permute keeps the offset: g itself (fuzz45e: it split a kernel)
    else:
        narrow = node.op == "call_method" and node.target == "narrow" or node.target in (torch.narrow,
                                                                                         aten.narrow.default)
        whole = (narrow or node.target is aten.slice.Tensor) and all(type(a) is int for a in node.args[1:]) and (
            narrow or len(node.args) < 5 or node.args[4] == 1)   # the same shape and strides: all of the dim, step 1
    return whole and not object_seen(node, node.args[0]) and not reshaped_in_place(node.args[0])


def is_no_op_conversion(node) -> bool:
    """`h.contiguous()` of a contiguous h, `h.to(x.device)`, `h.to("cpu")`, `h.to(x)` where
    nothing changes: eager returns h itself, and the node split a pointwise group (fuzz34a)."""
    aten_to = node.op == "call_function" and getattr(node.target, "overloadpacket", None) is aten.to
    if not (aten_to or node.op == "call_method" and node.target in ("contiguous", "to")) or not node.args:
        return False
    src, out = node.args[0], single_tensor_meta(node)
    before = single_tensor_meta(src) if isinstance(src, torch.fx.Node) else None
    if before is None or out is None or tuple(out.stride) != tuple(before.stride) or out.dtype != before.dtype \
            or reshaped_in_place(src):   # h.t_(): src's metadata is stale (fuzz43h)
        return False
    if node.target == "contiguous":
        return len(node.args) == 1 and node.kwargs.get("memory_format", torch.contiguous_format) \
            is torch.contiguous_format and set(node.kwargs) <= {"memory_format"} \
            and tuple(before.stride) == row_major(before.shape)
    devices = {fxfuse_meta(n).get("device") for n in (src, node)}
    if aten_to:   # export's spelling of them: aten.to.dtype_layout(h, dtype=, layout=, device=), aten.to.device ...
        return len(devices) == 1 and None not in devices and node.kwargs.get("copy") is not True \
            and node.kwargs.get("memory_format") in (None, torch.preserve_format) and node.kwargs.get(
                "layout", torch.strided) is torch.strided and not any(a is True for a in node.args[2:])
    plain = all(isinstance(a, (str, torch.device, torch.dtype)) or isinstance(a, torch.fx.Node) and single_tensor_meta(a)
                is not None for a in node.args[1:])   # .to(x.device, x.dtype), .to(device=.., dtype=..) (review37b)
    memory_format = node.kwargs.get("memory_format", torch.preserve_format)   # at 4 and 5 dims eager's
    keywords = (memory_format is torch.preserve_format or memory_format is torch.contiguous_format   # choice
                and len(before.shape) not in (4, 5) and torch_contiguous(before.shape, before.stride)) \
        and set(node.kwargs) <= {"device", "dtype", "non_blocking", "memory_format"} and not any(
        isinstance(v, torch.fx.Node) for v in node.kwargs.values())   # to copy or not is suggest_memory_format's (review44h)
    return 2 <= len(node.args) + len(node.kwargs) and len(node.args) <= 3 and plain and keywords \
        and len(devices) == 1 and None not in devices


def read_only_clone(node, is_pointwise_target):
    """`h.clone()` (torch.clone, any memory_format that keeps h's strides; export's lift_fresh_copy of a
    constant) read only by pointwise
    ops, in a graph that keeps no in-place op: its readers may read h itself, which is what eager's
    copy holds (fuzz44d, fuzz44e: the copy split a kernel, where `.contiguous()` did not). Not where
    the copy is returned (eager returns fresh memory) or anything may write h. Returns h, else None."""
    args = positional(node, ("input", "memory_format"))
    if node.op not in ("call_function", "call_method") or op_name(node) not in ("clone", "lift_fresh_copy") \
            or args is None or not 1 <= len(args) <= 2 or not _is_tensor_node(args[0]):
        return None
    src, out, before = args[0], single_tensor_meta(node), single_tensor_meta(args[0])
    if out is None or before is None or tuple(out.stride) != tuple(before.stride) \
            or reshaped_in_place(src):
        return None
    return src if _read_by_pointwise_only(node, is_pointwise_target) else None


def _read_by_pointwise_only(node, is_pointwise_target) -> bool:
    """node is read, by pointwise ops only, in a graph that keeps no in-place op."""
    gm = node.graph.owning_module
    return gm is not None and not gm.meta.get("fxfuse_inplace_kept") and bool(node.users) and all(
        u.op == "call_function" and is_pointwise_target(u.target) and "kept" not in u.meta.get("fxfuse", {})
        for u in node.users)


def read_as_broadcast_only(node, is_pointwise_target) -> bool:
    """node is read by pointwise ops only (_read_by_pointwise_only), whose other operands are all
    contiguous: an expanded view in node's place then leaves each reader's result row-major, as
    node's own row-major memory did (a reader's other operand in another layout: an expanded
    operand's result follows it; review44h: channels_last came back where eager's is contiguous). A 0-d
    node takes no part in a result's layout: its readers may read anything (fuzz46d: GPT-2's
    `torch.where(self.bias[.., :k], w, torch.full([], min))` reads a sliced mask)."""
    meta = single_tensor_meta(node)
    if meta is not None and not meta.shape:
        return _read_by_pointwise_only(node, is_pointwise_target)
    return _read_by_pointwise_only(node, is_pointwise_target) and all(
        torch_contiguous(m.shape, m.stride) for u in node.users for a in u.all_input_nodes
        if a is not node and (m := single_tensor_meta(a)) is not None)


def copy_as_contiguous(node) -> bool:
    """`h.clone()`, `h.clone(memory_format=torch.contiguous_format)`, `h.to(memory_format=...)` of an h
    that is not row-major, into a row-major copy: `h.contiguous()`, which copies there too and which
    fusion takes as a layout (fuzz44e: `h.t().clone(...)`, `h.expand(...).clone()` split a kernel).
    Rewritten in place; True if it was."""
    to = op_name(node) == "to" and node.op == "call_method" and set(node.kwargs) == {"memory_format"}
    if node.op not in ("call_function", "call_method") or not (op_name(node) == "clone" or to) \
            or len(node.args) != 1 or set(node.kwargs) - {"memory_format"} or not _is_tensor_node(node.args[0]):
        return False
    out, before = single_tensor_meta(node), single_tensor_meta(node.args[0])
    if out is None or before is None or out.dtype != before.dtype or tuple(out.shape) != tuple(before.shape) \
            or tuple(out.stride) != row_major(out.shape) or torch_contiguous(before.shape, before.stride):
        return False   # (.contiguous() of a contiguous h is h itself, where the copy is not: review44h)
    node.op, node.target, node.args, node.kwargs = "call_method", "contiguous", (node.args[0],), {}
    return True


ATLEAST = {torch.atleast_1d: 1, torch.atleast_2d: 2, torch.atleast_3d: 3}


def atleast_of_enough_dims(node) -> bool:
    """`torch.atleast_2d(h)` of an h with 2 or more dims returns h itself (fuzz44d: it split a kernel)."""
    meta = single_tensor_meta(node.args[0]) if node.op == "call_function" and node.target in ATLEAST \
        and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], torch.fx.Node) else None
    return meta is not None and len(meta.shape) >= ATLEAST[node.target]


def respell_view(node) -> bool:
    """Views with a common spelling that fusion knows, rewritten in place (True if one was):
    `h.ravel()` is `h.reshape(-1)`; of a real h, `h.mH` and `h.adjoint()` are `h.mT`, `h.H` is `h.T`
    (fuzz44e: each split a kernel)."""
    if node.op == "call_function" and node.target in (torch.ravel, torch.adjoint) and set(node.kwargs) == {"input"} \
            and not node.args:
        node.args, node.kwargs = (node.kwargs["input"],), {}   # torch.ravel(input=h) (review44h)
    if node.op not in ("call_function", "call_method") or not node.args or not _is_tensor_node(node.args[0]) \
            or node.kwargs:
        return False
    h, name = node.args[0], op_name(node) if node.target is not getattr else node.args[1]
    if name == "ravel" and len(node.args) == 1:
        node.op, node.target, node.args = "call_method", "reshape", (h, -1)
        return True
    to = {"mH": "mT", "H": "T"} if node.target is getattr else {"adjoint": "mT"} if len(node.args) == 1 else {}
    meta = single_tensor_meta(h) if name in to else None
    if meta is None or meta.dtype.is_complex:
        return False
    node.op, node.target, node.args = "call_function", getattr, (h, to[name])
    return True


def squeezed_slice_as_select(node) -> bool:
    """`h[:, k:k + 1].squeeze(1)`, `h.narrow(1, k, 1).squeeze(1)`: `h.select(1, k)`, one view
    that fusion reads (fuzz44e: a slice then a squeeze cost a kernel). Rewritten in place."""
    squeeze = node.op == "call_method" and node.target == "squeeze" or node.target in (torch.squeeze,)
    args = positional(node, ("input", "dim")) if squeeze else None
    if args is None or len(args) != 2 or not isinstance(args[0], torch.fx.Node) \
            or type(args[1]) is not int or len(args[0].users) != 1:
        return False
    part, meta = args[0], single_tensor_meta(args[0])
    if meta is None or not part.args or not _is_tensor_node(part.args[0]):
        return False
    d = args[1] % max(len(meta.shape), 1)
    if op_name(part) == "narrow" and len(part.args) == 4 and not part.kwargs:
        dim, start, length = part.args[1:]
        found = type(dim) is int and dim % len(meta.shape) == d and type(start) is int and start >= 0 and length == 1
    elif part.op == "call_function" and part.target is operator.getitem and isinstance(part.args[1], tuple) \
            and len(part.args[1]) == d + 1 and all(i == slice(None) for i in part.args[1][:d]):
        last = part.args[1][d]
        start = last.start if isinstance(last, slice) else None
        found = type(start) is int and start >= 0 and last.stop == start + 1 and last.step in (None, 1)
    else:
        return False
    if not found or meta.shape[d] != 1:
        return False
    node.op, node.target, node.args, node.kwargs = "call_method", "select", (part.args[0], d, start), {}
    return True


def repeat_as_expand(node, is_pointwise_target) -> bool:
    """`h.repeat(4, 1, 1)` (or tile) that repeats only size-1 or new dims, read only by pointwise
    ops in a graph that keeps no in-place op: `h.expand(...)`, which they read without the copy
    (fuzz44e). Rewritten in place."""
    args = positional(node, ("input", "repeats" if op_name(node) == "repeat" else "dims"))
    if op_name(node) not in ("repeat", "tile") or args is None or len(args) < 2 \
            or not _is_tensor_node(args[0]) or not read_as_broadcast_only(node, is_pointwise_target):
        return False
    reps = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    src, out = single_tensor_meta(args[0]), single_tensor_meta(node)
    if src is None or out is None or not all(type(r) is int for r in reps) or len(reps) < len(src.shape) \
            or reshaped_in_place(args[0]):
        return False
    padded = (1,) * (len(reps) - len(src.shape)) + tuple(src.shape)
    if any(r != 1 and size != 1 for r, size in zip(reps, padded)):
        return False
    node.op, node.target, node.args, node.kwargs = "call_method", "expand", (args[0], *out.shape), {}
    return True


PIXEL_SHUFFLES = {torch.nn.functional.pixel_shuffle: True, torch.nn.functional.pixel_unshuffle: False,
                  torch.pixel_shuffle: True, torch.pixel_unshuffle: False}


def pixel_shuffle_as_views(gm, node) -> bool:
    """`F.pixel_shuffle(h, r)` (or unshuffle, or nn.PixelShuffle) of a row-major 4-D h as the view,
    permute and reshape it is: a kernel reads the permute where it lies and a pointwise op after it
    joins h's kernel, where the library's copy split them (fuzz47e: ESPCN's conv, act, shuffle, act).
    The reshape copies into row-major memory, as torch's shuffle does for such an h."""
    if node.op == "call_module" and type(gm.get_submodule(node.target)) in (torch.nn.PixelShuffle, torch.nn.PixelUnshuffle):
        mod = gm.get_submodule(node.target)
        up, r = isinstance(mod, torch.nn.PixelShuffle), getattr(mod, "upscale_factor", getattr(mod, "downscale_factor", 0))
    elif node.op == "call_function" and node.target in PIXEL_SHUFFLES and len(node.args) == 2 and not node.kwargs:
        up, r = PIXEL_SHUFFLES[node.target], node.args[1]
    else:
        return False
    h = node.args[0] if len(node.args) >= 1 else None
    meta, out = single_tensor_meta(h), single_tensor_meta(node)
    if meta is None or out is None or len(meta.shape) != 4 or type(r) is not int or r < 1 \
            or tuple(meta.stride) != row_major(meta.shape) or tuple(out.stride) != row_major(out.shape):
        return False
    n, c, height, width = meta.shape
    if up:
        steps = ((n, c // (r * r), r, r, height, width), (0, 1, 4, 2, 5, 3))
    else:
        steps = ((n, c, height // r, r, width // r, r), (0, 1, 3, 5, 2, 4))
    t = torch.empty(tuple(meta.shape), dtype=meta.dtype, device="meta").view(steps[0])
    if t.permute(steps[1]).reshape(tuple(out.shape))._is_view():
        return False   # r == 1, or 1 x 1 maps: the reshape would alias h, where torch's shuffle copies (review47r3)
    g = gm.graph
    with g.inserting_before(node):
        view = g.call_method("view", (h, steps[0]))
        permute = g.call_method("permute", (view, steps[1]))
        reshape = g.call_method("reshape", (permute, tuple(out.shape)))
    view.meta["tensor_meta"] = _extract_tensor_metadata(t)
    permute.meta["tensor_meta"] = _extract_tensor_metadata(t.permute(steps[1]))
    reshape.meta = dict(node.meta)
    for new in (view, permute):
        new.meta["fxfuse"] = dict(fxfuse_meta(node))
    node.replace_all_uses_with(reshape)
    g.erase_node(node)
    return True

