"""Which asserts of torch.export's graph are the user's own `torch._check`s (tracing._exported).

export's graph carries asserts of two kinds: the conditions forward() gives torch._check (or
torch._check_is_size) on numbers read from tensors, which eager checks on every call and so must
the graph (fuzz40e), and export's own range assumptions (`u0 >= -8` for a slice bound, which
eager clamps instead: keeping them raised where eager returns, review40). The user's are
recorded while export runs, by the condition's sympy expression, and matched up to sympy's
simplification (export prints `k + 1 <= 7` as `u0 <= 6`: review40b).
"""
import contextlib
import sys
import threading

import torch

_RECORDING = threading.local()


class Checks:
    def __init__(self):
        self.conditions, self.sizes = [], set()

    def made(self, node) -> bool:
        """Whether an assert node checks one of the recorded conditions."""
        value = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        expr = getattr(getattr(value, "node", None), "expr", None)
        if expr is None:
            return False
        if node.target is not torch.ops.aten._assert_scalar.default:   # sym_constrain_range(_for_size) of u0
            return expr in self.sizes
        return any(_same(expr, c) for c in self.conditions) or any(_same(expr, s >= 0) for s in self.sizes)


def _same(a, b) -> bool:
    return a == b or _canonical(a) == _canonical(b)


def _canonical(e):
    """A relation as (kind, lhs - rhs expanded), `>`/`>=` turned around: `k + 1 <= 7` and `6 >= k`
    both become (<=, k - 6). No sympy.simplify: one per pair of assert and check took a build to
    80 s (review40c)."""
    import sympy
    flipped = {sympy.StrictGreaterThan: sympy.StrictLessThan, sympy.GreaterThan: sympy.LessThan}
    if isinstance(e, sympy.core.relational.Relational):
        kind, lhs, rhs = type(e), e.lhs, e.rhs
        if kind in flipped:
            kind, lhs, rhs = flipped[kind], rhs, lhs
        try:   # `2*k <= 12` as `k <= 6` (review40d): the difference over its positive content
            content, primitive = sympy.expand(lhs - rhs).as_content_primitive()
            return (kind, primitive) if content > 0 else (kind, sympy.expand(lhs - rhs))
        except Exception:  # noqa: BLE001 -- as it is
            return e
    return e


def _users_frame() -> bool:
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name != "torch" and not name.startswith("torch.")


@contextlib.contextmanager
def users_checks():
    """Records, while export runs in this thread, the conditions forward()'s own code gives
    torch._check and its kin (not torch's code; a `from torch import _check` bound before is not seen)."""
    found, originals = Checks(), {name: getattr(torch, name) for name in CHECKS if hasattr(torch, name)}

    def recording(name, check):
        def wrapper(*args, **kwargs):
            if getattr(_RECORDING, "on", False) and _users_frame():
                cond = args[1] if name == "_check_with" and len(args) > 1 else args[0] if args else None
                expr = getattr(getattr(cond, "node", None), "expr", None)
                if expr is not None and name == "_check_is_size":
                    found.sizes.add(expr)
                    bound = kwargs.get("max")   # keyword-only; args[1] is the message (review40d)
                    if bound is not None:   # _check_is_size(k, max=6): k <= 6 too
                        found.conditions.append(expr <= bound)
                elif expr is not None:
                    found.conditions.append(expr)
            return check(*args, **kwargs)
        return wrapper
    _RECORDING.on = True
    for name, check in originals.items():
        setattr(torch, name, recording(name, check))
    try:
        yield found
    finally:
        _RECORDING.on = False
        for name, check in originals.items():
            setattr(torch, name, check)


CHECKS = ("_check", "_check_is_size", "_check_with", "_check_index", "_check_value", "_check_type",
          "_check_not_implemented")
