"""Values whose shape depends on the input's values (h[h > 0], nonzero(x)): every graph is
specialized on shapes, so they are marked after shape propagation (tracing.propagate_shapes)."""
import math
import operator

import torch
import torch.fx

from .errors import UnsupportedError
from .node_meta import fxfuse_meta


# ops whose result's shape depends on the input's values: every graph is specialized on shapes,
# so a size read from such a result (`pos.shape[0]` after `pos = h[h > 0]`) would be frozen
DATA_DEPENDENT_FUNCTIONS = {torch.nonzero, torch.argwhere, torch.masked_select, torch.unique,
                            torch.unique_consecutive, torch.bincount, torch.repeat_interleave}
DATA_DEPENDENT_FUNCTIONS |= {getattr(torch.ops.aten, name).default for name in (
    "nonzero", "argwhere", "masked_select", "_unique2", "unique_consecutive", "unique_dim", "bincount")
    if hasattr(torch.ops.aten, name)}
DATA_DEPENDENT_METHODS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                          "repeat_interleave"}
# the same by name, for the spellings the sets miss: aten overloads (`aten.repeat_interleave.self_Tensor`,
# `aten.nonzero_numpy`), private functions (`torch._unique2`), unbound methods (`torch.Tensor.repeat_interleave`)
DATA_DEPENDENT_NAMES = DATA_DEPENDENT_METHODS | {"nonzero_numpy", "_unique", "_unique2", "unique_dim",
                                                 "unique_dim_consecutive"}
INDEXING = {operator.getitem, torch.ops.aten.index.Tensor}


def _torchs(target) -> bool:
    """torch's own function, method or aten overload (not a user's helper named `unique`: review50r4)."""
    return isinstance(target, torch._ops.OpOverload) or getattr(torch, getattr(target, "__name__", ""), None) is target \
        or getattr(torch.Tensor, getattr(target, "__name__", ""), None) is target


def _is_bool_tensor(a) -> bool:   # uint8 too: torch still indexes with it as a mask (deprecated; fuzz40e)
    meta = a.meta.get("tensor_meta") if isinstance(a, torch.fx.Node) else None
    return getattr(meta, "dtype", None) in (torch.bool, torch.uint8)


ONE_HOT = {torch.nn.functional.one_hot, torch.ops.aten.one_hot.default}
REPEATS_ONLY = {torch.repeat_interleave, torch.ops.aten.repeat_interleave.Tensor}   # repeat_interleave(counts)


def _makes_data_dependent_shape(n) -> bool:
    """Whether n's output shape depends on its input's values (nonzero, unique, masked_select,
    boolean-mask indexing, torch.where(cond) with one argument, tensor repeats)."""
    if n.op == "call_function" and n.target in INDEXING or n.op == "call_method" and n.target == "__getitem__":
        #                                               (a buffer's `self.table[mask]`: review40b)
        return any(_is_bool_tensor(a) for a in torch.utils._pytree.tree_leaves(list(n.args[1:])))
    if n.op == "call_function" and n.target is torch.where:
        return len(n.args) + len(n.kwargs) == 1
    if n.op == "call_function" and n.target in ONE_HOT:   # labels.max() + 1 columns unless num_classes is given
        return n.kwargs.get("num_classes", n.args[1] if len(n.args) > 1 else -1) == -1
    if n.op == "call_function" and n.target in REPEATS_ONLY and len(n.args) == 1 \
            and n.kwargs.get("output_size") is None and "repeats" not in n.kwargs:
        return True
    if n.op == "call_function" and op_name(n) == "where":   # aten.where.default(cond) (fuzz50l)
        return len(n.args) + len(n.kwargs) == 1
    dynamic = (n.op == "call_function" and (n.target in DATA_DEPENDENT_FUNCTIONS or op_name(n) in DATA_DEPENDENT_NAMES
                                            and _torchs(n.target))) \
        or (n.op == "call_method" and n.target in DATA_DEPENDENT_METHODS)
    if dynamic and op_name(n) == "repeat_interleave":   # tensor repeats only, and
        dynamic = any(isinstance(a, torch.fx.Node) for a in list(n.args[1:3]) + [n.kwargs.get("repeats")]) \
            and n.kwargs.get("output_size", n.args[3] if len(n.args) > 3 else None) is None   # no output_size
    return dynamic


VALUE_METHODS = {"item", "tolist"}
VALUE_FUNCTIONS = {p.default for p in (getattr(torch.ops.aten, "_local_scalar_dense", None),
                                      getattr(torch.ops.aten, "item", None)) if p is not None}   # export's .item()
# where a number read from a tensor does NOT set a size: op name -> (positions, keywords) of such arguments
# (a fill value, an eps, a momentum, a norm's p); any other argument of any op that is not pointwise may set
# one (a slice bound, arange's end, a pool's kernel size...), and is taken to (review35b, review35c)
NOT_SIZE_ARGUMENTS = {"full_like": ((1,), ("fill_value",)), "full": ((1,), ("fill_value",)),
                      "new_full": ((2,), ("fill_value",)), "pad": ((3,), ("value",)),
                      "layer_norm": ((4,), ("eps",)), "group_norm": ((4,), ("eps",)), "rms_norm": ((3,), ("eps",)),
                      "batch_norm": ((5, 6, 7), ("training", "momentum", "eps")), "normalize": ((1, 3), ("p", "eps")),
                      "masked_fill": ((2,), ("value",)), "index_fill": ((3,), ("value",)), "fill": ((1,), ("value",)),
                      # (fuzz40e; a dim sets sizes: fuzz40g; review40c)
                      "narrow": ((2,), ("start",)), "select": ((2,), ("index",)), "roll": ((1, 2), ("shifts", "dims")),
                      "index_select": ((2,), ("index",)), "norm": ((1,), ("p",)), "histc": ((2, 3), ("min", "max")),
                      "diff": ((3, 4), ("prepend", "append")), "var": ((), ("correction",)),
                      "std": ((), ("correction",))}
TENSORS_READ = {"index_select": ((2,), ("index",)), "diff": ((3, 4), ("prepend", "append"))}   # on the device


def _reads_a_number(n) -> bool:
    """`t.item()` (or export's spelling) of a number that is no bool (`x[True]` adds a dim: fuzz40g)."""
    source = n.args[0].meta.get("tensor_meta") if n.args and isinstance(n.args[0], torch.fx.Node) else None
    return (n.op == "call_method" and n.target == "item" or n.op == "call_function" and n.target in VALUE_FUNCTIONS) \
        and getattr(source, "dtype", torch.bool) != torch.bool


def _a_number(node, values: set) -> bool:
    """Whether node is one number: `t.item()`, or Python arithmetic on such numbers (`t.item() - 1`,
    review40d), not a list from `.tolist()`."""
    stack, seen, found = [node], set(), False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _reads_a_number(n):
            found = True
        elif n.op == "call_method" and n.target == "tolist" or n not in values:
            return False
        else:
            stack += n.all_input_nodes
    return found


def _reads_values(n) -> bool:
    """A Python number (or list) read from a tensor's values: `lengths.max().item()`, `c.tolist()`."""
    return n.op == "call_method" and n.target in VALUE_METHODS or n.op == "call_function" and n.target in VALUE_FUNCTIONS


def _sized_by_values(n, values: set) -> bool:
    """Whether a number read from a tensor's values (`values`), or a tensor used as a slice bound
    (`x[:, :lengths.max()]`), goes into n where it may set a size (review35: `h.shape[1]` was folded
    to the example's): any argument of an op that is not pointwise, but those NOT_SIZE_ARGUMENTS
    names (a fill value, an eps)."""
    indexing = n.op == "call_function" and n.target in INDEXING or n.op == "call_method" and n.target == "__getitem__"
    index = n.args[1] if indexing and len(n.args) > 1 else None   # (a buffer's `self.table[t.item()]`: review40c)
    items = index if isinstance(index, tuple) else (index,)
    bounds = [b for s in items if isinstance(s, slice) for b in (s.start, s.stop, s.step) if isinstance(b, torch.fx.Node)]
    if any(b in values or b.meta.get("tensor_meta") is not None for b in bounds):
        return True
    if n.target in (operator.getitem, "__getitem__") and index is not None and not bounds:
        source = n.args[0].meta.get("tensor_meta") if isinstance(n.args[0], torch.fx.Node) else None
        if not hasattr(source, "shape"):   # `x.split(3)[k]`: which piece, of its own size (fuzz40g)
            return any(isinstance(i, torch.fx.Node) and (i in values or i.meta.get("tensor_meta") is not None)
                       for i in items)
        if all(not isinstance(i, torch.fx.Node) or i not in values or _a_number(i, values) for i in items):
            return False   # `x[i.item()]`: a number read from a value picks an element; no size follows (fuzz40e);
            #                a list of them (`x[idx.tolist()]`) picks as many as it holds (review40)
    if n.op == "call_function" and n.target in (torch.tensor_split, torch.ops.aten.tensor_split.tensor_indices_or_sections) \
            and len(n.args) > 1 and isinstance(n.args[1], torch.fx.Node):
        return True
    if _sized_by_a_tensor(n):
        return True
    if not any(a in values for a in n.all_input_nodes):
        return False
    from fxfuse.passes.spellings import spelling_of   # passes import fxfuse modules: import late
    if spelling_of(n.graph.owning_module, n) is not None:   # pointwise (`x * scale.item()`): x's shape
        return False
    name = op_name(n)
    positions, keywords = NOT_SIZE_ARGUMENTS.get(name.rstrip("_"), ((), ()))
    sizing = [a for k, a in enumerate(n.args) if k not in positions] + \
        [v for k, v in n.kwargs.items() if k not in keywords]
    found = []
    torch.fx.node.map_arg(sizing, lambda a: found.append(a) or a)
    return any(a in values for a in found)


# ops with a size argument a one-element tensor may give directly (`torch.arange(n)`, `x.narrow(0, 0, n)`,
# `x.topk(n)`, `F.one_hot(y, n)`, `F.adaptive_avg_pool1d(x, n)`, a dim: `x.unsqueeze(d)`): torch reads its
# value (fuzz40e, fuzz40g). Factories take one anywhere, the others after their input. A list of the ops that
# take sizes, not of those that do not: a one-element tensor given to any other op (a timestep indexing a
# buffer, `x % period`, a loss at batch 1) is read as a tensor (review40b)
SIZE_FACTORIES = {"arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "linspace",
                  "logspace", "eye", "tril_indices", "triu_indices", "hann_window", "hamming_window", "blackman_window",
                  "bartlett_window", "kaiser_window"}
SIZE_TAKING = {"narrow", "narrow_copy", "select", "topk", "kthvalue", "pad", "constant_pad_nd", "split", "chunk",
               "tensor_split", "vsplit", "hsplit", "dsplit", "expand", "broadcast_to", "repeat", "tile", "view",
               "reshape", "unflatten", "flatten", "unsqueeze", "squeeze", "movedim", "moveaxis", "transpose",
               "swapaxes", "swapdims", "permute", "diagonal", "diag", "diag_embed", "unfold", "new_zeros", "new_ones",
               "new_empty", "new_full", "one_hot", "interpolate", "upsample", "pixel_shuffle", "pixel_unshuffle",
               "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
               "adaptive_max_pool2d", "adaptive_max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d",
               "max_pool2d", "max_pool3d", "lp_pool1d", "lp_pool2d", "fold", "unfold", "sum_to_size", "resize_",
               "as_strided", "diff", "histc", "rot90", "diagflat", "vander", "combinations", "unbind", "index_select",
               "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "std", "var", "logsumexp",
               "norm", "argmax", "argmin", "all", "any", "count_nonzero", "median", "nanmedian", "mode", "sort",
               "argsort", "cumsum", "cumprod", "cummax", "cummin", "softmax", "log_softmax", "flip", "trace",
               "fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fftn", "ifftn", "rfftn", "irfftn", "fft2", "ifft2",
               "rfft2", "irfft2", "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft",
               "fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn", "fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2",
               "full_like", "fill_", "fill", "roll"}   # (the last four: numbers that sync, never sizes; review40c:
#                                                          irfft's n, diff's n, histc's bins, a reduction's dim)
NUMBERS_ONLY = {"full_like", "fill_", "fill", "roll"}


def op_name(n) -> str:
    """A call's name: the method's, or the function's (aten overloads by their packet: `unsqueeze_`)."""
    name = n.target if n.op == "call_method" else getattr(getattr(n.target, "overloadpacket", n.target), "__name__", "")
    return name if isinstance(name, str) else ""


def _number_tensors(n, sizes_only: bool = True) -> list:
    """The one-element tensors computed from an input that n (one of SIZE_TAKING or SIZE_FACTORIES)
    reads as numbers: all but its first argument (a factory's too); with sizes_only not where
    NOT_SIZE_ARGUMENTS names a value (a fill value, a narrow start) or the op takes no size."""
    if n.op not in ("call_function", "call_method"):
        return []
    name = op_name(n)
    if name not in SIZE_TAKING and name not in SIZE_FACTORIES or sizes_only and name in NUMBERS_ONLY:
        return []
    positions, keywords = NOT_SIZE_ARGUMENTS.get(name.rstrip("_"), ((), ())) if sizes_only else \
        TENSORS_READ.get(name, ((), ()))
    args = [a for k, a in enumerate(n.args) if k not in positions and (k > 0 or name in SIZE_FACTORIES)]
    kwargs = [v for k, v in n.kwargs.items() if k not in keywords and k != "input"]   # input=: the data (review40d)
    if sizes_only and name in SIZE_AT:   # linspace(x.min(), x.max(), 8): only the steps set its size (review40)
        k, keyword = SIZE_AT[name]
        args, kwargs = n.args[k:k + 1], [n.kwargs[keyword]] if keyword in n.kwargs else []
    found = []
    torch.fx.node.map_arg(list(args) + kwargs, lambda a: found.append(a) or a)
    return [a for a in found if math.prod(getattr(a.meta.get("tensor_meta"), "shape", (0,))) == 1 and _from_inputs(a)]


def _sized_by_a_tensor(n) -> bool:
    return bool(_number_tensors(n))


SIZE_AT = {"linspace": (2, "steps"), "logspace": (2, "steps")}


def _from_inputs(node) -> bool:
    """Whether node is computed from an input (a 0-dim buffer of the model is no value of the
    input's: `torch.arange(self.n)` is rebuilt when n is edited). One pass over the graph, kept in
    each node's meta (review40b: a walk per node was quadratic in the graph's size)."""
    if FROM_INPUTS not in node.meta:
        for n in node.graph.nodes:
            n.meta[FROM_INPUTS] = n.op == "placeholder" or any(a.meta.get(FROM_INPUTS) for a in n.all_input_nodes)
    return node.meta[FROM_INPUTS]


FROM_INPUTS = "fxfuse_from_inputs"


def _reads_size(n) -> bool:
    return (n.op == "call_method" and n.target in ("size", "numel", "nelement")) or \
        (n.op == "call_function" and (n.target is len or n.target in SIZE_OPS or n.target is torch.numel
                                     or (n.target is getattr and n.args[1:] == ("shape",))))


SIZE_OPS = {getattr(torch.ops.aten, name).int if name == "sym_size" else getattr(torch.ops.aten, name).default
            for name in ("sym_size", "sym_numel") if hasattr(torch.ops.aten, name)}


def _source_line(n) -> str:
    """' (`source line`)' of forward() where the tracer recorded one (torch.export does), else ''."""
    lines = [line.strip() for line in (n.meta.get("stack_trace") or "").strip().splitlines()]
    return f" (`{lines[-1][:120]}`)" if lines and not lines[-1].startswith("File ") else ""


def reads_to_the_host(gm: torch.fx.GraphModule):
    """The first node that waits for a tensor's value on the host (`.item()`, `.tolist()`, a
    value-sized result such as nonzero, a tensor given as a number: `narrow(1, n, 2)`), else
    None: a CUDA graph cannot capture it, and a failed capture leaves torch's CUDA generator
    unusable ("Offset increment outside graph capture")."""
    return next((n for n in gm.graph.nodes if _reads_values(n) or _makes_data_dependent_shape(n)
                 or _number_tensors(n, sizes_only=False) or _picks_by_a_tensor(n)), None)


def _picks_by_a_tensor(n) -> bool:
    """`x.split(2)[k]` with k a tensor: Python indexes the list with its value."""
    if not (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)):
        return False
    return not hasattr(n.args[0].meta.get("tensor_meta"), "shape") and isinstance(n.args[1], torch.fx.Node) \
        and n.args[1].meta.get("tensor_meta") is not None


def mark_data_dependent_shapes(gm: torch.fx.GraphModule) -> None:
    """Every graph is specialized on shapes; a value whose shape depends on the input's values
    (h[h > 0], nonzero(x)) and everything computed from it may change shape between calls.
    Their shape metadata is dropped, so no pass builds a kernel for the example's shape (the
    library ops run them); a size read from one (`pos.shape[0]`) would be frozen at the
    example's value, so that is refused with the node named."""
    dynamic, values = set(), set()
    for n in gm.graph.nodes:
        if _reads_values(n) or n.meta.get("tensor_meta") is None and any(a in values for a in n.all_input_nodes):
            values.add(n)   # a number from a tensor's values, and Python arithmetic on it
            continue
        if _makes_data_dependent_shape(n) or _sized_by_values(n, values) \
                or any(a in dynamic for a in n.all_input_nodes):
            if _reads_size(n) and any(a in dynamic for a in n.all_input_nodes):
                source = next(a for a in n.all_input_nodes if a in dynamic)
                raise UnsupportedError(
                    f"node {n.name}{_source_line(n)} reads the size of {source.name}, whose shape depends on the "
                    "input's values; "
                    "fxfuse specializes every graph on shapes, so the size would be frozen at the example "
                    "input's. Run that part of the model outside fxfuse")
            dynamic.add(n)
            n.meta.pop("tensor_meta", None)
            fxfuse_meta(n)["kept"] = "shape depends on the input's values"
