"""A build leaves the model and the random streams as it found them (snapshot._Snapshot,
random_streams.RandomStreams), and refuses a forward() that keeps state in the module.

A memo that forward() fills on a miss (`if self.pe is None: self.pe = table(...)`, YOLOv5's grid
list) is refused too. A probe that took such memos after three more eager runs (one fill, one
run on the example's values shuffled, one fresh fill from those) was tried in this stop and taken
back: a calibration (`amax` survives a shuffle), an example of ones, a one-element argument, and
a memo whose rows depend on the size it was filled for (dynamic-NTK rotary tables) all passed it
and then gave wrong answers (review39d).

A dict memo (items only added) is no state: since stop 40 the build leaves it as its check's
eager run on the example filled it (kept_state's keep_memos), so the model is as after one eager
call, and later builds read the memo as eager's later calls would.
"""
import contextlib

import torch

from .errors import UnsupportedError
from .snapshot import _Snapshot
from .random_streams import RandomStreams


@contextlib.contextmanager
def kept_state(model: torch.nn.Module, keep_memos: bool = False):
    """Run a build; afterwards the model and the random number streams are as before, and a
    forward() that changed the model or drew from Python's random module is refused. With
    keep_memos (the build ran the model eagerly on the example to check it), a dict memo that
    run filled (`if "s" not in self.cache: self.cache["s"] = ...`) stays filled, as after one
    eager call: a later specialization's trace then reads it, as eager's later calls would, and
    does not fill it afresh from its own arguments (review39d)."""
    snapshot, streams = _Snapshot(model), RandomStreams(model)
    try:
        yield snapshot
    except Exception as e:   # the state, when changed, is the better reason (verification fails on it too)
        changed = snapshot.restore() + streams.restore()
        if changed:
            raise _refusal(changed) from e
        raise
    except BaseException:
        snapshot.restore()
        streams.restore()
        raise
    changed = snapshot.restore(keep_memos) + streams.restore()
    if changed:
        snapshot.forget_memos()
        raise _refusal(changed)


def _refusal(changed: list) -> UnsupportedError:
    if any(c.startswith("it draws from the torch.Generator") for c in changed):   # torch.fx kept it as
        changed = [c for c in changed if "._opaque_obj" not in c]                    # root._opaque_obj0
    if all(c.startswith("it draws from") for c in changed):
        return UnsupportedError(f"forward() {' and '.join(c[3:] for c in changed)}; the original module runs")
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""   # (fuzz43d: the rest went unnamed)
    return UnsupportedError(f"forward() changes the module's state ({', '.join(changed[:3])}{more}); fxfuse's "
                            "graphs keep no state between calls, so the original module runs")
