"""detach() in the graph: an alias of its input, which normalize removes where nothing sees the
alias itself (fxfuse records no autograd), and keeps where eager's result differs from the
input's tensor object: returned, or reshaped in place (fuzz40b, review40)."""
import torch
import torch.fx

from fxfuse.state_writes import VIEW_FUNCTIONS, VIEW_METHODS

from .identity_ops import hands_back, held_by_caller, reshaped_in_place, returned

aten = torch.ops.aten


DETACH_FUNCTIONS = {torch.detach, aten.detach.default, aten.detach_.default, aten.alias.default}


ALIAS_OF_REAL = {"resolve_conj", "resolve_neg", "conj", torch.resolve_conj, torch.resolve_neg, torch.conj,
                 aten.resolve_conj.default, aten.resolve_neg.default, aten.conj.default, aten.alias,
                 torch.real, aten.real.default}   # torch.real(x) as x.real (fuzz44d)


def _detach_source(node):
    """x where node is x.detach() (torch.detach, export's detach/alias, `x.data`), or an op that
    returns a real x as it is (`x.resolve_conj()`, `x.conj()`, `x.real`; fuzz43b), else None."""
    if node.op == "call_method":
        cut = node.target in ("detach", "detach_") and len(node.args) == 1 and not node.kwargs
    else:
        cut = node.op == "call_function" and (node.target in DETACH_FUNCTIONS and len(node.args) == 1
                                              or node.target is getattr and node.args[1:] == ("data",))
    if not cut and node.op in ("call_function", "call_method") and len(node.args) == 1 and not node.kwargs \
            or node.op == "call_function" and node.target is getattr and node.args[1:] == ("real",):
        source = node.args[0]
        meta = source.meta.get("tensor_meta") if isinstance(source, torch.fx.Node) else None
        cut = getattr(meta, "dtype", torch.complex64).is_complex is False and (
            node.target is getattr or node.target in ALIAS_OF_REAL)
    return node.args[0] if cut else None


def _is_detach(node) -> bool:
    """detach() only cuts autograd, which fxfuse never records: the value is its input (an alias
    of it, as in eager). torch.export wraps every tensor constant in detach_, which would
    otherwise count as an in-place op and keep everything it touches out of fusion. Kept where
    the alias itself is seen: returned (eager gives a new tensor object sharing the memory, and
    a caller's `out[1].unsqueeze_(0)` must not reshape out[0]: fuzz40b; its other readers read
    the source: _detach_readers), or where it or its source is reshaped in place (`d =
    h.detach(); d.unsqueeze_(0)` reshapes d only; `h.unsqueeze_(0)` h only: review40)."""
    source = _detach_source(node)
    if source is None:
        return False
    if node.target in ("detach_", aten.detach_.default):
        return True
    return not _reshaped_in_place(node, source) and not any(_keeps_the_alias(u, node, source) for u in node.users)


def _keeps_the_alias(user, of, source=None, depth: int = 0) -> bool:
    """Returned, or stored on the module by the graph's write-back (`self.last = x.detach()`:
    eager's attribute is no input that requires grad: review41c), also through views and casts
    that may return their input (`x.detach().float()`, `[0]`, `.view(...)`: review41d), ops that
    normalize removes as returning it (nn.Identity, eval Dropout, `torch.positive`: fuzz47f) and
    in-place ops, which return it."""
    if returned(user):   # (a fresh intermediate's alias returned may be it: review50r1)
        return user.op != "output" or source is None or held_by_caller(source)
    from .normalize import _is_identity   # (normalize imports this module)
    aliasing = user.op == "call_method" and user.target in ALIASING_METHODS or \
        user.op == "call_function" and user.target in VIEW_FUNCTIONS \
        or user.op in ("call_function", "call_method", "call_module") and (
            _detach_source(user) is not None or _is_identity(user.graph.owning_module, user)
            or hands_back(user, of))   # `x.detach().mul_(2)`, `.cpu()` return the alias (fuzz50c, review50r1)
    return aliasing and depth < 64 and any(_keeps_the_alias(u, user, source, depth + 1) for u in user.users)


ALIASING_METHODS = VIEW_METHODS | {"float", "double", "half", "to", "type", "type_as", "contiguous"}


def _reshaped_in_place(node, source) -> bool:
    """node or its source reshaped in place, also through ops that return it as it is (`d.float().t_()`,
    `h.detach().mul_(2).unsqueeze_(0)`: fuzz50c)."""
    return reshaped_in_place(node) or reshaped_in_place(source)



def _detach_readers(node) -> None:
    """A detach kept because it is returned: its other readers read its source (the same values),
    so a pointwise reader still joins the source's kernel."""
    source = _detach_source(node)
    if source is not None and isinstance(source, torch.fx.Node) and not _reshaped_in_place(node, source):
        for user in [u for u in node.users if not _keeps_the_alias(u, node, source)]:
            user.replace_input_with(node, source)
