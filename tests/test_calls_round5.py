"""Fuzzing, fifth round (CPU): how an optimized module is called. Each test is a finding that
gave a wrong answer, corrupted state, a spurious warning or a crash before its fix."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import threading  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402


def no_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


class Reduce(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, dims=(1,), shape=None, scale=2.0):
        h = torch.relu(self.lin(x)) * scale
        h = h.sum(dims)
        return h if shape is None else h.reshape(shape)


@pytest.mark.parametrize("example", [((0,),), ([0], [2, 4]), ((0, 1), None, 0.5), ((1,), (2, 2))])
def test_container_arguments_are_specialized_on(example):
    """Fuzz: a tuple, list or dict argument made torch.fx generate code that does not compile
    (`x, dims_1 = (1,), = ...`), so the model always fell back, although the README lists such
    values as supported."""
    model, x = Reduce().eval(), torch.randn(4, 8)
    opt = no_warnings(fxfuse.optimize, model, (x, *example), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        for args in (example, ((1,),), ([0, 1],), ((0,), (2, 4)), ()):
            y = torch.randn(4, 8)
            torch.testing.assert_close(opt(y, *args), model(y, *args))
    assert fxfuse.stats(opt)["reference_fallbacks"] == 0 and not opt._original_calls


def test_dict_argument_and_dict_default():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x, cfg={"scale": 3.0, "act": "relu"}):   # noqa: B006 -- the case under test
            h = self.lin(x) * cfg["scale"]
            return torch.relu(h) if cfg["act"] == "relu" else torch.tanh(h)

    model, x = Scaled().eval(), torch.randn(3, 6)
    opt = no_warnings(fxfuse.optimize, model, (x, {"scale": 0.5, "act": "tanh"}), strict=True)
    with torch.no_grad():
        for cfg in ({"scale": 0.5, "act": "tanh"}, {"scale": 2.0, "act": "relu"}):
            torch.testing.assert_close(opt(x, cfg), model(x, cfg))
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["specializations"] == 3


def test_none_default_used_as_an_index():
    """Fuzz: with tensor-only examples the defaults were traced as proxies: `idx is None` was
    false and the graph indexed with None (verify caught the shape and blamed fxfuse)."""
    class Pick(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, idx=None):
            h = torch.relu(self.lin(x))
            return h if idx is None else h[idx]

    model = Pick().eval()
    opt = no_warnings(fxfuse.optimize, model, torch.randn(4, 8), strict=True)
    with torch.no_grad():
        x = torch.randn(5, 8)
        torch.testing.assert_close(opt(x), model(x))
        torch.testing.assert_close(opt(x, 2), model(x, 2))
        torch.testing.assert_close(opt(x, idx=slice(1, 3)), model(x, idx=slice(1, 3)))
    assert fxfuse.stats(opt)["specializations"] == 4 and fxfuse.stats(opt)["fused_kernels"] >= 1   # (4, 8) and three at (5, 8)


@pytest.mark.parametrize("strict", [False, True])
def test_keywords_that_do_not_bind_raise_eagers_type_error(strict):
    """Fuzz: an unknown keyword (or a parameter given twice) gave a warning and then eager's
    TypeError, and under strict=True a GuardError instead of it."""
    model, x = Reduce().eval(), torch.randn(3, 8)
    opt = fxfuse.optimize(model, x, strict=strict)
    for call in (lambda f: f(x, dimz=(0,)), lambda f: f(x, (0,), dims=(1,)), lambda f: f(inp=x)):
        with pytest.raises(TypeError) as eager:
            call(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(TypeError) as got:
                call(opt)
        assert str(got.value) == str(eager.value)
    assert not opt._original_calls


def test_functional_call_leaves_the_model_as_it_was():
    """Fuzz: each specialization was a child module sharing the original's submodules, so every
    parameter had two names; torch.func.functional_call took them for tied weights and left its
    temporary tensors in the model (no longer Parameters) after the call."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    opt = fxfuse.optimize(model, x)
    temporary = {"original." + k: torch.randn_like(v) for k, v in before.items()}
    with torch.no_grad():
        torch.func.functional_call(opt, temporary, (x,))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert [n for n, _ in opt.named_parameters(remove_duplicate=False)] == ["original." + k for k in before]
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_threads_respect_max_specializations():
    """Fuzz: four threads missing at once built past max_specializations=2, one shape twice
    (the lookup and the limit were checked outside the build lock)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 8), max_specializations=2, use_kernels=False)
    barrier, results = threading.Barrier(4), {}

    def worker(x):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            barrier.wait()
            for _ in range(3):   # calls on a built graph while another thread builds (torch.fx's patch)
                results[x.shape[0]] = opt(x)

    inputs = [torch.randn(b, 8) for b in (4, 5, 6, 7)]
    threads = [threading.Thread(target=worker, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opt._specializations) == 2
    with torch.no_grad():
        for x in inputs:
            torch.testing.assert_close(results[x.shape[0]], model(x))


def test_threads_share_the_interpreter():
    """Fuzz: under TRITON_INTERPRET=1, kernels launched from two threads at once failed inside
    Triton's interpreter ("Did you forget to add @triton.jit ?"); launches now take turns."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh()).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    x, errors = torch.randn(3, 8), []
    want = model(x).detach()

    def worker():
        try:
            with torch.no_grad():
                for _ in range(3):
                    torch.testing.assert_close(opt(x), want)
        except Exception as e:  # noqa: BLE001 -- collected for the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_sparse_input_runs_the_original_with_one_warning():
    """Fuzz: a sparse CSR input crashed in the guard (it has no strides); eager accepts it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 8))
    x = torch.randn(3, 8).relu().to_sparse_csr()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_again = opt(x), opt(x)
    torch.testing.assert_close(got, model(x))
    torch.testing.assert_close(got_again, got)
    assert len(caught) == 1 and "sparse_csr" in str(caught[0].message)


def test_a_list_argument_is_described_without_its_values():
    """Fuzz: the guard's message read "input 0: expected False, got [tensor([1.0057, ...])]"."""
    class Sum(nn.Module):
        def forward(self, xs):
            return torch.relu(xs[0] + xs[1])

    opt = fxfuse.optimize(Sum().eval(), torch.randn(2, 3))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt([torch.randn(3), torch.randn(3)])
    message = str(caught[0].message)
    assert "where the specialization has a tensor (2, 3) torch.float32" in message and "tensor([" not in message


CONFIG = {"scale": 2.0}


class ReadsDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cfg=CONFIG):
        return torch.relu(self.lin(x)) * cfg["scale"]


def test_a_changed_dict_default_rebuilds():
    """Fuzz: a dict default changed by the caller after optimize kept its old contents in the graph."""
    model, x = ReadsDefault().eval(), torch.randn(2, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    try:
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
            CONFIG["scale"] = 5.0
            torch.testing.assert_close(opt(x), model(x))
        stats = fxfuse.stats(opt)   # rebuilt once, and the calls ran the graph
        assert stats["specializations"] == 1 and stats["fused_kernels"] >= 1 and not opt._original_calls
        assert opt._specializations[next(iter(opt._specializations))].calls == 1
    finally:
        CONFIG["scale"] = 2.0


def test_forwards_torch_fx_would_trace_as_something_else():
    """Fuzz: a forward set on the instance, or a decorator with defaults of its own, was traced as
    the class's (or the wrapped function's) forward; verify caught it and blamed fxfuse."""
    import functools

    class OnInstance(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.forward = self.other

        def forward(self, x):
            return self.lin(x)

        def other(self, x):
            return torch.tanh(self.lin(x))

    def own_default(f):
        @functools.wraps(f)
        def wrapper(self, x, k=5.0):
            return f(self, x, k)
        return wrapper

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @own_default
        def forward(self, x, k=3.0):
            return torch.relu(self.lin(x)) * k

    for model in (OnInstance().eval(), Wrapped().eval()):
        opt = no_warnings(fxfuse.optimize, model, torch.randn(2, 8), verify=False)
        assert isinstance(opt, fxfuse.OptimizedModule)
        with torch.no_grad():
            x = torch.randn(3, 8)
            torch.testing.assert_close(opt(x), model(x))
        assert not opt._original_calls and fxfuse.stats(opt)["specializations"] == 2


def test_keywords_past_defaults_that_are_not_constants():
    """Fuzz: opt(x, scale=2.0) past `act=F.relu` filled the function in as an example argument and
    warned about an argument the caller never passed; keyword-only parameters ruled out
    non-tensor example arguments; each keyword set warned again."""
    class Act(nn.Module):
        def forward(self, x, act=torch.relu, scale=1.0):
            return act(x) * scale

    class KeywordOnly(nn.Module):
        def forward(self, x, k=2, *, a=1.0, b=2.0):
            return torch.tanh(x) * k * a * b

    x = torch.randn(2, 8)
    opt = fxfuse.optimize(Act().eval(), x)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(opt(x, scale=2.0), torch.relu(x) * 2.0)
    assert len(caught) == 1 and "not a plain value" in str(caught[0].message)
    model = KeywordOnly().eval()
    assert isinstance(no_warnings(fxfuse.optimize, model, (x, 3), strict=True), fxfuse.OptimizedModule)
    opt = fxfuse.optimize(model, (x, 3))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kwargs in ({"a": 3.0}, {"b": 3.0}, {"a": 3.0, "b": 4.0}):
            torch.testing.assert_close(opt(x, 3, **kwargs), model(x, 3, **kwargs))
        torch.testing.assert_close(opt(x, 4), model(x, 4))
    assert len(caught) == 1   # one cause, one warning
    assert fxfuse.stats(opt)["specializations"] == 2 and fxfuse.stats(opt)["fused_kernels"] >= 1   # (x, 3), (x, 4)


def test_api_misuse_gets_the_users_error():
    """Fuzz (API round): a ScriptModule and an example that does not fit forward() were reported
    as "internal error" (or, with verify=False, built a specialization no call can match); a
    calibration path with a NUL byte dropped the whole optimization; explain(None) claimed
    optimize had fallen back."""
    model, x = nn.Sequential(nn.Linear(8, 16), nn.GELU()).eval(), torch.randn(2, 8)
    with pytest.raises(fxfuse.UnsupportedError, match="TorchScript"):
        fxfuse.optimize(torch.jit.script(model), x)
    for verify in (True, False):
        with pytest.raises(fxfuse.UnsupportedError, match=r"does not fit Sequential.forward\(input\)"):
            fxfuse.optimize(model, (x, x), strict=True, verify=verify)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, x, calibration="cal\0.json")
    assert isinstance(opt, fxfuse.OptimizedModule) and len(caught) == 1 and "cal" in str(caught[0].message)
    with pytest.raises(TypeError, match="takes what fxfuse.optimize returned"):
        fxfuse.explain(None)
    assert "not optimized by fxfuse (not an OptimizedModule)" in fxfuse.explain(model)


def test_use_kernels_true_without_a_way_to_run_them_warns(monkeypatch):
    """Fuzz (API round): use_kernels=True on a CPU without the interpreter ran the torch
    reference silently; it now warns once, as the default does."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, x = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval(), torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, x, use_kernels=True)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
    assert len(caught) == 1 and "torch reference" in str(caught[0].message)
