"""Stop 41 (fuzz41c): what a specialization is keyed on and what a build bakes in."""
import warnings

import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager


def test_swap_tensors_on_a_weight_the_generated_gemm_reads_rebuilds():
    # before: the generated GEMM kept an alias of the old weight's storage (|opt - eager| 3.9, silently)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)).eval()
    x = torch.randn(8, 16)
    opt = fxfuse.optimize(model, x, gemm="force", fused_mlp="off", strict=True)
    assert "EpilogueGemm" in {type(m).__name__ for m in next(iter(opt._specializations.values())).gm.modules()}
    assert_matches_eager(opt, model, x)
    torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.randn(16, 16)))
    assert_matches_eager(opt, model, x)


class ReturnsEmpty(nn.Module):
    def forward(self, x):
        return x * 2, torch.zeros(0), torch.zeros(2, 0)


def test_an_empty_constant_output_is_a_new_tensor_each_call():
    # before: the same empty tensor object every call; call 1's resize_/fill_ showed in call 2
    opt = fxfuse.optimize(ReturnsEmpty().eval(), torch.randn(4, 8), strict=True)
    with torch.no_grad():
        first = opt(torch.randn(4, 8))
        first[1].resize_(3).fill_(7.0)
        first[2].requires_grad_(True)
        second = opt(torch.randn(4, 8))
    assert second[1] is not first[1] and second[1].shape == (0,)
    assert second[2] is not first[2] and not second[2].requires_grad


class Factory(nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1, torch.arange(3.0)


def test_a_default_device_set_after_optimize_is_followed():
    # before: the factory stayed on the build's device (eager: meta, opt: cpu)
    model = Factory().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the rebuild under the meta device may fail: the original runs
        with torch.device("meta"), torch.no_grad():
            got, expected = opt(x), model(x)
    assert [t.device.type for t in got] == [t.device.type for t in expected] == ["cpu", "meta"]
    assert_matches_eager(opt, model, x)   # and back on the CPU


class Scaled(nn.Module):
    def forward(self, x, alpha=1.0):
        return torch.relu(x * alpha) + 1


def test_an_example_spelling_out_a_default_serves_calls_that_leave_it_out():
    # before: keyed (x, 1.0), so opt(x) missed: a second build, or with one slot the original and a warning
    model = Scaled().eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, (x, 1.0), max_specializations=1, strict=True)
    with torch.no_grad():
        for call in (lambda t: opt(t, 1.0), lambda t: opt(t), lambda t: opt(t, alpha=1.0)):
            y = torch.randn(4, 8)
            torch.testing.assert_close(call(y), model(y))
    assert len(opt._specializations) == 1 and not opt._misses and fxfuse.stats(opt)["fused_kernels"] == 1


class Scale(float):
    """A number type whose repr hides its value."""

    def __repr__(self):
        return "Scale"


class TakesTuple(nn.Module):
    def forward(self, x, scales):
        return torch.relu(x) * scales[0] + 1


def test_a_number_whose_repr_hides_its_value_inside_a_tuple_is_keyed_by_value():
    # before: (Scale(2.0),) and (Scale(5.0),) had one signature text: |opt - eager| 10.2, silently
    model = TakesTuple().eval()
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(model, (x, (Scale(2.0),)))
    with torch.no_grad():
        y = torch.randn(4, 8)
        torch.testing.assert_close(opt(y, (Scale(5.0),)), model(y, (Scale(5.0),)))


def test_strides_of_size_one_dims_do_not_make_a_new_specialization():
    # before: a batch-1 row made as col.T (stride (1, 1)) missed the (8, 1) build: a second build, or
    # with one slot the original and a warning (and .contiguous() could not help)
    model = Scaled().eval()
    opt = fxfuse.optimize(model, torch.randn(1, 8), max_specializations=1, strict=True)
    row = torch.randn(8, 1).T
    assert row.stride() == (1, 1) and row.is_contiguous()
    launches = fxfuse.stats(opt)["kernel_launches"]
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(opt(row), model(row))
    assert len(opt._specializations) == 1 and not opt._misses
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["kernel_launches"] == launches + 2


class BranchOnStride(nn.Module):
    def forward(self, x):
        if x.stride(0) == 1:
            return x * 2 + 1
        return x * 3 + 1


def test_a_forward_reading_strides_gets_its_own_specialization_for_size_one_strides():
    # review41b: the (8, 1) build served a (1, 1) row, and forward() branches on that stride
    model = BranchOnStride().eval()
    opt = fxfuse.optimize(model, torch.randn(1, 8), strict=True)
    row = torch.randn(8, 1).T
    with torch.no_grad():
        torch.testing.assert_close(opt(row), model(row))


def test_a_channels_last_input_differing_in_a_size_one_channel_stride_keeps_eagers_layout():
    # fuzz41i: the size-1 aliasing served a (25, 1, 5, 1) input with the (25, 25, 5, 1) build, and the
    # conv's output came back in the other memory format (a later .view() failed where eager's worked)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()).eval()
    plain = torch.randn(2, 1, 5, 5)
    opt = fxfuse.optimize(model, plain, strict=True)
    last = torch.randn(2, 1, 5, 5).to(memory_format=torch.channels_last)
    assert last.stride() != plain.stride()
    with torch.no_grad():
        for x in (last, plain):
            got, expected = opt(x), model(x)
            assert got.stride() == expected.stride()
            torch.testing.assert_close(got, expected)
