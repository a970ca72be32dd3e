"""Stop 46, runtime and tracing: a random draw symbolic_trace would freeze goes to torch.export (or the
original); functional_call takes opt's state_dict names (tied weights, strict=True, both spellings)."""
import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fxfuse


class Noise(nn.Module):
    """Noise of a fixed shape: `torch.rand(4, 8)` reads no input, so torch.fx ran it at trace time."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + torch.rand(4, 8)


class RandomFlip(nn.Module):
    """Test-time augmentation: a branch on a draw."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if torch.rand(()) < 0.5:
            h = h.flip(-1)
        return h


class FilledNoise(nn.Module):
    def forward(self, x):
        return x * torch.empty(4, 8).uniform_(-1, 1) + 1


@pytest.mark.parametrize("model_class", [Noise, RandomFlip, FilledNoise])
@pytest.mark.parametrize("verify", [True, False])
def test_a_draw_that_reads_no_input_is_drawn_on_every_call(model_class, verify):
    model, x = model_class().eval(), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, x, verify=verify)
    assert len([w for w in caught if "fxfuse" in str(w.message)]) <= 1
    outputs = set()
    with torch.no_grad():
        for seed in range(8):
            torch.manual_seed(seed)
            got, after_opt = opt(x), torch.rand(1)
            torch.manual_seed(seed)
            expected, after_eager = model(x), torch.rand(1)
            torch.testing.assert_close(got, expected)
            assert torch.equal(after_opt, after_eager)   # the caller's stream moves as eager's does
            outputs.add(tuple(got.flatten()[:4].tolist()))
    assert len(outputs) > 1


def test_noise_of_a_fixed_shape_is_still_optimized():
    opt = fxfuse.optimize(Noise().eval(), torch.randn(4, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(7, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _optimized(model, example):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxfuse.optimize(model, example)


def test_functional_call_swaps_a_tied_weight_under_opts_state_dict_name():
    model, ids = Tied().eval(), torch.randint(0, 10, (3, 4))
    opt = _optimized(model, ids)
    swapped = model.emb.weight.detach() * 2
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = functional_call(model, {"emb.weight": swapped}, (ids,))
        torch.testing.assert_close(functional_call(opt, {"emb.weight": swapped}, (ids,)), expected)
        torch.testing.assert_close(functional_call(opt, {"original.emb.weight": swapped}, (ids,)), expected)


def test_functional_call_strict_takes_opts_own_state_dict():
    model, x = TwoLayers().eval(), torch.randn(3, 7)
    opt = _optimized(model, x)
    params = {k: v * 2 for k, v in opt.state_dict().items()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(functional_call(opt, params, (x,), strict=True),
                                   functional_call(model, params, (x,), strict=True))


def test_functional_call_with_both_spellings_leaves_the_model_as_it_was():
    model, x = TwoLayers().eval(), torch.randn(3, 7)
    opt = _optimized(model, x)
    weight, values = model.l1.weight, model.l1.weight.detach().clone()
    params = {k: v * 2 for k, v in opt.state_dict().items()}
    params.update({k: v * 3 for k, v in opt.named_parameters()})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        functional_call(opt, params, (x,))
    assert model.l1.weight is weight and torch.equal(model.l1.weight, values)
    assert isinstance(model.l1.weight, nn.Parameter)


def test_functional_call_of_a_parent_holding_opt():
    inner = TwoLayers().eval()
    x = torch.randn(3, 7)
    parent = nn.Sequential(nn.Identity(), _optimized(inner, x)).eval()
    params = {k: v * 2 for k, v in parent.state_dict().items()}
    reference = nn.Sequential(nn.Identity(), inner)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(functional_call(parent, params, (x,), strict=True),
                                   functional_call(reference, params, (x,), strict=True))


GLOBAL_SCALE = torch.ones(5)


def _make_scale():
    cell = torch.ones(5)
    return (lambda h: h * cell), cell


CLOSURE_SCALE, CLOSURE_CELL = _make_scale()
DEFAULT_SCALE = torch.ones(5)


class ScaledByHeldTensor(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(7, 5), kind

    def forward(self, x, w=DEFAULT_SCALE):
        h = torch.relu(self.lin(x))
        if self.kind == "global":
            return h * GLOBAL_SCALE
        if self.kind == "closure":
            return CLOSURE_SCALE(h)
        return h * w


@pytest.mark.parametrize("kind, tensor", [("global", GLOBAL_SCALE), ("closure", CLOSURE_CELL),
                                          ("default", DEFAULT_SCALE)])
def test_a_held_tensor_unfrozen_after_optimize_records_autograd(kind, tensor):
    model, x = ScaledByHeldTensor(kind).eval().requires_grad_(False), torch.randn(3, 7)
    opt = fxfuse.optimize(model, x)
    with torch.no_grad():
        opt(x)
    try:
        tensor.requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = opt(x)
        assert out.requires_grad and len(caught) == 1
        out.sum().backward()
        expected = tensor.grad.clone()
        tensor.grad = None
        model(x).sum().backward()
        torch.testing.assert_close(tensor.grad, expected)
    finally:
        tensor.requires_grad_(False)
        tensor.grad = None


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(7, 8), nn.BatchNorm1d(8), nn.Linear(8, 5)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


class HoldsFrozen(nn.Module):
    """A frozen encoder kept out of state_dict() and parameters() in a plain list; an unused teacher too."""
    def __init__(self, encoder, teacher=None):
        super().__init__()
        self.frozen, self.teacher = [encoder], [teacher]
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.sigmoid(self.frozen[0](x)))


UNREGISTERED_EDITS = {
    "submodule replaced": lambda e: setattr(e, "l2", nn.Linear(8, 5).eval()),
    "parameter replaced": lambda e: setattr(e.l1, "weight", nn.Parameter(torch.randn(8, 7))),
    "load_state_dict(assign=True)": lambda e: e.load_state_dict(Encoder().state_dict(), assign=True),
    "bias = None": lambda e: setattr(e.l1, "bias", None),
    "train()": lambda e: e.train(),
}


@pytest.mark.parametrize("name", list(UNREGISTERED_EDITS))
def test_edits_of_a_module_held_unregistered_are_seen(name):
    encoder = Encoder().eval()
    model, x = HoldsFrozen(encoder).eval(), torch.randn(3, 7)
    opt = fxfuse.optimize(model, x)
    UNREGISTERED_EDITS[name](encoder)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(x)
        torch.testing.assert_close(got, model(x))
    assert len(caught) == (1 if name == "train()" else 0), [str(w.message) for w in caught]


def test_an_unused_teacher_in_training_mode_does_not_stop_the_graph():
    teacher = Encoder().train()
    model, x = HoldsFrozen(Encoder().eval(), teacher).eval(), torch.randn(3, 7)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        teacher.eval()
        teacher.train()
        torch.testing.assert_close(opt(x), model(x))
    assert fxfuse.stats(opt)["kernel_launches"] >= 2


class DefaultAfterKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, dims=(1,), t=torch.ones(8) * 2):
        return (self.lin(x) * t).sum(dims)


class StarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, *xs, scale=1.0, **kw):
        return sum(self.lin(t) for t in xs) * scale


@pytest.mark.parametrize("model_class, example, call_args, call_kwargs", [
    (DefaultAfterKeyword, 1, 1, {"dims": (0,)}),
    (StarArgs, 3, 3, {"scale": 1.0}),
], ids=["tensor default after the keyword", "*args and a keyword at its default"])
def test_keyword_calls_that_leave_only_trailing_defaults_run_the_graph(model_class, example, call_args, call_kwargs):
    model = model_class().eval()
    xs = [torch.randn(4, 8) for _ in range(example)]
    opt = fxfuse.optimize(model, tuple(xs) if example > 1 else xs[0], strict=True)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(opt(*xs[:call_args], **call_kwargs), model(*xs[:call_args], **call_kwargs))
    assert not caught, [str(w.message) for w in caught]
    assert fxfuse.stats(opt)["kernel_launches"] >= 1


class ExactTypeTest(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if type(x) is not torch.Tensor:   # a Proxy or FakeTensor while tracing
            x = torch.zeros_like(x)
        return self.lin(x)


def test_a_refusal_for_an_exact_type_test_names_it():
    with pytest.raises(fxfuse.FxfuseError, match=r"type\(x\) is torch.Tensor"):
        fxfuse.optimize(ExactTypeTest().eval(), torch.randn(4, 8), strict=True)


class HasAnOriginal(nn.Module):
    """A model whose own submodule is called `original`, as the optimized wrapper's is (review46r)."""
    def __init__(self):
        super().__init__()
        self.original = nn.Linear(8, 8, bias=False)
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.relu(self.original(x)) @ self.weight


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.l1(x))


class HoldsOptimized(nn.Module):
    def __init__(self, x):
        super().__init__()
        self.inner = _optimized(Inner().eval(), x)
        self.l3 = nn.Linear(8, 4)

    def forward(self, x):
        return self.l3(self.inner(x)).sigmoid()


@pytest.mark.parametrize("make", [lambda x: HasAnOriginal(), HoldsOptimized], ids=["own original", "nested opt"])
def test_functional_call_with_state_dict_keys_matches_the_model(make):
    x = torch.randn(3, 8)
    model = make(x).eval()
    opt = _optimized(model, x)
    params = {k: torch.randn_like(v) for k, v in opt.state_dict().items()}
    assert set(params) == set(model.state_dict())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(functional_call(opt, params, (x,), strict=True),
                                   functional_call(model, params, (x,), strict=True))


def test_a_childs_back_reference_to_its_parent_is_not_watched():
    class Child(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.child, self.other = Child(), nn.Dropout(0.5)
            self.child.parent = [self]

    parent = Parent()
    child, x = parent.child.eval(), torch.randn(3, 8)
    opt = fxfuse.optimize(child, x, strict=True)
    parent.train()
    child.eval()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(opt(x), child(x))
    assert not caught, [str(w.message) for w in caught]


class MemoAndRandomBranch(nn.Module):
    """A deterministic memo beside a random branch (review46i): the branch still draws on every call."""
    @functools.cached_property
    def scale(self):
        return torch.linspace(0.5, 1.5, 17)

    def forward(self, x):
        if torch.rand(()) < 0.5:
            return x * self.scale
        return x - self.scale


def test_a_memo_does_not_hide_a_random_branch():
    model, x = MemoAndRandomBranch().eval(), torch.randn(3, 17)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, x, verify=False)
    with torch.no_grad():
        for seed in range(6):
            torch.manual_seed(seed)
            got = opt(x)
            torch.manual_seed(seed)
            torch.testing.assert_close(got, reference(x))
    assert len(caught) == 1


def test_a_wrapper_held_unregistered_around_a_registered_layer_is_watched():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(6, 6)
            self.helper = [nn.Sequential(self.enc, nn.ReLU())]

        def forward(self, x):
            return self.helper[0](x) * 2
    model, x = M().eval(), torch.randn(3, 6)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        opt(x)
        model.helper[0][1] = nn.Tanh()
        torch.testing.assert_close(opt(x), model(x))


class ConvOverTokens(nn.Module):
    """[B, L, C] tokens through a conv as a 1-row image: the conv's output layout follows the input's
    size-1 batch stride, and a write through `h.reshape(-1)` reaches h or a copy by that layout."""
    def __init__(self, write):
        super().__init__()
        self.conv, self.write = nn.Conv2d(4, 6, (1, 3), padding=(0, 1)), write

    def forward(self, x):
        h = self.conv(x.transpose(1, 2).unsqueeze(2))
        if self.write:
            h.reshape(-1).add_(1.0)
        return torch.relu(h)


@pytest.mark.parametrize("write", [False, True])
def test_a_batch_stride_a_conv_reads_is_not_taken_as_alike(write):
    model = ConvOverTokens(write).eval()
    contiguous, strided = torch.randn(1, 8, 4), torch.randn(8, 4, 1).permute(2, 0, 1)
    for example, call in ((contiguous, strided), (strided, contiguous)):
        opt = fxfuse.optimize(model, example)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, expected = opt(call), model(call)
        torch.testing.assert_close(got, expected)
        assert got.stride() == expected.stride()
