"""Stop 49: helper findings in the optimized module's state handling (each test fails on the code before its fix)."""
import collections
import warnings

import pytest
import torch
from torch import nn

import fxfuse

from conftest import optimize_strict
from test_fuzz36_state import HoldsVersioned


class OptionalBias(nn.Module):
    """Old checkpoints have no l2.bias: a load post hook accepts them and starts it at zero."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.seen, self.prefixes = [], []
        self.register_load_state_dict_post_hook(OptionalBias._optional_bias)
        self._register_load_state_dict_pre_hook(self._note_prefix)

    def _note_prefix(self, state_dict, prefix, *args):
        self.prefixes.append(prefix)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    @staticmethod
    def _optional_bias(module, incompatible):
        module.seen.append(list(incompatible.missing_keys))
        if "l2.bias" in incompatible.missing_keys:
            incompatible.missing_keys.remove("l2.bias")
            with torch.no_grad():
                module.l2.bias.zero_()


def test_the_models_load_hooks_see_its_own_keys():
    """fuzz49f: opt.load_state_dict loaded through the wrapper, so the model's post hook saw "original.l2.bias"
    (strict: the load raised where eager's loads; strict=False: the hook never zeroed the bias, and opt
    computed other values than the eager model loaded from the same checkpoint), its pre hook prefix
    "original."."""
    torch.manual_seed(0)
    checkpoint = OptionalBias().state_dict()
    del checkpoint["l2.bias"]
    x = torch.randn(4, 16)
    for strict in (True, False):
        eager = OptionalBias().eval()
        eager.load_state_dict(checkpoint, strict=strict)
        model = OptionalBias().eval()
        opt = optimize_strict(model, x)
        with torch.no_grad():
            opt(x)   # built from the old weights: the load must drop them
        result = opt.load_state_dict(checkpoint, strict=strict)
        assert model.seen == [["l2.bias"]] and model.prefixes == [""] and result.missing_keys == []
        with torch.no_grad():
            torch.testing.assert_close(opt(x), eager(x))
        assert fxfuse.stats(opt)["optimized"]


def test_an_older_fxfuse_checkpoint_loads_into_a_versioned_model_once_converted():
    """The checkpoint of a version-sensitive model names its tensors and versions "original.x" (opt.state_dict
    keeps them so); loaded straight into the model, the names and the versions are read as the model's."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    source = optimize_strict(HoldsVersioned().eval(), x)
    saved = source.state_dict()
    assert list(saved) == ["original.sc.scale"]
    opt = optimize_strict(HoldsVersioned().eval(), x)
    opt.load_state_dict(saved)
    assert torch.equal(opt.original.sc.scale, source.original.sc.scale)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), source(x))


def test_a_wrong_checkpoint_names_the_models_class_and_keys():
    x = torch.randn(4, 16)
    opt = optimize_strict(OptionalBias().eval(), x)
    checkpoint = OptionalBias().state_dict()
    checkpoint["l3.weight"] = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            opt.load_state_dict(checkpoint)
        except RuntimeError as e:
            assert "for OptionalBias" in str(e) and '"l3.weight"' in str(e) and "original" not in str(e)
        else:
            raise AssertionError("an unexpected key loaded")


class ParameterBranch(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) * (2 if isinstance(x, nn.Parameter) else 3)


def test_an_nn_parameter_input_is_seen_as_one():
    """fuzz49j: the trace and verify ran on plain-tensor copies of an nn.Parameter example (and the float64
    reference on a plain `.double()`), so `isinstance(x, nn.Parameter)` took the other branch, unseen. Now
    verify sees eager's branch, and a Parameter is part of a call's signature."""
    p = nn.Parameter(torch.randn(3, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = fxfuse.optimize(ParameterBranch().eval(), p)
    assert not isinstance(refused, fxfuse.OptimizedModule) and len(caught) == 1
    opt = fxfuse.optimize(ParameterBranch().eval(), torch.randn(3, 8))
    with torch.no_grad(), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        torch.testing.assert_close(opt(p), ParameterBranch()(p))   # another signature: built, or the original
        x = torch.randn(3, 8)
        torch.testing.assert_close(opt(x), ParameterBranch()(x))


class Dequantizes(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x.dequantize()) * 2 + 1


def test_a_quantized_input_runs_the_original():
    """fuzz49j: a quantized tensor passed the plain-tensor check (strided, a torch.Tensor) and the build's copy
    lost its quantizer: under strict=True torch's INTERNAL ASSERT escaped; as the example, optimize said the
    model itself raises."""
    x = torch.randn(3, 8)
    q = torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)
    opt = optimize_strict(Dequantizes().eval(), x)
    with pytest.raises(fxfuse.FxfuseError, match="input 0 is a quantized tensor"):
        opt(q)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = fxfuse.optimize(Dequantizes().eval(), q)
    assert not isinstance(refused, fxfuse.OptimizedModule)
    assert [str(w.message) for w in caught if "quantized tensor" in str(w.message)], [str(w.message) for w in caught]


class ReturnsNumpy(nn.Module):
    def forward(self, x):
        return (torch.relu(x) * 2).numpy()


class NamedTupleInForward(nn.Module):
    def forward(self, x):
        Out = collections.namedtuple("Out", "y n")
        return Out(torch.relu(x) * 2, 3)


@pytest.mark.parametrize("model, words", [(ReturnsNumpy(), "output 0 is a numpy ndarray"),
                                          (NamedTupleInForward(), "a class forward() makes anew on each call")])
def test_refusals_name_the_output_kind(model, words):
    """fuzz49j: a numpy output was refused as `ndarray X where the rewritten graph returns ndarray X` (two equal
    values), a NamedTuple class made in forward() as `Out rebuilt as Out`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxfuse.optimize(model.eval(), torch.randn(3, 8))
    assert len(caught) == 1 and words in str(caught[0].message), str(caught[0].message)


class ConvertsItsLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Linear(4, 4)

    def forward(self, x):
        return self.p.half()(x.half())


def test_a_module_conversion_in_forward_is_named():
    """fuzz49k: `self.p.half()` in forward() was refused as a `.grad` read (nn.Module._apply converts each
    parameter's gradient too)."""
    model = ConvertsItsLayer().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = fxfuse.optimize(model, torch.randn(2, 4))
    assert not isinstance(refused, fxfuse.OptimizedModule) and len(caught) == 1
    assert "converts p.weight, p.bias" in str(caught[0].message) and ".grad" not in str(caught[0].message)
    assert model.p.weight.dtype == torch.float32   # the model as it was


OUTSIDE = nn.Linear(4, 4)   # a module-level layer forward() converts: no submodule of the model


class ConvertsAnOutsideLayer(nn.Module):
    def forward(self, x):
        return OUTSIDE.to(x.dtype)(x)


def test_a_conversion_of_a_module_held_apart_is_refused_and_undone():
    """fuzz49k: torch.export (forward()'s `inner.to(x.dtype)` stops symbolic_trace) left fake tensors in the
    module-level layer, so it failed on every later call ("Couldn't swap Linear.weight"), and optimize said
    the model itself raises. Now the layer is as it was, and the conversion is named as a state change."""
    weight = OUTSIDE.weight
    x = torch.randn(2, 4, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = fxfuse.optimize(ConvertsAnOutsideLayer().eval(), x)
    assert not isinstance(refused, fxfuse.OptimizedModule) and len(caught) == 1
    assert "changes the module's state" in str(caught[0].message) and "Linear.weight" in str(caught[0].message)
    assert OUTSIDE.weight is weight and type(weight) is nn.Parameter and weight.dtype == torch.float32
    with torch.no_grad():
        assert refused(x).dtype == torch.float16   # eager converts it, as it would have


class ReadsInputAttributes(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case

    def forward(self, x):
        if self.case == "size":
            return torch.relu(x).reshape(x.rows, -1) * 2
        if self.case == "default":
            return torch.sigmoid(x) * getattr(x, "scale", 1.0)
        x.count.add_(1)   # "written": a counter carried on the input
        return torch.relu(x) * 2


@pytest.mark.parametrize("case", ["size", "default", "written"])
def test_python_attributes_of_inputs_are_refused_and_left_alone(case):
    """review49r2: with the example's attributes copied, `x.reshape(x.rows, -1)` was frozen at the example's
    rows, and forward()'s in-place write into `x.count` ran on the caller's tensor at every build run. The
    guards do not check attributes: such a model runs the original, and the build writes nothing of the
    caller's."""
    x = torch.randn(4, 6)
    x.rows, x.scale, x.count = 2, 2.0, torch.zeros(())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = fxfuse.optimize(ReadsInputAttributes(case).eval(), x)
    assert not isinstance(refused, fxfuse.OptimizedModule) and len(caught) == 1
    assert "Python attribute set on an input tensor" in str(caught[0].message)
    assert x.count.item() == 0


class ConvertsMidway(nn.Module):
    def __init__(self, conversion, branch=False):
        super().__init__()
        self.lin, self.conversion, self.branch = nn.Linear(4, 4), conversion, branch

    def forward(self, x):
        getattr(self.lin, self.conversion)()
        if self.branch and x.sum() > 0:   # symbolic_trace stops here: torch.export traces
            return self.lin(x.to(self.lin.weight.dtype))
        return torch.relu(self.lin(x.to(self.lin.weight.dtype)))


@pytest.mark.parametrize("branch", [False, True], ids=["fx", "then-export"])
def test_a_refused_conversion_leaves_weights_and_grads_as_they_were(branch):
    """review49r2: the put-back ran only where the trace finished (a branch after the conversion left the
    weights in float64), and the gradients stayed converted."""
    model = ConvertsMidway("double", branch).eval()
    model.lin.weight.grad = torch.ones(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = fxfuse.optimize(model, torch.randn(2, 4))
    assert not isinstance(refused, fxfuse.OptimizedModule) and len(caught) == 1
    assert model.lin.weight.dtype == model.lin.weight.grad.dtype == model.lin.bias.dtype == torch.float32


@pytest.mark.parametrize("conversion", ["float", "cpu", "share_memory"])
def test_a_conversion_that_changes_nothing_is_no_state_change(conversion):
    """review49r2: `self.head.float()` of an fp32 module (torch's `_apply` sets each `param.data`, reads each
    `.grad`) was refused as a `.grad` read, then as a write into the parameter."""
    model = ConvertsMidway(conversion).eval()
    opt = optimize_strict(model, torch.randn(2, 4))
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class NarrowStateDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))

    def state_dict(self):   # noqa: D102 -- a class narrowing the signature (no keep_vars)
        return super().state_dict()


def test_loads_with_a_narrow_state_dict_and_unexpected_specialization_keys():
    """review49r2: opt.load_state_dict asked the model's state_dict(keep_vars=True), a TypeError for a class
    narrowing its signature; and it dropped any "specialization_" key the model lacks, where eager raises."""
    opt = optimize_strict(NarrowStateDict().eval(), torch.randn(2, 4))
    opt.load_state_dict(NarrowStateDict().state_dict())
    checkpoint = NarrowStateDict().state_dict()
    checkpoint["specialization_scale"] = torch.ones(1)
    with pytest.raises(RuntimeError, match="Unexpected key.*specialization_scale"):
        opt.load_state_dict(checkpoint)


class HoldsOddTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.helpers = [torch.jit.script(nn.Linear(4, 4)), nn.LazyLinear(4)]   # held apart, unused
        self.helpers[1].register_buffer("sparse", torch.eye(3).to_sparse())

    def forward(self, x):
        return torch.relu(self.lin(x)) + self.emb.weight[:2].sum()


def test_models_holding_tensors_without_plain_storage_optimize():
    """review49r4: the build's record of parameter data read the storage of a sparse gradient, a sparse buffer,
    an uninitialized LazyLinear's parameters and a script module's dicts: internal errors, the model refused."""
    model = HoldsOddTensors().eval()
    model.emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 4), (10, 4))
    x = torch.randn(2, 4)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class ApplyOwnFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        got = []
        self.l._apply(lambda t: (got.append(t.grad) if t.grad is not None and t.dim() == 2 else None, t)[1])
        return torch.relu(self.l(x)) + x @ (got[0] if got else torch.zeros(8, 8))


def test_a_grad_read_through_apply_with_forwards_own_function_is_refused():
    """review49r4: `.grad` reads inside nn.Module._apply were all taken for a conversion's; one with forward()'s
    own function baked the example's gradient in."""
    model = ApplyOwnFunction().eval()
    model.l.weight.grad = torch.ones(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = fxfuse.optimize(model, torch.randn(3, 8))
    assert not isinstance(refused, fxfuse.OptimizedModule) and ".grad" in str(caught[0].message)
