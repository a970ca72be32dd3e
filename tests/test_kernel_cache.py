"""Tests of the on-disk kernel cache: loading, reuse in and across processes, corruption, races."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import inspect
import linecache
import logging
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import triton

from fxfuse import kernel_cache
from fxfuse.errors import CodegenError
from fxfuse.kernel_cache import KernelCache, default_cache, source_key

REPO = pathlib.Path(__file__).resolve().parents[1]
N, BLOCK = 37, 64
# Under the interpreter kernels take CPU tensors; with TRITON_INTERPRET=0 (a GPU run) use CUDA.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

KERNEL_SRC = '''\
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)
'''

# Run in a child process: load KERNEL_SRC (read from argv[1]) through default_cache() and check
# the result. With argv[2:] = (ready_file, go_file) it first signals readiness and waits for "go",
# so that two children reach load() at the same moment.
CHILD = '''
import os, sys, time, pathlib
import torch
from fxfuse.kernel_cache import default_cache
src = pathlib.Path(sys.argv[1]).read_text()
if len(sys.argv) > 2:
    pathlib.Path(sys.argv[2]).touch()
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[3]):
        assert time.monotonic() < deadline, "no go signal"
        time.sleep(0.005)
kernel = default_cache().load(src, "add_kernel")
dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
x, y, out = (torch.randn(37, device=dev), torch.randn(37, device=dev), torch.empty(37, device=dev))
kernel[(1,)](x, y, out, 37, BLOCK=64)
assert torch.allclose(out, x + y), (out, x + y)
'''


def _check_kernel(kernel):
    x, y = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    out = torch.full((N,), float("nan"), device=DEVICE)
    kernel[(triton.cdiv(N, BLOCK),)](x, y, out, N, BLOCK=BLOCK)
    torch.testing.assert_close(out, x + y)


def _child(cache_dir, src_file, *args):
    env = dict(os.environ, FXFUSE_CACHE_DIR=str(cache_dir))  # TRITON_INTERPRET is inherited
    cmd = [sys.executable, "-c", CHILD, str(src_file), *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _assert_valid_entry(path):
    assert path.read_text() == kernel_cache._render(KERNEL_SRC)
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"], "temp file left behind"


def test_load_computes_and_file_is_real(tmp_path):
    cache = KernelCache(tmp_path)
    kernel = cache.load(KERNEL_SRC, "add_kernel")
    _check_kernel(kernel)
    path = cache.path_for(KERNEL_SRC)
    assert path.parent.parent == tmp_path and path.name == f"fxk_{source_key(KERNEL_SRC)}.py"
    _assert_valid_entry(path)
    # Triton needs the source back via inspect/linecache, from the real file.
    assert "def add_kernel" in inspect.getsource(kernel.fn)
    assert inspect.getsourcefile(kernel.fn) == str(path)
    assert linecache.getline(str(path), 1).startswith("# fxfuse kernel cache entry")


def test_second_load_is_from_memory(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path)
    first = cache.load(KERNEL_SRC, "add_kernel")
    stat = cache.path_for(KERNEL_SRC).stat()

    def no_disk(*args, **kwargs):
        raise AssertionError("second load touched the disk")

    monkeypatch.setattr(KernelCache, "_load_module", no_disk)
    monkeypatch.setattr(KernelCache, "_write", no_disk)
    assert cache.load(KERNEL_SRC, "add_kernel") is first
    after = cache.path_for(KERNEL_SRC).stat()
    assert (after.st_mtime_ns, after.st_ino) == (stat.st_mtime_ns, stat.st_ino)


def test_missing_kernel_name_is_codegen_error(tmp_path):
    cache = KernelCache(tmp_path)
    with pytest.raises(CodegenError, match=r"fxk_\w+\.py defines no 'no_such_kernel'"):
        cache.load(KERNEL_SRC, "no_such_kernel")


def test_other_process_reuses_file(tmp_path):
    cache_dir, src_file = tmp_path / "cache", tmp_path / "kernel_src.txt"
    src_file.write_text(KERNEL_SRC)
    path = KernelCache(cache_dir).path_for(KERNEL_SRC)
    KernelCache(cache_dir).load(KERNEL_SRC, "add_kernel")
    before = path.stat()
    proc = _child(cache_dir, src_file)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    after = path.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage", "other_source"])
def test_corrupt_entry_is_rebuilt(tmp_path, damage, caplog):
    KernelCache(tmp_path).load(KERNEL_SRC, "add_kernel")
    path = KernelCache(tmp_path).path_for(KERNEL_SRC)
    text = path.read_bytes()
    path.write_bytes({
        "truncate": text[: len(text) // 2],
        "empty": b"",
        "garbage": b"\xff\xfe\x00 not python at all (((",
        # A well-formed entry (header hash matches) for some other source.
        "other_source": kernel_cache._render("x = 1\n").encode(),
    }[damage])
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        kernel = KernelCache(tmp_path).load(KERNEL_SRC, "add_kernel")
    _check_kernel(kernel)
    _assert_valid_entry(path)
    assert any(r.levelno == logging.WARNING and str(path) in r.getMessage() for r in caplog.records)


def test_two_processes_race_on_new_source(tmp_path):
    cache_dir, src_file, go = tmp_path / "cache", tmp_path / "kernel_src.txt", tmp_path / "go"
    src_file.write_text(KERNEL_SRC)
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [_child(cache_dir, src_file, r, go) for r in ready]
    deadline = time.monotonic() + 90
    while not all(r.exists() for r in ready) and all(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "children never got ready"
        time.sleep(0.01)
    go.touch()
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    _assert_valid_entry(KernelCache(cache_dir).path_for(KERNEL_SRC))


def test_default_cache_honors_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "a"))
    a = default_cache()
    assert a.directory == tmp_path / "a" and default_cache() is a
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "b"))
    b = default_cache()
    assert b is not a and b.directory == tmp_path / "b"
    _check_kernel(b.load(KERNEL_SRC, "add_kernel"))
    assert b.path_for(KERNEL_SRC).is_relative_to(tmp_path / "b")
    monkeypatch.delenv("FXFUSE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache().directory == tmp_path / "xdg" / "fxfuse"


def test_unwritable_directory_falls_back_to_temp(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # keep the fallback dir inside tmp_path
    kernel_cache._private_directory.cache_clear()
    monkeypatch.setattr(kernel_cache.os, "access", lambda *a, **k: False)
    with caplog.at_level(logging.WARNING, logger="fxfuse"):
        cache = KernelCache(tmp_path / "ro")
    assert cache.directory != tmp_path / "ro" and cache.directory.name.startswith("fxfuse-")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert cache.directory.parent == tmp_path
    monkeypatch.undo()
    _check_kernel(cache.load(KERNEL_SRC, "add_kernel"))


@pytest.mark.parametrize("blocker", ["fifo", "directory", "unwritable"])
def test_an_entry_that_cannot_be_read_or_written_goes_to_a_private_copy(tmp_path, monkeypatch, blocker):
    """A FIFO at the entry's path blocked the read forever; a directory there, or a folder that
    became unwritable (another user's, a full disk), raised from the kernel's first call."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    kernel_cache._private_directory.cache_clear()
    cache = KernelCache(tmp_path / "cache")
    path = cache.path_for(KERNEL_SRC)
    path.parent.mkdir(parents=True)
    if blocker == "fifo":
        os.mkfifo(path)
    elif blocker == "directory":
        path.mkdir()
    else:
        write = KernelCache._write

        def refuse_the_cache(target, text):
            if target.is_relative_to(tmp_path / "cache"):
                raise PermissionError(13, "Permission denied", str(target))
            write(target, text)
        monkeypatch.setattr(KernelCache, "_write", staticmethod(refuse_the_cache))
    _check_kernel(cache.load(KERNEL_SRC, "add_kernel"))
    if blocker == "fifo":   # replaced by the entry
        _assert_valid_entry(path)
    else:
        assert any((tmp_path / "tmp").rglob(path.name))


def test_entries_are_readable_by_other_users_of_the_cache(tmp_path):
    cache = KernelCache(tmp_path)
    cache.load(KERNEL_SRC, "add_kernel")
    assert cache.path_for(KERNEL_SRC).stat().st_mode & 0o777 == 0o644


def test_key_depends_on_source_and_versions(monkeypatch):
    key = source_key(KERNEL_SRC)
    assert len(key) == 24 and int(key, 16) >= 0
    assert source_key(KERNEL_SRC) == key
    assert source_key(KERNEL_SRC + "\n") != key
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    torch_key = source_key(KERNEL_SRC)
    monkeypatch.setattr(triton, "__version__", "0.0.1-other")
    triton_key = source_key(KERNEL_SRC)
    monkeypatch.setattr(kernel_cache, "_fxfuse_version", lambda: "9.9.9")
    fxfuse_key = source_key(KERNEL_SRC)
    assert len({key, torch_key, triton_key, fxfuse_key}) == 4
