"""Spellings fuzz29 found cutting fused groups: `.type_as(x)` (Meta LLaMA's RMSNorm) and
`masked_fill` (attention masks) ran as library calls between fused kernels; torch.export's
aten.threshold had no row. Each checked against eager with the fusion counted."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse


def _library_calls(opt):
    return [line.split()[0] for line in fxfuse.explain(opt).splitlines() if "library call" in line]


class RMSNorm(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.weight, self.spelling = nn.Parameter(torch.randn(32)), spelling

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y.type_as(x) if self.spelling == "type_as" else y.to(x.dtype)) * self.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_type_as_is_a_cast(dtype):
    model = RMSNorm("type_as").to(dtype).eval()
    x = torch.randn(4, 32, dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        y = torch.randn(5, 32, dtype=dtype)
        got, want = opt(y), model(y)
    torch.testing.assert_close(got, want)
    assert got.dtype == want.dtype and "type_as" not in _library_calls(opt), _library_calls(opt)
    reference = fxfuse.optimize(RMSNorm("to").to(dtype).eval(), x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == fxfuse.stats(reference)["fused_kernels"]


MASKS = {
    "method": lambda s, m: s.masked_fill(m, -1e4),
    "function": lambda s, m: torch.masked_fill(s, m, -1e4),
    "keywords": lambda s, m: s.masked_fill(mask=m, value=float("-inf")),
    "in place": lambda s, m: s.masked_fill_(m, -1e4),
    "0-d tensor value": lambda s, m: s.masked_fill(m, torch.tensor(-3.0)),
}


class Masked(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.fill = MASKS[spelling]

    def forward(self, scores, mask):
        return torch.tanh(self.fill(scores * 0.125, mask)) * 2


@pytest.mark.parametrize("spelling", list(MASKS))
def test_masked_fill_is_a_where(spelling):
    model = Masked(spelling).eval()
    example = (torch.randn(2, 8, 8), torch.rand(8, 8) > 0.5)
    opt = fxfuse.optimize(model, example, strict=True)
    with torch.no_grad():
        fresh = (torch.randn(3, 8, 8), torch.rand(8, 8) > 0.5)
        torch.testing.assert_close(opt(*fresh), model(*fresh))
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and not _library_calls(opt), _library_calls(opt)


def test_masked_fill_that_where_would_promote_stays_masked_fill():
    """An int tensor filled with 1.5 stays int in masked_fill; torch.where would make it float."""
    class IntFill(nn.Module):
        def forward(self, x, mask):
            return (x * 2).masked_fill(mask, 1.5) + 1

    model = IntFill().eval()
    x, mask = torch.randint(-5, 5, (4, 6)), torch.rand(4, 6) > 0.5
    opt = fxfuse.optimize(model, (x, mask), strict=True)
    got, want = opt(x, mask), model(x, mask)
    assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)


def test_export_threshold_has_a_spelling():
    from fxfuse.passes.spellings import ATEN_SPELLINGS
    assert ATEN_SPELLINGS[torch.ops.aten.threshold.default].canonical is F.threshold


def test_type_as_through_torch_export_is_a_cast():
    """fuzz29c: where symbolic_trace fails and torch.export traces, type_as is aten.type_as and
    its operands are nodes normalize rewrote (which kept their device now)."""
    class ExportedRMS(RMSNorm):
        def forward(self, x):
            if x.shape[-1] == 32:   # symbolic_trace cannot branch on a traced size: torch.export traces
                x = x * 1.0
            return super().forward(x)

    model = ExportedRMS("type_as").half().eval()
    x = torch.randn(4, 32).half()
    opt = fxfuse.optimize(model, x, strict=True)
    assert "export" in fxfuse.explain(opt) and "type_as" not in _library_calls(opt), _library_calls(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
