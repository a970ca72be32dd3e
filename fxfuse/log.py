"""Diagnostics go through logging.getLogger("fxfuse"); FXFUSE_LOG=info|debug turns them on.

Nothing is printed unless asked: the logger has a NullHandler and does not propagate a level
of its own unless FXFUSE_LOG is set, in which case a stderr handler is attached once.
"""
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
