"""Stop 40, second round: the review of the stop's diff (review40), value-sized results again
(fuzz40g) and an optimized module among other modules (fuzz40f)."""
import collections

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.runtime import OptimizedModule

from conftest import assert_refused_and_eager, optimize_warned


class ViewThenTransposed(nn.Module):
    def forward(self, x):
        h = torch.sigmoid(x)
        v = h.reshape(h.shape)   # a view of h with h's shape
        v.t_()                   # transposes v only
        return h * 2, v * 1


class SourceUnsqueezed(nn.Module):
    def forward(self, x):
        h = torch.sigmoid(x)
        v = h.view(4, 8)
        h.unsqueeze_(0)          # h only
        return v * 2, h + 1


class DetachedThenSourceUnsqueezed(nn.Module):
    def forward(self, x):
        h = (x + 1).relu()
        d = h.detach()
        h.unsqueeze_(0)          # h only: d stays [4, 8]
        return h * 2, d * 1


@pytest.mark.parametrize("make", [ViewThenTransposed, SourceUnsqueezed, DetachedThenSourceUnsqueezed])
@pytest.mark.parametrize("verify", [True, False])
def test_a_view_or_detach_reshaped_in_place_keeps_both_shapes(make, verify):
    # before: sink_views dropped the same-shape view (normalize the detach), so both got the in-place reshape
    model = make().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8), verify=verify)
    assert isinstance(opt, OptimizedModule) and not messages
    x = torch.randn(4, 8)
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert [t.shape for t in got] == [t.shape for t in want]
    torch.testing.assert_close(got, want)


class DetachScaled(nn.Module):
    def forward(self, x):
        h = (x + 1).relu()
        d = h.detach()
        d.mul_(2)                # a value write through the alias is one into h
        return h + 1


class DetachReadAndReturned(nn.Module):
    def forward(self, x):
        h = torch.sigmoid(x) * 2
        d = h.detach()
        return h + d, d


@pytest.mark.parametrize("make,kernels", [(DetachScaled, 1), (DetachReadAndReturned, 1)])
def test_a_kept_detach_splits_no_kernel(make, kernels):
    model = make().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] == kernels
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class SelectedRows(nn.Module):
    def forward(self, x, m):
        h = x[torch.nonzero(m).flatten().tolist()]   # as many rows as m has ones
        return h.sum(0) / h.shape[0]


class PiecePicked(nn.Module):
    def forward(self, x, k):
        h = x.split(3)[k.item()]                     # pieces of 3, 3 and 2 rows
        return h.sum(0) / h.shape[0]


class BoolIndexed(nn.Module):
    def forward(self, x, b):
        h = x[b.item()]                              # x[True]: [1, ...], x[False]: [0, ...]
        return h.sum() + h.shape[0]


class OneHotOfN(nn.Module):
    def forward(self, y, n):
        oh = nn.functional.one_hot(y, n).float()     # n: a 0-dim tensor
        return oh.sum(0) / oh.shape[1]


class FirstRowsOfAVector(nn.Module):
    def forward(self, x, n):
        h = x.narrow(0, 0, n)                        # n: shape (1,)
        return h.sum(0) / h.shape[0]


class NarrowedAlongAValue(nn.Module):
    def forward(self, x, d):
        h = x.narrow(d.item(), 0, 2)                 # the dim read from a value
        return h.sum() / h.shape[0]


@pytest.mark.parametrize("make,example,later", [
    (SelectedRows, lambda: (torch.randn(6, 4), torch.tensor([1, 0, 1, 0, 0, 0])),
     lambda: (torch.randn(6, 4), torch.tensor([1, 1, 1, 0, 1, 0]))),
    (PiecePicked, lambda: (torch.randn(8, 4), torch.tensor(0)), lambda: (torch.randn(8, 4), torch.tensor(2))),
    (BoolIndexed, lambda: (torch.randn(3, 4), torch.tensor(True)), lambda: (torch.randn(3, 4), torch.tensor(False))),
    (OneHotOfN, lambda: (torch.tensor([0, 1, 2]), torch.tensor(4)), lambda: (torch.tensor([0, 1, 2]), torch.tensor(6))),
    (FirstRowsOfAVector, lambda: (torch.randn(6, 4), torch.tensor([3])), lambda: (torch.randn(6, 4), torch.tensor([5]))),
    (NarrowedAlongAValue, lambda: (torch.randn(6, 4), torch.tensor(0)), lambda: (torch.randn(6, 4), torch.tensor(1))),
])
def test_more_value_sized_results_are_refused_where_a_size_is_read(make, example, later):
    # before: the size read was frozen at the example's (silently wrong on the later values)
    assert_refused_and_eager(make, example, later)


class UnsqueezedAtATensorDim(nn.Module):
    def forward(self, x, d):
        return torch.relu(x * 2).unsqueeze(d)


def test_a_dim_given_as_a_tensor_is_not_frozen_into_a_reshape():
    # before: sink_views made the unsqueeze a reshape to the example's shape
    model = UnsqueezedAtATensorDim().eval()
    opt, _ = optimize_warned(model, (torch.randn(4, 3), torch.tensor(1)))
    for d in (0, 2, 1):
        args = (torch.randn(4, 3), torch.tensor(d))
        with torch.no_grad():
            got, want = opt(*args), model(*args)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_host_reads_of_tensors_given_as_numbers_keep_the_graph_out_of_cuda_graphs():
    from fxfuse.data_dependent import reads_to_the_host
    from fxfuse.tracing import propagate_shapes

    class Calls(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, x, n):
            return self.f(x, n)
    for f in (lambda x, n: torch.arange(n) * 2, lambda x, n: x.narrow(1, n, 2) * 2, lambda x, n: torch.roll(x, n, 1),
              lambda x, n: torch.split(x, [2, 2])[n] * 2, lambda x, n: x.topk(n, 1).values):
        gm = torch.fx.symbolic_trace(Calls(f))
        propagate_shapes(gm, (torch.randn(4, 4), torch.tensor(1)))
        assert reads_to_the_host(gm) is not None
    gm = torch.fx.symbolic_trace(Calls(lambda x, n: x[n] * 2))   # a gather on the device: no host read
    propagate_shapes(gm, (torch.randn(4, 4), torch.tensor(1)))
    assert reads_to_the_host(gm) is None


class Bins(nn.Module):
    def forward(self, x):
        edges = torch.linspace(x.min(), x.max(), 8)   # 8 steps: the bounds set no size
        return torch.relu(x) * 2 + edges.sum()


class BufferLength(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.tensor(8))

    def forward(self, x):
        return torch.relu(x) * 2 + torch.arange(self.n).sum()


class RepeatedToASize(nn.Module):
    def forward(self, x, r):
        h = torch.repeat_interleave(x, r, dim=0, output_size=8)
        return torch.relu(h) * 2 + h.shape[0]


@pytest.mark.parametrize("make,args", [
    (Bins, lambda: (torch.randn(4, 8),)),
    (BufferLength, lambda: (torch.randn(4, 8),)),
    (RepeatedToASize, lambda: (torch.randn(4, 3), torch.tensor([1, 2, 3, 2]))),
])
def test_sizes_not_read_from_the_inputs_values_still_fuse(make, args):
    model = make().eval()
    opt, messages = optimize_warned(model, args())
    assert isinstance(opt, OptimizedModule) and not messages and fxfuse.stats(opt)["fused_kernels"] >= 1
    a = args()
    with torch.no_grad():
        torch.testing.assert_close(opt(*a), model(*a))


class ShapeBranchInTry(nn.Module):
    def forward(self, x):
        try:
            if x.shape[0] > 2:   # a branch on a size: torch.export follows it
                x = x * 2
        except Exception:  # noqa: BLE001
            pass
        return torch.relu(x) + 1


def test_a_caught_trace_error_at_a_size_branch_goes_to_torch_export():
    # before: refused as a branch on a tensor's value
    model = ShapeBranchInTry().eval()
    opt, messages = optimize_warned(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and not messages and "torch.export" in fxfuse.explain(opt)
    for rows in (4, 2):
        x = torch.randn(rows, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


class SlicedAtAValue(nn.Module):
    def forward(self, x, n):
        if x.shape[0] > 0:   # torch.export traces
            pass
        k = n.item()
        return torch.relu(x[:, :k]) * 2


def test_exports_own_range_assumptions_do_not_raise_where_eager_returns():
    # before (this stop): export's `u0 >= -8` stayed in the graph, so k = -10 raised where eager slices nothing
    model = SlicedAtAValue().eval()
    opt, _ = optimize_warned(model, (torch.randn(4, 8), torch.tensor(3)))
    for k in (5, -10, 20):
        args = (torch.randn(4, 8), torch.tensor(k))
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), model(*args))


OutWithSize = collections.namedtuple("OutWithSize", "logits size")


class SizeInNamedTuple(nn.Module):
    def forward(self, x):
        return OutWithSize(torch.relu(x), x.shape)


def test_the_size_in_a_named_tuple_refusal_names_the_field():
    _, messages = optimize_warned(SizeInNamedTuple().eval(), torch.randn(4, 8))
    assert len(messages) == 1 and "output.size is a Size" in messages[0] and "tuple(x.shape)" in messages[0]


class ScaledByGetattr(nn.Module):
    def forward(self, x):
        scale = getattr(self, "scale", 2.0)   # every attribute watched: the type test was missed
        if isinstance(x, torch.Tensor):       # false for symbolic_trace's Proxy
            x = x * scale
        return torch.relu(x) + 1


def test_a_tensor_type_test_is_seen_also_where_attributes_are_read_by_name():
    # before, with verify=False: symbolic_trace's graph dropped `x * scale` (error 2.4)
    model = ScaledByGetattr().eval()
    opt, _ = optimize_warned(model, torch.randn(4, 8), verify=False)
    assert isinstance(opt, OptimizedModule) and "torch.export" in fxfuse.explain(opt)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x):
        return torch.relu(self.lin(x)) + self.shift


def test_buffers_parameters_and_children_registered_on_the_optimized_module_reach_the_model():
    # before: register_buffer/register_parameter landed on the wrapper (the graphs kept the old tensors);
    # add_module of an existing child raised KeyError
    model = Shifted().eval()
    opt, _ = optimize_warned(model, torch.randn(4, 8))
    opt.register_buffer("shift", torch.full((8,), 3.0))
    new_lin = nn.Linear(8, 8)
    opt.add_module("lin", new_lin)
    assert model.lin is new_lin and torch.equal(model.shift, torch.full((8,), 3.0))
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["specializations"] == 1   # rebuilt from the new state


def test_a_torch_compiled_module_is_optimized_from_the_module_it_compiled():
    # before: each build ran the compiled module in several modes, each a recompile: after one rebuild
    # dynamo's recompile limit was spent and the user's own compiled module silently ran eager
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    compiled = torch.compile(model, backend="eager")
    opt, messages = optimize_warned(compiled, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and opt.original is model and not messages
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
