"""Stop 43: a traced size used as a set member or dict key, and the module attributes torch.export
put back as copies."""
import functools

import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict
from test_join_outputs import Wrap as Direct   # forward(x) = fn(x)


class SizeLookup(nn.Module):
    """Branches on a set membership and scales by a dict entry, both keyed by the batch size."""

    def __init__(self, how):
        super().__init__()
        self.lin, self.how = nn.Linear(8, 8), how
        self.sizes, self.table = {4, 6}, {4: 2.0}

    def forward(self, x):
        n = x.shape[0]
        if self.how == "set" and n in self.sizes:
            x = x * 3
        scale = self.table.get(n, 1.0) if self.how == "get" else self.table[n] if n in self.table else 0.5
        return torch.relu(self.lin(x)) * scale - 1


@functools.lru_cache(maxsize=4)
def _inverse(n):
    return 1.0 / n


class CachedScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * _inverse(x.shape[0]) - 1


@pytest.mark.parametrize("how", ["set", "get", "in dict"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_size_looked_up_in_a_set_or_dict_follows_the_input(how, verify):
    """A Proxy hashes by identity: `x.shape[0] in self.sizes` was False and `.get(n, 1.0)` the
    default for every input, so with verify=False the graph computed the miss's way, silently
    (4.8 off at batch 4); with verify on the model fell back."""
    model = SizeLookup(how).eval()
    opt = optimize_strict(model, torch.randn(4, 8), verify=verify)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    assert_matches_eager(opt, model, torch.randn(4, 8))
    assert_matches_eager(opt, model, torch.randn(5, 8))   # another specialization, the other way


def test_a_size_keyed_lru_cache_still_traces():
    model = CachedScale().eval()
    opt = optimize_strict(model, torch.randn(4, 8))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    assert_matches_eager(opt, model, torch.randn(4, 8))
    assert_matches_eager(opt, model, torch.randn(3, 8))


SHARED = {"scale": 2.0}


class SharedConfig(nn.Module):
    """Holds a dict shared with other code and a cache dict; its isinstance() check sends the trace
    to torch.export, which puts every module attribute back from a pytree copy."""

    def __init__(self):
        super().__init__()
        self.lin, self.cfg, self.cache, self.nested = nn.Linear(8, 8), SHARED, {}, ([1], {"k": [2]})

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            x = x + 1
        t = x.shape[1]
        if t not in self.cache:
            self.cache[t] = torch.full((t,), 0.5)
        return torch.relu(self.lin(x)) * self.cfg["scale"] + self.cache[t]


def test_torch_export_leaves_the_models_own_containers_in_place():
    """After optimize the model held copies: SHARED's later edits did not reach the eager model
    (its output off by 1.0), and the cache memo filled by verify's eager run was another dict than
    the one fxfuse watched, so the model was refused as changing its state."""
    model = SharedConfig().eval()
    nested, cache = model.nested, model.cache
    opt = optimize_strict(model, torch.randn(3, 8))
    assert "torch.export" in fxfuse.explain(opt)
    assert model.cfg is SHARED and model.nested is nested and model.cache is cache
    assert model.nested[1]["k"] == [2] and all(not isinstance(v, torch.Tensor) or type(v) is torch.Tensor
                                               for v in cache.values())
    try:
        SHARED["scale"] = 3.0
        out = assert_matches_eager(opt, model, torch.randn(3, 8))
        x = torch.randn(3, 8)
        with torch.no_grad():
            torch.testing.assert_close(model(x), torch.relu(model.lin(x + 1)) * 3.0 + 0.5)
        assert out.shape == (3, 8)
    finally:
        SHARED["scale"] = 2.0


class DtypeLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scaled, self.by_device = nn.Linear(8, 8), {torch.float32}, {"cpu": 2.0, "cuda": 2.0}

    def forward(self, x):
        if x.dtype in self.scaled:
            x = x * 3
        return torch.relu(self.lin(x)) * self.by_device.get(x.device.type, 1.0) - 1


@pytest.mark.parametrize("verify", [True, False])
def test_a_dtype_or_device_looked_up_in_a_set_or_dict_follows_the_input(verify):
    """`x.dtype in self.scaled` missed for every dtype (3.1 off with verify=False)."""
    model = DtypeLookup().eval()
    opt = optimize_strict(model, torch.randn(4, 8), verify=verify)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    assert_matches_eager(opt, model, torch.randn(4, 8))


class Scratch(nn.Module):
    """Writes a scratch tensor and resets it within one call (a buffer or a plain attribute)."""

    def __init__(self, as_buffer):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        if as_buffer:
            self.register_buffer("scratch", torch.zeros(4, 8))
        else:
            self.scratch = torch.zeros(4, 8)

    def forward(self, x):
        self.scratch.zero_()
        self.scratch[:, 2:] = torch.relu(self.lin(x))[:, 2:]
        u = self.scratch * 3
        self.scratch.zero_()
        return u


@pytest.mark.parametrize("as_buffer", [True, False])
@pytest.mark.parametrize("verify", [True, False])
def test_a_scratch_tensor_written_and_reset_is_optimized_and_left_as_it_was(as_buffer, verify):
    """review43c: a plain-attribute scratch was refused (with verify on as "100 % off ... a bug in
    fxfuse": symbolic_trace ran the reset once and folded `scratch * 3` into a constant); a buffer
    one was left requiring grad, with a grad_fn into verify's grad probe, so the frozen model's
    eager outputs required grad and copy.deepcopy(model) raised."""
    import copy
    model = Scratch(as_buffer).eval().requires_grad_(False)
    opt = optimize_strict(model, torch.randn(4, 8), verify=verify)
    assert not model.scratch.requires_grad and model.scratch.grad_fn is None
    assert not model(torch.randn(4, 8)).requires_grad
    copy.deepcopy(model)
    for _ in range(2):
        assert_matches_eager(opt, model, torch.randn(4, 8))
    assert torch.count_nonzero(model.scratch) == 0


class SizeBranch(nn.Module):   # symbolic_trace cannot branch on a size; torch.export can
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return torch.relu(h) * 2 + 1 if x.shape[0] > 2 else torch.sigmoid(h)


def test_a_model_made_under_inference_mode_that_only_export_traces():
    """review43c: "internal error (Inference tensors do not track version counter)" from the
    parameters' versions taken before torch.export's trace."""
    with torch.inference_mode():   # (outside it, torch.export itself refuses such parameters)
        model = SizeBranch().eval()
        opt = optimize_strict(model, torch.randn(4, 8))
    assert "torch.export" in fxfuse.explain(opt)
    with torch.inference_mode():
        assert_matches_eager(opt, model, torch.randn(4, 8))


def test_a_call_under_a_meta_default_device_runs_as_eager():
    """review43c: under `with torch.device("meta")` the rebuild's fp32 rounding of a number
    literal made its tensor on the meta device and failed (`.item()`), warning of a model change."""
    import warnings
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Direct(lambda h: h * 0.5 + 1.0), nn.Linear(16, 8),
                          nn.Sigmoid()).eval()
    opt = optimize_strict(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.device("meta"), torch.no_grad():
            got = opt(x)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))


class TypeName(nn.Module):   # apex-style string type test
    def forward(self, x):
        return torch.relu(x) * (0.5 if x.type() in {"torch.FloatTensor", "torch.cuda.FloatTensor"} else 2.0)


class RealDtype(nn.Module):
    SCALE = {torch.float32: 0.5}

    def forward(self, x):
        return torch.relu(x) * self.SCALE.get(x.dtype.to_real(), 2.0)


class ShapeIndex(nn.Module):
    def forward(self, x):
        return torch.relu(x) * (3.0 if x.shape.index(4) in {1} else 1.0)


@pytest.mark.parametrize("make", [TypeName, RealDtype, ShapeIndex])
@pytest.mark.parametrize("verify", [True, False])
def test_a_type_name_or_a_methods_answer_looked_up_in_a_set_or_dict(make, verify):
    """review43f: x.type(), x.dtype.to_real(), x.shape.index(...) looked up missed every key, and
    verify's fp64 run took the same miss (type names and dtypes differ there)."""
    model = make().eval()
    opt = optimize_strict(model, torch.randn(3, 4), verify=verify)
    assert_matches_eager(opt, model, torch.randn(3, 4))


STANDARD_STATE = {
    "UserList": (__import__("collections").UserList, lambda st, n: st.append(n)),
    "UserDict": (__import__("collections").UserDict, lambda st, n: st.__setitem__("n", st.get("n", 0) + 1)),
    "ChainMap": (lambda: __import__("collections").ChainMap({}, {}), lambda st, n: st.__setitem__("n", st.get("n", 0) + 1)),
    "Namespace": (lambda: __import__("argparse").Namespace(n=0), lambda st, n: setattr(st, "n", st.n + 1)),
}


@pytest.mark.parametrize("name", STANDARD_STATE)
def test_state_in_the_standard_librarys_containers_is_refused_and_put_back(name):
    """fuzz43g (a regression of stop 42's last change, which left every standard-library object
    unwalked): a UserList / UserDict / ChainMap / Namespace forward() writes was optimized without a
    word, kept the build's entries (a UserList the trace's Proxy), and optimized calls never moved it."""
    make, write = STANDARD_STATE[name]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.state = make()

        def forward(self, x):
            write(self.state, x.shape[0])
            return (x * 2).relu()
    model = Net().eval()
    before = repr(model.state)
    with pytest.warns(fxfuse.FxfuseWarning, match="changes the module's state"):
        opt = fxfuse.optimize(model, torch.randn(3, 8))
    assert opt is model and repr(model.state) == before
