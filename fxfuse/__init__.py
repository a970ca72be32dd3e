"""fxfuse: a torch.fx graph compiler that makes PyTorch inference faster on NVIDIA GPUs.

    model = fxfuse.optimize(model, example_input)   # same results, less time
    print(fxfuse.explain(model))                    # what was rewritten, and why
"""
from . import log as _log  # noqa: F401  (installs the quiet-by-default logger)
from .api import optimize, stats
from .errors import CodegenError, FxfuseError, GuardError, OptionError, TraceError, UnsupportedError
from .options import Options
from .report import explain
from .runtime import FxfuseWarning, OptimizedModule

__version__ = "0.1.0"
__all__ = ["optimize", "explain", "stats", "Options", "OptimizedModule", "FxfuseError", "TraceError",
           "GuardError", "UnsupportedError", "CodegenError", "OptionError", "FxfuseWarning"]
