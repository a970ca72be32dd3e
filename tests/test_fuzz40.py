"""Stop 40: tracing of forwards whose way depends on values (fuzz40e) and outputs (fuzz40b).
The user's Python state: test_fuzz40_state.py."""
import collections
import contextlib

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.runtime import OptimizedModule

from conftest import assert_refused_and_eager, optimize_warned


class ClipInTry(nn.Module):
    def forward(self, x):
        try:
            if x.abs().max() > 10:   # symbolic_trace raises here, and forward() catches it
                x = x.clamp(-10, 10)
        except Exception:  # noqa: BLE001
            pass
        return x.relu() * 2


class ClipSuppressed(nn.Module):
    def forward(self, x):
        with contextlib.suppress(Exception):
            if x.abs().max() > 10:
                x = x.clamp(-10, 10)
        return x.relu() * 2


@pytest.mark.parametrize("make,args", [
    (ClipInTry, lambda: (torch.randn(4, 8) * 0.1,)),
    (ClipSuppressed, lambda: (torch.randn(4, 8) * 0.1,)),
])
def test_a_trace_error_forward_catches_is_refused_not_followed_one_way(make, args):
    # before: the graph took the example's way (no clamp, k = 3, no loop) for every input, silently
    model = make().eval()
    opt, messages = optimize_warned(model, args())
    assert opt is model and len(messages) == 1 and "catches the error symbolic_trace raised" in messages[0]
    assert "test_fuzz40.py" in messages[0]   # the line of forward() that did it


class CheckedItem(nn.Module):
    def forward(self, x, n):
        if x.shape[0] > 0:   # symbolic_trace cannot follow this: torch.export traces
            pass
        k = n.item()
        torch._check(k <= 6, lambda: "k must be at most 6")
        return x[:, :k].relu() * 2


def test_a_torch_check_on_an_item_stays_in_the_exported_graph():
    # before: tracing._exported erased every aten._assert_scalar, so k = 7 returned a tensor where eager raises
    model = CheckedItem().eval()
    opt, messages = optimize_warned(model, (torch.randn(4, 8), torch.tensor(3)))
    assert isinstance(opt, OptimizedModule) and not messages
    x = torch.randn(4, 8)
    torch.testing.assert_close(opt(x, torch.tensor(5)), model(x, torch.tensor(5)))
    with pytest.raises(RuntimeError, match="must be at most 6"):
        model(x, torch.tensor(7))
    with pytest.raises(RuntimeError):
        opt(x, torch.tensor(7))


class DetachedToo(nn.Module):
    def forward(self, x):
        h = (x + 1).relu()
        return h, h.detach()


def test_a_returned_detach_is_a_new_tensor_sharing_memory():
    # before: normalize removed the detach, so out[1] was out[0]: `out[1].unsqueeze_(0)` reshaped out[0]
    model = DetachedToo().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        out = opt(torch.randn(4, 8))
    assert out[1] is not out[0] and out[1].data_ptr() == out[0].data_ptr()
    out[1].unsqueeze_(0)
    assert out[0].shape == (4, 8)


class DetachReshaped(nn.Module):
    def forward(self, x):
        h = (x + 1).relu()
        d = h.detach()
        d.unsqueeze_(0)   # reshapes d only
        return h * 2, d


def test_a_detach_changed_in_place_keeps_its_source_as_it_was():
    # before: refused with a misleading reason (verify), and with verify=False h came back [1, 4, 8]
    model = DetachReshaped().eval()
    for verify in (True, False):
        opt, messages = optimize_warned(model, torch.randn(4, 8), verify=verify)
        assert isinstance(opt, OptimizedModule) and not messages
        x = torch.randn(4, 8)
        with torch.no_grad():
            got, want = opt(x), model(x)
        assert [tuple(t.shape) for t in got] == [(4, 8), (1, 4, 8)]
        torch.testing.assert_close(got, want)


class ConstantOutputs(nn.Module):
    def forward(self, x):
        mask = torch.ones(8).expand(4, 8)   # a default mask, as HF-style code builds one
        c = torch.zeros(3)
        return (x * 2).relu(), mask, c, c, c[1:]


def test_outputs_made_of_constants_keep_eagers_strides_and_aliasing():
    # before: each was cloned on its own: the mask row-major, c twice two tensors, c[1:] no view of them
    model = ConstantOutputs().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        out = opt(torch.randn(4, 8))
        again = opt(torch.randn(4, 8))
    assert out[1].stride() == (0, 1) and out[2] is out[3]
    out[2].fill_(7)
    assert out[4].tolist() == [7.0, 7.0] and again[2].tolist() == [0.0, 0.0, 0.0]   # fresh per call


OutWithSize = collections.namedtuple("OutWithSize", "logits shape")


class Pair(tuple):
    def first(self):
        return self[0]


class Tokens(list):
    pass


class ReturnsSubclasses(nn.Module):
    def __init__(self, nested):
        super().__init__()
        self.nested = nested

    def forward(self, x):
        if self.nested:
            return {"toks": Tokens([(x * 2).relu(), x])}
        return Pair(((x * 2).relu(), x + 1))


@pytest.mark.parametrize("nested", [False, True])
def test_a_tuple_or_list_subclass_output_is_refused_not_retyped(nested):
    # before: it came back a plain tuple / list, silently (its methods gone)
    model = ReturnsSubclasses(nested).eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert opt is model and len(messages) == 1
    assert ("output['toks'] is a Tokens" if nested else "output is a Pair") in messages[0]


class SizeInNamedTuple(nn.Module):
    def forward(self, x):
        return OutWithSize((x * 2).relu(), x.shape)


def test_a_size_inside_a_named_tuple_is_not_returned_as_a_tuple():
    # before: (4, 8), a plain tuple (.numel() failed); now refused (verify compares container types)
    model = SizeInNamedTuple().eval()
    opt, _ = optimize_warned(model, torch.randn(4, 8))
    with torch.no_grad():
        out = opt(torch.randn(4, 8))
    assert isinstance(out.shape, torch.Size) and out.shape.numel() == 32


OutWithShape = collections.namedtuple("OutWithShape", "logits shape")


class FieldNamedShape(nn.Module):
    def forward(self, x):
        return OutWithShape((x * 2).relu(), x.shape[0])


def test_explain_of_a_named_tuple_output_with_a_field_named_shape():
    opt, messages = optimize_warned(FieldNamedShape().eval(), torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages
    with torch.no_grad():
        opt(torch.randn(4, 8))
    assert "fused" in fxfuse.explain(opt)   # before: AttributeError ('Out' object has no attribute 'dtype')


class GatedNorm(nn.Module):   # RetNet: silu(g(x)) * gn(o.reshape(B * T, D)).view(B, T, D)
    def __init__(self):
        super().__init__()
        self.g, self.gn = nn.Linear(12, 12, bias=False), nn.GroupNorm(3, 12)

    def forward(self, x, o):
        b, t, d = x.shape
        return nn.functional.silu(self.g(x)) * self.gn(o.reshape(b * t, d)).view(b, t, d)


class SameShapeView(nn.Module):
    def forward(self, x):
        h = x * 2
        return h + torch.relu(h).view_as(h)


@pytest.mark.parametrize("make,args", [
    (GatedNorm, lambda: (torch.randn(2, 9, 12), torch.randn(2, 9, 12))),
    (SameShapeView, lambda: (torch.randn(2, 8, 16),)),
])
def test_a_view_does_not_cut_a_pointwise_chain_in_two(make, args):
    # before: sink_views reshaped silu's result (or the same-shape view stayed): 2 kernels where 1 does
    model = make().eval()
    a = args()
    opt, messages = optimize_warned(model, a)
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] == 1
    b = args()
    with torch.no_grad():
        torch.testing.assert_close(opt(*b), model(*b))


class OneHotClasses(nn.Module):
    def forward(self, labels):
        oh = nn.functional.one_hot(labels).float()   # labels.max() + 1 columns
        return oh.sum(0) / oh.shape[1]


class RepeatCounts(nn.Module):
    def forward(self, x, counts):
        idx = torch.repeat_interleave(counts)        # counts.sum() entries
        return x.relu() * 2 / idx.shape[0]


class ByteMasked(nn.Module):
    def forward(self, x):
        p = x[(x > 0).byte()]                        # a uint8 mask still selects (deprecated)
        return x.relu() / p.shape[0]


class Positions(nn.Module):
    def forward(self, x, n):
        pos = torch.arange(n)                        # a 0-dim tensor as a size
        return x.relu() + pos.shape[0]


class FirstRows(nn.Module):
    def forward(self, x, n):
        h = x.narrow(0, 0, n)
        return h.sum(0) / h.shape[0]


class TopkMean(nn.Module):
    def forward(self, x, n):
        v = x.topk(n, 1).values
        return v.sum(1) / v.size(1)


@pytest.mark.parametrize("make,example,later", [
    (OneHotClasses, lambda: (torch.tensor([0, 3, 1, 2, 1, 0]),), lambda: (torch.tensor([0, 5, 1, 2, 4, 0]),)),
    (RepeatCounts, lambda: (torch.randn(4, 8), torch.tensor([1, 2, 3, 0, 1])),
     lambda: (torch.randn(4, 8), torch.tensor([4, 2, 3, 0, 1]))),
    (ByteMasked, lambda: (torch.randn(6, 8),), lambda: (torch.randn(6, 8),)),
    (Positions, lambda: (torch.randn(4, 8), torch.tensor(3)), lambda: (torch.randn(4, 8), torch.tensor(5))),
    (FirstRows, lambda: (torch.randn(6, 8), torch.tensor(3)), lambda: (torch.randn(6, 8), torch.tensor(5))),
    (TopkMean, lambda: (torch.randn(6, 8), torch.tensor(3)), lambda: (torch.randn(6, 8), torch.tensor(5))),
])
def test_a_size_read_of_a_value_sized_result_is_refused_not_frozen(make, example, later):
    # before: the size was frozen at the example's (silent wrong answers on other values)
    assert_refused_and_eager(make, example, later, "depends on the input's values")


class ExportedWeightSpellings(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.W, self.b = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(16))
        self.flat = nn.Parameter(torch.randn(16 * 8))

    def forward(self, x):
        for _ in range(x.shape[0]):   # symbolic_trace cannot iterate a size: torch.export traces
            pass
        if self.spelling == "view":
            return torch.relu(nn.functional.linear(x, self.flat.view(16, 8), self.b))
        w = {"T": lambda: self.W.T, "mT": lambda: self.W.mT, "swapaxes": lambda: self.W.swapaxes(-1, -2)}
        return torch.relu(x @ w[self.spelling]() + self.b)


@pytest.mark.parametrize("spelling", ["T", "mT", "swapaxes", "view"])
def test_exports_spellings_of_a_weight_make_a_linear(spelling):
    # before: aten.numpy_T / mT / swapaxes / view of the weight kept a library matmul (no GEMM under gemm="force")
    model = ExportedWeightSpellings(spelling).eval()
    x = torch.randn(2, 3, 8)
    opt, messages = optimize_warned(model, x, gemm="force")
    assert isinstance(opt, OptimizedModule) and not messages and "torch.export" in fxfuse.explain(opt)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class PickRow(nn.Module):
    def forward(self, x, i):
        return torch.sigmoid(x[i.item()]) * 2 + x[0]   # shape (8,) whatever i is


class Window(nn.Module):
    def forward(self, x, i):
        return torch.relu(x.narrow(1, i.item(), 2)) * 2 + 1   # a start read from a value, length 2


@pytest.mark.parametrize("make", [PickRow, Window])
def test_an_index_read_from_a_value_sets_no_size_and_fuses(make):
    # before: marked "shape depends on the input's values": nothing after it fused (right values)
    model = make().eval()
    opt, messages = optimize_warned(model, (torch.randn(4, 8), torch.tensor(2)))
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] == 1
    for i in (0, 3, 1):
        x = torch.randn(4, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x, torch.tensor(i)), model(x, torch.tensor(i)))
