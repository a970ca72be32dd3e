"""Stop 50 on the GPU: whole views returned through in-place ops, and fused optimizer steps made
without Optimizer.step, against CUDA eager."""
import pytest
import torch

import fxfuse
from test_fuzz50 import WHOLE_VIEWS_WRITTEN, Apply
from test_fuzz50_runtime import FoldedBlock, _functional_adam

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


@pytest.mark.parametrize("name", ["slice_mul_", "detach_mul_", "slice_cpu", "relu__input_slice"])
def test_a_returned_whole_view_is_not_the_input_itself_on_cuda(name):
    model = Apply(WHOLE_VIEWS_WRITTEN[name]).eval()
    opt = fxfuse.optimize(model, torch.randn(4, 6, device="cuda"), strict=True)
    with torch.no_grad():
        x = torch.randn(4, 6, device="cuda")
        xe = x.clone()
        got, want = opt(x), model(xe)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x, xe)
    assert got is not x
    got.unsqueeze_(0)
    assert x.shape == (4, 6)


def test_a_functional_fused_adam_step_on_cuda_rebuilds_the_folded_weights():
    torch.manual_seed(0)
    model, x = FoldedBlock().cuda().eval(), torch.randn(5, 8, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        opt(x)
    params = list(model.parameters())
    model(torch.randn(5, 8, device="cuda")).square().mean().backward()
    _functional_adam(params)
    with torch.no_grad():
        xi = torch.randn(5, 8, device="cuda")
        torch.testing.assert_close(opt(xi), model(xi))


def test_adam_fused_true_on_cuda_is_seen():
    torch.manual_seed(0)
    model, x = FoldedBlock().cuda().eval(), torch.randn(5, 8, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    adam = torch.optim.Adam(model.parameters(), lr=0.5, fused=True)
    for _ in range(2):
        with torch.no_grad():
            opt(x)
        model(torch.randn(5, 8, device="cuda")).square().mean().backward()
        adam.step()
        adam.zero_grad()
        with torch.no_grad():
            xi = torch.randn(5, 8, device="cuda")
            torch.testing.assert_close(opt(xi), model(xi))

