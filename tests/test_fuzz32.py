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


def _bn_block():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 13), nn.BatchNorm1d(13), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2)
    return model


def test_a_parent_build_spends_none_of_an_optimized_childs_specializations(recwarn):
    """The parent's verify and grad probes called the child OptimizedModule, which built two
    unused specializations per parent build; at the parent's 5th shape came the child's
    "all 8 specializations are in use" warning (a strict child raised GuardError)."""
    class Parent(nn.Module):
        def __init__(self, child):
            super().__init__()
            self.child, self.head = child, nn.Linear(13, 3)

        def forward(self, x):
            return torch.sigmoid(self.head(torch.relu(self.child(x))))
    child = _bn_block()
    opt_child = fxfuse.optimize(child, torch.randn(5, 13), strict=True)
    parent = Parent(opt_child).eval()
    opt = fxfuse.optimize(parent, torch.randn(5, 13))
    for batch in (2, 3, 4, 6, 7, 9):
        x = torch.randn(batch, 13)
        with torch.no_grad():
            want = torch.sigmoid(parent.head(torch.relu(child(x))))   # not through opt_child
        torch.testing.assert_close(_outputs(opt, (x,))[0], want)
    assert len(opt_child._specializations) == 1 and len(opt._specializations) == 7
    assert not [w for w in recwarn if "fxfuse" in str(w.message)]


def test_an_input_that_is_a_weight_written_in_place_runs_the_original():
    """forward() writes its input, and the input is the weight BatchNorm was folded into: eager
    computes with the written weight, the graph read its folded copy."""
    class WritesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = _bn_block()

        def forward(self, x):
            x.add_(1)
            return self.block(x)
    model = WritesInput().eval()
    twin = WritesInput().eval()
    twin.load_state_dict(model.state_dict())
    opt = fxfuse.optimize(model, torch.randn(13, 13))
    with pytest.warns(fxfuse.FxfuseWarning, match="parameter or buffer of the model"):
        got = _outputs(opt, (model.block[0].weight,))[0]
    want = _outputs(twin, (twin.block[0].weight,))[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.block[0].weight, twin.block[0].weight)


def test_copies_of_inference_tensors_are_announced_once():
    with torch.inference_mode():
        model = _bn_block()
    x = torch.randn(5, 13)
    with pytest.warns(fxfuse.FxfuseWarning, match="inference tensors") as seen:
        opt = fxfuse.optimize(model, x)
        with torch.inference_mode():
            opt(torch.randn(7, 13))     # a second build: no second warning
    assert len([w for w in seen if "inference tensors" in str(w.message)]) == 1
    assert len(opt._specializations) == 2


def test_prune_remove_is_seen():
    """prune.remove puts the same Parameter back with its .data replaced: no version counter
    moves, but the registration it makes has the storages compared."""
    from torch.nn.utils import prune
    model, x = _bn_block(), torch.randn(5, 13)
    opt = fxfuse.optimize(model, x)
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.warns(fxfuse.FxfuseWarning, match="hook"):
        _outputs(opt, (x,))                       # while pruned: a forward pre-hook, the original runs
    prune.remove(model[0], "weight")
    assert (model[0].weight == 0).sum() > 0
    torch.testing.assert_close(_outputs(opt, (x,))[0], _outputs(model, (x,))[0])


def test_a_positional_default_is_the_same_specialization_and_misses_name_the_argument():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x, y, alpha=1.0):
            return torch.relu(self.lin(x) + alpha * y)
    torch.manual_seed(0)
    model, x, y = Scaled().eval(), torch.randn(3, 6), torch.randn(3, 6)
    opt = fxfuse.optimize(model, (x, y), strict=True, max_specializations=1)
    torch.testing.assert_close(_outputs(opt, (x, y, 1.0))[0], _outputs(model, (x, y))[0])
    assert len(opt._specializations) == 1
    with pytest.raises(fxfuse.GuardError, match=r"input 2 \(alpha\) is the float 2.0"):
        _outputs(opt, (x, y, 2.0))


@pytest.mark.parametrize("spelling", ["module", "functional"])
def test_max_norm_embeddings_are_refused_before_anything_runs(spelling):
    """max_norm rescales the looked-up rows of the weight in place: optimize() ran forward()
    (verify, probes) before it refused, and left the rows rescaled."""
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 6, max_norm=1.0 if spelling == "module" else None)
            self.head = nn.Linear(6, 3)

        def forward(self, ids):
            h = self.e(ids) if spelling == "module" else F.embedding(ids, self.e.weight, max_norm=1.0)
            return self.head(h), F.linear(h, self.e.weight)
    torch.manual_seed(0)
    model = Table().eval()
    with torch.no_grad():
        model.e.weight.mul_(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(fxfuse.FxfuseWarning, match="e.weight in place"):
        assert fxfuse.optimize(model, torch.randint(0, 10, (2, 4))) is model
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("make", ["torch.zeros_like(x)", "x.new_zeros(x.shape)", "torch.zeros(x.shape)"])
def test_an_accumulator_created_from_x_leaves_x_unwritten(make):
    """`acc = torch.zeros_like(x); acc.add_(...)` made x look written in place: the ops reading
    x were not fused ("may alias a value an in-place op writes")."""
    class Accumulates(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            acc = eval(make)
            h = torch.sigmoid(x) * 2 + x
            acc.add_(F.gelu(self.a(x)))
            acc.mul_(0.5)
            return F.relu(self.b(h)) + acc
    torch.manual_seed(0)
    model, x = Accumulates().eval(), torch.randn(3, 8)
    opt = fxfuse.optimize(model, x, strict=True, verify=False)
    assert "may alias" not in fxfuse.explain(opt) and fxfuse.stats(opt)["fused_kernels"] == 2
    torch.testing.assert_close(_outputs(opt, (x,))[0], _outputs(model, (x,))[0])


def test_math_of_sizes_folds_into_the_kernel_and_explain_keeps_keywords():
    import math

    class Scores(nn.Module):
        def forward(self, q, k):
            a, b = q.split(4, dim=-1)
            s = (a @ b.transpose(-1, -2)) / math.sqrt(a.size(-1))
            return torch.relu(s) * math.log(k.shape[0] + 1) + k.mean(-1, keepdim=True)
    model = Scores().eval()
    q, k = torch.randn(2, 5, 8), torch.randn(2, 5, 5)
    opt = fxfuse.optimize(model, (q, k), strict=True)
    report = fxfuse.explain(opt)
    assert "sqrt" not in report and "split(4, dim=-1)" in report and "keepdim=True" in report
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    torch.testing.assert_close(_outputs(opt, (q, k))[0], _outputs(model, (q, k))[0])
    q, k = torch.randn(3, 5, 8), torch.randn(3, 5, 5)   # another batch: the log's value follows it
    torch.testing.assert_close(_outputs(opt, (q, k))[0], _outputs(model, (q, k))[0])
