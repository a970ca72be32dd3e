"""Stop 48: what a build depends on that a later call could change unseen (trace-time folds, parametrizations,
state), from the helpers' findings and the reviews of this stop's diff."""
import warnings

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

import fxfuse

from conftest import optimize_strict




class FillsFromHeldTensors(nn.Module):
    """`torch.full_like(held, held_value)` runs once while tracing (no proxy in it): the fill value is read,
    the shape source is not."""
    def __init__(self):
        super().__init__()
        self.cfg = {"like": torch.randn(3, 4), "s": torch.tensor(2.0)}

    def forward(self, x):
        return x * torch.full_like(self.cfg["like"], self.cfg["s"]) + 1


def test_a_held_fill_value_read_while_tracing_is_watched():
    model = FillsFromHeldTensors().eval()
    x = torch.randn(3, 4)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.cfg["like"].mul_(5)          # only its shape was read: no rebuild
        torch.testing.assert_close(opt(x), model(x))
        assert opt._dropped[0] == 0
        model.cfg["s"].mul_(-3)            # its value was read: the next call must see it
        x2 = torch.randn(3, 4)
        torch.testing.assert_close(opt(x2), model(x2))


# fuzz48d: what the trace computed from held tensors, watched in more ways

OTHER = nn.Linear(6, 6)


class ReadsAListedEncodersBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.others = [OTHER]   # not registered

    def forward(self, x):
        return x * self.others[0].bias.exp()


class ReadsADataAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.rand(6) + 0.5)
        self.pd = self.p.data   # the parameter's memory, a version counter of its own

    def forward(self, x):
        return x * self.pd.exp()


class ReadsADictTensor(nn.Module):
    def __init__(self, loop=False):
        super().__init__()
        self.cfg, self.loop = {"w": torch.rand(6) + 0.5, "ema": torch.rand(6)}, loop

    def forward(self, x):
        out = 0
        if self.loop:
            for i in range(len(x)):   # symbolic_trace cannot: torch.export traces it
                out = out + x[i]
        return x * torch.tensor(self.cfg["w"].tolist()) + out


class UsesATemplate(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.cfg, self.spelling = {"ema": torch.rand(6)}, spelling

    def forward(self, x):
        t = self.cfg["ema"]
        made = {"type_as": lambda: torch.ones(6).type_as(t).cumsum(0), "to": lambda: torch.ones(6).to(t).cumsum(0),
                "view_as": lambda: torch.arange(6.0).view_as(t).exp(),
                "expand_as": lambda: torch.ones(1).expand_as(t).cumsum(0)}[self.spelling]()
        return (x + made) * t


def _edited_then_equal(model, edit, x, **options):
    opt = fxfuse.optimize(model, x, **options)
    assert fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        opt(x)
        edit(model)
        x2 = torch.randn_like(x)
        torch.testing.assert_close(opt(x2), model(x2))
    return opt


def test_a_listed_encoders_parameter_replaced_after_a_trace_time_read_is_seen():
    opt = _edited_then_equal(ReadsAListedEncodersBias().eval(), lambda m: setattr(
        OTHER, "bias", nn.Parameter(torch.rand(6) + 2)), torch.randn(3, 6))
    assert opt._dropped[0] == 1


def test_an_alias_with_a_counter_of_its_own_is_watched_through_its_owner():
    _edited_then_equal(ReadsADataAlias().eval(), lambda m: m.p.mul_(2), torch.randn(3, 6))


def test_swap_tensors_on_a_held_tensor_read_while_tracing_is_seen():
    _edited_then_equal(ReadsADictTensor().eval(), lambda m: torch.utils.swap_tensors(
        m.cfg["w"], torch.rand(6) + 2), torch.randn(3, 6))


def test_a_python_read_of_a_held_tensor_on_the_export_path_is_watched():
    opt = _edited_then_equal(ReadsADictTensor(loop=True).eval(), lambda m: m.cfg["w"].mul_(2), torch.randn(3, 6))
    assert opt._dropped[0] == 1


@pytest.mark.parametrize("spelling", ["type_as", "to", "view_as", "expand_as"])
def test_a_held_tensor_used_as_a_template_rebuilds_nothing(spelling):
    model = UsesATemplate(spelling).eval()
    x = torch.randn(3, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, x, verify=False)
        with torch.no_grad():
            for _ in range(4):
                model.cfg["ema"].mul_(0.9).add_(0.1)   # an EMA between calls: the graph reads it live
                torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["optimized"] and opt._dropped[0] == 0


# fuzz48c: inside parametrize.cached(), eager computes a parametrized weight once

class Noise(nn.Module):
    def forward(self, w):
        return w + torch.randn_like(w)


class ReadsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)

    def forward(self, x):
        return self.l1(x) - self.l1(x)


def test_parametrize_cached_runs_the_original():
    model = ReadsTwice()
    parametrize.register_parametrization(model.l1, "weight", Noise())
    model.eval()
    x = torch.randn(3, 8)
    opt = fxfuse.optimize(model, x, verify=False)
    assert fxfuse.stats(opt)["optimized"]
    with torch.no_grad(), parametrize.cached(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(opt(x), torch.zeros(3, 8))   # one noisy weight for both reads
    assert any("parametrize.cached()" in str(w.message) for w in caught)


# fuzz48c: an RNN's own per-call lists of its parametrized weights are no state of the model

class WeightNormedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.r, self.l = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 3)
        torch.nn.utils.parametrizations.weight_norm(self.r, "weight_hh_l0")

    def forward(self, x):
        return self.l(self.r(x)[0]).tanh()


def test_a_parametrized_lstm_is_optimized_and_follows_its_weights():
    model = WeightNormedLSTM().eval()
    x = torch.randn(2, 3, 4)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.r.parametrizations.weight_hh_l0.original1.mul_(2)
        torch.testing.assert_close(opt(x), model(x))


# review48r1: reads this stop's fold_sources changes missed or over-counted

class PicksARow(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.state, self.spelling = {"table": torch.rand(4, 6) + 0.5, "k": torch.tensor(1)}, spelling

    def forward(self, x):
        t, k = self.state["table"], self.state["k"]
        row = t[k] if self.spelling == "index" else torch.narrow(t, 0, k, 1)[0]
        return x * (row.sqrt() if self.spelling != "live" else row)


@pytest.mark.parametrize("spelling", ["index", "narrow", "live"])
def test_a_held_index_that_picks_a_view_is_watched(spelling):
    _edited_then_equal(PicksARow(spelling).eval(), lambda m: m.state["k"].add_(1), torch.randn(3, 6))


class LoopsThenScales(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = {"w": torch.randn(4)}

    def forward(self, x):
        out = x
        for _ in range(x.shape[0]):   # torch.export traces it
            out = out + 0
        return out * self.cfg["w"]


def test_a_tensor_an_export_graph_reads_live_rebuilds_nothing():
    model = LoopsThenScales().eval()
    x = torch.randn(3, 4)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        for _ in range(4):
            model.cfg["w"].mul_(0.9).add_(0.01)
            torch.testing.assert_close(opt(x), model(x))
    assert opt._dropped[0] == 0


class OwnAttention(nn.MultiheadAttention):
    def forward(self, q, k, v, need_weights=False):   # returns one tensor
        B, T, E = q.shape
        qkv = F.linear(q, self.in_proj_weight, self.in_proj_bias).view(B, T, 3, self.num_heads, -1)
        qh, kh, vh = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return self.out_proj(F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(B, T, E))


class UsesOwnAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = OwnAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x, need_weights=False)


@pytest.mark.parametrize("verify", [True, False])
def test_an_attention_subclass_with_its_own_forward_keeps_its_output(verify):
    model = UsesOwnAttention().eval()
    x = torch.randn(2, 3, 8)
    opt = fxfuse.optimize(model, x, verify=verify)
    assert fxfuse.stats(opt)["optimized"]
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class ReadsAListedBiasAtOneShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.held = [nn.Linear(4, 4)]

    def forward(self, x):
        return x * self.held[0].bias.exp() if x.shape[0] == 2 else x + 1


def test_a_listed_tensor_only_a_later_build_reads_is_watched():
    model = ReadsAListedBiasAtOneShape().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 4))
    x2 = torch.randn(2, 4)
    with torch.no_grad():
        opt(x2)
        model.held[0].bias = nn.Parameter(torch.randn(4))
        torch.testing.assert_close(opt(x2), model(x2))
        model.held[0].bias.mul_(3)
        torch.testing.assert_close(opt(x2), model(x2))


class Scale(nn.Module):
    def forward(self, w):
        return w * 2.0


def test_a_parametrization_registered_later_then_called_inside_cached():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(3, 8)
    opt = fxfuse.optimize(model, x)
    parametrize.register_parametrization(model[0], "weight", Scale())
    model.eval()   # (the new parametrization module starts in training mode)
    with torch.no_grad(), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with parametrize.cached():
            torch.testing.assert_close(opt(x), model(x))
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["optimized"] and len(opt._specializations) == 1   # built outside cached()


class RegistersOnFirstCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(4))

    def forward(self, x):
        if not hasattr(self, "p"):
            self.p = nn.Parameter(self.q.detach() * 2)
        return x * self.p


def test_a_parameter_forward_registers_is_refused_and_removed():
    model = RegistersOnFirstCall().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, torch.randn(3, 4))
    assert not fxfuse.stats(opt)["optimized"] and list(model._parameters) == ["q"]
    assert any("changes the module's state" in str(w.message) for w in caught)


class ReadsOnlyShapes(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.cfg, self.spelling = {"a": torch.rand(5), "b": torch.rand(5).half()}, spelling

    def forward(self, x):
        a, b = self.cfg["a"], self.cfg["b"]
        if self.spelling == "meshgrid":
            g = torch.meshgrid(torch.arange(5.0), a, indexing="ij")[0]
        elif self.spelling == "atleast_2d":
            g = torch.atleast_2d(torch.arange(5.0), a)[0]
        else:
            g = torch.ones(5).to(b).float()
        return x * g.sum(0) * a


@pytest.mark.parametrize("spelling", ["meshgrid", "atleast_2d", "to"])
def test_reads_of_shape_and_dtype_only_rebuild_nothing(spelling):
    model = ReadsOnlyShapes(spelling).eval()
    x = torch.randn(3, 5)
    opt = fxfuse.optimize(model, x, verify=False)
    with torch.no_grad():
        for _ in range(3):
            model.cfg["b"].mul_(0.5)
            model.cfg["a"].mul_(0.9)   # read live by the graph (and only as a shape by meshgrid, atleast_2d)
            torch.testing.assert_close(opt(x), model(x))
    assert opt._dropped[0] == 0
