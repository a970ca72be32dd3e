"""The exceptions fxfuse raises (all derive from FxfuseError, so one except clause catches them)
and the category of its warnings."""
import sys
import warnings


class FxfuseError(Exception):
    """Base class of every error fxfuse raises on purpose."""


class TraceError(FxfuseError):
    """The model could not be captured as a graph (symbolic trace and torch.export both failed)."""


class UnsupportedError(FxfuseError):
    """The model or input is outside what fxfuse handles (training mode, non-tensor input, ...)."""


class GuardError(FxfuseError):
    """A call's inputs do not match any specialization and no new one may be built."""


class CodegenError(FxfuseError):
    """A fused group could not be turned into a kernel (names the node and the reason)."""


class OptionError(FxfuseError, ValueError):
    """An option of fxfuse.optimize has a value outside its range (also a ValueError)."""


def as_fxfuse_error(e: Exception, doing: str) -> FxfuseError:
    """e itself, or an internal error (any other exception) wrapped with what was being done:
    the fallback policy covers both, and strict=True raises the result."""
    if isinstance(e, FxfuseError):
        return e
    return FxfuseError(f"internal error while {doing} ({type(e).__name__}: {e})").with_traceback(e.__traceback__)


class FxfuseWarning(UserWarning):
    """Category of fxfuse's fallback warnings, so users can filter them."""


def _internal(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name in ("fxfuse", "torch") or name.startswith(("fxfuse.", "torch."))   # (review44g: an opt inside
    #   nn.Sequential, or under torch.jit.trace, was warned at torch's container.py / _trace.py)


def warn(message: str, category: type = FxfuseWarning) -> None:
    """Warn with FxfuseWarning at the user's line: the first frame outside fxfuse and torch
    (Module.__call__, a Sequential's forward). A fixed stacklevel cannot do it (the same warning comes from optimize()
    and from a call several frames deeper), and a file:line inside fxfuse or torch would also
    make the default filter (once per location) merge or split warnings arbitrarily."""
    frame, level = sys._getframe(1), 2     # stacklevel 2 is warn()'s caller
    while frame is not None and _internal(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
