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


_SHOWN: dict = {}   # the registry of warnings shown again after a build: "default" shows each place once


@contextlib.contextmanager
def model_warnings_once():
    """A build runs forward() several times (the trace, shape propagation, verify and its
    probes), and torch.fx's and fxfuse's own catch_warnings blocks reset the "once per place"
    memory: a warning of the model's own (F.softmax without dim, var() of one element) showed 3
    to 15 times where eager shows it once (fuzz37e). Each distinct warning is recorded and shown
    once, at its first place, through the user's filters, after the build (also a failed one)."""
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        places = {}   # each warning at its place in the user's code where one run had it (verify's eager run)
        for w in caught:
            key = (type(w.message), str(w.message))
            if key not in places or _internal(places[key].filename) and not _internal(w.filename):
                places[key] = w
        for w in places.values():
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_SHOWN, source=w.source)


def _internal(filename: str) -> bool:
    path = filename.replace("\\", "/")
    return path.startswith("<eval_with_key>") or "/torch/" in path or "/fxfuse/" in path
