"""Regression tests from fuzzing round 6 over model structure: containers torch.fx rebuilds
as another type, and torch.nn blocks symbolic_trace keeps opaque. Each names the failure."""
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.runtime import OptimizedModule


class OrderedDictOutput(nn.Module):
    """torchvision's IntermediateLayerGetter and segmentation models return an OrderedDict."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.first(x))
        return OrderedDict(out=h, aux=self.second(h) * 2)


def test_an_ordered_dict_output_is_optimized_and_stays_an_ordered_dict():
    """torch.fx recorded the OrderedDict as a dict; the verification then refused the model
    with "the rewritten graph returns TreeSpec(dict, ...)" and the original came back."""
    model = OrderedDictOutput().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 8))
    assert isinstance(opt, OptimizedModule) and fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        for batch in (4, 7):
            x = torch.randn(batch, 8)
            got, expected = opt(x), model(x)
            assert type(got) is OrderedDict and list(got) == ["out", "aux"]
            for key in expected:
                torch.testing.assert_close(got[key], expected[key])


class EncoderWithHead(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_a_transformer_encoder_inside_a_model_is_fused():
    """symbolic_trace keeps every torch.nn module as one call: the encoder's Linears, bias adds,
    ReLUs and residual adds were one opaque library call (1 fused kernel: the head's bias), while
    the same layer as the root model went through torch.export and fused."""
    torch.manual_seed(0)
    model = EncoderWithHead().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 5, 16))
    assert fxfuse.stats(opt)["fused_kernels"] > 4
    assert "symbolic_trace kept encoder as one call" in fxfuse.explain(opt)
    with torch.no_grad():
        for shape in ((2, 5, 16), (3, 7, 16)):
            x = torch.randn(*shape)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_transformer_block_export_cannot_take_stays_one_call():
    """Where torch.export fails (here: a non-tensor argument, which it is not tried for) the
    symbolic_trace graph is kept, the block one call, and the model still matches eager."""
    class WithScale(EncoderWithHead):
        def forward(self, x, scale=2.0):
            return self.head(self.encoder(x)) * scale

    torch.manual_seed(0)
    model = WithScale().eval()
    x = torch.randn(2, 5, 16)
    opt = fxfuse.optimize(model, (x, 3.0))
    assert isinstance(opt, OptimizedModule)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, 3.0), model(x, 3.0), rtol=1e-4, atol=1e-5)


class PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)

    def forward(self, x, padding):
        return self.encoder(self.proj(x), src_key_padding_mask=padding)


def test_a_transformer_given_a_padding_mask_stays_one_call():
    """Review of the export path: eager's inference fast path (nested tensors) returns zeros at
    padded positions where the slow path export records returns values: optimized without
    padding, a padded call silently differed from eager (and a padded example was refused as
    'a bug in fxfuse')."""
    torch.manual_seed(0)
    model = PaddedEncoder().eval()
    x = torch.randn(2, 5, 16)
    no_padding = torch.zeros(2, 5, dtype=torch.bool)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    for example in (no_padding, padding):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = fxfuse.optimize(model, (x, example))
        assert not [w for w in caught if "fxfuse" in str(w.message)]
        assert "constructed by torch.fx.symbolic_trace" in fxfuse.explain(opt)   # the encoder one call
        with torch.no_grad():
            torch.testing.assert_close(opt(x, padding), model(x, padding), rtol=1e-4, atol=1e-5)


def test_a_print_in_forward_prints_nothing_on_the_export_path(capsys):
    class Printing(EncoderWithHead):
        def forward(self, x):
            h = self.encoder(x)
            print("debug:", h.shape)
            return self.head(h)

    model = Printing().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 5, 16))
    assert "kept encoder as one call" in fxfuse.explain(opt)
    assert "FakeTensor" not in capsys.readouterr().out


def test_fx_trace_of_a_wrapper_calling_opt_on_a_constant_tensor():
    """A traced forward() calling opt with a plain tensor attribute (no proxy) ran the
    specialization, whose submodule calls went through fx's patched __call__: NameError."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 8))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = opt
            self.prompt = torch.randn(3, 8)

        def forward(self, x):
            return x + self.inner(self.prompt)

    with torch.no_grad():
        traced = torch.fx.symbolic_trace(Wrapper())
        x = torch.randn(3, 8)
        torch.testing.assert_close(traced(x), x + model(traced.prompt))


def test_a_nested_tensor_runs_the_original_and_a_dict_subclass_output_is_named():
    model = nn.Linear(8, 8).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nested = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
        with torch.no_grad():
            got = opt(nested)
    assert got.is_nested
    assert [str(w.message) for w in caught if "nested tensor" in str(w.message) and "fxfuse" in str(w.message)]

    class MyDict(dict):
        pass

    class DictSubclassOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return MyDict(out=self.lin(x))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxfuse.optimize(DictSubclassOutput().eval(), torch.randn(3, 8))
    assert len(caught) == 1 and "returns a MyDict" in str(caught[0].message)


def test_a_transformer_layer_as_the_model_given_a_padding_mask_is_refused():
    """symbolic_trace fails on the layer itself and torch.export records its slow path: with a
    key-padding mask that differs from eager at padded positions, so the original comes back."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x, padding = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False, False, False, True, True]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(layer, (x, torch.zeros(5, 5), padding))   # src_mask, src_key_padding_mask
    assert opt is layer
    assert [w for w in caught if "is given a mask (key-padding" in str(w.message)]
    assert isinstance(fxfuse.optimize(layer, x), OptimizedModule)   # no mask: decomposed as before


def test_a_padded_block_in_a_model_symbolic_trace_cannot_take_is_refused():
    """Where symbolic_trace fails elsewhere in the model, export traces the whole of it; a
    block inside given a key-padding mask is found by running the model once with hooks."""
    class Branchy(PaddedEncoder):
        def forward(self, x, padding):
            h = self.proj(x)
            if h.sum() > 1e9:          # data-dependent control flow: symbolic_trace fails
                h = h * 2
            return self.encoder(h, src_key_padding_mask=padding)

    torch.manual_seed(0)
    model = Branchy().eval()
    x, padding = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False, False, False, True, True]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, (x, padding))
    assert opt is model
    assert [w for w in caught if "encoder is given a mask (key-padding" in str(w.message)], \
        [str(w.message) for w in caught]


def test_an_input_the_model_rejects_after_a_tracing_failure_gets_the_input_advice():
    """fuzz29: symbolic_trace failed for a tracing reason (a buffer sliced by a traced size) and
    torch.export's graph then failed on the input (the model's own dtype error): the advice
    was about control flow."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8).half()
            self.register_buffer("pos", torch.zeros(16, 8))

        def forward(self, x):
            return self.lin(x + self.pos[: x.shape[1]])   # fp32 into an fp16 Linear: eager raises

    with pytest.raises(fxfuse.TraceError, match="same dtype.*Check the example input") as info:
        fxfuse.optimize(M().eval(), torch.randn(2, 4, 8), strict=True)
    assert "control flow" not in str(info.value)
