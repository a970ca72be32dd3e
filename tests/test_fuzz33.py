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
