"""Stop 47 (fuzz47g): what a build depends on that a later call could change unseen."""
import dataclasses
import re
import types
import warnings

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._utils
from torch import nn
from torch.compiler import is_compiling
import torch.nn.functional as F

import fxfuse

from conftest import optimize_strict


def four():
    return torch.tensor([1.0, 2.0, 3.0, 4.0])


def closing_over(t):
    def helper(x):
        return x * t.exp()
    return helper


@dataclasses.dataclass
class Config:
    w: torch.Tensor


class Holder(nn.Module):
    """forward() computes from a tensor the trace does not proxy: symbolic_trace ran `.exp()` (or
    `.item()`) once and kept its result as a constant."""
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "dict":
            self.cfg = {"w": four()}
        elif kind == "namespace":
            self.cfg = types.SimpleNamespace(w=four())
        elif kind == "dataclass":
            self.cfg = Config(four())
        elif kind == "tuple":
            self.cfg = (four(),)
        elif kind == "closure":
            self.t = four()   # also a plain attribute: the closure reads it, the graph holds exp() of it
            self.helper = closing_over(self.t)
        elif kind == "unregistered module":
            self.cfg = [nn.Linear(4, 4)]
        elif kind == "item":
            self.cfg = {"scale": torch.tensor(0.5)}
        elif kind == "parameters()":
            self.w = nn.Parameter(four())

    def held(self):
        return {"dict": lambda: self.cfg["w"], "namespace": lambda: self.cfg.w, "dataclass": lambda: self.cfg.w,
                "tuple": lambda: self.cfg[0], "closure": lambda: self.t,
                "unregistered module": lambda: self.cfg[0].weight, "item": lambda: self.cfg["scale"],
                "parameters()": lambda: self.w}[self.kind]()

    def forward(self, x):
        if self.kind == "closure":
            return self.helper(x) + 1
        if self.kind == "unregistered module":
            return x * self.cfg[0].weight.exp().sum(0) + 1
        if self.kind == "item":
            return x * self.cfg["scale"].item() + 1
        if self.kind == "parameters()":
            return x * next(self.parameters()).exp() + 1
        return x * self.held().exp() + 1


@pytest.mark.parametrize("kind", ["dict", "namespace", "dataclass", "tuple", "closure", "unregistered module",
                                  "item", "parameters()"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_tensor_the_trace_computed_from_is_watched(kind, verify):
    model = Holder(kind).eval()
    x = torch.randn(3, 4)
    opt = fxfuse.optimize(model, x, verify=verify, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.held().mul_(-1)
        y = torch.randn(3, 4)
        torch.testing.assert_close(opt(y), model(y))
    assert fxfuse.stats(opt)["optimized"]


class Reciprocal(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return 1.0 / (x * self.scale) + 1


@pytest.mark.parametrize("zero, negative_zero", [(np.float32(0.0), np.float32(-0.0)), (np.float16(0.0), np.float16(-0.0))])
def test_a_numpy_scalar_or_complex_attribute_changed_to_negative_zero_rebuilds(zero, negative_zero):
    model = Reciprocal(zero).eval()
    x = torch.rand(2, 3) + 0.5
    opt = optimize_strict(model, x)
    with torch.no_grad():
        opt(x)
        model.scale = negative_zero
        torch.testing.assert_close(opt(x), model(x))


def test_complex_and_numpy_attributes_compare_by_sign_of_zero():
    from fxfuse.module_state import same_attr
    assert not same_attr(0j, -0j) and not same_attr(complex(1, 0.0), complex(1, -0.0)) and same_attr(1j, 1j)
    assert not same_attr(np.float32(0.0), np.float32(-0.0)) and same_attr(np.float32("nan"), np.float32("nan"))
    assert not same_attr(np.float32(1.0), np.float64(1.0))


class GradBranchThroughC(nn.Module):
    def forward(self, x):
        if torch._C.is_grad_enabled():
            return x * 2 + 1
        return x * 3 + 1


@pytest.mark.parametrize("verify", [True, False])
def test_a_grad_mode_branch_through_torch_C_is_seen(verify):
    model = GradBranchThroughC().eval()
    x = torch.randn(4, 3)
    opt = fxfuse.optimize(model, x, verify=verify)
    y = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.enable_grad():
            torch.testing.assert_close(opt(y), model(y))
    with torch.no_grad():
        torch.testing.assert_close(opt(y), model(y))


class PadOfAView(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):   # [1, L, C] -> [1, C, 1, L]: channels_last or not by x.stride(0)
        h = x.permute(0, 2, 1).unsqueeze(2)
        h = F.pad(h, (1, 1)) if self.op == "pad" else torch.roll(h, 1, -1)
        return h * 2 + 1


@pytest.mark.parametrize("op", ["pad", "roll"])
def test_pad_and_roll_output_strides_follow_a_size_1_stride(op):
    model = PadOfAView(op).eval()
    opt = optimize_strict(model, torch.randn(1, 5, 4))
    other = torch.randn(5, 4).unsqueeze(0).as_strided((1, 5, 4), (1, 4, 1))
    with torch.no_grad():
        got, expected = opt(other), model(other)
    torch.testing.assert_close(got, expected)
    assert got.stride() == expected.stride()


class LSTMThenAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h, _ = self.rnn(x)
        return self.mha(h, h, h, need_weights=False)[0] * 2


def test_rounding_between_modes_in_torch_is_no_mode_dependence():
    torch.manual_seed(0)
    model = LSTMThenAttention().eval()
    x = torch.randn(2, 5, 8)
    opt = optimize_strict(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            y = torch.randn(2, 5, 8)
            torch.testing.assert_close(opt(y), model(y))
    assert not opt._original_calls.get("inference"), dict(opt._original_calls)


def _is_compiling_spellings():   # `is_compiling` bound at import, before fxfuse's export trace (module top)
    return {"torch._dynamo": lambda: torch._dynamo.is_compiling(), "bound name": lambda: is_compiling(),
            "torch._utils": lambda: torch._utils.is_compiling(), "torch.compiler": lambda: torch.compiler.is_compiling()}


class CompileOnlyBranch(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.lin, self.spelling = nn.Linear(4, 4), spelling

    def forward(self, x):
        h = torch.stack([self.lin(row) for row in x])   # iterating a tensor: symbolic_trace fails, torch.export traces
        if _is_compiling_spellings()[self.spelling]():  # eager: False
            h = h * 0
        return h.relu()


@pytest.mark.parametrize("spelling", ["torch._dynamo", "bound name", "torch._utils", "torch.compiler"])
@pytest.mark.parametrize("verify", [True, False])
def test_every_spelling_of_is_compiling_answers_as_eager_while_exporting(spelling, verify):
    torch.manual_seed(0)
    model = CompileOnlyBranch(spelling).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # torch._utils.is_compiling is deprecated
        warnings.simplefilter("ignore", UserWarning)
        opt = fxfuse.optimize(model, torch.randn(3, 4), verify=verify, strict=True)
        with torch.no_grad():
            y = torch.randn(3, 4)
            torch.testing.assert_close(opt(y), model(y))
    assert torch.compiler.is_compiling() is False and torch._dynamo.is_compiling() is False


class IntOfATensorAsASize(nn.Module):
    def forward(self, x, m):
        return x[:, :int(m.sum())] * 2


class AssignAtA0dIndex(nn.Module):
    def forward(self, x, i):
        h = x * 2
        h[i] = 0.0
        return h


@pytest.mark.parametrize("model, args, advice", [
    (IntOfATensorAsASize(), (torch.randn(3, 8), torch.tensor([1, 1, 0])), "Write `t.item()`"),
    (AssignAtA0dIndex(), (torch.randn(3, 4), torch.tensor(1)), "`h[i.view(1)] = v`"),
])
def test_a_refusal_at_a_data_dependent_int_names_the_spelling_that_works(model, args, advice):
    with pytest.raises(fxfuse.FxfuseError, match=re.escape(advice)):
        fxfuse.optimize(model.eval(), args, strict=True)


class ReadsLive(nn.Module):
    """Held tensors the graph reads live (an alias or a metadata read at trace time): an in-place update
    between calls needs no rebuild (review47r2: an EMA model rebuilt on every call)."""
    def __init__(self, how):
        super().__init__()
        self.cfg, self.how, self.lin = {"w": torch.randn(16)}, how, nn.Linear(16, 16)

    def forward(self, x):
        w = self.cfg["w"]
        if self.how == "float":
            w = w.float()
        elif self.how == "slice":
            w = w[:16]
        elif self.how == "dtype":
            x = x.to(next(self.parameters()).dtype)
        return self.lin(x) * w


@pytest.mark.parametrize("how", ["float", "slice", "dtype"])
def test_a_held_tensor_read_live_is_no_reason_to_rebuild(how):
    model = ReadsLive(how).eval()
    x = torch.randn(3, 16)
    opt = optimize_strict(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            for _ in range(4):
                model.cfg["w"].add_(0.01)
                for p in model.parameters():
                    p.mul_(0.999)
                torch.testing.assert_close(opt(x), model(x))
    assert opt._dropped[0] == 0


class WritesItsParameters(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.fc, self.spelling = nn.Linear(8, 8), spelling

    def forward(self, x):
        for p in self.parameters():
            if self.spelling == ".data":
                p.data.mul_(0.5)
            else:
                with torch.no_grad():
                    p.mul_(0.5)
        return self.fc(x)


@pytest.mark.parametrize("spelling", [".data", "no_grad"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_forward_writing_its_parameters_is_refused_and_they_stay(spelling, verify):
    model = WritesItsParameters(spelling).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fxfuse.FxfuseError, match="writes the parameter|changes the module's state"):
        fxfuse.optimize(model, torch.randn(4, 8), verify=verify, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class NonTensorValueRead(nn.Module):
    """Value reads whose result is no tensor (review47r4)."""
    def __init__(self, how):
        super().__init__()
        self.cfg, self.how = {"w": torch.ones(4)}, how

    def forward(self, x):
        w = self.cfg["w"]
        flag = {"equal": lambda: torch.equal(w, torch.ones(4)), "allclose": lambda: torch.allclose(w, torch.ones(4)),
                "format": lambda: f"{w[0]:.4f}" == "1.0000", "contains": lambda: 1.0 in w}[self.how]()
        return x * 2 if flag else x * 3


@pytest.mark.parametrize("how", ["equal", "allclose", "format", "contains"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_value_read_with_no_tensor_result_is_watched(how, verify):
    model = NonTensorValueRead(how).eval()
    x = torch.randn(3, 4)
    opt = fxfuse.optimize(model, x, verify=verify)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.cfg["w"].mul_(-1)
        torch.testing.assert_close(opt(x), model(x))


class ShapedLikeALiveTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + torch.zeros_like(self.lin.weight[0]) + self.lin.weight.new_ones(8)


def test_a_factory_shaped_like_a_live_tensor_reads_no_value():
    model = ShapedLikeALiveTensor().eval()
    x = torch.randn(3, 8)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        for _ in range(4):
            for p in model.parameters():
                p.mul_(0.999)
            torch.testing.assert_close(opt(x), model(x))
    assert opt._dropped[0] == 0


class GradAttributes(nn.Module):
    def __init__(self, read):
        super().__init__()
        self.lin, self.read = nn.Linear(4, 4), read

    def forward(self, x):
        y = self.lin(x)
        if self.read == "T.grad_fn":
            flag = y.T.grad_fn is not None
        elif self.read == "loop .grad":
            flag = any(p.grad is not None for p in self.parameters())
        else:
            flag = x.grad is not None
        return y * 2 if flag else y * 3


@pytest.mark.parametrize("read", ["T.grad_fn", "loop .grad", "input .grad"])
def test_grad_reads_follow_eager_or_refuse(read):
    model = GradAttributes(read).eval()
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxfuse.optimize(model, x, verify=False)
    assert not fxfuse.stats(opt)["optimized"]   # a gradient changes with no version counter; a grad_fn with how
    #                                             the caller made the input (review47r5): refused
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        torch.testing.assert_close(opt(x), model(x))


class WritesThroughOtherSpellings(nn.Module):
    """Parameter writes review47r5 found unseen: an item assignment, `out=`, `.data = `, a _foreach_ op."""
    def __init__(self, spelling):
        super().__init__()
        self.fc, self.spelling = nn.Linear(8, 8), spelling

    def forward(self, x):
        w = next(self.parameters())
        with torch.no_grad():
            if self.spelling == "setitem":
                w.data[0] = w.data[0] * 2
            elif self.spelling == "out=":
                torch.mul(w.data, 0.5, out=w.data)
            elif self.spelling == ".data =":
                w.data = w.data * 0.5
            else:
                torch._foreach_mul_([p.data for p in self.parameters()], 0.5)
        return self.fc(x)


@pytest.mark.parametrize("spelling", ["setitem", "out=", ".data =", "_foreach_mul_"])
def test_other_spellings_of_a_parameter_write_are_refused_and_undone(spelling):
    model = WritesThroughOtherSpellings(spelling).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fxfuse.FxfuseError):
        fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class EagerMultiOutputOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.randn(4, 6)

    def forward(self, x):
        a, b = self.table.chunk(2, 1)
        gx, gy = torch.meshgrid(torch.arange(4.0), torch.arange(3.0), indexing="ij")
        return x * (a + b).exp() + (gx + gy).sum(), x.requires_grad_(False)


def test_ops_returning_several_tensors_at_trace_time_trace():
    model = EagerMultiOutputOps().eval()
    x = torch.randn(4, 3)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.table.mul_(-1)
        torch.testing.assert_close(opt(x), model(x))


class FreezesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        self.backbone.requires_grad_(False)
        self.head.bias.requires_grad = False
        w = self.head.weight
        return self.head(self.backbone(x)) * (1.0 if w.is_conj() or w.type() == "x" else 2.0)


def test_requires_grad_off_and_metadata_reads_are_no_state_writes_nor_value_reads():
    model = FreezesInForward().eval()
    x = torch.randn(3, 8)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        for _ in range(3):
            for p in model.head.parameters():
                p.mul_(0.999)
            torch.testing.assert_close(opt(x), model(x))
    assert opt._dropped[0] == 0



class WritesThroughAten(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.fc, self.spelling = nn.Linear(8, 8), spelling

    def forward(self, x):
        for p in self.parameters():
            if self.spelling == "aten":
                torch.ops.aten.mul_.Tensor(p.data, torch.tensor(0.5))
            else:
                torch.neg_(input=p.data)
        return self.fc(x)


@pytest.mark.parametrize("spelling", ["aten", "input="])
def test_parameter_writes_through_aten_or_a_keyword_are_refused_and_undone(spelling):
    model = WritesThroughAten(spelling).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fxfuse.FxfuseError):
        fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class FillFromAHeldValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.cfg = nn.Linear(4, 4), {"s": torch.tensor(2.0)}

    def forward(self, x):
        w = self.lin.weight
        kind = torch.result_type(w, 1.0)
        return self.lin(x) + torch.full_like(x, self.cfg["s"]).to(kind)


def test_a_fill_value_is_watched_and_result_type_is_metadata():
    model = FillFromAHeldValue().eval()
    x = torch.randn(3, 4)
    opt = optimize_strict(model, x)
    with torch.no_grad():
        for p in model.lin.parameters():
            p.mul_(0.999)
        torch.testing.assert_close(opt(x), model(x))
        assert opt._dropped[0] == 0
        model.cfg["s"].mul_(-3)
        torch.testing.assert_close(opt(x), model(x))
