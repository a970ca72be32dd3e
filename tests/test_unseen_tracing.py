"""Regression tests from fuzzing round 6 over model structure: containers torch.fx rebuilds
as another type, and torch.nn blocks symbolic_trace keeps opaque. Each names the failure."""
import warnings
from collections import OrderedDict

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
