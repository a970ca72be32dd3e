"""Stop 33's fixes from the helpers' rounds (.scratch/fuzz33*), each against eager."""
import copy
import collections
import dataclasses
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.errors import UnsupportedError  # noqa: E402


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 3)).eval()


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.SGD])
def test_a_fused_optimizer_step_reaches_the_folded_copies(optimizer):
    """fused=True optimizers write parameters without a version bump: the BatchNorm folded
    into the Linear's weight copy stayed stale (fuzz33a)."""
    model = _bn_net()
    eager = copy.deepcopy(model)
    opt = fxfuse.optimize(model, torch.randn(4, 7))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    steps = [optimizer(m.parameters(), lr=0.05, fused=True) for m in (model, eager)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # grad-mode calls run the original module (one warning)
        for _ in range(2):
            x = torch.randn(4, 7)
            for m, step in zip((opt, eager), steps):
                m(x).pow(2).mean().backward()
                step.step()
                step.zero_grad()
    x = torch.randn(4, 7)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), eager(x))


def test_a_plain_tensor_attribute_made_to_require_grad_after_optimize_runs_the_original():
    class Calibrated(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)
            self.T = torch.ones(1) * 1.5   # a plain tensor attribute, not a Parameter

        def forward(self, x):
            return self.lin(x) / self.T

    torch.manual_seed(0)
    model = Calibrated().eval().requires_grad_(False)
    x = torch.randn(4, 5)
    opt = fxfuse.optimize(model, x)
    model.T.requires_grad_(True)
    with pytest.warns(fxfuse.FxfuseWarning, match="autograd"):
        out = opt(x)
    assert out.requires_grad
    out.sum().backward()
    assert model.T.grad is not None


def test_a_frozen_model_with_grad_mode_on_runs_the_graph_without_verify():
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU()).eval().requires_grad_(False)
    x = torch.randn(3, 5)
    opt = fxfuse.optimize(model, x, verify=False, strict=True)   # strict: a fallback would raise
    torch.testing.assert_close(opt(x), model(x))
    assert not opt(x).requires_grad


def test_bool_and_or_fuse_and_are_no_writes():
    """`m1 & m2` was taken for an in-place op (operator.and_ ends in "_"): fusion stopped and
    the same mask passed twice ran the original (fuzz33d)."""
    class Masks(nn.Module):
        def forward(self, x, m1, m2):
            keep = (m1 & m2) | (x > 0.5)
            both = torch.logical_and(x > 0, m1).logical_or(m2)
            return torch.where(keep, x * 2, -x).relu() + 1, both, x.masked_fill(~(m1 | m2), 0.0) * 3

    torch.manual_seed(0)
    masks = lambda: (torch.randn(5, 7), torch.rand(5, 7) > 0.5, torch.rand(5, 7) > 0.5)   # noqa: E731
    model = Masks().eval()
    with torch.no_grad():
        for verify in (True, False):
            opt = fxfuse.optimize(model, masks(), strict=True, verify=verify)
            assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
            x, m1, m2 = masks()
            for args in ((x, m1, m2), (x, m1, m1)):   # the same mask twice: no fallback under strict
                for a, b in zip(opt(*args), model(*args)):
                    assert torch.equal(a, b)


def test_integer_and_stays_bitwise():
    class Bits(nn.Module):
        def forward(self, a, b):
            return (a & b) + 1, (a | 3) * 2
    a, b = torch.randint(0, 100, (4, 5)), torch.randint(0, 100, (4, 5))
    opt = fxfuse.optimize(Bits().eval(), (a, b), strict=True, verify=False)
    for x, y in zip(opt(a, b), Bits()(a, b)):
        assert torch.equal(x, y)


class HFOutput(collections.OrderedDict):   # the essentials of transformers' ModelOutput
    pass


@dataclasses.dataclass
class DictDataclass(dict):
    a: torch.Tensor = None


@pytest.mark.parametrize("kind", ["subclass", "dataclass", "defaultdict"])
@pytest.mark.parametrize("verify", [True, False])
def test_dict_subclass_outputs_are_refused_not_flattened(kind, verify):
    """torch.fx records a dict subclass as a plain dict: with verify=False the optimized module
    returned a dict (an empty one for a dict dataclass) where eager returns the subclass (fuzz33g)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4)

        def forward(self, x):
            h = torch.relu(self.lin(x))
            if kind == "subclass":
                return HFOutput(logits=h)
            if kind == "dataclass":
                return DictDataclass(a=h)
            return collections.defaultdict(list, out=h)

    model, x = Net().eval(), torch.randn(3, 6)
    with pytest.warns(fxfuse.FxfuseWarning, match="subclass of dict"):
        opt = fxfuse.optimize(model, x, verify=verify)
    assert type(opt(x)) is type(model(x))
    with pytest.raises(UnsupportedError, match="subclass of dict"):
        fxfuse.optimize(model, x, verify=verify, strict=True)


def test_a_dataclass_in_the_example_tuple_falls_back_with_one_warning():
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    class Net(nn.Module):
        def forward(self, b):
            return torch.relu(b.x) + 1

    batch = Batch(torch.randn(3, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(Net().eval(), (batch,))
    assert len([w for w in caught if issubclass(w.category, fxfuse.FxfuseWarning)]) == 1
    torch.testing.assert_close(opt(batch), Net()(batch))


def test_number_and_string_arguments_leave_no_checks_in_the_graph():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 4)

        def forward(self, x, scale: float = 1.0, mode: str = "a"):
            h = torch.relu(self.lin(x)) * scale
            return h + 1 if mode == "a" else h - 1

    model, x = Scaled().eval(), torch.randn(3, 5)
    opt = fxfuse.optimize(model, (x, 2.0, "b"), strict=True)
    assert fxfuse.stats(opt)["library_calls"] == 1   # the Linear only: no eq / _assert
    assert "_assert" not in fxfuse.explain(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, 2.0, "b"), model(x, 2.0, "b"))
        torch.testing.assert_close(opt(x, 3.0, "a"), model(x, 3.0, "a"))   # another specialization


def test_hardsigmoid_keeps_its_bits_near_minus_three():
    x = torch.tensor([-3.0, -2.9999998, -2.9999995, -2.99999, 2.9999998, 0.1, -0.1])
    model = nn.Sequential(nn.Hardsigmoid(), nn.Identity()).eval()
    opt = fxfuse.optimize(nn.Sequential(nn.Hardsigmoid(), nn.ReLU()).eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    torch.testing.assert_close(opt(x), torch.relu(model(x)), rtol=1e-6, atol=0)


def test_a_build_inside_functional_call_is_not_kept():
    """A specialization built while torch.func.functional_call had swapped the weights kept the
    temporary ones for every later call at that shape (fuzz33e)."""
    torch.manual_seed(0)
    model = _bn_net()
    opt = fxfuse.optimize(model, torch.randn(5, 7))
    temporary = {k: v * 2 for k, v in opt.named_parameters()}
    with torch.no_grad():
        x = torch.randn(3, 7)   # a new shape: a miss inside the call
        with pytest.warns(fxfuse.FxfuseWarning, match="functional_call"):
            inside = torch.func.functional_call(opt, temporary, (x,))
        torch.testing.assert_close(inside, torch.func.functional_call(model, {k[len("original."):]: v for k, v in
                                                                              temporary.items()}, (x,)))
        torch.testing.assert_close(opt(x), model(x))
        assert fxfuse.stats(opt)["specializations"] >= 1


@pytest.mark.parametrize("options", [{"strassen": "force"}, {"gemm": "force", "tf32x3": "force"}])
def test_an_all_zero_example_keeps_the_numerics_guard_closed(options):
    """The guard compared errors relative to a zero reference as 0.0 and let Strassen / 3xTF32
    in on a zeros example (fuzz33f): now the error cannot be measured there, as for NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 24)).eval()
    opt = fxfuse.optimize(model, torch.zeros(40, 64), verify=False, **options)
    report = fxfuse.explain(opt)
    assert "all zeros" in report, report
    x = torch.randn(40, 64)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_an_attribute_first_set_after_optimize_is_seen():
    """`getattr(self, "temperature", 1.0)` / `hasattr(self, "shift")`: an attribute absent at the
    build and set afterwards kept the traced "absent" branch at the shapes already built (fuzz33e)."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(13, 7)

        def forward(self, x):
            logits = self.fc(x) / getattr(self, "temperature", 1.0)
            if hasattr(self, "shift"):
                logits = logits + self.shift
            return logits

    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(5, 13)
    opt = fxfuse.optimize(model, x)
    with torch.no_grad():
        model.temperature = 4.0
        torch.testing.assert_close(opt(x), model(x))
        model.shift = torch.randn(7)
        torch.testing.assert_close(opt(x), model(x))
        Head.scale_unused = 3   # a class attribute no code looks up: no rebuild needed, values as before
        torch.testing.assert_close(opt(x), model(x))


def test_out_none_keywords_are_no_writes():
    """torch.fx records F.normalize, torch.norm and tensordot with out=None: each was taken for
    a write (fusion refused around it, opt(x, x) ran the original or raised under strict; fuzz33b)."""
    class Cosine(nn.Module):
        def forward(self, a, b):
            sim = (F.normalize(a, dim=-1) * F.normalize(b, dim=-1)).sum(-1) * 10
            return torch.relu(sim) + 1, torch.norm(a, dim=-1) * 2, torch.tensordot(a, b, dims=([1], [1])) + 1

    torch.manual_seed(0)
    model, a, b = Cosine().eval(), torch.randn(4, 6), torch.randn(4, 6)
    opt = fxfuse.optimize(model, (a, b), strict=True)
    assert "in-place op" not in fxfuse.explain(opt)
    with torch.no_grad():
        for args in ((a, b), (a, a)):   # the same tensor twice: no fallback (strict would raise)
            for got, want in zip(opt(*args), model(*args)):
                torch.testing.assert_close(got, want)


def test_a_submodule_assigned_with_a_hook_runs_the_original_from_the_first_call():
    """A module assigned after optimize() carrying a forward hook: the rebuild traced past the
    hook (verify=False: the first call skipped it; with verify a failed build blamed fxfuse and
    stuck after the hook's removal; fuzz33e)."""
    for options in ({"verify": False}, {}):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(13, 33), nn.ReLU(), nn.Linear(33, 7)).eval()
        opt = fxfuse.optimize(model, torch.randn(5, 13), **options)
        new = nn.Linear(33, 7)
        handle = new.register_forward_hook(lambda mod, inp, out: out * 10)
        model[2] = new
        x = torch.randn(5, 13)
        with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="forward hook"):
            torch.testing.assert_close(opt(x), model(x))
        handle.remove()
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
        assert fxfuse.stats(opt)["specializations"] == 1   # built once the hook is gone


def test_an_encoder_layer_given_an_attention_mask_keeps_eagers_fast_path():
    """A src_mask hiding every key of some rows: eager's fast path gives NaN there, the slow
    path torch.export records gave numbers, silently on calls unlike the example (fuzz33c).
    A block given any mask now stays one library call."""
    batch, tokens, width, heads = 3, 5, 8, 2

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(width, heads, 16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(width, 4)

        def forward(self, x, mask):
            return self.head(self.enc(x, src_mask=mask))

    def mask_from(lengths):
        valid = torch.arange(tokens)[None] < lengths[:, None]
        return (~(valid[:, :, None] & valid[:, None, :])).repeat_interleave(heads, 0)

    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        opt = fxfuse.optimize(model, (torch.randn(batch, tokens, width), mask_from(torch.tensor([5, 5, 5]))))
        x, mask = torch.randn(batch, tokens, width), mask_from(torch.tensor([5, 3, 4]))
        torch.testing.assert_close(opt(x, mask), model(x, mask), equal_nan=True)


def test_a_forward_decorated_with_enable_grad_records_without_verify():
    class Grads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        @torch.enable_grad()
        def forward(self, x):
            return torch.relu(self.lin(x))

    model, x = Grads().eval(), torch.randn(4, 5)
    opt = fxfuse.optimize(model, x, verify=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert opt(x).requires_grad == model(x).requires_grad == True   # noqa: E712


def test_a_forward_that_runs_autograd_is_told_so():
    class Forces(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, pos):
            with torch.enable_grad():
                pos = pos.detach().requires_grad_()
                energy = self.net(pos).sum()
                return -torch.autograd.grad(energy, pos)[0]

    with pytest.warns(fxfuse.FxfuseWarning, match="forward\\(\\) runs autograd"):
        fxfuse.optimize(Forces().eval(), torch.randn(5, 3))


GLOBAL_WEIGHT = torch.randn(6, requires_grad=True)


def test_review33_regressions():
    """review33: functional_call at a built shape after any module was created (the drop took
    the swapped tensors as the structure, then rebuilt from them); a global tensor requiring
    grad with verify=False (the unprobed rule looked at the model's tensors only); a child
    probed with hasattr(self.block, ...); out=None on a canonical op."""
    torch.manual_seed(0)
    model = _bn_net()
    x = torch.randn(5, 7)
    opt = fxfuse.optimize(model, x)
    nn.Linear(2, 2)   # any module created anywhere moves the registration count
    temporary = {k: v * 2 for k, v in opt.named_parameters()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.func.functional_call(opt, temporary, (x,))
        torch.testing.assert_close(opt(x), model(x))

    class Global(nn.Module):
        def forward(self, x):
            return torch.relu(x * GLOBAL_WEIGHT) + 1

    x = torch.randn(3, 6)
    opt = fxfuse.optimize(Global().eval(), x, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert opt(x).requires_grad

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.block = nn.Linear(6, 6), nn.Identity()

        def forward(self, x):
            y = self.lin(x)
            if hasattr(self.block, "scale"):
                y = y * self.block.scale
            return torch.sigmoid(y, out=None)

    model = Probe().eval()
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    model.block.scale = 5.0
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_buffer_is_no_internal_error(layout):
    """A GCN keeping its adjacency as a sparse buffer: comparing and locating sparse tensors
    raised NotImplementedError inside optimize ("internal error"; fuzz33k)."""
    torch.manual_seed(5)
    adjacency = torch.sparse_coo_tensor(torch.randint(0, 9, (2, 20)), torch.rand(20), (9, 9)).coalesce()

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("adj", adjacency if layout == "coo" else adjacency.to_sparse_csr())
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return F.relu(torch.sparse.mm(self.adj, self.lin(x)) + x)

    model, x = GCN().eval(), torch.randn(9, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch's own sparse beta warnings
        opt = fxfuse.optimize(model, x, strict=True)
        with torch.no_grad():
            fresh = torch.randn(9, 6)
            torch.testing.assert_close(opt(fresh), model(fresh))


def test_review33b_regressions():
    """review33b: a submodule's @torch.enable_grad() forward without verify; a decorator closing
    over an object whose __getattr__ raises KeyError; the same part read through two chunk
    nodes (`(h * sigmoid(h)).chunk(2)`) counted as overlap; a 0-dim scale kept hoist_permutes
    from moving the op (ReZero)."""
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)

        @torch.enable_grad()
        def forward(self, x):
            return torch.relu(self.lin(x))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) + 1

    x = torch.randn(3, 5)
    model = Outer().eval()
    opt = fxfuse.optimize(model, x, verify=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert opt(x).requires_grad == model(x).requires_grad

    class AttrDict(dict):
        def __getattr__(self, name):
            return self[name]   # KeyError, not AttributeError

    config = AttrDict(scale=2.0)

    def scaled(fn):
        def wrapper(*args):
            return fn(*args) * config["scale"]
        return wrapper

    class Decorated(nn.Module):
        @scaled
        def forward(self, x):
            return torch.relu(x) + 1

    opt = fxfuse.optimize(Decorated().eval(), x, strict=True)
    torch.testing.assert_close(opt(x), Decorated()(x))

    class SwishGate(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(10))

        def forward(self, x):
            h = x + self.bias
            a, b = (h * torch.sigmoid(h)).chunk(2, -1)
            return a * torch.tanh(b)

    class ReZero(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return x + (self.alpha * torch.tanh(x * 2)).transpose(1, 2)

    for model, shape in ((SwishGate(), (3, 10)), (ReZero(), (2, 6, 6))):
        model.eval()
        x = torch.randn(*shape)
        opt = fxfuse.optimize(model, x, strict=True)
        assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


def test_functional_call_of_another_module_leaves_the_optimized_one_alone():
    """The swap count was process-wide: functional_call of any module, in any thread, sent every
    optimized module to its original (review33b). Now only the modules the swap touches."""
    model, x = _bn_net(), torch.randn(4, 7)
    opt = fxfuse.optimize(model, x, strict=True)   # strict: running the original would raise

    class Caller(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, h):
            return opt(h) * self.scale

    with torch.no_grad():
        out = torch.func.functional_call(Caller(), {"scale": torch.tensor(2.0)}, (x,))
        torch.testing.assert_close(out, model(x) * 2)


def test_fuzz33l_absent_attributes_in_loops_and_helpers():
    """`for b in self.blocks: hasattr(b, "gamma")`, getattr in a generator expression or a
    helper defined in forward(): set after optimize, not seen (fuzz33l)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class LayerScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x) * b.gamma if hasattr(b, "gamma") else b(x)
            return x * sum(getattr(b, "scale", 1.0) for b in self.blocks)

    torch.manual_seed(0)
    model, x = LayerScale().eval(), torch.randn(3, 6)
    opt = fxfuse.optimize(model, x)
    with torch.no_grad():
        model.blocks[1].gamma = 3.0
        torch.testing.assert_close(opt(x), model(x))
        model.blocks[0].scale = 2.0
        torch.testing.assert_close(opt(x), model(x))


def test_fuzz33l_another_models_fused_steps_do_not_rebuild():
    teacher, student = _bn_net(), _bn_net()
    x = torch.randn(4, 7)
    opt = fxfuse.optimize(teacher, x)
    step = torch.optim.Adam(student.parameters(), lr=0.01, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            student(x).pow(2).mean().backward()
            step.step()
            with torch.no_grad():
                torch.testing.assert_close(opt(x), teacher(x))
    assert fxfuse.stats(opt)["specializations"] == 1 and opt._state_rebuilds == 0


def test_fuzz33l_functional_call_of_a_parent_swapping_its_head_only():
    """Values right; the block inside runs its original while the parent's tensors are swapped
    (a tied or shared tensor is swapped under every name: review33c)."""
    class Parent(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block, self.head = block, nn.Linear(13, 2)

        def forward(self, x):
            return self.head(self.block(x))

    x = torch.randn(4, 7)
    block = fxfuse.optimize(_bn_net()[:3].eval(), x)   # Linear, BN, ReLU
    parent = Parent(block).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.func.functional_call(parent, {"head.weight": torch.ones(2, 13)}, (x,))
        torch.testing.assert_close(out, block.original(x) @ torch.ones(2, 13).T + parent.head.bias)


def test_fuzz33l_enable_grad_blocks_and_helpers_without_verify():
    class WithBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = torch.relu(self.a(x))
            with torch.enable_grad():
                return self.b(h)

    model, x = WithBlock().eval(), torch.randn(4, 5)
    opt = fxfuse.optimize(model, x, verify=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert opt(x).requires_grad == model(x).requires_grad == True   # noqa: E712


def test_fuzz33m_export_bool_and_or_fuse():
    class ExportOnly(nn.Module):
        def forward(self, x, y):
            if x.shape[0] > 1:   # makes symbolic_trace fail on nothing; the loop below needs export
                pass
            out = x
            for i in range(x.shape[1]):
                out = out + 0
            return torch.where((x > 0) & (y < 0.5) | (y > 2), x, y * 2)

    x, y = torch.randn(4, 5), torch.randn(4, 5)
    opt = fxfuse.optimize(ExportOnly().eval(), (x, y), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1, fxfuse.explain(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, y), ExportOnly()(x, y))


def test_fuzz33n_an_absent_name_set_while_another_attribute_goes():
    """The absent-name watch looked at a dict only when its size moved: `del m.tmp; m.shift = 5.0`
    between two calls kept the size and the stale graph (fuzz33n)."""
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.tmp = nn.Linear(4, 4), 1

        def forward(self, x):
            y = self.lin(x)
            return y + self.shift if hasattr(self, "shift") else y

    model, x = Shifted().eval(), torch.randn(2, 4)
    opt = fxfuse.optimize(model, x)
    with torch.no_grad():
        opt(x)
        del model.tmp
        model.shift = 5.0
        torch.testing.assert_close(opt(x), model(x))


def test_review33c_regressions():
    """review33c: a module shared between a parent and an optimized submodule, swapped by
    functional_call under the parent's name (the path walk missed it; torch also leaves the
    temporary tensor behind); nested functional_calls of a class with __eq__; a grandchild probed
    by getattr(self.block.inner, ...); a training helper using enable_grad that forward() never
    calls (every no_grad call ran the original without verify)."""
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(7, 7), nn.BatchNorm1d(7)

        def forward(self, x):
            return torch.relu(self.bn(self.lin(x)))

    class Root(nn.Module):
        def __init__(self, a, body):
            super().__init__()
            self.a, self.body = a, body

        def forward(self, x):
            return self.a(x) + self.body(x)

    torch.manual_seed(0)
    body = Body().eval()
    with torch.no_grad():
        body.bn.running_mean.normal_()
    x = torch.randn(5, 7)
    opt = fxfuse.optimize(body, x, verify=False)
    root, reference = Root(body.lin, opt).eval(), Root(body.lin, body).eval()
    new = {"a.weight": torch.randn(7, 7)}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(torch.func.functional_call(root, new, (x,)),
                                   torch.func.functional_call(reference, new, (x,)))
        torch.testing.assert_close(opt(x), body(x))

    class WithEq(nn.Linear):
        def __eq__(self, other):
            return self.in_features == other.in_features   # raises for a module without it
        __hash__ = nn.Linear.__hash__

    outer, inner = WithEq(3, 3), nn.Identity()
    class Nest(nn.Module):
        def forward(self, h):
            return torch.func.functional_call(inner, {}, (h,))
    torch.func.functional_call(outer, {}, (torch.randn(2, 3),))
    torch.func.functional_call(Nest(), {}, (torch.randn(2, 3),))

    class Inner(nn.Module):
        def forward(self, x):
            return x

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Module()
            self.block.inner, self.lin = Inner(), nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * getattr(self.block.inner, "scale", 1.0)

        def train_step(self, x):
            with torch.enable_grad():
                return self.forward(x).sum()

    model, x = Deep().eval(), torch.randn(2, 4)
    opt = fxfuse.optimize(model, x, verify=False, strict=True)
    with torch.no_grad():
        opt(x)   # strict: a fallback for the unused train_step would raise
        model.block.inner.scale = 3.0
        torch.testing.assert_close(opt(x), model(x))
