"""Diagnostics go through logging.getLogger("fxfuse"); FXFUSE_LOG=info|debug turns them on.

Nothing is printed unless asked: the logger has a NullHandler and does not propagate a level
of its own unless FXFUSE_LOG is set, in which case a stderr handler is attached once.
"""
import contextlib
import logging
import os
import warnings

from .env import FALSE_WORDS, TRUE_WORDS

logger = logging.getLogger("fxfuse")
logger.addHandler(logging.NullHandler())

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_level = os.environ.get("FXFUSE_LOG", "").strip().upper()
if _level.lower() in TRUE_WORDS:
    _level = "INFO"
elif _level and _level not in LEVELS and _level.lower() not in FALSE_WORDS:
    warnings.warn(f"FXFUSE_LOG={os.environ['FXFUSE_LOG']!r} is none of debug, info, warning, error, critical (or 1/0): "
                  "fxfuse logs nothing", stacklevel=2)
if _level in LEVELS:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[fxfuse %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(_level)


_BUILD_WARNINGS = {}   # warn_explicit's registry for warnings a build passes on ("default": once per place)


@contextlib.contextmanager
def warnings_once():
    """A build runs forward() several times (the trace, verify, the grad and mode probes), and
    each run raised forward()'s warnings again: 6 copies of a model's own warning, 12 of
    torch's std() warning on an empty batch (fuzz31c). Inside, warnings are recorded; on the
    way out each distinct one (text and category) is issued once, through the caller's filters
    ("error" raises it then, "ignore" drops it)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield   # (a build that fails passes nothing on: the caller then runs the original, which warns)
    distinct = {}
    for w in seen:   # the first place each was raised (the trace's, eager's and the graph's runs differ)
        distinct.setdefault((str(w.message), w.category), w)
    for w in distinct.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_BUILD_WARNINGS)
