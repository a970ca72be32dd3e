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
    import sympy
    if a == b:
        return True
    try:
        return bool(sympy.simplify(sympy.Equivalent(a, b)) is sympy.true)
    except Exception:  # noqa: BLE001 -- not comparable: not the same
        return False


def _users_frame() -> bool:
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name != "torch" and not name.startswith("torch.")


@contextlib.contextmanager
def users_checks():
    """Records, while export runs in this thread, the conditions forward()'s own code gives
    torch._check and torch._check_is_size (not torch's code)."""
    check, is_size, found = torch._check, torch._check_is_size, Checks()

    def recording_check(cond, *args, **kwargs):
        expr = getattr(getattr(cond, "node", None), "expr", None)
        if getattr(_RECORDING, "on", False) and expr is not None and _users_frame():
            found.conditions.append(expr)
        return check(cond, *args, **kwargs)

    def recording_is_size(i, *args, **kwargs):
        expr = getattr(getattr(i, "node", None), "expr", None)
        if getattr(_RECORDING, "on", False) and expr is not None and _users_frame():
            found.sizes.add(expr)
        return is_size(i, *args, **kwargs)
    _RECORDING.on, torch._check, torch._check_is_size = True, recording_check, recording_is_size
    try:
        yield found
    finally:
        _RECORDING.on, torch._check, torch._check_is_size = False, check, is_size
