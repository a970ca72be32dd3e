"""forward() writing into the model's parameters: found before the graph runs, and refused.

fxfuse's graphs keep no state between calls, and module_state, which compares and restores
buffers and tensor attributes by value, keeps no copy of the parameters: a write that ran
during optimize() (shape propagation, the checks against eager) would stay in the model. So
the write is found in the traced graph (refuse_state_writes), in torch.fx's failure to trace an
augmented assignment to a parameter (assigns_parameter), or, where only torch.export could
trace forward(), in the parameters' version counters right after the export
(refuse_written_parameters).
"""
import operator

import torch
import torch.fx

from .errors import UnsupportedError
from .module_state import version as _version   # None for an inference tensor (review43c: a model
from .node_meta import fetch_attr                   # loaded under inference_mode failed inside fxfuse)


class StateWriteError(UnsupportedError):
    """forward() writes into a parameter or buffer of the model."""


AUGMENTED_NAMES = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
                   "matmul")   # the operators of Python's augmented assignments (`v += y` is operator.iadd)
AUGMENTED_OPERATORS = {getattr(operator, f"i{name}") for name in AUGMENTED_NAMES if name != "matmul"}   # writes
VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "narrow", "select",
                "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as", "diagonal", "as_strided",
                "split", "chunk", "unbind", "detach", "movedim", "moveaxis", "swapaxes", "swapdims", "unfold",
                "tensor_split", "hsplit", "vsplit", "dsplit", "adjoint", "unsafe_split", "unsafe_chunk",
                "split_with_sizes", "unsafe_split_with_sizes"}
VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.transpose,
                  torch.narrow, torch.select, torch.t, torch.permute, torch.diagonal, torch.split, torch.chunk,
                  torch.unbind, torch.detach, torch.movedim, torch.swapaxes, torch.swapdims, torch.tensor_split,
                  torch.hsplit, torch.vsplit, torch.dsplit, torch.view_as_real, torch.view_as_complex, torch.adjoint,
                  torch.moveaxis, torch.unflatten, torch.unsafe_split, torch.unsafe_chunk, torch.split_with_sizes,
                  torch.unsafe_split_with_sizes}


# named with a trailing underscore only because `and`, `or`, `not` and `is` are Python keywords:
# `mask_a & mask_b` writes nothing (fuzz33d: it was taken for an in-place op)
KEYWORD_OPERATORS = (operator.and_, operator.or_, operator.not_, operator.is_)


def _writes_in_place(n: torch.fx.Node):
    """The tensor an in-place node writes into (`b += 0.1`, `b.add_(1)`, `torch.relu_(b)`,
    `b[0] = 1`, `out=b`), else None."""
    if (n.op == "call_function" and (n.target in AUGMENTED_OPERATORS or n.target is operator.setitem)) or \
            (n.op == "call_method" and n.target == "__setitem__"):   # b.__setitem__(i, v): fx keeps the method
        return n.args[0] if n.args else None
    if n.kwargs.get("out") is not None:   # torch.fx records F.normalize(x) with out=None: no write
        return n.kwargs["out"]
    if n.op == "call_function" and n.target in RENORMS:   # F.embedding(ids, W, max_norm=1.0) rescales W's rows
        bound = dict(zip(RENORMS[n.target], n.args), **n.kwargs)
        return bound.get("weight") if bound.get("max_norm") is not None else None
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "") if n.op == "call_function" else ""
    in_place = isinstance(name, str) and ((name.endswith("_") and not name.startswith("_")
                                           and n.target not in KEYWORD_OPERATORS)
                                          or (name.startswith("__i") and name.endswith("__")))
    if in_place or n.kwargs.get("inplace") is True:
        return n.args[0] if n.args else None
    written = schema_writes(n)
    return written[0] if written else None


def schema_writes(n: torch.fx.Node) -> list:
    """The operands an op's schema marks as written: a torch.library.custom_op(mutates_args=...)
    called through torch.ops (its name says nothing: review38 found fusion moving a read of x
    across it), aten's in-place and out= overloads."""
    if n.op != "call_function":
        return []
    target = n.target
    overloads = [target] if isinstance(target, torch._ops.OpOverload) else [
        getattr(target, name) for name in target.overloads()] if isinstance(target, torch._ops.OpOverloadPacket) else []
    written = []
    for schema in (op._schema for op in overloads):
        for k, arg in enumerate(schema.arguments):
            value = n.args[k] if k < len(n.args) and not arg.kwarg_only else n.kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write:   # a Tensor[] operand: each (review38b)
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(item, torch.fx.Node) and item not in written:
                        written.append(item)
    return written


RENORMS = {   # functions whose max_norm renormalizes the looked-up rows of the weight in place
    torch.nn.functional.embedding: ("input", "weight", "padding_idx", "max_norm"),
    torch.nn.functional.embedding_bag: ("input", "weight", "offsets", "max_norm"),
}


def _module_writes(gm, n: torch.fx.Node) -> str | None:
    """The parameter a called module writes: nn.Embedding(max_norm=...) / EmbeddingBag, an
    in-place activation module applied to (a view of) it."""
    if n.op != "call_module":
        return None
    mod = gm.get_submodule(n.target)
    if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.max_norm is not None:
        return f"{n.target}.weight"
    if getattr(mod, "inplace", False) is True and not isinstance(mod, torch.nn.modules.dropout._DropoutNd) and n.args:
        return _root_attribute(n.args[0])   # nn.ReLU(inplace=True) on a view of a parameter (review34)
    return None


def _root_attribute(a) -> str | None:
    """The get_attr target a value is a view of (through view ops), else None."""
    while isinstance(a, torch.fx.Node):
        if a.op == "get_attr":
            return a.target
        is_view = (a.op == "call_method" and a.target in VIEW_METHODS) or (
            a.op == "call_function" and (a.target in VIEW_FUNCTIONS or (a.target is getattr and a.args[1] in ("T", "mT", "data"))))
        if not is_view or not a.args:
            return None
        a = a.args[0]
    return None


def written_attributes(gm: torch.fx.GraphModule) -> set:
    """The get_attr targets forward() writes in place (directly or through a view): a pass must
    not fold or copy them at optimize time (review35: BatchNorm statistics set in forward)."""
    return {t for n in gm.graph.nodes if (t := _module_writes(gm, n) or _root_attribute(_writes_in_place(n)))}


def refuse_state_writes(gm: torch.fx.GraphModule) -> None:
    """A forward() that writes into a parameter of the model (`self.lin.bias += 0.1`,
    `self.lin.weight[0].add_(1)`) changes the module's state; fxfuse's graphs keep none. Refused
    before anything runs: shape propagation and the check against eager would each apply the
    write, and module_state, which compares and restores buffers and tensor attributes by value
    (a scratch buffer written and reset in forward() passes), keeps no copy of the parameters."""
    for n in gm.graph.nodes:
        target = _module_writes(gm, n) or _root_attribute(_writes_in_place(n))
        if target is not None and isinstance(fetch_attr(gm, target), torch.nn.Parameter):
            raise StateWriteError(f"forward() changes the module's state: node {n.name} writes into the parameter "
                                  f"{target} in place; fxfuse's graphs keep no state between calls, so the original "
                                  "module runs")


def assigns_parameter(error: BaseException) -> StateWriteError | None:
    """`self.lin.bias += 0.1`: torch.fx cannot assign its Proxy to the parameter and raises a
    TypeError; torch.export, tried next, would run forward() and apply the write."""
    if isinstance(error, TypeError) and "cannot assign" in str(error) and "as parameter" in str(error):
        return StateWriteError("forward() changes the module's state: it assigns to a parameter (an augmented "
                               "assignment such as `self.lin.bias += 0.1`); fxfuse's graphs keep no state between "
                               "calls, so the original module runs")
    return None


def parameter_versions(model: torch.nn.Module) -> list:
    return [(name, p, _version(p)) for name, p in model.named_parameters()]   # (inference tensors: None)


def refuse_written_parameters(versions: list) -> None:
    """After torch.export traced forward() (which applies a write once), before the graph runs."""
    written = next((name for name, p, v in versions if _version(p) != v), None)
    if written is not None:
        raise StateWriteError(f"forward() changes the module's state: it writes into the parameter {written} "
                              "in place (torch.export's trace applied the write once); fxfuse's graphs keep no "
                              "state between calls, so the original module runs")
