"""A specialization whose graph is one fused MLP kernel launches it directly (fxfuse/direct_launch.py):
no CUDA graph, the input read in place, a fresh output per call. The CPU tests check which
graphs qualify; the GPU tests check results, output safety and the ordinary-path fallbacks.
"""
import pytest
import torch
import torch.nn as nn

import fxfuse
from conftest import relative_error as rel_err
from fxfuse.demo import seed_network
from fxfuse.direct_launch import single_kernel
from fxfuse.mlp_kernel import FusedMLP


def _spec(opt):
    return next(iter(opt.specializations.values()))


def test_single_kernel_graphs_only():
    model = seed_network(24, 3)
    opt = fxfuse.optimize(model, torch.randn(5, 24), strict=True, fused_mlp="force")
    assert isinstance(single_kernel(_spec(opt).gm), FusedMLP)
    assert _spec(opt).direct is None            # CPU tensors: nothing to launch directly
    split = fxfuse.optimize(model, torch.randn(5, 24), strict=True, fused_mlp="off")
    assert single_kernel(_spec(split).gm) is None

    class TwoOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = seed_network(24, 2)

        def forward(self, x):
            y = self.body(x)
            return y, y.sum()

    two = fxfuse.optimize(TwoOut().eval(), torch.randn(5, 24), strict=True, fused_mlp="force")
    assert single_kernel(_spec(two).gm) is None


gpu = pytest.mark.cuda


@gpu
@pytest.mark.usefixtures("ieee_fp32")
@pytest.mark.parametrize("shape", [(1, 64), (37, 64), (2, 3, 64), (700, 64)])
def test_direct_launch_matches_eager_and_never_overwrites(shape):
    model = seed_network(64, 8).cuda()
    x = torch.randn(shape, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, fused_mlp="force")
    spec = _spec(opt)
    assert spec.direct is not None and spec.graph is None and "launched directly" in fxfuse.explain(opt)
    (mod,) = [m for m in spec.gm.modules() if isinstance(m, FusedMLP)]
    with torch.no_grad():
        x1, x2 = torch.randn_like(x), torch.randn_like(x)
        x1_copy = x1.clone()
        launches = mod.launches
        y1 = opt(x1)
        kept = y1.clone()
        y2 = opt(x2)
        torch.cuda.synchronize()
        assert mod.launches == launches + 2 and y1.shape == shape[:-1] + (64,)
        assert torch.equal(y1, kept) and y1.data_ptr() != y2.data_ptr()   # a fresh output per call
        assert torch.equal(x1, x1_copy)
        assert rel_err(y1, model(x1)) < 1e-6 and rel_err(y2, model(x2)) < 1e-6
    assert "us per direct launch" in fxfuse.explain(opt, measure=True)


@gpu
@pytest.mark.usefixtures("ieee_fp32")
def test_misaligned_input_takes_the_ordinary_path():
    """Same shape and strides as the example, but 4 bytes into a buffer: the compiled kernel
    assumed 16-byte aligned pointers, so this call goes through the module's own launch."""
    model = seed_network(64, 2).cuda()
    opt = fxfuse.optimize(model, torch.randn(5, 64, device="cuda"), strict=True, fused_mlp="force")
    spec = _spec(opt)
    assert spec.direct is not None
    x = torch.randn(5 * 64 + 1, device="cuda")[1:].view(5, 64)
    assert x.data_ptr() % 16 and spec.direct(x) is None
    with torch.no_grad():
        assert rel_err(opt(x), model(x)) < 1e-6
    assert fxfuse.stats(opt)["specializations"] == 1


@gpu
@pytest.mark.usefixtures("ieee_fp32")
def test_non_contiguous_example_keeps_the_graph_and_says_why():
    model = seed_network(64, 2).cuda()
    xt = torch.randn(64, 6, device="cuda").t()
    opt = fxfuse.optimize(model, xt, strict=True, fused_mlp="force")
    spec = _spec(opt)
    assert spec.direct is None and spec.graph is not None and "no direct launch" in spec.cuda_graph_note
    with torch.no_grad():
        fresh = torch.randn(64, 6, device="cuda").t()
        assert rel_err(opt(fresh), model(fresh)) < 1e-6


@gpu
@pytest.mark.usefixtures("ieee_fp32")
def test_narrow_seed_network_auto_is_one_direct_launch():
    """With the shipped H100 calibration, "auto" fuses 8 x Linear(64) into one kernel (about 2x
    the per-layer plan's speed, mlp_probe_20261124.txt) and launches it directly."""
    if "H100" not in torch.cuda.get_device_name():
        pytest.skip("the plan follows the H100 calibration")
    model = seed_network(64, 8).cuda()
    x = torch.randn(16, 64, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    assert _spec(opt).direct is not None
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    with torch.no_grad():
        fresh = torch.randn_like(x)
        assert rel_err(opt(fresh), model(fresh)) < 1e-6
