"""Stop 35's fixes around the model's state: buffers and tensors forward() writes, tensors in
containers, plain-tensor weights, saving a model an OptimizedModule watches."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402


def test_a_model_saved_while_optimized_needs_no_fxfuse_to_load():
    """torch.save(opt.original) pickled fxfuse's load hooks: loading it without fxfuse failed
    (fuzz35d). They pickle as a no-op of builtins; a load into the copy reaches nothing."""
    import io
    import pickle
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    data = pickle.dumps(model)
    assert b"fxfuse" not in data
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert b"fxfuse" not in buffer.getvalue()
    copy = pickle.loads(data)
    copy.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))   # the original's weights, unchanged
    model.load_state_dict(copy.state_dict())          # the original's hook still rebuilds
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_plain_tensor_weight_gives_no_torch_fx_warning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    weight = model[0].weight
    del model[0].weight
    model[0].weight = weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_fast_weights_on_a_linear_reach_the_graph_that_folded_them():
    """A Linear's weight as a plain tensor (MAML-style fast weights), reassigned or edited in
    place after optimize: BatchNorm folding kept the first one (fuzz35d: 3.2 off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    model[1].running_mean.normal_()
    weight = model[0].weight
    del model[0].weight
    model[0].weight = weight.detach().clone()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    for step in range(3):
        if step == 1:
            model[0].weight = torch.randn(8, 8)
        if step == 2:
            model[0].weight.mul_(2)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


class _ScaleInADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cfg = {"scale": torch.randn(8)}

    def forward(self, x):
        return (self.fc(x) * self.cfg["scale"]).relu() + 1


def test_a_tensor_in_a_dict_set_to_require_grad_after_optimize_gets_its_gradient():
    """fuzz35d: the graph ran and the gradient of the dict's tensor was silently missing."""
    torch.manual_seed(0)
    model = _ScaleInADict().eval().requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    model.cfg["scale"].requires_grad_(True)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(x)
    want = model(x)
    assert got.requires_grad and len(caught) == 1
    (g_got,) = torch.autograd.grad(got.sum(), model.cfg["scale"])
    (g_want,) = torch.autograd.grad(want.sum(), model.cfg["scale"])
    torch.testing.assert_close(g_got, g_want)


def test_an_in_place_edit_of_a_tensor_in_a_dict_reaches_the_graph():
    """Watched by version now, the edit rebuilt, and the rebuild refused the dict's tensor as "a
    constant forward() writes in place" (its version had moved: the user's write)."""
    torch.manual_seed(0)
    model = _ScaleInADict().eval()
    model.cfg["scale"].add_(1)   # written before optimize, too
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model.cfg["scale"].mul_(-2)
        torch.testing.assert_close(opt(x), model(x))


_RESETS = {
    "zero_": lambda b: b.zero_(),
    "fill_": lambda b: b.fill_(0.0),
    "mul_": lambda b: b.mul_(0),
    "setitem": lambda b: b.__setitem__(slice(None), 0),
    "torch.zero_": lambda b: torch.zero_(b),
    "copy_zeros": lambda b: b.copy_(torch.zeros(b.shape)),
}


class _ScratchBuffer(nn.Module):
    """A scratch buffer written and reset within each call (the README promises it works)."""

    def __init__(self, reset):
        super().__init__()
        self.reset = reset
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scratch", torch.zeros(4, 8))

    def forward(self, x):
        out = x + self.scratch
        self.scratch.copy_(x * 2)
        y = out * torch.relu(self.lin(self.scratch))
        self.reset(self.scratch)
        return y


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("name", sorted(_RESETS))
def test_a_scratch_buffer_reset_with_no_traced_operand_is_recorded(name, verify):
    """torch.fx ran `self.scratch.zero_()` once while tracing and left it out of the graph: the
    buffer kept x * 2 after an optimized call (review35, fuzz35c), silently."""
    torch.manual_seed(0)
    model = _ScratchBuffer(_RESETS[name]).eval()
    twin = _ScratchBuffer(_RESETS[name]).eval()
    twin.load_state_dict(model.state_dict())
    opt = fxfuse.optimize(model, torch.randn(4, 8), verify=verify, strict=True)
    for _ in range(2):
        x = torch.randn(4, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), twin(x))
        torch.testing.assert_close(model.scratch, twin.scratch, rtol=0, atol=0)


def test_a_view_of_a_buffer_read_after_a_write_reads_the_write():
    class ViewThenWrite(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(32))

        def forward(self, x):
            v = self.buf.view(2, 16)
            self.buf.copy_(x.flatten())
            y = torch.relu(v) * 2
            self.buf.zero_()
            return y

    model = ViewThenWrite().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 16), verify=False, strict=True)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), torch.relu(x) * 2)
    assert not model.buf.any()


class _LiveStats(nn.Module):
    """BatchNorm over statistics forward() sets (and restores) itself."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        self.bn.running_mean.copy_(x.mean(0)[:6])
        y = self.bn(self.lin(x))
        self.bn.running_mean.copy_(x.new_zeros(6))
        return y


class _ScratchWeight(nn.Module):
    """A work buffer filled from a parameter, used as a weight, then cleared."""

    def __init__(self, stored_in_out):
        super().__init__()
        self.stored_in_out = stored_in_out
        self.P = nn.Parameter(torch.randn(8, 6) if stored_in_out else torch.randn(6, 8))
        self.register_buffer("W", torch.zeros_like(self.P))

    def forward(self, x):
        self.W.copy_(self.P * 2)
        y = torch.relu(x @ self.W if self.stored_in_out else F.linear(x, self.W))
        self.W.copy_(self.P * 0)
        return y


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("make,options", [(_LiveStats, {}), (lambda: _ScratchWeight(True), {"gemm": "force"}),
                                          (lambda: _ScratchWeight(False), {"fused_mlp": "force"})],
                         ids=["batchnorm_stats", "x_at_W", "fused_mlp"])
def test_a_tensor_forward_writes_is_not_folded_or_copied_at_optimize_time(make, options, verify):
    """review35: BatchNorm folding, the transposed copy for `x @ W` and the fused MLP's packed
    weights were taken before forward()'s write: silently wrong with verify=False, a fallback
    blaming the model with verify on."""
    torch.manual_seed(0)
    model = make().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 8), verify=verify, **options)
    assert fxfuse.stats(opt)["optimized"]
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_value_computed_from_a_buffer_and_written_in_place_is_traced():
    """torch.fx computed `self.scale.exp()` at trace time (a buffer is no proxy) and refused the
    later `v.clamp_()` as a write into a constant (fuzz35a); buffers are graph nodes then."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.randn(3))

        def forward(self, x):
            v = self.scale.exp()
            v.clamp_(max=1.5)
            return x * v

    model = Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 3), strict=True)
    x = torch.randn(4, 3)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.scale.mul_(-1)   # a later edit of the buffer reaches the graph
        torch.testing.assert_close(opt(x), model(x))


def test_a_dict_tensor_read_through_a_view_counts_for_the_grad_rule():
    """review35c: matching the graph's constants by identity missed `cfg["W"].t()`: after
    requires_grad_(True) the output had no grad, silently. Every tensor of a watched container
    counts (review35b's unread list tensor then sends grad-mode calls to the original too)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = {"W": torch.randn(8, 8)}

        def forward(self, x):
            return torch.relu(x @ self.cfg["W"].t()) + 1

    model = Model().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    model.cfg["W"].requires_grad_(True)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(x)
    assert got.requires_grad and len(caught) == 1
    torch.testing.assert_close(got, model(x))


_TABLE = torch.tensor([1.0, 2.0, 3.0])
_TABLE.mul_(2)   # built in place at import


class _Cfg:
    def __init__(self):
        self.scales = [torch.tensor([1.0, 2.0, 3.0])]


@pytest.mark.parametrize("where", ["nested_config", "module_global"])
def test_a_tensor_written_before_optimize_is_no_written_constant(where):
    """review35b: a tensor two levels deep in a config, or a module-level table, edited in place
    before optimize() was refused as "a tensor forward() makes from constants and writes"."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = _Cfg()

        def forward(self, x):
            return torch.relu(x * (self.cfg.scales[0] if where == "nested_config" else _TABLE) + 1)

    model = Model().eval()
    model.cfg.scales[0].mul_(2)
    opt = fxfuse.optimize(model, torch.randn(4, 3), strict=True)
    x = torch.randn(4, 3)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _SlotsConfig:
    __slots__ = ("scale",)

    def __init__(self):
        self.scale = 2.0

    def __getattr__(self, name):
        raise KeyError(name)


_SLOTS = _SlotsConfig()


def test_a_global_config_whose_getattr_raises_does_not_break_optimize():
    """review35c: the scan of globals forward() names read `__dict__` of a __slots__ object whose
    __getattr__ raises KeyError: an internal error."""
    class Model(nn.Module):
        def forward(self, x):
            return torch.relu(x) * _SLOTS.scale

    model = Model().eval()
    opt = fxfuse.optimize(model, torch.randn(4), strict=True)
    x = torch.randn(4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
