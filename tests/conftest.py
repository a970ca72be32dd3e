"""Shared test setup: Triton interpreter on the CPU, a private kernel cache, seeded RNG, the
`cuda` marker, and `assert_matches_eager`, the differential check every model test ends with.

GPU run: TRITON_INTERPRET=0 python -m pytest tests -m cuda
"""
import os
import tempfile

# Both must be set before anything imports triton or fxfuse: the interpreter is chosen when
# @triton.jit functions are defined, and the kernel cache directory is read from the env.
os.environ.setdefault("TRITON_INTERPRET", "1")
_CACHE_DIR = tempfile.mkdtemp(prefix="fxfuse-test-cache-")  # per session: no stale kernels, no pollution
os.environ["FXFUSE_CACHE_DIR"] = _CACHE_DIR

import dataclasses  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import fxfuse  # noqa: E402

# Tests that count kernels of fuse_pointwise turn the fully fused MLP pass off (when this
# checkout has it): that pass would turn a narrow Linear chain into one MLP kernel.
NO_MLP = ({"fused_mlp": "off"} if "fused_mlp" in {f.name for f in dataclasses.fields(fxfuse.Options)}
          else {})


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")   # as Triton reads it


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU with compiled (not interpreted) Triton kernels")
    # numpy's "divide by zero" / "invalid value" from inside the interpreter are expected (inf/nan tests)
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and not interpreting():
        return
    skip = pytest.mark.skip(reason="needs CUDA with compiled Triton kernels (TRITON_INTERPRET unset or 0)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if os.environ.get("FXFUSE_CACHE_DIR") == _CACHE_DIR:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture
def ieee_fp32():
    """fp32 matmuls in IEEE precision (TF32 off) for the test, as the GPU tests compare at 1e-6."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def optimize_strict(model, *example, **options):
    """fxfuse.optimize with strict=True (any fallback is an error); returns the OptimizedModule.
    Several example arguments are passed as a tuple, one as itself."""
    opt = fxfuse.optimize(model, example if len(example) != 1 else example[0], strict=True, **options)
    assert isinstance(opt, fxfuse.OptimizedModule), type(opt).__name__
    return opt


@pytest.fixture
def optimized():
    """`optimized(model, *example, **options)`: the model optimized with strict=True."""
    return optimize_strict


def fresh_like(t):
    """A new random tensor with t's shape, dtype and strides (so it hits t's specialization)."""
    if not isinstance(t, torch.Tensor):
        return t
    # random storage as large as t's, viewed like t: same strides and storage offset, so
    # expanded (stride 0) and sliced inputs stay what they were
    size = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    if t.dtype == torch.bool:
        base = torch.rand(size) > 0.5
    elif t.is_floating_point():
        base = torch.randn(size).to(t.dtype)
    else:
        base = torch.randint(-5, 6, (size,)).to(t.dtype)
    return base.to(t.device).as_strided(t.shape, t.stride(), t.storage_offset())


def _clone(x):
    """A copy with x's strides and storage offset (in-place ops in a model stay local)."""
    if not isinstance(x, torch.Tensor):
        return x
    storage = x.untyped_storage().clone()
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(storage, x.storage_offset(), x.shape, x.stride())


def assert_matches_eager(opt, model, *inputs, rtol=1e-5, atol=1e-5, fresh=True, equal_nan=False):
    """Run opt and model under no_grad on fresh random inputs shaped like `inputs` (or on
    `inputs` themselves with fresh=False) and compare; each side gets its own copy, so
    in-place ops in the model cannot leak from one to the other. Returns opt's output."""
    args = [fresh_like(a) for a in inputs] if fresh else list(inputs)
    with torch.no_grad():
        expected = model(*[_clone(a) for a in args])
        got = opt(*[_clone(a) for a in args])
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=equal_nan)
    return got


def optimized_graph(opt):
    """The rewritten GraphModule of opt's first specialization."""
    assert isinstance(opt, fxfuse.OptimizedModule), f"not optimized: {type(opt).__name__}"
    return next(iter(opt._specializations.values())).gm


def assert_fast_path(opt):
    """The generated kernels ran (no torch-reference fallback) in the calls so far."""
    s = fxfuse.stats(opt)
    assert s["optimized"] and s["kernel_launches"] > 0 and s["reference_fallbacks"] == 0, s
    return s


@pytest.fixture
def kernel_backend(request):
    """For kernel test files (`pytestmark = pytest.mark.usefixtures("kernel_backend")`): tests
    marked cuda run compiled kernels on the GPU, the others CPU tensors under the interpreter;
    each kind skips where its backend is missing."""
    if request.node.get_closest_marker("cuda"):
        if not torch.cuda.is_available() or interpreting():
            pytest.skip("needs CUDA with compiled Triton kernels (TRITON_INTERPRET unset or 0)")
    elif not interpreting():
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")


def assert_refused_and_eager(make, example, later, reason: str = "") -> None:
    """make()'s model is refused with one warning (naming `reason`), and the returned original
    gives eager's values on the later input."""
    import torch
    model = make().eval()
    opt, messages = optimize_warned(model, example())
    assert opt is model and len(messages) == 1 and reason in messages[0]
    args = later()
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))


def optimize_warned(model, x, **options):
    """(fxfuse.optimize's result, the fxfuse warnings it gave)."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, x, **options)
    return opt, [str(w.message) for w in caught if "fxfuse" in str(w.message)]
