"""A disk cache for generated Triton source modules.

Triton's @jit reads a kernel's source back with inspect.getsource, so a generated kernel must
live in a real file and be imported from it; exec() of a string is not enough. Keeping those
files across processes also lets a warm start skip code generation. Each entry is named by a
hash of its source and of the versions that shaped it, so stale entries are never reused.
"""
import atexit
import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import linecache
import logging
import os
import pathlib
import shutil
import stat
import sys
import tempfile
import threading

import torch
import triton

from .errors import CodegenError

logger = logging.getLogger("fxfuse")

_HEADER = "# fxfuse kernel cache entry; sha256 of the rest of this file: "


@functools.lru_cache(maxsize=None)
def _fxfuse_version() -> str:
    try:
        return importlib.metadata.version("fxfuse")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+src"  # running from a source checkout


def source_key(source: str) -> str:
    """Name of the cache entry for `source`. The versions are part of it because the same text
    can compile differently (or mean something else) under another fxfuse, torch, triton or Python."""
    h = hashlib.sha256(source.encode("utf-8"))
    for part in (_fxfuse_version(), torch.__version__, triton.__version__, sys.version.split()[0]):
        h.update(b"\0" + str(part).encode("utf-8"))
    return h.hexdigest()[:24]  # 96 bits: collisions are not a concern, paths stay short


def _render(source: str) -> str:
    """The file text: a header holding the sha256 of the body, so truncation is detectable."""
    return f"{_HEADER}{hashlib.sha256(source.encode('utf-8')).hexdigest()}\n{source}"


def _problem(data: bytes, source: str) -> str | None:
    """Why the file contents `data` are not a good entry for `source`, or None if they are."""
    header, _, body = data.decode("utf-8", "replace").partition("\n")  # bad bytes fail the hash
    if not header.startswith(_HEADER):
        return "empty or missing header"
    if hashlib.sha256(body.encode("utf-8")).hexdigest() != header[len(_HEADER):]:
        return "hash mismatch (truncated or corrupt)"
    if body != source:
        return "holds a different source (key collision)"
    return None


class _VerifiedLoader(importlib.machinery.SourceFileLoader):
    """Executes exactly the text that was verified, and skips __pycache__: a .pyc is keyed on
    mtime and size, which a same-size rewrite within one second would not change."""

    def __init__(self, fullname: str, path: str, text: str):
        super().__init__(fullname, path)
        self._text = text

    def get_code(self, fullname):
        return compile(self._text, self.path, "exec", dont_inherit=True)


def _default_directory() -> pathlib.Path:
    if os.environ.get("FXFUSE_CACHE_DIR"):
        return pathlib.Path(os.environ["FXFUSE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return pathlib.Path(xdg).expanduser() / "fxfuse"


class KernelCache:
    """Source text -> imported kernel module, kept on disk and, once loaded, in this process."""

    def __init__(self, directory: str | os.PathLike | None = None):
        path = pathlib.Path(directory).expanduser() if directory is not None else _default_directory()
        try:
            path.mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(f"{path} is not writable")
        except OSError as e:
            # A read-only home or a full disk should cost warm starts, not the compile.
            fallback = _private_directory()
            logger.warning("kernel cache %s unusable (%s); using %s for this process", path, e, fallback)
            path = fallback
        self.directory = path
        self._modules = {}  # key -> module: a repeated load does no disk I/O

    def path_for(self, source: str) -> pathlib.Path:
        return self._path(source_key(source))

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / key[:2] / f"fxk_{key}.py"  # fan out so no directory grows huge

    def load(self, source: str, kernel_name: str):
        """Return the object named kernel_name (a @triton.jit function) from the Python module whose text is `source`."""
        key = source_key(source)
        module = self._modules.get(key)
        if module is None:
            module = self._modules.setdefault(key, self._load_module(key, source))
        kernel = getattr(module, kernel_name, None)
        if kernel is None:
            raise CodegenError(f"generated module {self._path(key)} defines no {kernel_name!r} (codegen bug)")
        return kernel

    def _load_module(self, key: str, source: str):
        path = self._path(key)
        text = _render(source)
        try:
            if not stat.S_ISREG(path.stat().st_mode):   # a FIFO or a device would block the read
                raise OSError("not a regular file")
            problem = _problem(path.read_bytes(), source)
        except OSError as e:
            problem = "missing" if isinstance(e, FileNotFoundError) else f"unreadable ({e})"
        if problem is None:
            try:
                logger.debug("kernel cache hit %s", path)
                return self._import(key, path, text)
            except Exception as e:  # e.g. written by an incompatible setup: rebuild it
                problem = f"failed to import ({type(e).__name__}: {e})"
        log = logger.debug if problem == "missing" else logger.warning
        log("kernel cache entry %s %s; writing it", path, problem)
        try:
            self._write(path, text)
        except OSError as e:   # the directory became unwritable, another user's folder, a directory
            private = _private_directory() / path.parent.name / path.name   # at the entry's path:
            logger.warning("kernel cache entry %s cannot be written (%s); using %s", path, e, private)
            path = private                              # this process's own copy
            self._write(path, text)
        try:
            return self._import(key, path, text)
        except Exception as e:
            raise CodegenError(f"generated module {path} failed to import: {type(e).__name__}: {e}") from e

    @staticmethod
    def _write(path: pathlib.Path, text: str) -> None:
        """Atomic: readers (other processes included) see the old file or the whole new one.
        Concurrent writers of one key write identical text, so whichever replace wins is fine."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(OSError):   # a filesystem without POSIX modes: the entry as it is
                os.chmod(tmp, 0o644)   # mkstemp's 0600 would hide the entry from other users of the cache
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        linecache.checkcache(str(path))  # drop lines cached from a previous, corrupt version

    @staticmethod
    def _import(key: str, path: pathlib.Path, text: str):
        name = f"_fxfuse_kernel_{key}"
        spec = importlib.util.spec_from_file_location(name, path, loader=_VerifiedLoader(name, str(path), text))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # so inspect.getmodule and pickling find it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module


@functools.lru_cache(maxsize=None)
def _private_directory() -> pathlib.Path:
    """One temporary directory per process for entries the cache directory cannot take,
    removed when the process exits."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="fxfuse-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


_caches = {}
_caches_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache for the current FXFUSE_CACHE_DIR (re-read each call)."""
    directory = _default_directory().resolve()
    with _caches_lock:
        if directory not in _caches:
            _caches[directory] = KernelCache(directory)
        return _caches[directory]
