"""Rewrites keep eager's memory layout where it can be seen (fuzz28): a generated GEMM, a fused
MLP and Strassen write row-major where eager's residual add kept a transposed input's layout,
and an eval BatchNorm as a multiply-add keeps its input's layout where batch_norm writes
contiguous. A later `.view()` then failed (the build fell back with an "internal error"), the
output came back with other strides than eager's, and kernels downstream, built for eager's
strides, ran their torch reference on every call. fxfuse.ops.keep_eager_layout restores eager's
strides after such a rewrite (a copy only where they differ)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse

from fxfuse.kernel import FusedKernel
from fxfuse.ops import as_layout


class TransposedResidual(nn.Module):
    def __init__(self, view):
        super().__init__()
        self.a, self.view = nn.Linear(16, 16), view

    def forward(self, x):            # x: [B, 5, 16]
        x = x.transpose(0, 1)
        x = x + self.a(x)           # eager: the sum keeps x's transposed layout
        y = x.transpose(0, 1)[:, 1:3].tanh()
        return y.view(-1, 16) if self.view else x


def _graph_targets(opt):
    """Every node's target, and as_layout where a fused kernel took it as a member (the kernel
    then writes eager's layout itself)."""
    spec = next(iter(opt._specializations.values()))
    kernels = [m for m in spec.gm.modules() if isinstance(m, FusedKernel)]
    return [n.target for n in spec.gm.graph.nodes] + [as_layout for k in kernels
                                                      if any(d.endswith("=as_layout") for d in k.members)]


@pytest.mark.parametrize("view", [True, False])
@pytest.mark.parametrize("options,rewrite", [({"gemm": "force"}, "fused_gemm"), ({"fused_mlp": "force"}, "fused_mlp"),
                                             ({"strassen": "force"}, torch.bmm)])
def test_a_rewritten_linear_keeps_eager_layout(options, rewrite, view):
    model = TransposedResidual(view).eval()
    opt = fxfuse.optimize(model, torch.randn(2, 5, 16), strict=True, **options)
    with torch.no_grad():
        for b in (2, 3):
            x = torch.randn(b, 5, 16)
            got, want = opt(x), model(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert got.stride() == want.stride()
    targets = _graph_targets(opt)
    assert any(t == rewrite or str(t).startswith(str(rewrite)) for t in targets), targets   # rewritten
    assert as_layout in targets
    assert fxfuse.stats(opt)["reference_fallbacks"] == 0


def test_contiguous_layers_get_no_layout_node():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 8), strict=True, gemm="force")
    assert as_layout not in _graph_targets(opt) and fxfuse.stats(opt)["fused_kernels"] == 2


@pytest.mark.parametrize("view", [True, False])
def test_batchnorm_on_a_transposed_input_keeps_eager_layout(view):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8)

        def forward(self, x):
            h = F.relu(self.bn(self.lin(x).transpose(1, 2)))
            return h.view(h.shape[0], -1) if view else h

    model = M().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    opt = fxfuse.optimize(model, torch.randn(3, 5, 6), strict=True)
    with torch.no_grad():
        x = torch.randn(3, 5, 6)
        got, want = opt(x), model(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert got.stride() == want.stride()
    assert fxfuse.stats(opt)["fused_kernels"] >= 1 and fxfuse.stats(opt)["reference_fallbacks"] == 0
