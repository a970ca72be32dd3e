"""Stop 38: fixes from the fuzz38 helper rounds and the items stop 37 left alone."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse


class ImplicitSoftmaxDims(nn.Module):
    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax()
        self.log_softmax = nn.LogSoftmax()

    def forward(self, x, y):
        return (F.softmax(x * 2), F.log_softmax(y, None), F.softmin(x, dtype=torch.float64),
                self.softmax(x + 1), self.log_softmax(y))


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 5), (2, 3, 4, 5)])
def test_softmax_without_dim_warns_in_the_build_only_and_keeps_torchs_dim(shape):
    # torch picks the dim by rank and warns each call; the graph asked again on its first call and the
    # same warning came a second time from fxfuse's generated code (review37)
    model = ImplicitSoftmaxDims().eval()
    x, y = torch.randn(shape), torch.randn(shape)
    with warnings.catch_warnings(record=True):   # shown once per place, by the first build only
        opt = fxfuse.optimize(model, (x, y), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            got = [opt(x, y) for _ in range(2)][-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(x, y)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1


class ExclusiveOr(nn.Module):
    def forward(self, x, y):
        a, b = x > 0, y < 0.3
        return (x * (a ^ b), torch.logical_xor(x, y - 0.5) * 2.0, x.logical_xor(a).float() + y,
                torch.bitwise_xor(a, b) | a, a.__xor__(b) & b)


def test_exclusive_or_of_masks_and_logical_xor_join_the_kernel():
    # `^` of two masks and torch.logical_xor were library calls between kernels (review37)
    x, y = torch.randn(3, 5), torch.randn(5)
    x[0, 0], y[1] = 0.0, 0.5   # exact zeros: logical_xor reads "nonzero"
    opt = fxfuse.optimize(ExclusiveOr().eval(), (x, y), strict=True)
    assert (fxfuse.stats(opt)["fused_kernels"], fxfuse.stats(opt)["library_calls"]) == (1, 0)
    for args in ((x, y), (torch.randn(3, 5), torch.randn(5))):
        with torch.no_grad():
            for got, want in zip(opt(*args), ExclusiveOr()(*args)):
                assert got.dtype == want.dtype and torch.equal(got, want)


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.randn(4, 8)   # a plain tensor attribute, not a buffer

    def forward(self, x):
        x.add_(1)
        return (self.table * 2).sigmoid() + x


def test_an_input_that_is_a_tensor_attribute_of_the_model_runs_the_original_when_forward_writes_it():
    # the graph's (self.table * 2).sigmoid() is a constant computed before the write; eager reads the
    # written table through the alias (review38: a silent wrong answer; buffers were guarded already)
    model = WritesItsInput().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    before = model.table.clone()
    with torch.no_grad(), pytest.warns(fxfuse.FxfuseWarning, match="a tensor it holds"):
        got = opt(model.table)
    model.table.copy_(before)
    with torch.no_grad():
        want = model(model.table)
    torch.testing.assert_close(got, want)


def test_a_reassigned_tensor_attribute_passed_as_the_written_input_runs_the_original():
    # the aliasing guard knew the build's tensors only: after `model.table = t`, opt(t) rebuilt and ran the
    # graph on the alias (review38b)
    model = WritesItsInput().eval()
    opt = fxfuse.optimize(model, torch.randn(4, 8))
    for _ in range(2):
        model.table = torch.randn(4, 8)
        before = model.table.clone()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = opt(model.table)
            model.table.copy_(before)
            want = model(model.table)
        torch.testing.assert_close(got, want)


class Pointwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, x):
        return self.lin((x * 2).relu() + 1).sigmoid()


def test_inputs_differing_only_in_a_size_one_dims_stride_keep_eagers_output_layout():
    # a conv picks its output memory format from the input's strides, a size-1 channel dim's too: a
    # specialization reused across such inputs handed back the other layout, and .view() failed (review38b)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()).eval()
    plain = torch.randn(2, 1, 5, 5)
    opt = fxfuse.optimize(model, plain, strict=True)
    for x in (plain.contiguous(memory_format=torch.channels_last), torch.randn(2, 1, 5, 5)):
        with torch.no_grad():
            got, want = opt(x), model(x)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got.view(2, -1), want.view(2, -1))


@pytest.mark.parametrize("switch", ["fp16_reduction", "bf16_reduction"])
def test_library_precision_switches_changed_after_the_build_rebuild(switch):
    # cuBLAS's reduced-precision fp16/bf16 reductions decide the library kernels a CUDA graph captured;
    # turned off after the build they kept the old kernels (review38)
    owner, name = {"fp16_reduction": (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
                   "bf16_reduction": (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction")}[switch]
    model, x = Pointwise().eval(), torch.randn(3, 8)
    saved = getattr(owner, name)
    try:
        opt = fxfuse.optimize(model, x, strict=True)
        built = next(iter(opt._specializations.values()))
        setattr(owner, name, False)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
        assert next(iter(opt._specializations.values())) is not built
    finally:
        setattr(owner, name, saved)


@torch.library.custom_op("fxfuse_test38::scale_in_place", mutates_args=("x",))
def _scale_(x: torch.Tensor, s: float) -> None:
    x.mul_(s)


@torch.library.custom_op("fxfuse_test38::scale_second", mutates_args=("x",))
def _scale_second_(s: float, x: torch.Tensor) -> None:
    x.mul_(s)


@torch.library.custom_op("fxfuse_test38::add_one_to_each", mutates_args=("xs",))
def _add_one_to_each(xs: list[torch.Tensor]) -> None:
    for t in xs:
        t.add_(1)


for _op in (_scale_, _scale_second_, _add_one_to_each):
    _op.register_fake(lambda *args: None)


class CustomOpWritesAList(nn.Module):
    def forward(self, x):
        y = x * 2
        a = y + 1   # read before the write
        torch.ops.fxfuse_test38.add_one_to_each([y])
        return a * 3, y + 0


def test_a_custom_op_that_writes_a_list_of_tensors_is_a_write():
    # a Tensor[] operand of mutates_args was skipped: the write was lost (review38b: off by 1.0 with
    # verify=False, refused otherwise)
    model = CustomOpWritesAList().eval()
    for verify in (True, False):
        opt = fxfuse.optimize(model, torch.randn(4, 8), strict=True, verify=verify)
        x = torch.randn(4, 8)
        with torch.no_grad():
            for got, want in zip(opt(x), model(x)):
                torch.testing.assert_close(got, want)


class CustomOpWritesItsInput(nn.Module):
    def __init__(self, second):
        super().__init__()
        self.second = second

    def forward(self, x, y):
        a = (x * 2).sigmoid()
        if self.second:   # no name says the op writes
            torch.ops.fxfuse_test38.scale_second(3.0, x)
        else:
            torch.ops.fxfuse_test38.scale_in_place(x, 3.0)
        return (a + x).relu() * y


@pytest.mark.parametrize("second", [False, True])
def test_a_custom_op_that_writes_an_input_is_a_write_by_its_schema(second):
    # fusion moved the read of x after the op into the kernel before it (review38: wrong values with
    # verify=False; the check against eager refused the model otherwise)
    model = CustomOpWritesItsInput(second).eval()
    x, y = torch.randn(4, 8), torch.randn(8)
    for verify in (True, False):
        opt = fxfuse.optimize(model, (x.clone(), y), strict=True, verify=verify)
        assert fxfuse.stats(opt)["fused_kernels"] >= 1
        for _ in range(2):
            a, b = torch.randn(4, 8), torch.randn(8)
            a_eager = a.clone()
            with torch.no_grad():
                got, want = opt(a, b), model(a_eager, b)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(a, a_eager)   # the caller's x written as eager writes it


def test_sgn_of_complex_values_stays_torchs_sgn():
    # normalize spelled torch.sgn as torch.sign, which refuses complex tensors: the build failed (fuzz38b)
    class Sgn(nn.Module):
        def forward(self, z):
            return torch.sgn(z) * 2, z.sgn() + 1

    z = torch.randn(4, 8, dtype=torch.complex64)
    opt = fxfuse.optimize(Sgn().eval(), z, strict=True)
    for got, want in zip(opt(z), Sgn()(z)):
        torch.testing.assert_close(got, want)


def test_a_linear_with_no_input_features_under_forced_gemm_and_3xtf32():
    # the 3xTF32 guard measured the layer by x.reshape(-1, 0): an internal error (fuzz38b)
    model = nn.Sequential(nn.Linear(0, 8), nn.ReLU()).eval()
    for rows in (20, 600):
        x = torch.randn(rows, 0)
        opt = fxfuse.optimize(model, x, gemm="force", tf32x3="force", strict=True)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


def _split_gate(x):
    a, b = (x * 2 + 1).tensor_split(2, -1)
    c, d = torch.hsplit(x * 3, 2)
    return a * torch.sigmoid(b) + c * d


class SplitGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = _split_gate

    def forward(self, *args):   # torch.export traces this one (aten spellings)
        return self.gate(*args)


def test_export_tensor_split_and_hsplit_parts_join_the_producers_kernel():
    # aten.tensor_split.sections under export kept the ops before it in a kernel of their own (fuzz38b)
    x = torch.randn(2, 8)
    opt = fxfuse.optimize(SplitGate().eval(), x, strict=True)
    assert "aten.tensor_split" in fxfuse.explain(opt) and fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), SplitGate()(x))


GLOBAL_WEIGHT = nn.Parameter(torch.randn(7, 5))


class ReadsAGlobalWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 7)

    def forward(self, x):
        return torch.relu(self.lin(x)) @ GLOBAL_WEIGHT + 1


def test_a_module_level_weight_read_by_a_linear_gives_no_torch_fx_warning():
    # torch.fx's "Attempted to insert a get_attr Node with no underlying reference" reached the user from
    # weight_views (fuzz38a, fuzz38d)
    model = ReadsAGlobalWeight().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, torch.randn(4, 7), strict=True)
    x = torch.randn(4, 7)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class GCNLayer(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.lin, self.b, self.spelling = nn.Linear(7, 16, bias=False), nn.Parameter(torch.randn(16)), spelling

    def forward(self, x, src, dst):
        msg = self.lin(x)[src]
        zeros = torch.zeros(x.shape[0], 16)   # torch.export traces this (zeros of a traced size)
        agg = zeros.index_add_(0, dst, msg) if self.spelling == "index_add_" else \
            zeros.scatter_add_(0, dst[:, None].expand(-1, 16), msg)
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
        return F.relu(agg * deg.clamp(min=1).pow(-0.5)[:, None] + self.b)


class FNOLayer(nn.Module):
    def __init__(self, c=4, m=3):
        super().__init__()
        self.m, self.w, self.pw = m, nn.Parameter(torch.randn(c, c, m, m, dtype=torch.cfloat) / c), nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        xf = torch.fft.rfft2(x)
        out = torch.zeros(b, c, h, w // 2 + 1, dtype=torch.cfloat)
        out[:, :, :self.m, :self.m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :self.m, :self.m], self.w)
        return F.gelu(torch.fft.irfft2(out, s=(h, w)) + self.pw(x))


@pytest.mark.parametrize("model", ["index_add_", "scatter_add_", "fno"])
def test_readers_after_a_write_into_a_fresh_buffer_fuse(model):
    # export's aten.index_add_ on torch.zeros kept every reader of the aggregate out of the kernels, and an
    # irfft2 of a written buffer counted as its alias (fuzz38d: a GCN layer, an FNO layer)
    if model == "fno":
        m, args = FNOLayer().eval(), (torch.randn(2, 4, 9, 10),)
        new_args = (torch.randn(2, 4, 9, 10),)
    else:
        m, src, dst = GCNLayer(model).eval(), torch.randint(0, 13, (40,)), torch.randint(0, 13, (40,))
        args, new_args = (torch.randn(13, 7), src, dst), (torch.randn(13, 7), src, dst)
    opt = fxfuse.optimize(m, args, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and "may alias" not in fxfuse.explain(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(*new_args), m(*new_args))


class HalfComposites(nn.Module):
    def __init__(self):
        super().__init__()
        self.tanhshrink, self.softsign = nn.Tanhshrink(), nn.Softsign()

    def forward(self, x):
        return F.tanhshrink(x) * 1.0, F.softsign(x) * 1.0, self.tanhshrink(x * 3), self.softsign(x * 3)


def test_fp16_tanhshrink_and_softsign_round_their_inner_result_as_eager():
    # torch computes them as x - x.tanh() and x / (x.abs() + 1), rounding the inner result to fp16; the
    # kernel rounded once (fuzz38c: 61 of 64 fp16 tanhshrinks differed, up to 73x relative near 0)
    x = torch.randn(8, 16).half()
    model = HalfComposites().eval()
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    for _ in range(2):
        with torch.no_grad():
            for got, want in zip(opt(x), model(x)):
                assert torch.equal(got, want)
        x = torch.randn(8, 16).half()


def test_calls_inside_and_outside_a_cudnn_flags_block_do_not_rebuild():
    # cuDNN on/off was a watched setting: code that runs under torch.backends.cudnn.flags(enabled=False) now
    # and then rebuilt the graph on every call (review38b)
    model, x = Pointwise().eval(), torch.randn(3, 8)
    opt = fxfuse.optimize(model, x, strict=True)
    built = next(iter(opt._specializations.values()))
    with torch.no_grad():
        for _ in range(3):
            with torch.backends.cudnn.flags(enabled=False, allow_tf32=torch.backends.cudnn.allow_tf32):
                opt(x)
            opt(x)
    assert next(iter(opt._specializations.values())) is built


class InPlaceMaskOps(nn.Module):
    def forward(self, a, b, given):
        m = a > 0
        m &= b > 0
        m ^= a < 0.5
        m.bitwise_or_(b > 1)
        given ^= m   # a mask the caller passed: written in place, as eager writes it
        return m.float() * a, given


def test_in_place_and_or_xor_of_masks_fuse_and_write_what_eager_writes():
    # `m &= c`, `^=`, bitwise_or_ on a fresh mask were kept in place and split the chain (review38b)
    model = InPlaceMaskOps().eval()
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    opt = fxfuse.optimize(model, (a, b, torch.rand(4, 8) > 0.5), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] <= 2
    for _ in range(2):
        a, b, given = torch.randn(4, 8), torch.randn(4, 8), torch.rand(4, 8) > 0.5
        given_eager = given.clone()
        with torch.no_grad():
            got, want = opt(a, b, given), model(a, b, given_eager)
        assert torch.equal(got[0], want[0]) and torch.equal(given, given_eager) and torch.equal(got[1], want[1])


class IntoATransposedBuffer(nn.Module):
    def forward(self, y):
        s = torch.sigmoid(y)
        v = torch.zeros_like(s)   # y's strides: (1, 4) for a transposed y
        v.index_add_(0, torch.tensor([3, 0, 1, 1]), s)
        v.reshape(-1).view(4, 8).diagonal().zero_()   # eager: a copy, v not contiguous
        return v * 1.0


def test_a_write_into_a_buffer_of_other_strides_keeps_them():
    # the out-of-place twin of index_add_ returned a contiguous tensor: eager's strides were lost, and a
    # reshape that copies in eager became a view whose write changed v (fuzz38h)
    y = torch.randn(8, 4).t()
    model = IntoATransposedBuffer().eval()
    opt = fxfuse.optimize(model, y, strict=True, verify=False)
    for _ in range(2):
        with torch.no_grad():
            got, want = opt(y), model(y)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)
        y = torch.randn(8, 4).t()


@pytest.mark.parametrize("after", ["conv", "maxpool", "relu"])
def test_a_conv_bias_nothing_pointwise_reads_stays_in_the_conv_call(after):
    # split into a pointwise add, it was a one-op kernel of its own before a conv or a pooling (fuzz38i);
    # before a ReLU it joins the ReLU's kernel
    tail = {"conv": nn.Conv2d(8, 4, 1), "maxpool": nn.MaxPool2d(2), "relu": nn.ReLU()}[after]
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), tail).eval()
    model[1].running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 9, 9)
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == (1 if after == "relu" else 0)
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_copies_keeping_aliases_keep_views_together_and_leave_conj_expand_and_small_views_alone():
    # the CUDA-graph runtime's copies of outputs (review38, review38c)
    from fxfuse.handout import copies_keeping_aliases
    y = torch.randn(3, 4)
    a, b, c, d = copies_keeping_aliases((y, y.view(-1), y[1], torch.randn(2)), fill=True)
    a.add_(1)
    assert torch.equal(b.view(3, 4), a) and torch.equal(c, a[1]) and a.untyped_storage() is not None
    w = torch.randn(3, dtype=torch.complex64)
    got = copies_keeping_aliases((w, w.conj()), fill=True)
    assert torch.equal(got[0], w) and torch.equal(got[1], w.conj())
    e = torch.randn(4)
    assert [t.shape for t in copies_keeping_aliases((e, e.expand(3, 4)), fill=False)] == [(4,), (3, 4)]
    big = torch.randn(1000)
    assert copies_keeping_aliases((big[:2], big[5:7]), fill=True)[0].untyped_storage().nbytes() == 8


class InPlaceClampBounds(nn.Module):
    def forward(self, x):
        h = x * 2
        h.clamp_min_(-0.5)
        torch.clamp_max_(h, 0.7)
        return h + 1, x.clone().clamp_max_(0.1) * 3


def test_in_place_clamp_min_and_clamp_max_fuse():
    # they had no canonical form: kept in place, the chain split around them (fuzz38j)
    x = torch.randn(4, 8)
    opt = fxfuse.optimize(InPlaceClampBounds().eval(), x, strict=True)
    assert "no canonical form" not in fxfuse.explain(opt) and fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        for got, want in zip(opt(x), InPlaceClampBounds()(x)):
            torch.testing.assert_close(got, want)
