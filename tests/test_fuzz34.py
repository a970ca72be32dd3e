"""Stop 34's fixes from the helpers' rounds (.scratch/fuzz34*), each against eager."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402


def _calls(opt, model, x):
    """opt(x) and model(x) under no_grad, and the warnings opt's call gave."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = opt(x.clone())
    with torch.no_grad():
        want = model(x.clone())
    return got, want, [str(w.message) for w in caught]


class _TrainOnlyScale(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


def test_a_submodule_assigned_in_training_mode_is_not_built_into_the_eval_graph():
    """A module appended after optimize starts in training mode; the rebuild traced its
    training branch and kept serving it after model.eval() (fuzz34h: 2x eager's output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.append(_TrainOnlyScale())
    got, want, caught = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    assert len(caught) == 1 and "submodule 3 is in training mode" in caught[0]
    model.eval()
    for _ in range(2):
        got, want, caught = _calls(opt, model, torch.randn(4, 16))
        torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["specializations"] == 1 and fxfuse.stats(opt)["fused_kernels"] >= 1


@pytest.mark.parametrize("new", [lambda: nn.Dropout(0.1), lambda: nn.BatchNorm1d(16)])
def test_the_graph_comes_back_after_eval_of_a_new_training_mode_submodule(new):
    """The rebuild failed with an unrelated reason ("not deterministic") and marked the
    signature failed for good (fuzz34h)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.insert(2, new())
    _, _, caught = _calls(opt, model, torch.randn(4, 16))
    assert len(caught) == 1 and "training mode" in caught[0] and "deterministic" not in caught[0]
    model.eval()
    got, want, caught = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["specializations"] == 1


class _ReadsChildFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        h = self.backbone(x)
        if self.backbone.training:      # a mode-free child's flag, read by the model's code
            h = h * 2
        return torch.tanh(self.head(h)) + h


def test_train_of_a_child_whose_flag_forward_reads_rebuilds():
    torch.manual_seed(0)
    model = _ReadsChildFlag().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.backbone.train()
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    model.backbone.eval()
    got, want, caught = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["fused_kernels"] >= 1


class _Scaled(nn.Module):
    scale = 2.0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale


def test_a_class_attribute_shadowed_on_the_subclass_after_optimize_is_seen():
    class Sub(_Scaled):
        pass
    torch.manual_seed(0)
    model = Sub().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    Sub.scale = 5.0                     # shadows _Scaled.scale
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)


class _ActOnInput(nn.Module):
    def __init__(self, act, export: bool):
        super().__init__()
        self.act, self.fc, self.export = act, nn.Linear(16, 16), export

    def forward(self, x):
        if not self.export or isinstance(x, torch.Tensor):   # isinstance: traced with torch.export
            x = self.act(x)             # on the caller's tensor
        return torch.tanh(self.fc(x)) + x


@pytest.mark.parametrize("export", [False, True])
@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU])
def test_inplace_set_on_an_activation_of_an_input_after_optimize_writes_the_input(act, export):
    """`inplace` of ReLU/SiLU was not watched: eager then wrote into the caller's tensor, opt did not (fuzz34h)."""
    torch.manual_seed(0)
    model = _ActOnInput(act(), export).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    model.act.inplace = True
    x = torch.randn(4, 16)
    mine, theirs = x.clone(), x.clone()
    with torch.no_grad():
        got, want = opt(mine), model(theirs)
    torch.testing.assert_close(got, want)
    assert torch.equal(mine, theirs) and not torch.equal(mine, x)


@pytest.mark.parametrize("edit", ["bn.weight = None", "conv.bias = None", "del conv.bias"])
def test_a_parameter_set_to_none_or_deleted_after_optimize_is_seen(edit):
    """No torch hook fires there; the graph kept using the BatchNorm folded from the old tensor (fuzz34h)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.normal_(), model[1].running_var.uniform_(0.5, 2), model[1].weight.normal_()
        model[1].bias.normal_(), model[0].bias.normal_()
    opt = fxfuse.optimize(model, torch.randn(2, 4, 8, 8))
    {"bn.weight = None": lambda: setattr(model[1], "weight", None),
     "conv.bias = None": lambda: setattr(model[0], "bias", None),
     "del conv.bias": lambda: delattr(model[0], "bias")}[edit]()
    if edit == "del conv.bias":
        model[0].bias = None            # Conv2d's forward reads self.bias
    got, want, _ = _calls(opt, model, torch.randn(2, 4, 8, 8))
    torch.testing.assert_close(got, want)


class _ReadsSwappedChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.block(x) * (self.block[0].out_features / 32) * len(self.block)
        return torch.relu(self.fc(h)) @ self.fc.weight    # a child's weight read directly


def test_a_child_swapped_for_its_optimized_version_still_answers_the_parent():
    """An OptimizedModule passes reads of the original's names through (fuzz34h: TypeError / AttributeError)."""
    torch.manual_seed(0)
    model = _ReadsSwappedChild().eval()
    eager = _ReadsSwappedChild().eval()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(4, 16)
    model.block = fxfuse.optimize(model.block, x)
    model.fc = fxfuse.optimize(model.fc, x)
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x))
    assert [type(m) for m in model.block] == [nn.Linear, nn.GELU, nn.Linear] and bool(model.block)
    assert model.fc.weight is model.fc.original.weight and fxfuse.stats(model.block)["fused_kernels"] >= 1
    with pytest.raises(AttributeError):
        model.fc.no_such_attribute


def test_a_write_of_the_originals_attribute_through_the_optimized_module_is_the_originals():
    torch.manual_seed(0)
    model = _Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    opt.scale = 3.0
    assert model.scale == 3.0 and "scale" not in vars(opt)
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    opt.note = "mine"                   # a name the original lacks stays the wrapper's
    assert not hasattr(model, "note") and opt.note == "mine"


def test_one_warning_when_an_optimized_child_of_an_optimized_parent_is_in_training_mode():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.GELU())
            self.out = nn.Linear(16, 8)

        def forward(self, x):
            return self.out(self.inner(x) * 2)
    torch.manual_seed(0)
    parent, x = Parent().eval(), torch.randn(4, 16)
    parent.inner = fxfuse.optimize(parent.inner, x)
    opt = fxfuse.optimize(parent, x)
    parent.inner.train()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        opt(x)
    assert len(caught) == 1 and "inner" in str(caught[0].message)


class _Lora(nn.Module):
    """peft's LoraLayer in small: merge() adds the delta into the base weight through .data and
    appends to a list that forward() branches on (through a property)."""

    def __init__(self):
        super().__init__()
        self.base, self.a, self.b = nn.Linear(16, 32), nn.Linear(16, 4, bias=False), nn.Linear(4, 32, bias=False)
        nn.init.normal_(self.b.weight)
        self.scaling = {"default": 2.0}
        self.merged_adapters = []

    @property
    def merged(self):
        return bool(self.merged_adapters)

    def merge(self):
        self.base.weight.data += self.b.weight @ self.a.weight * self.scaling["default"]
        self.merged_adapters.append("default")

    def forward(self, x):
        out = self.base(x)
        if not self.merged:
            out = out + self.b(self.a(x)) * self.scaling["default"]
        return F.gelu(out)


def test_an_item_appended_to_a_list_forward_reads_rebuilds():
    """peft's merge: the list append went unseen and the merged weight was read live, so the
    delta counted twice (fuzz34g: max |opt - eager| 26.6, no warning)."""
    torch.manual_seed(0)
    model = _Lora().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.merge()
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    model.scaling["default"] = 3.0      # a dict item set in place (the branch is gone: no effect, no error)
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)


class _Configured(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.fc = config, nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.config.scale + self.config.shift


def test_an_attribute_of_a_config_object_set_in_place_rebuilds():
    import types
    torch.manual_seed(0)
    model = _Configured(types.SimpleNamespace(scale=2.0, shift=0.5)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16))
    model.config.scale = 3.0
    got, want, _ = _calls(opt, model, torch.randn(4, 16))
    torch.testing.assert_close(got, want)
    for _ in range(3):                  # unchanged: the graph stays
        got, want, caught = _calls(opt, model, torch.randn(4, 16))
        torch.testing.assert_close(got, want)
    assert not caught and fxfuse.stats(opt)["fused_kernels"] >= 1


def test_torchs_hook_based_pruning_is_refused_with_the_way_out():
    import torch.nn.utils.prune as prune
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(fxfuse.FxfuseError, match=r"submodule 0 \(Linear\) has a forward pre-hook .*prune.remove"):
        fxfuse.optimize(model, torch.randn(2, 8), strict=True)


SPECIAL = [float("nan"), -0.0, 0.0, -2.5, -0.5, 0.5, 1.5, 2.5, float("inf"), -float("inf"), 3.7, -3.7, 8388609.0,
           0.49999997, 1e-40, -1e-40]
ROUNDING = {"trunc": torch.trunc, "fix": torch.fix, "round": torch.round, "round method": lambda h: h.round(),
            "frac": torch.frac, "sign": torch.sign, "sgn": lambda h: h.sgn(),
            "isnan": lambda h: torch.isnan(h).to(h.dtype), "isinf": lambda h: h.isinf().to(h.dtype),
            "isfinite": lambda h: torch.isfinite(h).to(h.dtype), "trunc_": lambda h: h.trunc_()}


class _Around(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x * 1.5 + 0.0) * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(ROUNDING))
def test_rounding_and_classifying_ops_fuse_bit_for_bit(name, dtype):
    """round/trunc/frac/sign/isnan/... split a pointwise chain into two kernels and a library
    call (fuzz34g: a QAT fake-quant); now one kernel, with eager's ties (half to even), signed
    zeros and NaN."""
    torch.manual_seed(0)
    model = _Around(ROUNDING[name]).eval()
    make = lambda: torch.cat([torch.tensor(SPECIAL), torch.randn(77) * 4]).to(dtype)  # noqa: E731
    opt = fxfuse.optimize(model, make())
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    x = make()
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.signbit(), want.signbit())


def test_exp2_and_log2_fuse_and_round_with_decimals_stays_in_the_library():
    torch.manual_seed(0)
    for f in (torch.exp2, torch.log2, lambda h: h.exp2()):
        model = _Around(lambda h: f(h.abs())).eval()
        opt = fxfuse.optimize(model, torch.randn(40))
        assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
        x = torch.randn(40)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
    model = _Around(lambda h: torch.round(h, decimals=1)).eval()   # was an internal error (kwargs into the kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(40))
    assert fxfuse.stats(opt)["library_calls"] == 1
    x = torch.randn(40)
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


class _Fn(nn.Module):
    def __init__(self, f, **tensors):
        super().__init__()
        self.f = f
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t))

    def forward(self, *xs):
        return self.f(self, *xs)


def _same(opt, model, *xs):
    with torch.no_grad():
        got, want = opt(*xs), model(*xs)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), (got, want)


def test_add_with_alpha_is_one_multiply_add():
    """`x + y * alpha` rounded twice: 3e38 + ... came out inf, cancelling terms 0 (fuzz34e)."""
    for f in (lambda s, x, y: torch.add(x * 1.0, y, alpha=2) * 1.0, lambda s, x, y: (x * 1.0).sub(y, alpha=-2) * 1.0,
              lambda s, x, y: torch.rsub(y, x * 1.0, alpha=-2) * 1.0):
        model = _Fn(f).eval()
        x, y = torch.tensor([-3e38, 1.0, 0.1, -2.5]), torch.tensor([3e38, 3.0, -0.05, 1.75])
        opt = fxfuse.optimize(model, (x, y))
        assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
        _same(opt, model, x, y)
        _same(opt, model, torch.randn(64), torch.randn(64))


@pytest.mark.parametrize("e", [4, -3, -4])
def test_powers_eager_computes_with_powf_keep_subnormal_results(e):
    """x ** -3 as 1 / (x * x * x): the product overflowed, 1e13 ** -3 came out 0 (fuzz34e)."""
    model = _Fn(lambda s, x: (x * 1.0) ** e * 1.0).eval()
    x = torch.tensor([1e13, -1e13, 1e10, 3.3, -0.7, 2.0])
    opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        got, want = opt(x), model(x)
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=0)   # within an ulp (eager's powf)
    assert torch.equal(got.signbit(), want.signbit()) and torch.equal(got == 0, want == 0)


def test_a_comparison_reads_its_number_in_fp32():
    """The literal 1e-50 was compared in fp64 on the GPU (fuzz34e): the kernel source must hold fp32's value."""
    model = _Fn(lambda s, x: ((x * 1.0) == 1e-50) | ((x * 2.0) > 1e39)).eval()
    opt = fxfuse.optimize(model, torch.randn(6))
    source = next(opt.fused_kernels()).source
    assert "1e-50" not in source and "1e+39" not in source and "== 0.0)" in source and "> 1e999)" in source
    _same(opt, model, torch.tensor([0.0, -0.0, 1.0, 1e-40, 1e-45, -2.0]))


def test_negation_keeps_the_sign_of_zero_in_the_source():
    """Triton compiles -x as 0 - x: +0.0 for x = +0.0 on the GPU (fuzz34e); the kernel multiplies by -1."""
    model = _Fn(lambda s, x: 1.0 / -(x * 1.0)).eval()
    x = torch.tensor([0.0, -0.0, 2.0, float("nan"), float("inf")])
    opt = fxfuse.optimize(model, x)
    assert "* -1.0" in next(opt.fused_kernels()).source
    _same(opt, model, x)


@pytest.mark.parametrize("spelling", ["method", "function", "list", "dims="])
def test_permute_0_1_of_a_weight_is_no_transpose(spelling):
    """W.permute(0, 1) keeps W as it is; it was read as W.T (fuzz34a: errors of 5-12, silent with verify=False)."""
    torch.manual_seed(0)
    permuted = {"method": lambda w: w.permute(0, 1), "function": lambda w: torch.permute(w, (0, 1)),
                "list": lambda w: w.permute([-2, -1]), "dims=": lambda w: w.permute(dims=(0, 1))}[spelling]
    model = _Fn(lambda s, x: torch.relu(x @ permuted(s.w) + s.b), w=torch.randn(8, 8), b=torch.randn(8)).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8), verify=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_fp16_exponents_and_shrink_bounds_are_read_in_fp16_whatever_their_type():
    """A numpy float or an int beyond fp16's integers was used as given (fuzz34a): h ** np.float64(2.0001)
    gave NaN for negative h, h ** 2051 the wrong sign at -1, hardshrink(h, 2051) kept 2052."""
    import numpy as np
    h = torch.tensor([-1.0, -0.7, 0.3, 1.3, -2052.0, 2054.0, 0.30005], dtype=torch.float16)
    for f in (lambda s, x: (x * 1.0) ** np.float64(2.0001), lambda s, x: (x * 1.0) ** 2051,
              lambda s, x: F.hardshrink(x * 1.0, np.float64(0.3)), lambda s, x: F.hardshrink(x * 1.0, 2051)):
        model = _Fn(f).eval()
        opt = fxfuse.optimize(model, h.abs())
        _same(opt, model, h)


@pytest.mark.parametrize("view", [lambda h: h.unsqueeze(1), lambda h: torch.unsqueeze(h, 1),
                                  lambda h: h.view(3, 7, 1, 13).squeeze(2), lambda h: h.contiguous(),
                                  lambda h: h.to("cpu"), lambda h: h.to(h)])
def test_unit_views_and_no_op_conversions_between_pointwise_ops_keep_one_kernel(view):
    model = _Fn(lambda s, x: torch.sigmoid(view(torch.relu(x * 2.0))) + 1.0).eval()
    x = torch.randn(3, 7, 13)
    opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1   # (a view of the result may remain: no kernel)
    x = torch.randn(3, 7, 13)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _Addmm(nn.Module):
    def __init__(self, kwargs):
        super().__init__()
        self.w, self.b, self.kwargs = nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6)), kwargs

    def forward(self, x):
        return torch.relu(torch.addmm(self.b, x, self.w, **self.kwargs))


@pytest.mark.parametrize("kwargs", [{"beta": 1, "alpha": 1}, {"beta": 1.0}, {"beta": 0.5, "alpha": 2.0}])
def test_addmm_with_unit_beta_and_alpha_spelled_out_is_a_linear(kwargs):
    torch.manual_seed(0)
    model = _Addmm(kwargs).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    linear = kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1
    kinds = [n.target for n in next(iter(opt.specializations.values())).gm.graph.nodes if n.op == "call_function"]
    assert (F.linear in kinds) == linear
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_long_unrolled_recurrence_is_split_into_bounded_kernels():
    """A RetNet recurrence unrolled over 160 steps was ONE kernel of 481 operands: 100 s of GPU
    compile per build (fuzz34b). Kernels stop at MAX_GROUP_OPS ops."""
    from fxfuse.passes.fuse_pointwise import MAX_GROUP_OPS

    def recurrence(s, k, v):
        state = torch.zeros_like(k[:, 0])
        for t in range(100):
            state = state * 0.97 + torch.tanh(k[:, t] * v[:, t])
        return state
    model = _Fn(recurrence).eval()
    k, v = torch.randn(2, 100, 5), torch.randn(2, 100, 5)
    opt = fxfuse.optimize(model, (k, v))
    kernels = list(opt.fused_kernels())
    assert len(kernels) >= 3 and all(len(kernel.members) <= MAX_GROUP_OPS for kernel in kernels)
    k, v = torch.randn(2, 100, 5), torch.randn(2, 100, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt(k, v), model(k, v))


class _EmbeddingSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.typ, self.pos = nn.Embedding(23, 12), nn.Embedding(2, 12), nn.Parameter(torch.randn(7, 12))

    def forward(self, ids, types):
        e = self.tok(ids)
        e += self.typ(types)            # in place on a module's fresh output (BERT's embeddings)
        return torch.tanh(e + self.pos) * 0.5


class _RollSum(nn.Module):
    def forward(self, x):
        y = torch.roll(x, 1, 1)
        y += x
        return torch.sigmoid(y) * x


@pytest.mark.parametrize("case", ["embedding", "roll"])
def test_in_place_ops_on_fresh_outputs_of_modules_and_library_ops_fuse(case):
    """`e = tok(ids); e += typ(tt)` kept the add and everything after it unfused: an Embedding's
    (ConvTranspose's, roll's) output was not known to be new memory (fuzz34b)."""
    torch.manual_seed(0)
    model, make = {"embedding": (_EmbeddingSum(), lambda: (torch.randint(0, 23, (2, 7)), torch.randint(0, 2, (2, 7)))),
                   "roll": (_RollSum(), lambda: (torch.randn(2, 5, 6),))}[case]
    model.eval()
    opt = fxfuse.optimize(model, make())
    assert fxfuse.stats(opt)["fused_kernels"] == 1   # the add joins it: the library runs the lookups / roll only
    assert fxfuse.stats(opt)["library_calls"] == {"embedding": 2, "roll": 1}[case]
    args = make()
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))


def test_a_complex_output_is_verified_by_its_parts():
    """A complex64 output right to an ulp was refused: verify compared it exactly (fuzz34b)."""
    class ComplexGate(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, dtype=torch.cfloat))

        def forward(self, z):
            h = z * self.w + 1
            return torch.sigmoid(h.abs()) * h
    torch.manual_seed(0)
    model = ComplexGate().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 16, dtype=torch.cfloat))
    z = torch.randn(4, 16, dtype=torch.cfloat)
    with torch.no_grad():
        torch.testing.assert_close(opt(z), model(z))
    assert fxfuse.stats(opt)["optimized"]


def test_strassen_that_passes_per_layer_but_not_as_a_whole_falls_back_to_classical_layers():
    """An example with one row 1e6 times the others: each Strassen layer passed its check, the
    whole model did not, and optimize returned the original module blaming fxfuse (fuzz34d)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(17, 31), nn.Tanh(), nn.Linear(31, 5)).eval()
    x = torch.randn(33, 17)
    x[3] *= 1e6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, x, strassen="force")
    assert fxfuse.stats(opt)["optimized"] and fxfuse.stats(opt)["fused_kernels"] >= 1
    assert "Strassen and 3xTF32 off" in fxfuse.explain(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
