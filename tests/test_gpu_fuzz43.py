"""Stop 43 on the GPU: the fusions this stop added (a pointwise operand computed at a view's source
shape, copying reshapes, zero tests of wide integers, in-place chains keeping fp16, Linear spellings
and an index unsqueeze under the generated GEMM), compiled, under the CUDA graph, at odd sizes."""
import pytest
import torch

import fxfuse
from test_fuzz43_spellings import AS_COMMON, LINEAR_SPELLINGS, Chain, HandLeaky, IntegerMasks, MixedInPlace, Product
from test_fuzz43_views import ChannelScaleAfterFlatten, Dist2BBox, FlattenedHidden, HeadMerge, IndexUnsqueeze, MambaGate

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def _three_calls(opt, model, make, exact=False):
    kept = []
    for _ in range(3):
        args = make()
        with torch.no_grad():
            got, want = opt(*args), model(*args)
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kept.append((got, want.clone()))
    for got, want in kept:   # call 1's output untouched by the later calls
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 37, 1000])
def test_reshapes_between_pointwise_results_on_the_gpu(rows):
    for make, shapes in ((MambaGate, [(rows, 5, 2, 3), (rows, 5, 2, 3), (rows, 5, 6)]),
                         (lambda: HeadMerge(True), [(2, 2, 9, 4), (2, 9, 8)])):
        model = make().eval().cuda()
        args = lambda: [torch.randn(*s, device="cuda") for s in shapes]   # noqa: E731
        opt = fxfuse.optimize(model, args(), strict=True)
        assert fxfuse.stats(opt)["fused_kernels"] == 1
        _three_calls(opt, model, args)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_zero_tests_of_wide_integers_on_the_gpu(dtype):
    model = IntegerMasks().eval()

    def args():
        a, b = (torch.randint(-3, 4, (37, 129), dtype=dtype, device="cuda") * (2 ** 30 + 1) for _ in range(2))
        return a, b, torch.randn(37, 129, device="cuda")
    opt = fxfuse.optimize(model, args(), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    _three_calls(opt, model, args, exact=True)


def test_an_fp16_in_place_chain_on_the_gpu():
    model = MixedInPlace().eval()
    args = lambda: (torch.randn(37, 129, device="cuda").half(), torch.randn(37, 129, device="cuda"))   # noqa: E731
    opt = fxfuse.optimize(model, args(), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    _three_calls(opt, model, args, exact=True)


@pytest.mark.parametrize("name", ["mm mat2=", "Tensor.addmm", "aten.addmm packet", "movedim"])
def test_linear_spellings_under_the_generated_gemm_on_the_gpu(name):
    model = Product(LINEAR_SPELLINGS[name]).eval().cuda()
    args = lambda: (torch.randn(37, 16, device="cuda"),)   # noqa: E731
    opt = fxfuse.optimize(model, args(), strict=True, gemm="force")
    assert (fxfuse.stats(opt)["fused_kernels"], fxfuse.stats(opt)["library_calls"]) == (1, 0)
    _three_calls(opt, model, args)
    index = IndexUnsqueeze().eval().cuda()
    opt = fxfuse.optimize(index, torch.randn(37, 16, device="cuda"), strict=True, gemm="force")
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    _three_calls(opt, index, args)


@pytest.mark.parametrize("name", ["aten.cat packet", "stride", "dtype.itemsize"])
def test_packets_and_metadata_reads_on_the_gpu(name):
    model = Chain(AS_COMMON[name][0]).eval()
    args = lambda: (torch.randn(37, 16, device="cuda"),)   # noqa: E731
    opt = fxfuse.optimize(model, args(), strict=True)
    _three_calls(opt, model, args)


@pytest.mark.parametrize("options", [{}, {"fused_mlp": "force"}, {"gemm": "force"}])
def test_a_flattened_hidden_state_between_linears_on_the_gpu(options):
    model = FlattenedHidden("after relu").eval().cuda()
    args = lambda: (torch.randn(3, 37, 16, device="cuda"),)   # noqa: E731
    opt = fxfuse.optimize(model, args(), strict=True, **options)
    _three_calls(opt, model, args)


@pytest.mark.parametrize("rows", [1, 37, 1000])
def test_ops_after_a_join_and_channel_scales_past_a_view_on_the_gpu(rows):
    model = Dist2BBox().eval()
    args = lambda: (torch.randn(rows, 2, 39, device="cuda"), torch.randn(rows, 2, 39, device="cuda"),   # noqa: E731
                    torch.rand(1, 2, 39, device="cuda") * 8, torch.rand(1, 39, device="cuda") * 16)
    opt = fxfuse.optimize(model, args(), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    _three_calls(opt, model, args)
    model = ChannelScaleAfterFlatten("flatten").eval().cuda()
    args = lambda: (torch.randn(rows, 4, 5, 6, device="cuda"),)   # noqa: E731
    opt = fxfuse.optimize(model, args(), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    _three_calls(opt, model, args)


@pytest.mark.parametrize("options", [{}, {"fused_mlp": "force"}, {"gemm": "force"}])
def test_a_hand_written_leaky_relu_between_linears_on_the_gpu(options):
    model = HandLeaky("gt").eval().cuda()
    args = lambda: (torch.randn(37, 8, device="cuda"),)   # noqa: E731
    opt = fxfuse.optimize(model, args(), strict=True, **options)
    _three_calls(opt, model, args)
