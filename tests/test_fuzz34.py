"""Stop 34's fixes from the helpers' rounds (.scratch/fuzz34*): the module's state and lifecycle, against eager."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402


def _calls(opt, model, x):
    """opt(x) and model(x) under no_grad, and the warnings opt's call gave."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = opt(x.clone())
    with torch.no_grad():
        want = model(x.clone())
    return got, want, [str(w.message) for w in caught]


class _TrainOnlyScale(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


def test_a_submodule_assigned_in_training_mode_is_not_built_into_the_eval_graph():
    """A module appended after optimize starts in training mode; the rebuild traced its
    training branch and kept serving it after model.eval() (fuzz34h: 2x eager's output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.append(_TrainOnlyScale())
    got, want, caught = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    assert len(caught) == 1 and "submodule 3 is in training mode" in caught[0]
    model.eval()
    for _ in range(2):
        got, want, caught = _calls(opt, model, torch.randn(4, 16))
        torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["specializations"] == 1 and fxfuse.stats(opt)["fused_kernels"] >= 1


@pytest.mark.parametrize("new", [lambda: nn.Dropout(0.1), lambda: nn.BatchNorm1d(16)])
def test_the_graph_comes_back_after_eval_of_a_new_training_mode_submodule(new):
    """The rebuild failed with an unrelated reason ("not deterministic") and marked the
    signature failed for good (fuzz34h)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.insert(2, new())
    _, _, caught = _calls(opt, model, torch.randn(4, 16))
    assert len(caught) == 1 and "training mode" in caught[0] and "deterministic" not in caught[0]
    model.eval()
    got, want, caught = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["specializations"] == 1


class _ReadsChildFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        h = self.backbone(x)
        if self.backbone.training:      # a mode-free child's flag, read by the model's code
            h = h * 2
        return torch.tanh(self.head(h)) + h


def test_train_of_a_child_whose_flag_forward_reads_rebuilds():
    torch.manual_seed(0)
    model = _ReadsChildFlag().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.backbone.train()
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    model.backbone.eval()
    got, want, caught = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["fused_kernels"] >= 1


class _Scaled(nn.Module):
    scale = 2.0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale


def test_a_class_attribute_shadowed_on_the_subclass_after_optimize_is_seen():
    class Sub(_Scaled):
        pass
    torch.manual_seed(0)
    model = Sub().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    Sub.scale = 5.0                     # shadows _Scaled.scale
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)


class _ActOnInput(nn.Module):
    def __init__(self, act, export: bool):
        super().__init__()
        self.act, self.fc, self.export = act, nn.Linear(16, 16), export

    def forward(self, x):
        if not self.export or isinstance(x, torch.Tensor):   # isinstance: traced with torch.export
            x = self.act(x)             # on the caller's tensor
        return torch.tanh(self.fc(x)) + x


@pytest.mark.parametrize("export", [False, True])
@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU])
def test_inplace_set_on_an_activation_of_an_input_after_optimize_writes_the_input(act, export):
    """`inplace` of ReLU/SiLU was not watched: eager then wrote into the caller's tensor, opt did not (fuzz34h)."""
    torch.manual_seed(0)
    model = _ActOnInput(act(), export).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    model.act.inplace = True
    x = torch.randn(4, 16)
    mine, theirs = x.clone(), x.clone()
    with torch.no_grad():
        got, want = opt(mine), model(theirs)
    torch.testing.assert_close(got, want)
    assert torch.equal(mine, theirs) and not torch.equal(mine, x)


@pytest.mark.parametrize("edit", ["bn.weight = None", "conv.bias = None", "del conv.bias"])
def test_a_parameter_set_to_none_or_deleted_after_optimize_is_seen(edit):
    """No torch hook fires there; the graph kept using the BatchNorm folded from the old tensor (fuzz34h)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.normal_(), model[1].running_var.uniform_(0.5, 2), model[1].weight.normal_()
        model[1].bias.normal_(), model[0].bias.normal_()
    opt = fxfuse.optimize(model, torch.randn(2, 4, 8, 8))
    {"bn.weight = None": lambda: setattr(model[1], "weight", None),
     "conv.bias = None": lambda: setattr(model[0], "bias", None),
     "del conv.bias": lambda: delattr(model[0], "bias")}[edit]()
    if edit == "del conv.bias":
        model[0].bias = None            # Conv2d's forward reads self.bias
    got, want, _ = _calls(opt, model, torch.randn(2, 4, 8, 8))
    torch.testing.assert_close(got, want)


class _ReadsSwappedChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.block(x) * (self.block[0].out_features / 32) * len(self.block)
        return torch.relu(self.fc(h)) * self.fc.out_features    # a child's attribute read directly


def test_a_child_swapped_for_its_optimized_version_still_answers_the_parent():
    """An OptimizedModule passes reads of the original's names through (fuzz34h: TypeError / AttributeError)."""
    torch.manual_seed(0)
    model = _ReadsSwappedChild().eval()
    eager = _ReadsSwappedChild().eval()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(4, 16)
    model.block = fxfuse.optimize(model.block, x)
    model.fc = fxfuse.optimize(model.fc, x)
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x))
    assert [type(m) for m in model.block] == [nn.Linear, nn.GELU, nn.Linear] and bool(model.block)
    assert fxfuse.stats(model.block)["fused_kernels"] >= 1
    with pytest.raises(AttributeError):
        model.fc.no_such_attribute


def test_a_write_of_the_originals_attribute_through_the_optimized_module_is_the_originals():
    torch.manual_seed(0)
    model = _Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    opt.scale = 3.0
    assert model.scale == 3.0 and "scale" not in vars(opt)
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    opt.temperature = 0.5               # a name the original lacks: its own too (getattr(self, "temperature", 1.0))
    assert model.temperature == 0.5 and opt.temperature == 0.5 and "temperature" not in vars(opt)
    opt.training = True                 # the flag too (it was dropped)
    assert model.training
    model.eval()


def test_one_warning_when_an_optimized_child_of_an_optimized_parent_is_in_training_mode():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.GELU())
            self.out = nn.Linear(16, 8)

        def forward(self, x):
            return self.out(self.inner(x) * 2)
    torch.manual_seed(0)
    parent, x = Parent().eval(), torch.randn(4, 16)
    parent.inner = fxfuse.optimize(parent.inner, x)
    opt = fxfuse.optimize(parent, x)
    parent.inner.train()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        opt(x)
    assert len(caught) == 1 and "inner" in str(caught[0].message)


class _Lora(nn.Module):
    """peft's LoraLayer in small: merge() adds the delta into the base weight through .data and
    appends to a list that forward() branches on (through a property)."""

    def __init__(self):
        super().__init__()
        self.base, self.a, self.b = nn.Linear(16, 32), nn.Linear(16, 4, bias=False), nn.Linear(4, 32, bias=False)
        nn.init.normal_(self.b.weight)
        self.scaling = {"default": 2.0}
        self.merged_adapters = []

    @property
    def merged(self):
        return bool(self.merged_adapters)

    def merge(self):
        self.base.weight.data += self.b.weight @ self.a.weight * self.scaling["default"]
        self.merged_adapters.append("default")

    def forward(self, x):
        out = self.base(x)
        if not self.merged:
            out = out + self.b(self.a(x)) * self.scaling["default"]
        return F.gelu(out)


def test_an_item_appended_to_a_list_forward_reads_rebuilds():
    """peft's merge: the list append went unseen and the merged weight was read live, so the
    delta counted twice (fuzz34g: max |opt - eager| 26.6, no warning)."""
    torch.manual_seed(0)
    model = _Lora().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.merge()
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    model.scaling["default"] = 3.0      # a dict item set in place (the branch is gone: no effect, no error)
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)


class _Configured(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.fc = config, nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.config.scale + self.config.shift


def test_an_attribute_of_a_config_object_set_in_place_rebuilds():
    import types
    torch.manual_seed(0)
    model = _Configured(types.SimpleNamespace(scale=2.0, shift=0.5)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.config.scale = 3.0
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    for _ in range(3):                  # unchanged: the graph stays
        got, want, caught = _calls(opt, model, torch.randn(4, 16))
        torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["fused_kernels"] >= 1
    rebuilds = opt._state_rebuilds
    for step in range(3):               # an attribute forward() never reads: no rebuild (review34)
        model.config.step = step
        got, want, caught = _calls(opt, model, torch.randn(4, 16))
        torch.testing.assert_close(got, want)
    assert opt._state_rebuilds == rebuilds and not caught


def test_torchs_hook_based_pruning_is_refused_with_the_way_out():
    import torch.nn.utils.prune as prune
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(fxfuse.FxfuseError, match=r"submodule 0 \(Linear\) has a forward pre-hook .*prune.remove"):
        fxfuse.optimize(model, torch.randn(2, 8), strict=True)


class _HeadFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x).relu()
        if self.head.training:
            h = h * 0
        return self.head(h)


def test_a_rebuild_keeps_the_training_flags_the_user_set_on_submodules():
    """gm.train() of a new build switched the model's own children back to eval (fuzz34i)."""
    torch.manual_seed(0)
    model = _HeadFlag().eval()
    opt = fxfuse.optimize(model, torch.randn(8, 16))
    model.head.train()
    for rows in (8, 3):                 # the same shape (a rebuild), then a new one
        got, want, _ = _calls(opt, model, torch.randn(rows, 16))
        torch.testing.assert_close(got, want)
        assert model.head.training


def test_eval_of_an_eval_model_counts_no_change():
    """Each train()/eval() made every optimized model walk its structure on its next call (fuzz34i)."""
    from fxfuse.torch_hooks import MODE_CHANGES
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    before = MODE_CHANGES[0]
    model.eval()
    assert MODE_CHANGES[0] == before
    model.train()
    assert MODE_CHANGES[0] > before


def test_a_users_dispatch_mode_runs_the_original_and_optimize_under_one_is_refused_clearly():
    """Fused kernels ran outside the user's TorchDispatchMode: another value, silently (fuzz34k)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ZeroGelu(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 0 if func is torch.ops.aten.gelu.default else out
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with ZeroGelu(), warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got, want = opt(x), model(x)
    torch.testing.assert_close(got, want)
    assert len(caught) == 1 and "TorchDispatchMode" in str(caught[0].message)
    with ZeroGelu(), pytest.raises(fxfuse.FxfuseError, match="TorchFunctionMode or TorchDispatchMode is active"):
        fxfuse.optimize(model, x, strict=True)
    with torch.device("cpu"), torch.no_grad():     # a device context is a function mode too: the graph runs
        assert torch.equal(opt(x), opt(x))
    assert opt._original_calls["mode"] == 1


class _WritesThenFails(nn.Module):
    def forward(self, x):
        x.add_(1)
        if x.shape[0] > 4:              # a shape the build cannot take
            return x * torch.nonzero(x > 1).shape[0]
        return x * 2


def test_strict_raises_before_writing_the_callers_input():
    """The original ran on the caller's tensors before strict raised: a fallback wrote twice (fuzz34k)."""
    opt = fxfuse.optimize(_WritesThenFails().eval(), torch.randn(4, 8), strict=True)
    x = torch.zeros(5, 8)
    with pytest.raises(fxfuse.FxfuseError), torch.no_grad():
        opt(x)
    assert torch.equal(x, torch.zeros(5, 8))


def test_a_loop_over_modules_meets_a_swapped_childs_weight_once():
    """opt is one of the parent's modules() too: `hasattr(m, "weight")` on it passed through and an
    apply()-style edit scaled the weight twice (review34). Its own tensors stay opt.original's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    weight = model[2].weight.detach().clone()
    model[2] = fxfuse.optimize(model[2], torch.randn(3, 8))

    def halve(m):
        if hasattr(m, "weight"):
            with torch.no_grad():
                m.weight.mul_(0.5)
    model.apply(halve)
    torch.testing.assert_close(model[2].original.weight, weight * 0.5)
    with pytest.raises(AttributeError, match="opt.original.weight"):
        model[2].weight
    model[2].original.scale = 2.0
    del model[2].scale                   # a delete of the original's name is the original's
    assert not hasattr(model[2].original, "scale")


class _Saturating(torch.Tensor):
    """A weight type whose every op saturates at +-100 (a quantization emulation)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            return out.clamp(-100, 100) if isinstance(out, torch.Tensor) else out


def test_a_parameter_of_a_tensor_subclass_with_its_own_torch_function_is_refused():
    """Its ops were skipped by the fused kernels: 83295 where eager gave 302 (fuzz34k)."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.ones(8).as_subclass(_Saturating))

        def forward(self, x):
            return (x * self.w) * 3
    model = Scaled().eval()
    with pytest.raises(fxfuse.FxfuseError, match="w is a _Saturating, a torch.Tensor subclass"):
        fxfuse.optimize(model, torch.randn(4, 8), strict=True)


class _ReluOnParameterView(nn.Module):
    def __init__(self, inplace):
        super().__init__()
        self.p, self.act = nn.Parameter(torch.randn(4, 8)), nn.ReLU(inplace=inplace)

    def forward(self, x):
        return x + self.act(self.p[:, :8])


def test_an_in_place_activation_module_on_a_parameter_view_is_a_state_write():
    """Set after optimize, the rebuild ran forward on the real parameter, writing it (review34)."""
    model = _ReluOnParameterView(inplace=True).eval()
    with pytest.raises(fxfuse.FxfuseError, match="writes into the parameter p"):
        fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    model = _ReluOnParameterView(inplace=False).eval()
    p = model.p.detach().clone()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    model.act.inplace = True
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True), torch.no_grad():
        warnings.simplefilter("always")
        got = opt(x)
    torch.testing.assert_close(got, x + torch.relu(p))
    assert torch.equal(model.p, torch.relu(p))   # eager's one write, once
