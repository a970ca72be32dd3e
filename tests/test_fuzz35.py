"""Stop 35's fixes: non-tensor example arguments traced by torch.export, dict example inputs."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402


def _leaves(value):
    return torch.utils._pytree.tree_leaves(value)


def _check_calls(opt, model, calls):
    """Every (args, kwargs) call of opt against eager, with no warning."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for args, kwargs in calls:
            got, want = _leaves(opt(*args, **kwargs)), _leaves(model(*args, **kwargs))
            assert len(got) == len(want)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
    assert not caught, [str(w.message) for w in caught]


class _HFStyleEmbeddings(nn.Module):
    """BERT-style embeddings: the sliced position_ids buffer makes symbolic_trace fail."""

    def __init__(self, vocab=50, width=16):
        super().__init__()
        self.word = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(16, width)
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.register_buffer("position_ids", torch.arange(16).expand((1, -1)), persistent=False)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_hidden_states=False,
                scale=1.0):
        shape = input_ids.size() if input_ids is not None else inputs_embeds.size()[:-1]
        position_ids = self.position_ids[:, :shape[1]]
        if inputs_embeds is None:
            inputs_embeds = self.word(input_ids)
        h0 = self.norm(inputs_embeds + self.pos(position_ids))
        h = F.gelu(self.fc(h0)) * scale + 1
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return (h, (h0, h)) if output_hidden_states else (h,)


def _ids(*shape):
    return torch.randint(0, 50, shape)


@pytest.mark.parametrize("example", ["embeds", "flags", "mask"])
def test_none_and_flag_example_arguments_are_traced_by_torch_export(example):
    """symbolic_trace fails on the model; fxfuse refused it where the example held None or a
    flag ("torch.export is not tried for non-tensor inputs", fuzz34g). Export specializes on
    them as the runtime's signature does, so other values build other specializations."""
    torch.manual_seed(0)
    model = _HFStyleEmbeddings().eval()
    examples = {"embeds": (None, None, torch.randn(2, 8, 16)),
                "flags": (_ids(2, 8), None, None, True, 2.0),
                "mask": (_ids(2, 8), torch.rand(2, 8), None, False)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, examples[example])
    assert fxfuse.stats(opt)["optimized"] and fxfuse.stats(opt)["fused_kernels"] >= 1
    assert "torch.export(strict=False)" in fxfuse.explain(opt)
    _check_calls(opt, model, [
        (examples[example], {}),
        ((None, None, torch.randn(2, 8, 16)), {}),
        ((_ids(2, 8), None, None, True, 3.0), {}),
        ((_ids(3, 5), torch.rand(3, 5), None, False, 2.0), {}),
        ((), {"input_ids": _ids(2, 8), "output_hidden_states": True}),
        ((_ids(2, 8),), {"scale": 2.5}),
    ])


ACTIVATIONS = {"gelu": nn.GELU(), "silu": nn.SiLU()}   # HF's ACT2FN: modules no model owns


class _GlobalActivationLayer(nn.Module):
    def __init__(self, act="gelu"):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = act

    def forward(self, h, mask, output_attentions=False):
        out = ACTIVATIONS[self.act](self.fc(h)) * mask[..., None] + h
        return (out, None) if output_attentions else (out,)


def test_a_flag_argument_does_not_stop_the_export_of_a_layer_using_a_global_activation():
    torch.manual_seed(0)
    model = _GlobalActivationLayer().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, (torch.randn(2, 8, 16), torch.rand(2, 8), False))
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    _check_calls(opt, model, [((torch.randn(2, 8, 16), torch.rand(2, 8), False), {}),
                              ((torch.randn(2, 8, 16), torch.rand(2, 8), True), {}),
                              ((torch.randn(2, 8, 16), torch.rand(2, 8)), {})])


class _TypeTestedSlice(nn.Module):
    """An isinstance test on a tensor sends the trace to torch.export; the int bounds a slice."""

    def forward(self, x, n: int, flag: bool = False):
        if isinstance(x, torch.Tensor):
            x = x * 2
        y = torch.relu(x[:, :n]) + 1
        return y.sigmoid() if flag else y


def test_an_int_example_argument_traced_by_export_is_checked_on_every_call():
    torch.manual_seed(0)
    model = _TypeTestedSlice().eval()
    opt = fxfuse.optimize(model, (torch.randn(3, 9), 4))
    assert "torch.export(strict=False)" in fxfuse.explain(opt) and fxfuse.stats(opt)["fused_kernels"] >= 1
    _check_calls(opt, model, [((torch.randn(3, 9), n, *flag), {}) for n in (4, 5, 4) for flag in ((), (True,))])
    assert fxfuse.stats(opt)["specializations"] == 4


class _NamedArguments(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None, scale=1.0):
        h = torch.relu(self.fc(input_ids)) * scale
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return h + 1


def test_a_dict_example_input_binds_by_name_and_keyword_calls_reuse_its_specialization():
    """optimize(model, inputs) for code that calls model(**inputs) raised "example_input must
    be a tensor or a tuple" (fuzz34g)."""
    torch.manual_seed(0)
    model = _NamedArguments().eval()
    x, mask = torch.randn(2, 3, 8), torch.rand(2, 3)
    opt = fxfuse.optimize(model, {"attention_mask": mask, "input_ids": x}, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    _check_calls(opt, model, [((), {"input_ids": torch.randn(2, 3, 8), "attention_mask": torch.rand(2, 3)}),
                              ((torch.randn(2, 3, 8), torch.rand(2, 3)), {})])
    assert fxfuse.stats(opt)["specializations"] == 1
    scaled = fxfuse.optimize(model, {"input_ids": x, "scale": 2.0}, strict=True)
    _check_calls(scaled, model, [((), {"input_ids": torch.randn(2, 3, 8), "scale": 2.0})])
    assert fxfuse.stats(scaled)["specializations"] == 1


@pytest.mark.parametrize("example", [{"foo": 1}, {}, {"attention_mask": torch.rand(2, 3)}])
def test_a_dict_example_input_that_does_not_bind_names_the_parameters(example):
    with pytest.raises(fxfuse.UnsupportedError, match=r"input_ids', 'attention_mask', 'scale'"):
        fxfuse.optimize(_NamedArguments().eval(), example)


def test_a_dict_example_input_for_a_kwargs_forward_is_refused_clearly():
    class PassThrough(nn.Module):
        def forward(self, *args, **kwargs):
            return torch.relu(kwargs["x"])

    with pytest.raises(fxfuse.UnsupportedError, match="keyword-only or \\*\\*kwargs"):
        fxfuse.optimize(PassThrough().eval(), {"x": torch.randn(3)})


class _Reparametrize(nn.Module):
    """A VAE encoder's sample, and noise a model adds in eval mode too."""

    def __init__(self):
        super().__init__()
        self.mu, self.logvar = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        mu, logvar = self.mu(x), self.logvar(x)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return F.dropout(z.relu(), p=0.25, training=True) + torch.rand(z.shape) * 0.1


def test_torch_random_ops_pass_verify_and_draw_as_eager_under_the_same_seed():
    """verify ran eager and the graph from different random streams, so every model with a
    random op was refused as "not deterministic" (fuzz34g); both now start from one state."""
    torch.manual_seed(0)
    model, x = _Reparametrize().eval(), torch.randn(4, 16)
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, x)
    assert fxfuse.stats(opt)["optimized"] and fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        torch.manual_seed(7)
        got1, got2 = opt(x), opt(x)
        torch.manual_seed(7)
        want1, want2 = model(x), model(x)
    torch.testing.assert_close(got1, want1)
    torch.testing.assert_close(got2, want2)
    assert not torch.equal(got1, got2)   # each call draws anew


def test_a_build_of_a_random_model_leaves_the_random_stream_as_it_found_it():
    model, x = _Reparametrize().eval(), torch.randn(4, 16)
    torch.manual_seed(5)
    fxfuse.optimize(model, x)
    after_build = torch.rand(3)
    torch.manual_seed(5)
    torch.testing.assert_close(after_build, torch.rand(3), rtol=0, atol=0)


def test_a_model_saved_while_optimized_needs_no_fxfuse_to_load():
    """torch.save(opt.original) pickled fxfuse's load hooks: loading it without fxfuse failed
    (fuzz35d). They pickle as a no-op of builtins; a load into the copy reaches nothing."""
    import io
    import pickle
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    data = pickle.dumps(model)
    assert b"fxfuse" not in data
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert b"fxfuse" not in buffer.getvalue()
    copy = pickle.loads(data)
    copy.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))   # the original's weights, unchanged
    model.load_state_dict(copy.state_dict())          # the original's hook still rebuilds
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_plain_tensor_weight_gives_no_torch_fx_warning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    weight = model[0].weight
    del model[0].weight
    model[0].weight = weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_fast_weights_on_a_linear_reach_the_graph_that_folded_them():
    """A Linear's weight as a plain tensor (MAML-style fast weights), reassigned or edited in
    place after optimize: BatchNorm folding kept the first one (fuzz35d: 3.2 off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    model[1].running_mean.normal_()
    weight = model[0].weight
    del model[0].weight
    model[0].weight = weight.detach().clone()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    for step in range(3):
        if step == 1:
            model[0].weight = torch.randn(8, 8)
        if step == 2:
            model[0].weight.mul_(2)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


class _ScaleInADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cfg = {"scale": torch.randn(8)}

    def forward(self, x):
        return (self.fc(x) * self.cfg["scale"]).relu() + 1


def test_a_tensor_in_a_dict_set_to_require_grad_after_optimize_gets_its_gradient():
    """fuzz35d: the graph ran and the gradient of the dict's tensor was silently missing."""
    torch.manual_seed(0)
    model = _ScaleInADict().eval().requires_grad_(False)
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    model.cfg["scale"].requires_grad_(True)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(x)
    want = model(x)
    assert got.requires_grad and len(caught) == 1
    (g_got,) = torch.autograd.grad(got.sum(), model.cfg["scale"])
    (g_want,) = torch.autograd.grad(want.sum(), model.cfg["scale"])
    torch.testing.assert_close(g_got, g_want)


def test_an_in_place_edit_of_a_tensor_in_a_dict_reaches_the_graph():
    """Watched by version now, the edit rebuilt, and the rebuild refused the dict's tensor as "a
    constant forward() writes in place" (its version had moved: the user's write)."""
    torch.manual_seed(0)
    model = _ScaleInADict().eval()
    model.cfg["scale"].add_(1)   # written before optimize, too
    opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True)
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model.cfg["scale"].mul_(-2)
        torch.testing.assert_close(opt(x), model(x))


def test_torch_jit_script_of_an_optimized_module_scripts_the_original():
    """It raised torch's NotSupportedError from inside fxfuse's runtime (fuzz35d)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # torch.jit.script is deprecated in torch 2.13
        scripted = torch.jit.script(opt)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


_RESETS = {
    "zero_": lambda b: b.zero_(),
    "fill_": lambda b: b.fill_(0.0),
    "mul_": lambda b: b.mul_(0),
    "setitem": lambda b: b.__setitem__(slice(None), 0),
    "torch.zero_": lambda b: torch.zero_(b),
    "copy_zeros": lambda b: b.copy_(torch.zeros(b.shape)),
}


class _ScratchBuffer(nn.Module):
    """A scratch buffer written and reset within each call (the README promises it works)."""

    def __init__(self, reset):
        super().__init__()
        self.reset = reset
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scratch", torch.zeros(4, 8))

    def forward(self, x):
        out = x + self.scratch
        self.scratch.copy_(x * 2)
        y = out * torch.relu(self.lin(self.scratch))
        self.reset(self.scratch)
        return y


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("name", sorted(_RESETS))
def test_a_scratch_buffer_reset_with_no_traced_operand_is_recorded(name, verify):
    """torch.fx ran `self.scratch.zero_()` once while tracing and left it out of the graph: the
    buffer kept x * 2 after an optimized call (review35, fuzz35c), silently."""
    torch.manual_seed(0)
    model = _ScratchBuffer(_RESETS[name]).eval()
    twin = _ScratchBuffer(_RESETS[name]).eval()
    twin.load_state_dict(model.state_dict())
    opt = fxfuse.optimize(model, torch.randn(4, 8), verify=verify, strict=True)
    for _ in range(2):
        x = torch.randn(4, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), twin(x))
        torch.testing.assert_close(model.scratch, twin.scratch, rtol=0, atol=0)


def test_a_view_of_a_buffer_read_after_a_write_reads_the_write():
    class ViewThenWrite(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(32))

        def forward(self, x):
            v = self.buf.view(2, 16)
            self.buf.copy_(x.flatten())
            y = torch.relu(v) * 2
            self.buf.zero_()
            return y

    model = ViewThenWrite().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 16), verify=False, strict=True)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), torch.relu(x) * 2)
    assert not model.buf.any()


_VALUE_SIZED = {
    "slice_by_max": lambda x, c: (lambda h: torch.tanh(h).sum(1) / h.shape[1])(x[:, :c.max()]),
    "slice_by_item": lambda x, c: (lambda h: torch.relu(h) + h.shape[-1])(x[:, :c[0].item()]),
    "narrow": lambda x, c: (lambda h: torch.relu(h) * h.size(1))(x.narrow(1, 0, c[0].item())),
    "topk": lambda x, c: (lambda h: h * h.shape[1])(x.topk(c[0].item(), dim=1).values),
    "split_tolist": lambda x, c: (lambda h: torch.relu(h) * h.size(0))(torch.split(x, c.tolist())[0]),
    "tensor_split": lambda x, c: (lambda h: h * h.size(0))(torch.tensor_split(x, c, dim=0)[0]),
}


class _Sized(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x, c):
        return self.f(x, c)


@pytest.mark.parametrize("name", sorted(_VALUE_SIZED))
def test_a_size_set_by_a_tensor_value_is_not_frozen(name):
    """review35: normalize folded `h.shape[1]` of `x[:, :lengths.max()]` to the example's number;
    the same shapes with other lengths were silently wrong. Now the size read is refused."""
    torch.manual_seed(0)
    model = _Sized(_VALUE_SIZED[name]).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxfuse.optimize(model, (torch.randn(6, 8), torch.tensor([4, 2])))
        for a in (1, 3, 5):
            args = (torch.randn(6, 8), torch.tensor([a, 6 - a]))
            with torch.no_grad():
                torch.testing.assert_close(opt(*args), model(*args))


def test_a_value_sized_slice_without_a_size_read_keeps_its_graph():
    model = _Sized(lambda x, c: torch.relu(x[:, :c[0].item()]) * 2 + 1).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, (torch.randn(6, 8), torch.tensor([4, 2])))
    assert fxfuse.stats(opt)["optimized"]
    for a in (1, 5):
        args = (torch.randn(6, 8), torch.tensor([a, 6 - a]))
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), model(*args))


def test_a_guard_miss_names_the_argument_that_was_given():
    """`opt(x, bias=False)` was reported as "input 1 (scale) is the float 1.0" (fuzz35c)."""
    class Flags(nn.Module):
        def forward(self, x, scale: float = 1.0, mask=None, bias: bool = True):
            h = torch.relu(x) * scale
            return h + 1 if bias else h

    model = Flags().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 16), max_specializations=1)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(4, 16)
        torch.testing.assert_close(opt(x, bias=False), model(x, bias=False))
    assert len(caught) == 1 and "input 3 (bias) is the bool False" in str(caught[0].message)


class _LiveStats(nn.Module):
    """BatchNorm over statistics forward() sets (and restores) itself."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        self.bn.running_mean.copy_(x.mean(0)[:6])
        y = self.bn(self.lin(x))
        self.bn.running_mean.copy_(x.new_zeros(6))
        return y


class _ScratchWeight(nn.Module):
    """A work buffer filled from a parameter, used as a weight, then cleared."""

    def __init__(self, stored_in_out):
        super().__init__()
        self.stored_in_out = stored_in_out
        self.P = nn.Parameter(torch.randn(8, 6) if stored_in_out else torch.randn(6, 8))
        self.register_buffer("W", torch.zeros_like(self.P))

    def forward(self, x):
        self.W.copy_(self.P * 2)
        y = torch.relu(x @ self.W if self.stored_in_out else F.linear(x, self.W))
        self.W.copy_(self.P * 0)
        return y


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("make,options", [(_LiveStats, {}), (lambda: _ScratchWeight(True), {"gemm": "force"}),
                                          (lambda: _ScratchWeight(False), {"fused_mlp": "force"})],
                         ids=["batchnorm_stats", "x_at_W", "fused_mlp"])
def test_a_tensor_forward_writes_is_not_folded_or_copied_at_optimize_time(make, options, verify):
    """review35: BatchNorm folding, the transposed copy for `x @ W` and the fused MLP's packed
    weights were taken before forward()'s write: silently wrong with verify=False, a fallback
    blaming the model with verify on."""
    torch.manual_seed(0)
    model = make().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 8), verify=verify, **options)
    assert fxfuse.stats(opt)["optimized"]
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_value_computed_from_a_buffer_and_written_in_place_is_traced():
    """torch.fx computed `self.scale.exp()` at trace time (a buffer is no proxy) and refused the
    later `v.clamp_()` as a write into a constant (fuzz35a); buffers are graph nodes then."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.randn(3))

        def forward(self, x):
            v = self.scale.exp()
            v.clamp_(max=1.5)
            return x * v

    model = Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 3), strict=True)
    x = torch.randn(4, 3)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.scale.mul_(-1)   # a later edit of the buffer reaches the graph
        torch.testing.assert_close(opt(x), model(x))


def test_a_model_that_rejects_its_example_is_named_as_the_cause():
    """Both tracers failed and the warning blamed control flow, naming an internal proxy class;
    the cause was eager's own error on the example (fuzz35b)."""
    class Loop(nn.Module):
        def forward(self, x):
            h = torch.zeros(x.shape[0], 4)   # fp32: an fp16 x makes eager fail
            for i in range(x.shape[1]):
                h = h * 0.5 + x[:, i:i + 1]
            return h @ torch.ones(4, 4, dtype=x.dtype)

    with pytest.raises(fxfuse.FxfuseError, match="Loop itself raises on the example input"):
        fxfuse.optimize(Loop().eval(), torch.randn(2, 3, dtype=torch.float16), strict=True)
