"""Stop 38: what each call checks: the aliasing guard, the grad rule, replaced weights, training
flags, guard messages (review38, review38b-e, fuzz38a, fuzz38f, fuzz38j)."""
import dataclasses
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse


def test_a_parameter_or_buffer_replaced_in_its_modules_dict_rebuilds():
    # learn2learn's MAML writes fast weights into module._parameters, which fires no hook: the graph kept
    # computing with copies of the old weights (BatchNorm folded into the Linear; forced GEMMs) (fuzz38a)
    for options in ({}, {"gemm": "force"}):
        model = nn.Sequential(nn.Linear(7, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).eval()
        model[1].running_mean.normal_()
        opt = fxfuse.optimize(model, torch.randn(4, 7), strict=True, **options)
        x = torch.randn(4, 7)
        with torch.no_grad():
            opt(x)
            model[0]._parameters["weight"] = model[0].weight - 0.5 * torch.randn_like(model[0].weight)
            torch.testing.assert_close(opt(x), model(x))
            model[1]._buffers["running_mean"] = torch.ones(16)
            torch.testing.assert_close(opt(x), model(x))
            model[3]._parameters["weight"] = nn.Parameter(torch.randn(3, 16))
            torch.testing.assert_close(opt(x), model(x))


class ReturnsItsState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.state = nn.Linear(8, 8), torch.zeros(8)   # a plain tensor attribute

    def forward(self, x):
        return torch.relu(self.lin(x)) + self.state, self.state


def test_a_returned_tensor_attribute_is_the_attribute_as_in_eager():
    # the graph returned a copy: a caller updating the returned state in place did not change the model (fuzz38f)
    model = ReturnsItsState().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        _, state = opt(x)
        assert state is model.state
        state.add_(1.0)
        torch.testing.assert_close(opt(x)[0], model(x)[0])


class FoldedWithAConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x))), torch.zeros(3) + 2


def test_optimize_under_inference_mode_does_not_call_trace_constants_the_models_inference_tensors():
    # the "model was created or loaded under torch.inference_mode()" warning counted a tensor made from
    # constants in forward() as one of the model's (fuzz38f)
    model = FoldedWithAConstant().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
            x = torch.randn(4, 8)
            torch.testing.assert_close(opt(x)[0], model(x)[0])


class TwoInputs(nn.Module):
    def forward(self, x, mask):
        return (x * 2 + mask).relu()


def test_a_miss_is_told_against_the_closest_specialization_and_names_the_argument():
    # with specializations for (4, 8) and (6, 8), a (6, 8) call with an fp64 mask was told "input 0: shape
    # (6, 8) where the specialization has (4, 8)"; tensor inputs were named by position only (fuzz38f)
    opt = fxfuse.optimize(TwoInputs().eval(), (torch.randn(4, 8), torch.randn(4, 8)), max_specializations=2,
                          strict=True)
    with torch.no_grad():
        opt(torch.randn(6, 8), torch.randn(6, 8))
        with pytest.raises(fxfuse.GuardError, match=r"input 1 \(mask\): dtype torch.float64 where the "
                                                     r"specialization has torch.float32"):
            opt(torch.randn(6, 8), torch.randn(6, 8, dtype=torch.float64))


class HoldsAModuleUnregistered(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.body, self.how, shared = nn.Linear(7, 7), how, nn.Linear(7, 5)
        if how == "setattr":
            object.__setattr__(self, "shared", shared)
        else:
            self.shared = {"list": [shared], "tuple": (shared,), "dict": {"p": shared},
                           "namespace": types.SimpleNamespace(p=shared)}[how]

    def projection(self):
        s = self.shared
        return s if self.how == "setattr" else s[0] if self.how in ("list", "tuple") else s["p"] \
            if self.how == "dict" else s.p

    def forward(self, x):
        return F.linear(torch.relu(self.body(x)), self.projection().weight) * 2


@pytest.mark.parametrize("how", ["list", "tuple", "dict", "namespace", "setattr"])
def test_a_parameter_of_an_unregistered_module_unfrozen_after_optimize_gets_its_gradient(how):
    # the graph ran on: the output did not require grad and the weight's .grad stayed None (fuzz38a)
    model = HoldsAModuleUnregistered(how).eval()
    model.requires_grad_(False)
    model.projection().requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(4, 7))
    weight = model.projection().weight
    weight.requires_grad_(True)
    x = torch.randn(4, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = opt(x)
    assert got.requires_grad
    (g_got,) = torch.autograd.grad(got.sum(), weight)
    (g_want,) = torch.autograd.grad(model(x).sum(), weight)
    torch.testing.assert_close(g_got, g_want)


def test_a_subclass_of_sequential_assigned_after_optimize_rebuilds():
    # torch.ao's ConvReLU2d is an nn.Sequential that starts in training mode: its mode was taken to matter
    # and the original ran, where a plain Sequential rebuilt (fuzz38i)
    from torch.ao.nn.intrinsic import ConvReLU2d
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1)).eval()
    x = torch.randn(2, 3, 8, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    model[2] = ConvReLU2d(nn.Conv2d(4, 4, 1), nn.ReLU())
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["optimized"]


GLOBAL_BIAS = torch.randn(8)


class WritesInputBesideHeldTensors(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, lin = how, nn.Linear(8, 8)
        if how == "list":
            self.holder = [lin]
        elif how == "setattr":
            object.__setattr__(self, "holder", lin)

    def bias(self):
        return self.holder[0].bias if self.how == "list" else self.holder.bias if self.how == "setattr" \
            else GLOBAL_BIAS

    def forward(self, x):
        x.add_(1)
        return (self.bias() * 2).sigmoid() + x


@pytest.mark.parametrize("how", ["list", "setattr", "global"])
def test_an_input_that_is_an_unregistered_weight_or_a_global_tensor_is_guarded(how):
    # the trace computes (bias * 2).sigmoid() before the write into x; eager reads the written bias through
    # the alias: a silent wrong answer where the aliasing guard did not know the tensor (review38c)
    model = WritesInputBesideHeldTensors(how).eval()
    opt = fxfuse.optimize(model, torch.randn(8))
    t = model.bias()
    before = t.detach().clone()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = opt(t.data)
        t.data.copy_(before)
        want = model(t.data)
        t.data.copy_(before)
    torch.testing.assert_close(got, want)


@dataclasses.dataclass
class _Holder:
    lin: nn.Module


class HoldsDeep(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.body, lin = nn.Linear(7, 7), nn.Linear(7, 5)
        self.holder = _Holder(lin) if how == "dataclass" else [[[[lin]]]]
        self.how = how

    def projection(self):
        return self.holder.lin if self.how == "dataclass" else self.holder[0][0][0][0]

    def forward(self, x):
        return F.linear(torch.relu(self.body(x)), self.projection().weight) * 2


@pytest.mark.parametrize("how", ["dataclass", "deep list"])
def test_deeper_unregistered_modules_unfrozen_after_optimize_get_their_gradient(how):
    model = HoldsDeep(how).eval().requires_grad_(False)
    model.projection().requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(4, 7))
    model.projection().weight.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert opt(torch.randn(4, 7)).requires_grad


class FrozenWithATeacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.teacher = [nn.Linear(8, 8)]   # held for distillation elsewhere; unused by forward()

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def test_an_unused_unregistered_module_requiring_grad_does_not_stop_the_graph():
    # every call with grad on ran the original: the teacher's parameters counted though forward() never
    # reads them (review38c)
    model = FrozenWithATeacher().eval().requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x), model(x))   # grad mode on: strict raises if the original had to run


EXAMPLE_INPUT = torch.randn(4, 6)   # a script's example input, a global of the model's module


class FillsItsOwnBuffer(nn.Module):
    def forward(self, x):
        h = x * 2
        h[0] = 3.0   # torch.export traces it; a write into a fresh buffer, no input written
        return h


def test_an_example_input_that_is_a_global_of_the_models_module_runs_the_graph():
    # every tensor of the module's globals counted as one forward() might read: opt(x) with the script's
    # own x ran the original with "two inputs share memory" (fuzz38j)
    model = FillsItsOwnBuffer().eval()
    opt = fxfuse.optimize(model, EXAMPLE_INPUT, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(EXAMPLE_INPUT), model(EXAMPLE_INPUT))


class CallsWithoutForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = 0.5

    def __call__(self, x):   # overrides __call__, no forward of its own: its mode matters
        return F.dropout(x, self.p, self.training)


class UsesCallOverride(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(8, 8), CallsWithoutForward()

    def forward(self, x):
        return self.drop(self.lin(x))


def test_a_module_without_a_forward_of_its_own_is_not_mode_free():
    # Module.forward (none of its own) counted as a mode-free forward: m.drop.training = True was ignored
    # (review38d: no dropout, no warning)
    model = UsesCallOverride().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    model.drop.training = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        got = opt(torch.ones(4, 8))
    assert (got == 0).any()   # dropout ran, as in eager


class Heads(nn.ModuleList):   # no forward of its own: a container, its training flag changes nothing
    pass


def test_a_container_subclass_assigned_after_optimize_rebuilds():
    # review38e: counted as mode-sensitive, it sent every call to the original
    model = TwoInputs().eval()
    opt = fxfuse.optimize(model, (torch.randn(4, 8), torch.randn(4, 8)), strict=True)
    model.extra = Heads([nn.Linear(8, 8)])   # starts in training mode; forward() never reads it
    x, mask = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, mask), model(x, mask))
