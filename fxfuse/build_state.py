"""A build leaves the model and the random streams as it found them (module_state._Snapshot,
random_streams.RandomStreams), and refuses a forward() that keeps state in the module; except
a memo: an attribute or cache entry that forward() fills on a miss and then only reads.

Why the memo probe: `if self.grid[0].shape[2:4] != x.shape[2:4]: self.grid[0] = make_grid(...)`
(YOLOv5's Detect head), or `if self.pe is None: self.pe = table(...)`, assigns during the trace,
which looked like state: the whole model was refused, and after one call at another size the
model's own size was never built again (fuzz39c, review39b). A memo is told apart from state by
three more eager runs: one fills it from the example; one on the example's values shuffled must
change nothing (a counter, a history or a running value moves again) and return what a run on
those values from the empty memo returns (a data-dependent init, ActNorm's, does not); none may
draw random numbers (a random table made on first use: the graph would keep the trace's draw).
The model then keeps the filled memo, as after one eager call, and the build goes on.
"""
import contextlib

import torch

from .errors import UnsupportedError
from .module_state import _Snapshot, same_attr, same_value
from .random_streams import RandomStreams
from .shape_propagation import clone_args


@contextlib.contextmanager
def kept_state(model: torch.nn.Module, rerun=None):
    """Run a build; afterwards the model and the random number streams are as before, and a
    forward() that changed the model or drew from Python's random module is refused, unless
    what it changed is a memo (`rerun(other)` runs forward() on copies of the example, with its
    values shuffled where `other`: the probe above)."""
    snapshot, streams = _Snapshot(model), RandomStreams(model)
    try:
        yield snapshot
    except Exception as e:   # the state, when changed, is the better reason (verification fails on it too)
        changed = snapshot.restore() + streams.restore()
        if changed and not _memoized(model, snapshot, changed, rerun):
            raise _refusal(changed) from e
        raise
    except BaseException:
        snapshot.restore()
        streams.restore()
        raise
    changed = snapshot.restore() + streams.restore()
    if changed and not _memoized(model, snapshot, changed, rerun):
        raise _refusal(changed)


def _memoized(model, snapshot, changed: list, rerun) -> bool:
    """Whether all forward() changed are attributes or container items it fills once (see above).
    Taken, the model keeps what the first run filled, as after one eager call on the example: a
    later build's trace reads the memo as eager's later calls do (a value made from the first
    call's arguments stays)."""
    if rerun is None or not set(changed) <= snapshot.replaced:
        return False
    streams, drawn, memo = RandomStreams(model), _generator_states(), False
    try:
        with torch.no_grad():
            rerun(False)
            filled = _Snapshot(model)
            hit = rerun(True)         # other values of the same shapes, the memo in place
            moved = filled.restore()
            snapshot.restore()
            missed = rerun(True)      # the same values, the memo made from them: a data-dependent init
        memo = not moved and _same_outputs(hit, missed) and _generator_states() == drawn   # differs (review39c)
    except Exception:  # noqa: BLE001 -- not known to be a memo
        memo = False
    finally:
        snapshot.restore()
        if memo:
            filled.restore()
        streams.restore()
    return memo


def shuffled(args: tuple) -> tuple:
    """Copies of the tensor arguments with their values permuted (the same values, other places:
    indices stay in range), for the memo probe; a fixed generator, torch's own stream untouched."""
    generator = torch.Generator().manual_seed(0)
    copies = clone_args(args)
    for t in copies:
        if isinstance(t, torch.Tensor) and t.numel() > 1:
            flat = t.reshape(-1)
            try:
                t.copy_(flat[torch.randperm(flat.numel(), generator=generator).to(t.device)].reshape(t.shape))
            except RuntimeError:   # an expanded input (stride 0) cannot be written: left as it is
                pass
    return copies


def _generator_states() -> list:
    """torch's default generators' states: a forward() that draws is no memo (a random table made on
    first use: the trace's draw would be baked into the graph, eager's next fill draws anew)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return [bytes(s.numpy()) for s in states]


def _same_outputs(a, b) -> bool:
    leaves_a, leaves_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        same_value(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else same_attr(x, y)
        for x, y in zip(leaves_a, leaves_b))


def _refusal(changed: list) -> UnsupportedError:
    if any(c.startswith("it draws from the torch.Generator") for c in changed):   # torch.fx kept it as
        changed = [c for c in changed if "._opaque_obj" not in c]                    # root._opaque_obj0
    if all(c.startswith("it draws from") for c in changed):
        return UnsupportedError(f"forward() {' and '.join(c[3:] for c in changed)}; the original module runs")
    return UnsupportedError(f"forward() changes the module's state ({', '.join(changed[:3])}); fxfuse's "
                            "graphs keep no state between calls, so the original module runs")
