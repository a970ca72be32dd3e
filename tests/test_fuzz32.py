"""Stop 32's changes, each checked against eager and against what it promises.

A part of a parameter sliced in forward() (`F.linear(x, W[:16], b[:16])`, a packed projection
split with `W.split(...)` or `W.chunk(...)`) is a constant view of the model's tensor
(normalize_layers.fold_constant_slice), so the generated GEMM takes such a layer with its
epilogue where it used to stay a library call ("its weight is computed in the graph")."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402


class SlicedRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(12, 24)

    def forward(self, x):
        return torch.relu(F.linear(x, self.l.weight[:16], self.l.bias[:16])) + 1


class PackedSplit(nn.Module):   # nn.MultiheadAttention's packed projection for cross-attention
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(24, 8)), nn.Parameter(torch.randn(24))

    def forward(self, q, kv):
        wq, wkv = self.w.split([8, 16])
        bq, bkv = self.b.split([8, 16])
        return torch.relu(F.linear(q, wq, bq)) * 2, F.gelu(F.linear(kv, wkv, bkv))


class StridedParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12))

    def forward(self, x):
        return torch.relu(x @ self.w[:, ::2] + 1), torch.relu(F.linear(x, self.w.chunk(3, dim=1)[2].T))


CASES = [(SlicedRows, [(5, 12)], 1), (PackedSplit, [(3, 8), (5, 8)], 2), (StridedParts, [(5, 8)], 2)]


def _outputs(module, args):
    with torch.no_grad():
        out = module(*args)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("cls,shapes,gemms", CASES, ids=[c[0].__name__ for c in CASES])
def test_sliced_weights_run_in_the_generated_gemm_and_follow_edits(cls, shapes, gemms, verify):
    torch.manual_seed(0)
    model = cls().eval()
    args = tuple(torch.randn(*s) for s in shapes)
    opt = fxfuse.optimize(model, args, strict=True, gemm="force", verify=verify)
    report = fxfuse.explain(opt)
    assert "computed in the graph" not in report
    assert fxfuse.stats(opt)["library_calls"] == 0 and report.count("generated GEMM") >= gemms, report
    for a, b in zip(_outputs(opt, args), _outputs(model, args)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5)                                 # an in-place edit reaches the views
    fresh = tuple(torch.randn(*s) for s in shapes)
    for a, b in zip(_outputs(opt, fresh), _outputs(model, fresh)):
        torch.testing.assert_close(a, b)


def test_a_reassigned_parameter_is_seen_through_its_slice():
    torch.manual_seed(0)
    model, x = SlicedRows().eval(), torch.randn(5, 12)
    opt = fxfuse.optimize(model, x, strict=True, gemm="force")
    model.l.weight = nn.Parameter(torch.randn(24, 12))
    torch.testing.assert_close(_outputs(opt, (x,))[0], _outputs(model, (x,))[0])


def test_slices_keep_eager_semantics_where_they_are_no_weight():
    """A positional table sliced by the input's length, an int index, a whole-tuple use."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos, self.table = nn.Parameter(torch.randn(1, 10, 8)), nn.Parameter(torch.randn(3, 8))

        def forward(self, x):
            parts = self.table.unbind(0)
            return torch.relu(x + self.pos[:, :x.size(1)]) * self.table[1], torch.stack(parts).sum(0)
    torch.manual_seed(0)
    model = Mixed().eval()
    for n in (7, 3):
        x = torch.randn(2, n, 8)
        opt = fxfuse.optimize(model, x, strict=True, verify=False)
        assert fxfuse.stats(opt)["fused_kernels"] >= 1
        for a, b in zip(_outputs(opt, (x,)), _outputs(model, (x,))):
            torch.testing.assert_close(a, b)
            assert a.stride() == b.stride()
