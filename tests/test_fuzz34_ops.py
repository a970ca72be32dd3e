"""Stop 34's fixes from the helpers' rounds (.scratch/fuzz34*): ops, numerics, spellings and fusion, against eager."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402


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
    kinds = [n.target for n in next(iter(opt._specializations.values())).gm.graph.nodes if n.op == "call_function"]
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


class _ScaledScores(nn.Module):
    def __init__(self, returns_literal=False, writes_literal=False):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)
        self.returns_literal, self.writes_literal = returns_literal, writes_literal

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scale = torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float32, device=x.device))
        half = torch.tensor(0.5, device=x.device)
        if self.writes_literal:
            half.mul_(2)
        scores = (q @ k.transpose(-2, -1)) / scale * half + x.new_tensor(1.0)
        out = torch.softmax(scores, -1)
        return (out, half) if self.returns_literal else out


@pytest.mark.parametrize("variant", ["plain", "returned", "written"])
def test_tensors_made_from_numbers_in_forward_become_constants(variant):
    """torch.tensor(d_k, device=...) in forward: a host-to-device copy per call that no CUDA graph
    captures (fuzz34b: capture failed, the model ran without its graph). Folded where nobody sees
    the difference: not returned, not written."""
    torch.manual_seed(0)
    model = _ScaledScores(returns_literal=variant == "returned", writes_literal=variant == "written").eval()
    opt = fxfuse.optimize(model, torch.randn(2, 5, 16))
    gm = next(iter(opt._specializations.values())).gm
    factories = [n for n in gm.graph.nodes if n.target in (torch.tensor, "new_tensor")]
    assert len(factories) == {"plain": 0, "returned": 1, "written": 1}[variant]
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        if variant == "returned":
            first = opt(x)[1]
            first.add_(1)                    # the caller's tensor: the next call's is a fresh 0.5
            assert opt(x)[1].item() == 0.5


def test_siblings_past_the_op_cap_share_kernels():
    """Past a full kernel, each further reader of a shared input got a kernel of its own (fuzz34i: 29 for 210 ops)."""
    class Many(nn.Module):
        def forward(self, x, y):
            return tuple((x * (i + 1) + y).sin() for i in range(70))
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    model = Many().eval()
    opt = fxfuse.optimize(model, (x, y))
    assert fxfuse.stats(opt)["fused_kernels"] == 2
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with torch.no_grad():
        for got, want in zip(opt(x, y), model(x, y)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e4m3fn])
def test_inputs_of_dtypes_triton_lacks_leave_the_kernel_to_the_library(dtype):
    """complex32 / float8 operands crashed inside Triton and the whole model was refused (fuzz34k)."""
    class Up(nn.Module):
        def forward(self, x):
            return (x.float() * 2).relu() + 1
    x = torch.randn(4, 8).to(dtype) if dtype != torch.complex32 else torch.randn(4, 8, dtype=torch.complex64).to(dtype)
    model = Up().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxfuse.FxfuseWarning)   # no fallback (the model's own complex cast
        opt = fxfuse.optimize(model, x)                        # warning shows once, since stop 37)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


def test_a_calibration_file_that_cannot_be_read_gives_one_warning_and_the_roofline(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)      # past the JSON decoder's recursion limit (fuzz34k)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, torch.randn(4, 8), calibration=str(path))
    assert fxfuse.stats(opt)["optimized"] and len(caught) == 1 and "roofline" in str(caught[0].message)


class _Rotary(nn.Module):
    """transformers' LlamaRotaryEmbedding.forward, trimmed: torch.export traces it (symbolic_trace
    cannot), recording its disabled autocast region as a wrap_with_autocast node."""

    def __init__(self, enabled=False):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, 6, 2).float() / 6)), persistent=False)
        self.enabled = enabled

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        pos = position_ids[:, None, :].float()
        with torch.autocast(device_type="cpu", enabled=self.enabled, dtype=torch.bfloat16):
            freqs = (inv.float() @ pos.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * 1.0, emb.sin() * 1.0
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def test_a_disabled_autocast_region_is_inlined_and_an_enabled_one_refused():
    """HF's rotary embedding (in most HF RoPE models) was refused as "enters torch.autocast" (fuzz34j)."""
    x, pos = torch.randn(2, 5, 6), torch.arange(5).expand(2, 5)
    model = _Rotary().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, (x, pos))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        for got, want in zip(opt(x, pos + 3), model(x, pos + 3)):
            torch.testing.assert_close(got, want)
    with pytest.raises(fxfuse.FxfuseError, match="autocast"):
        fxfuse.optimize(_Rotary(enabled=True).eval(), (x, pos), strict=True)


class _NestedDisabled(nn.Module):
    def forward(self, x):
        assert isinstance(x, torch.Tensor)          # torch.export traces it
        with torch.autocast("cpu", enabled=False):
            a = x.float() * 2
            with torch.autocast("cpu", enabled=False):
                b = a.exp() + 1
            c = b * a
        return torch.tanh(c * 0.1)


class _WritesItsConstant(nn.Module):
    def forward(self, x):
        t = torch.tensor([1.0, 2.0])
        y = x * t
        t.mul_(3)
        return y + t


def test_nested_disabled_autocast_regions_inline_and_a_written_constant_is_traced_by_export():
    """Nested regions raised an internal TypeError (review34b); a constant forward() makes and
    writes was traced with the write already applied (review34b: silent with verify=False); torch.export
    traces it now (fuzz38h)."""
    model = _NestedDisabled().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    # torch.export records the constant and the write (stop 38; it was refused before)
    opt = fxfuse.optimize(_WritesItsConstant().eval(), torch.randn(4, 2), verify=False, strict=True)
    for _ in range(2):
        x = torch.randn(4, 2)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), _WritesItsConstant()(x))
