"""The exceptions fxfuse raises (all derive from FxfuseError, so one except clause catches them)
and the category of its warnings."""


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


class FxfuseWarning(UserWarning):
    """Category of fxfuse's fallback warnings, so users can filter them."""
