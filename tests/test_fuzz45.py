"""Stop 45: a tensor filled with one number (torch.full, zeros_like, ones_like, full_like, new_full)
read by pointwise ops is a one-element constant the fused kernel reads in place: no library call
fills it on every call; a write of a whole fresh tensor (`h.copy_(y)`, `h[:] = v`) and a copy to a
tensor's own dtype (`h.to(h.dtype, copy=True)`) read as values, which fusion takes in."""
import operator

import pytest
import torch
from torch import nn

import fxfuse

from conftest import assert_matches_eager, optimize_strict, optimized_graph

FILLS = {
    "zeros_like": lambda x: torch.zeros_like(x) - 1,
    "ones_like*3": lambda x: torch.ones_like(x) * 3,
    "full_like": lambda x: torch.full_like(x, 0.25),
    "new_full": lambda x: x.new_full((x.shape[-1],), -2.0),
    "torch.full row": lambda x: torch.full((x.shape[-1],), 0.5, device=x.device),
    "torch.full int fill": lambda x: torch.full((1, x.shape[-1]), 3, dtype=x.dtype, device=x.device),
    "new_ones": lambda x: x.new_ones(x.shape[0], 1),
}


class Filled(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, x):
        return torch.sigmoid(x) * self.fill(x) + x


def _fills_left(opt) -> list:
    return [n for n in optimized_graph(opt).graph.nodes if n.op in ("call_function", "call_method")
            and any(name in str(n.target) for name in ("full", "zeros", "ones"))]


@pytest.mark.parametrize("name", list(FILLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_filled_tensor_read_by_pointwise_ops_is_a_constant_in_the_kernel(name, dtype):
    model = Filled(FILLS[name]).eval()
    x = torch.randn(5, 7).to(dtype)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and not _fills_left(opt)
    tol = 1e-3 if dtype is torch.float16 else 1e-5
    assert_matches_eager(opt, model, x, rtol=tol, atol=tol)


class FilledThenWritten(nn.Module):
    def forward(self, x):
        acc = torch.zeros_like(x)
        acc += x * 2                # written in place: the memory must be its own
        acc[:, 0] = 1.0
        return acc + 1


class FilledAndReturned(nn.Module):
    def forward(self, x):
        z = torch.ones_like(x)
        return z * x, z             # returned: the caller gets a tensor of its own, writable


class FilledIntoAMatmul(nn.Module):
    def forward(self, x):
        return (x @ torch.full((x.shape[-1], 3), 0.5)).relu()


@pytest.mark.parametrize("model", [FilledThenWritten(), FilledAndReturned(), FilledIntoAMatmul()],
                         ids=lambda m: type(m).__name__)
def test_a_filled_tensor_written_returned_or_read_by_a_library_op_stays_filled(model):
    x = torch.randn(4, 6)
    opt = optimize_strict(model.eval(), x)
    assert_matches_eager(opt, model, x)
    with torch.no_grad():
        out = opt(torch.randn(4, 6))
        if isinstance(out, tuple):
            assert out[1].stride() == (6, 1)
            out[1].add_(1)      # a stride-0 expand would raise here
            assert torch.equal(opt(x)[1], torch.ones(4, 6))


WHOLE_WRITES = {
    "empty_like.copy_": lambda x, y: torch.empty_like(x).copy_(y.sigmoid()) + x,
    "copy_ of itself doubled": lambda x, y: (lambda h: (h.copy_(h * 2), h + x)[1])(x.sigmoid()),
    "h[:] = tensor": lambda x, y: (lambda h: (h.__setitem__(slice(None), y.exp()), h * x)[1])(x.sigmoid()),
    "h[...] = row": lambda x, y: (lambda h: (h.__setitem__(Ellipsis, y[0].exp()), h * x)[1])(x.sigmoid()),
    "h[:, :] = number": lambda x, y: (lambda h: (h.__setitem__((slice(None), slice(None)), 0.75), h * x)[1])(x + y),
    "copy_ of fp16": lambda x, y: torch.zeros_like(x).copy_(y.half().sigmoid()) - x,
    "copy_ of a transposed layout": lambda x, y: (lambda h: (h.copy_(y.T.contiguous().T.exp()), h * x)[1])(x.sigmoid()),
    "to(copy=True)": lambda x, y: x.sigmoid().to(torch.float32, copy=True) + y,
    "to(x, copy=True)": lambda x, y: (x.sigmoid() * 2).to(y, copy=True) + y,
}


VIEWS = {"t", "expand", "contiguous", getattr, operator.getitem}   # (x.T; the input's own contiguous copy)


class WholeWrite(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write

    def forward(self, x, y):
        return self.write(x, y)


@pytest.mark.parametrize("name", list(WHOLE_WRITES))
def test_a_write_of_a_whole_fresh_tensor_reads_as_its_value(name):
    """`h.copy_(src)`, `h[:] = v`, `h.to(h.dtype, copy=True)`: kept in place (or a library copy), the
    write split the kernel around it (stop 44 left them)."""
    model = WholeWrite(WHOLE_WRITES[name]).eval()
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    opt = optimize_strict(model, x, y)
    left = [n.target for n in optimized_graph(opt).graph.nodes if n.op in ("call_function", "call_method")
            and not str(n.target).startswith("fused_") and n.target not in VIEWS]
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and not left
    assert_matches_eager(opt, model, x, y, rtol=1e-3, atol=1e-3)


class IntFilled(nn.Module):
    def forward(self, x):
        h = (x * 10).long()
        h[:] = 2.7                   # eager converts the number as a fill does: 2
        return h * (x * 10).long()


class WrittenInput(nn.Module):
    def forward(self, x, y):
        x.copy_(y.sigmoid())         # an input: the caller sees the write
        return x + 1


class ViewTakenBeforeTheWrite(nn.Module):
    def forward(self, x, y):
        h = x.sigmoid()
        row = h[0]                   # a view: it shows what the write puts there
        h.copy_(y * 3)
        return row + 1, h


class WrittenAgainAfterwards(nn.Module):
    def forward(self, x, y):
        h = torch.empty(x.shape[0], x.shape[1])
        h.copy_(y.t().t().exp())
        h.add_(1)
        h[:, 0] = -1.0
        return h


@pytest.mark.parametrize("model", [IntFilled(), WrittenInput(), ViewTakenBeforeTheWrite(), WrittenAgainAfterwards()],
                         ids=lambda m: type(m).__name__)
def test_whole_writes_that_must_stay_writes_compute_what_eager_does(model):
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    args = (x,) if isinstance(model, IntFilled) else (x, y)
    opt = optimize_strict(model.eval(), *args)
    ex, got = [a.clone() for a in args], [a.clone() for a in args]
    with torch.no_grad():
        expected, out = model(*ex), opt(*got)
    torch.testing.assert_close(out, expected)
    for a, b in zip(got, ex):
        torch.testing.assert_close(a, b)           # what eager wrote into an input, opt wrote too
    first = out[-1] if isinstance(out, tuple) else out
    assert first.stride() == expected[-1].stride() if isinstance(out, tuple) else first.stride() == expected.stride()


class CatOfSplitItems(nn.Module):
    """YOLOv8's C2f joins a chunk's items and a conv of one; a swap of two split pieces."""

    def __init__(self, how):
        super().__init__()
        self.how, self.cv1, self.m = how, nn.Conv2d(4, 8, 1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        if self.how == "c2f":
            y = list(self.cv1(x).chunk(2, 1))
            y.extend(self.m(y[-1]) for _ in range(1))
            return torch.cat(y, 1).sigmoid()
        a, b = x.split([1, 3], 1)
        return torch.cat([b, a], 1).relu() * 2


@pytest.mark.parametrize("how", ["c2f", "swap"])
def test_a_cat_of_a_splits_items_is_optimized(how):
    """join_outputs read `.shape` of the split's tuple of metas: an internal error (fuzz45a)."""
    model = CatOfSplitItems(how).eval()
    x = torch.randn(1, 4, 5, 5)
    opt = optimize_strict(model, x)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    assert_matches_eager(opt, model, x)


BOOL_READERS = {
    "div": lambda x: x.bool() / 3,
    "sqrt": lambda x: torch.sqrt(x.bool()),
    "sigmoid of to(bool)": lambda x: torch.sigmoid(x.to(torch.bool)),
    "pow": lambda x: x.bool() ** 0.5,
    "div by x": lambda x: x.bool() / x,
}


@pytest.mark.parametrize("name", list(BOOL_READERS))
def test_a_bool_cast_inside_a_kernel_is_read_as_a_number(name):
    """The kernel read the int1 of `x.bool()` where fp32 was expected: an error in the kernel (fuzz45b)."""
    model = WholeWrite(lambda x, y: BOOL_READERS[name](x) + y).eval()
    x = torch.randn(3, 5)
    x[0, 0] = 0.0
    opt = optimize_strict(model, x, torch.randn(3, 5), verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, x, torch.randn(3, 5), fresh=False, equal_nan=True)   # (0 / 0)


IDENTITY_PERMUTES = {
    "permute(0, 1)": lambda g: g.permute(0, 1),
    "transpose(0, 0)": lambda g: g.transpose(0, 0),
    "transpose(-1, 1)": lambda g: g.transpose(-1, 1),
    "swapdims(1, 1)": lambda g: g.swapdims(1, 1),
    "movedim(0, 0)": lambda g: torch.movedim(g, 0, 0),
}


@pytest.mark.parametrize("name", list(IDENTITY_PERMUTES))
def test_a_permute_that_moves_nothing_is_its_source(name):
    """With two readers, it split the kernel in two (fuzz45e)."""
    model = WholeWrite(lambda x, y: (lambda g: (g * y, g.sum()))(IDENTITY_PERMUTES[name](torch.tanh(x) + 1))).eval()
    opt = optimize_strict(model, torch.randn(3, 5), torch.randn(3, 5))
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_matches_eager(opt, model, torch.randn(3, 5), torch.randn(3, 5))


def test_a_mask_xor_true_is_its_negation_in_the_kernel():
    model = WholeWrite(lambda x, y: ((x > 0) ^ True) * y + torch.bitwise_xor(y > 0, True) * x).eval()
    opt = optimize_strict(model, torch.randn(3, 5), torch.randn(3, 5))
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, torch.randn(3, 5), torch.randn(3, 5))


class ContractedWithWeight(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, self.lin = how, nn.Linear(6, 4)

    def forward(self, x):
        w = self.lin.weight
        if self.how == "inner":
            h = torch.inner(x, w)
        elif self.how == "tensordot":
            h = torch.tensordot(x, w, dims=([-1], [1]))
        else:
            h = torch.tensordot(x, w.T, dims=([-1], [0]))
        return torch.relu(h + self.lin.bias)


@pytest.mark.parametrize("how", ["inner", "tensordot", "tensordot of W.T"])
@pytest.mark.parametrize("shape", [(3, 6), (2, 3, 6)])
def test_inner_and_tensordot_with_a_weight_are_linears(how, shape):
    """Not planned as Linears, their bias and activation stayed apart (fuzz45d)."""
    model = ContractedWithWeight(how).eval()
    opt = optimize_strict(model, torch.randn(*shape))
    targets = [n.target for n in optimized_graph(opt).graph.nodes if n.op == "call_function"]
    assert torch.nn.functional.linear in targets and not {torch.inner, torch.tensordot} & set(targets)
    assert_matches_eager(opt, model, torch.randn(*shape))


class ExportedWeightSpelling(nn.Module):
    """forward(*xs): symbolic_trace cannot splat it, torch.export traces the body."""

    def __init__(self, spelling):
        super().__init__()
        self.lin, self.spelling = nn.Linear(16, 8), spelling

    def forward(self, *xs):
        return self.body(*xs)

    def body(self, x):
        w = self.lin.weight
        wt = {"movedim": lambda: w.movedim(0, 1), "moveaxis": lambda: w.moveaxis(1, 0), "mH": lambda: w.mH,
              "adjoint": lambda: w.adjoint()}[self.spelling]()
        return torch.relu(x @ wt + self.lin.bias)


@pytest.mark.parametrize("spelling", ["movedim", "moveaxis", "mH", "adjoint"])
def test_export_spellings_of_a_transposed_weight_are_linears(spelling):
    """aten.movedim.int, aten.mH and aten.adjoint of a weight were no W.T: not planned (fuzz45d)."""
    model = ExportedWeightSpelling(spelling).eval()
    opt = optimize_strict(model, torch.randn(5, 16))
    text = fxfuse.explain(opt)
    assert "torch.export" in text and "m x k->n" in text   # traced by export, planned as a Linear
    assert_matches_eager(opt, model, torch.randn(5, 16))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryHalf(nn.Module):
    """transformers' apply_rotary_pos_emb (Llama, NeoX)."""

    def forward(self, q, cos, sin):
        return q * cos + rotate_half(q) * sin


class JoinTimesATransposed(nn.Module):
    def forward(self, x, s):
        return torch.cat([x * 2, x + 1], -1) * s.t()     # s.t(): not row-major, the product follows it


@pytest.mark.parametrize("shapes", [[(2, 2, 6, 16), (6, 16), (6, 16)], [(3, 10), (3, 10), (1, 10)]])
def test_rotate_half_is_one_kernel(shapes):
    """The cat of (-x2, x1) read by `* sin` was a library copy between two kernels (fuzz45a): the
    product now reads sin's halves per piece, and the kernel writes the join."""
    model = RotaryHalf().eval()
    opt = optimize_strict(model, *[torch.randn(*s) for s in shapes])
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert not [n for n in optimized_graph(opt).graph.nodes if n.target is torch.cat]
    assert_matches_eager(opt, model, *[torch.randn(*s) for s in shapes])


def test_a_join_times_a_transposed_operand_keeps_eagers_layout():
    model = JoinTimesATransposed().eval()
    x, s = torch.randn(4, 3), torch.randn(6, 4)
    opt = optimize_strict(model, x, s)
    got = assert_matches_eager(opt, model, x, s)
    with torch.no_grad():
        assert got.stride() == model(x, s).stride()


NUMBER_WRITES = {
    "h[:] = 7.0 (export's fill_)": lambda x: (lambda h: (h.__setitem__(slice(None), 7.0), h + x)[1])(x * 1),
    "fill_": lambda x: (lambda h: (h.fill_(7.0), h + x)[1])(x * 1),
    "zero_": lambda x: (lambda h: (h.zero_(), h + x)[1])(x * 1),
    "to(copy=True) then mul_": lambda x: (lambda y: (y.mul_(x), y + 1)[1])(x.sigmoid().to(x.dtype, copy=True)),
    "True ^ mask": lambda x: (True ^ (x > 0)) * x,
}


@pytest.mark.parametrize("name", list(NUMBER_WRITES))
def test_numbers_written_over_a_fresh_tensor_and_xor_spellings_join_the_kernel(name):
    """review45h: each kept a library call (fill_, zero_, export's h[:] = v as aten.fill_.Tensor; a
    copy by `to` written in place; `True ^ mask`)."""
    model = WholeWrite(lambda x, y: NUMBER_WRITES[name](x) * y).eval()
    x, y = torch.randn(3, 17), torch.randn(3, 17)
    opt = optimize_strict(model, x, y)
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, x, y)


class ExportedXor(nn.Module):
    def forward(self, x):
        if x.shape[0] > 2:        # symbolic_trace fails here: torch.export traces it (aten.__xor__.Scalar)
            return ((x > 0) ^ True) * x
        return x


def test_an_exported_xor_with_true_joins_the_kernel():
    opt = optimize_strict(ExportedXor().eval(), torch.randn(3, 17))
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, ExportedXor().eval(), torch.randn(3, 17))


class ExportedRotary(nn.Module):
    def forward(self, q, cos, sin):
        if q.shape[0] in (2, 3):    # symbolic_trace fails: torch.export traces (aten.slice.Tensor pieces)
            return q * cos + rotate_half(q) * sin
        return q


def test_an_exported_rotate_half_is_one_kernel():
    model, shapes = ExportedRotary().eval(), [(2, 6, 16), (6, 16), (6, 16)]
    opt = optimize_strict(model, *[torch.randn(*s) for s in shapes])
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["library_calls"] == 0
    assert_matches_eager(opt, model, *[torch.randn(*s) for s in shapes])
