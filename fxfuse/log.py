"""Diagnostics go through logging.getLogger("fxfuse"); FXFUSE_LOG=info|debug turns them on.

Nothing is printed unless asked: the logger has a NullHandler and does not propagate a level
of its own unless FXFUSE_LOG is set, in which case a stderr handler is attached once.
"""
import collections
import contextlib
import logging
import os
import sys
import threading
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


_EMITTED: set = set()   # (category, text, file, line) shown after a build: later builds do not show them again


@contextlib.contextmanager
def model_warnings_once():
    """A build runs forward() several times (the trace, shape propagation, verify and its
    probes), and torch.fx's and fxfuse's own catch_warnings blocks reset the "once per place"
    memory: a warning of the model's own (F.softmax without dim, var() of one element) showed 3
    to 15 times where eager shows it once (fuzz37e). The build thread's warnings are recorded and,
    after the build (also a failed one), each shown once per place in the user's code (the run
    that had it there: verify's eager run), through the user's filters, and not again by later
    builds (review37). Other threads' warnings meanwhile are shown as they come."""
    builder, caught, building = threading.get_ident(), [], [True]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            show = warnings.showwarning

            def record(message, category, filename, lineno, file=None, line=None):
                # after the build it passes everything on: another thread's catch_warnings that began during
                # the build and ends after it puts this function back (review37b: later warnings were lost)
                if building[0] and threading.get_ident() == builder:
                    caught.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
                else:
                    show(message, category, filename, lineno, file, line)
            warnings.showwarning = record
            yield
    finally:
        building[0] = False
        _show_once(caught)


def _show_once(caught) -> None:
    places = {}   # (category, text) -> the places it had in the user's code, else its first place
    for w in caught:
        group = places.setdefault((w.category, str(w.message)), {})
        if not _internal(w.filename):
            group.pop(None, None)
            group.setdefault((w.filename, w.lineno), w)
        elif not group:
            group[None] = w
    for (category, text), group in places.items():
        for w in group.values():
            key = (category, text, w.filename, w.lineno)
            if key not in _EMITTED:
                _EMITTED.add(key)
                module = _module_name(w.filename)   # not module=None: Python then drops the warning (a notebook
                named = {"module": module} if module is not None else {}   # cell's, exec'd code's; review37c)
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_registry(module),
                                       source=w.source, **named)


def _registry(module) -> dict:
    """The module's own `__warningregistry__`, which Python's "once per place" reads: shown from
    there, the warning is not shown again by forward()'s next eager run (fuzz45d: it was, under the
    default filter, with registry={})."""
    namespace = getattr(sys.modules.get(module), "__dict__", None) if module is not None else None
    if not isinstance(namespace, dict):
        return {}
    registry = namespace.setdefault("__warningregistry__", {})
    return registry if isinstance(registry, dict) else {}


def _module_name(filename: str) -> str | None:
    """The name of the module loaded from filename ("__main__" for a script): filters that name
    a module, and Python's default DeprecationWarning filter for __main__, match on it."""
    for name, module in list(sys.modules.items()):
        try:
            if getattr(module, "__file__", None) == filename:
                return name
        except Exception:  # noqa: BLE001 -- a lazy module raising on attribute access (review37b)
            continue
    return None


def _internal(filename: str) -> bool:
    """A place in torch, fxfuse or a generated graph, not in the user's code (real package folders:
    a checkout named fxfuse/ holds user code too, as CI's clone does)."""
    return filename.startswith("<eval_with_key>") or inside_packages(filename, ("torch", "fxfuse"))


def inside_packages(filename: str, packages, except_for=()) -> bool:
    """Whether filename lies in one of the installed packages' folders (`fxfuse.passes` included,
    which an editable install maps outside fxfuse/), not in any of `except_for` (subpackages)."""
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    inside = any(path.startswith(folder) for folder in _folders(tuple(packages)))
    return inside and not any(path.startswith(folder) for folder in _folders(tuple(except_for)))


def _folders(packages: tuple) -> tuple:
    """The folders of packages by name; a subpackage not imported yet, under its parent's folder."""
    folders = []
    for name in packages:
        module = sys.modules.get(name)
        paths = list(getattr(module, "__path__", ())) if module is not None else []
        root = sys.modules.get(name.split(".")[0])
        if not paths and root is not None and "." in name:
            paths = [os.path.join(p, *name.split(".")[1:]) for p in getattr(root, "__path__", ())]
        folders += [os.path.join(os.path.realpath(p), "") for p in paths]
        if name == "fxfuse":
            folders += _folders(("fxfuse.passes",))
    return tuple(folders)


class _QuietForThreads:
    """A stream that drops what the quiet threads write and passes the others' writes on."""

    def __init__(self, stream):
        self._stream, self.quiet = stream, set()

    def write(self, text):
        return len(text) if threading.get_ident() in self.quiet else self._stream.write(text)

    def __getattr__(self, name):   # flush, fileno, encoding, isatty: the stream's own
        return getattr(self._stream, name)


# the last few kept alive after use: print() in another thread holds a borrowed reference to sys.stdout
# while it writes, and a wrapper freed when the build put the stream back crashed the process (segfault);
# not all of them: each keeps its stream (a redirect's buffer, pytest's capture) alive (review38c)
_RECENT_WRAPPERS = collections.deque(maxlen=8)


def _wrapper_of(stream) -> _QuietForThreads:
    found = next((w for w in _RECENT_WRAPPERS if w._stream is stream), None)
    if found is None:
        found = _QuietForThreads(stream)
        _RECENT_WRAPPERS.append(found)
    return found


class _DropThread(logging.Filter):
    def __init__(self, thread: int):
        super().__init__()
        self.thread = thread

    def filter(self, record) -> bool:
        return record.thread != self.thread


def _all_handlers() -> list:
    loggers = [logging.root, *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    handlers = [h for lg in loggers for h in lg.handlers] + ([logging.lastResort] if logging.lastResort else [])
    return list(dict.fromkeys(handlers))


@contextlib.contextmanager
def quiet_this_thread(stdout: bool = True, stderr: bool = True, logs: bool = False):
    """What this thread prints to stdout / stderr (and, with logs, logs) goes nowhere while the
    block runs; other threads' output goes where it went. contextlib.redirect_stdout and
    logging.disable are the process's: another thread's prints, logs and tracebacks during a
    build were lost (fuzz38f: 1,200 of 1,690 lines during a torch.export trace)."""
    me, saved = threading.get_ident(), {}
    for name, wanted in (("stdout", stdout), ("stderr", stderr)):
        stream = getattr(sys, name)
        if wanted and stream is not None:
            wrapper = _wrapper_of(stream)
            wrapper.quiet.add(me)
            saved[name] = (stream, wrapper)
            setattr(sys, name, wrapper)
    drop = _DropThread(me) if logs else None
    handlers = _all_handlers() if logs else []
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)
        for name, (stream, wrapper) in saved.items():
            wrapper.quiet.discard(me)
            if getattr(sys, name) is wrapper:   # not another thread's redirect made meanwhile (review38c)
                setattr(sys, name, stream)
