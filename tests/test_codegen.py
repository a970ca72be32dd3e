"""Code generation: the fused-kernel IR, the generated Triton source, masks on irregular
sizes, multi-output kernels, and every op-table expression against torch (interpreter)."""
import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from conftest import NO_MLP, assert_fast_path, assert_matches_eager, optimized_graph
from fxfuse.codegen import block_size, generate
from fxfuse.ir import IndexMap, IRBuilder, KernelIR
from fxfuse.kernel import FusedKernel, triton_cdiv
from fxfuse.kernel_cache import default_cache
from fxfuse.ops import BY_NAME, POINTWISE, literal


def contiguous(shape):
    return torch.empty(shape, device="meta").stride()


# ---- IR ------------------------------------------------------------------------------------

def _ir(shape, *input_maps):
    """A kernel adding all its inputs (each loaded through its map), stored contiguously."""
    b = IRBuilder(shape)
    vals = []
    for k, m in enumerate(input_maps):
        b.add_input(torch.float32)
        vals.append(b.load(k, m))
    acc = vals[0]
    for v in vals[1:]:
        acc = b.op("add", [acc, v])
    b.store(acc, torch.float32)
    return b.build()


def _load_maps(ir: KernelIR):
    return [i.param("index") for i in ir.instrs if i.op == "load"]


def test_coalesced_merges_contiguous_dims():
    shape = (4, 5, 6)
    ir = _ir(shape, IndexMap(0, contiguous(shape)), IndexMap(0, contiguous(shape))).coalesced()
    assert ir.shape == (120,)
    assert all(m.strides == (1,) for m in ir.index_maps())


def test_coalesced_keeps_broadcast_dim():
    shape = (4, 5, 6)
    bias = IndexMap.broadcast((6,), (1,), shape)
    assert bias.strides == (0, 0, 1)
    ir = _ir(shape, IndexMap(0, contiguous(shape)), bias).coalesced()
    assert ir.shape == (20, 6)                      # [B*S, N], the bias still broadcast over rows
    x_map, b_map = _load_maps(ir)
    assert x_map.strides == (6, 1) and b_map.strides == (0, 1)
    assert ir.stores[0].index.strides == (6, 1)
    assert ir.numel == 120


def test_coalesced_per_channel_bias_on_nchw():
    shape = (2, 3, 4, 5)
    bias = IndexMap.broadcast((3, 1, 1), (1, 1, 1), shape)
    assert bias.strides == (0, 1, 0, 0)
    ir = _ir(shape, IndexMap(0, contiguous(shape)), bias).coalesced()
    assert ir.shape == (2, 3, 20)                   # H and W merge; N and C cannot
    assert _load_maps(ir)[1].strides == (0, 1, 0)


def test_coalesced_drops_size_one_dims_and_keeps_offsets():
    shape = (4, 1, 6)
    ir = _ir(shape, IndexMap(7, contiguous(shape))).coalesced()
    assert ir.shape == (24,)
    assert _load_maps(ir)[0] == IndexMap(7, (1,))


def test_coalesced_does_not_merge_transposed():
    shape = (5, 7)
    ir = _ir(shape, IndexMap(0, (1, 5)), IndexMap(0, contiguous(shape))).coalesced()
    assert ir.shape == (5, 7)
    assert _load_maps(ir)[0].strides == (1, 5)


def test_broadcast_map_rejects_bad_shapes():
    with pytest.raises(ValueError):
        IndexMap.broadcast((3,), (1,), (4, 5))
    with pytest.raises(ValueError):
        IndexMap.broadcast((2, 4, 5), (20, 5, 1), (4, 5))


def test_builder_value_numbering():
    b = IRBuilder((8,))
    b.add_input(torch.float32)
    m = IndexMap(0, (1,))
    assert b.load(0, m) == b.load(0, m)
    x = b.load(0, m)
    assert b.op("exp", [x]) == b.op("exp", [x]) and b.const(2.0) == b.const(2.0)


# ---- generated source ------------------------------------------------------------------------

def test_explain_shows_generated_source():
    model = nn.Sequential(nn.Linear(13, 7), nn.GELU()).eval()
    opt = fxfuse.optimize(model, torch.randn(37, 13), strict=True, **NO_MLP)
    text = fxfuse.explain(opt, kernels=True)
    assert "@triton.jit" in text and "tl.load" in text and "tl.store" in text
    assert "mask" in text and "< 259" in text     # 37 * 7 points, the last block partial
    assert "@triton.jit" not in fxfuse.explain(opt)      # kernels=False: no source
    (k,) = [m for m in optimized_graph(opt).modules() if isinstance(m, FusedKernel)]
    assert k.source in text


def test_generation_is_deterministic():
    shape = (6, 10)
    ir1 = _ir(shape, IndexMap(0, contiguous(shape)), IndexMap.broadcast((10,), (1,), shape))
    ir2 = _ir(shape, IndexMap(0, contiguous(shape)), IndexMap.broadcast((10,), (1,), shape))
    assert generate(ir1) == generate(ir2)
    ir3 = _ir((6, 11), IndexMap(0, contiguous((6, 11))), IndexMap.broadcast((11,), (1,), (6, 11)))
    assert generate(ir3)[1] != generate(ir1)[1]


def test_huge_iteration_space_uses_64_bit_offsets():
    shape = (1 << 16, 1 << 16)
    src, _ = generate(_ir(shape, IndexMap(0, contiguous(shape))))
    assert "int64" in src
    src_small, _ = generate(_ir((64, 64), IndexMap(0, contiguous((64, 64)))))
    assert "int64" not in src_small


def _run_ir(ir, *inputs, extra=0, fill=math.nan):
    """Launch the generated kernel directly, outputs padded by `extra` sentinel elements."""
    src, name = generate(ir)
    kernel = default_cache().load(src, name)
    outs = [torch.full((ir.numel + extra,), fill, dtype=o.dtype) for o in ir.outputs]
    block = block_size(ir.numel)
    kernel[(triton_cdiv(ir.numel, block),)](*inputs, *outs, BLOCK=block)
    return [o[: ir.numel].view(spec.shape) for o, spec in zip(outs, ir.outputs)], [o[ir.numel:] for o in outs]


@pytest.mark.parametrize("shape", [(37, 13), (45, 37), (3, 7, 11), (1025,)])
def test_masks_on_irregular_shapes(shape):
    """Lanes past the end must neither read nor write: the padding keeps its sentinel."""
    x = torch.randn(shape)
    bias = torch.randn(shape[-1])
    ir = _ir(shape, IndexMap(0, contiguous(shape)), IndexMap.broadcast(bias.shape, bias.stride(), shape))
    assert ir.numel % block_size(ir.numel) != 0        # the last block is partial
    (out,), (tail,) = _run_ir(ir, x, bias, extra=2048, fill=-7.0)
    torch.testing.assert_close(out, x + bias, rtol=0, atol=0)
    assert torch.all(tail == -7.0)


def test_strided_input_map():
    base = torch.randn(20, 9)
    x = base.t()[:, 2:17]                  # shape (9, 15), strides (1, 9), offset 18
    shape = tuple(x.shape)
    ir = _ir(shape, IndexMap(x.storage_offset(), x.stride()))
    (out,), _ = _run_ir(ir, base)
    torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_kernel_with_two_outputs():
    class M(nn.Module):
        def forward(self, x):
            a = torch.sigmoid(x)
            return a * 3, (a - x).abs()

    model = M().eval()
    x = torch.randn(29, 31)
    opt = fxfuse.optimize(model, x, strict=True)
    (k,) = [m for m in optimized_graph(opt).modules() if isinstance(m, FusedKernel)]
    assert len(k.ir.outputs) == 2
    assert k.source.count("tl.store(") == 2
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


def test_fp16_output_stored_as_fp16():
    shape = (5, 9)
    b = IRBuilder(shape)
    b.add_input(torch.float16)
    v = b.op("exp", [b.load(0, IndexMap(0, contiguous(shape)))])
    b.store(v, torch.float16)
    ir = b.build()
    x = torch.randn(shape).half()
    (out,), _ = _run_ir(ir, x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, torch.exp(x.float()).half(), rtol=1e-3, atol=1e-3)


def test_scalar_only_value_fills_block():
    """A store of a value built from constants alone (x * 0 + 1 folded upstream is not needed)."""
    shape = (3, 5)
    b = IRBuilder(shape)
    b.add_input(torch.float32)
    b.load(0, IndexMap(0, contiguous(shape)))
    c = b.op("add", [b.const(1.0), b.const(2.0)])
    b.store(c, torch.float32)
    (out,), _ = _run_ir(b.build(), torch.randn(shape))
    assert torch.all(out == 3.0)


# ---- the op table, each expression against torch ------------------------------------------------

EDGE = [0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 0.05, -0.05, 0.5, -0.5, 1.0, -1.0, 2.5, -2.5, 10.0, -10.0,
        19.9, 20.1, 30.0, -30.0, 88.0, -88.0, 1e30, -1e30, math.inf, -math.inf, math.nan]

UNARY_CASES = [  # (op name, params, torch function)
    ("neg", {}, torch.neg), ("exp", {}, torch.exp), ("log", {}, torch.log), ("sqrt", {}, torch.sqrt),
    ("rsqrt", {}, torch.rsqrt), ("reciprocal", {}, torch.reciprocal), ("abs", {}, torch.abs),
    ("sin", {}, torch.sin), ("cos", {}, torch.cos), ("erf", {}, torch.erf), ("floor", {}, torch.floor),
    ("ceil", {}, torch.ceil), ("expm1", {}, torch.expm1), ("log1p", {}, torch.log1p),
    ("relu", {}, torch.relu), ("sigmoid", {}, torch.sigmoid), ("tanh", {}, torch.tanh),
    ("gelu", {}, F.gelu), ("gelu", {"approximate": "tanh"}, lambda t: F.gelu(t, approximate="tanh")),
    ("silu", {}, F.silu), ("mish", {}, F.mish), ("selu", {}, F.selu),
    ("hardsigmoid", {}, F.hardsigmoid), ("hardswish", {}, F.hardswish),
    ("leaky_relu", {"negative_slope": 0.2}, lambda t: F.leaky_relu(t, 0.2)),
    ("elu", {"alpha": 0.7}, lambda t: F.elu(t, 0.7)),
    ("softplus", {}, F.softplus),
    ("softplus", {"beta": 2.0, "threshold": 5.0}, lambda t: F.softplus(t, 2.0, 5.0)),
    ("clamp", {"min": -0.5, "max": 2.0}, lambda t: torch.clamp(t, -0.5, 2.0)),
    ("clamp", {"min": 0.0}, lambda t: torch.clamp(t, min=0.0)),
    ("pow", {"exponent": 2.0}, lambda t: t ** 2), ("pow", {"exponent": 3.0}, lambda t: t ** 3),
    ("pow", {"exponent": -1.0}, lambda t: t ** -1), ("pow", {"exponent": 0.0}, lambda t: t ** 0),
    ("pow", {"exponent": 0.5}, lambda t: t ** 0.5), ("pow", {"exponent": 5.0}, lambda t: t ** 5),
    ("pow", {"exponent": 1.5}, lambda t: t ** 1.5),
    ("celu", {"alpha": 0.7}, lambda t: F.celu(t, 0.7)), ("softsign", {}, F.softsign),
    ("logsigmoid", {}, F.logsigmoid), ("tanhshrink", {}, F.tanhshrink),
    ("hardshrink", {"lambd": 0.5}, lambda t: F.hardshrink(t, 0.5)),
    ("softshrink", {"lambd": 0.5}, lambda t: F.softshrink(t, 0.5)),
    ("threshold", {"threshold": 0.05, "value": -1.0}, lambda t: F.threshold(t, 0.05, -1.0)),
]


def _unary_kernel(name, params, x):
    shape = tuple(x.shape)
    b = IRBuilder(shape)
    b.add_input(x.dtype)
    v = b.op(name, [b.load(0, IndexMap(0, contiguous(shape)))], **params)
    b.store(v, torch.float32)
    (out,), _ = _run_ir(b.build(), x)
    return out


@pytest.mark.parametrize("name,params,fn", UNARY_CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}" for c in UNARY_CASES])
def test_unary_expression_matches_torch(name, params, fn):
    edge = EDGE
    if name == "gelu" and not params:   # eager's erf-gelu gives nan at +-inf; the kernel inf and nan
        edge = [v for v in EDGE if not math.isinf(v)]
    x = torch.cat([torch.tensor(edge), torch.linspace(-12, 12, 301), torch.randn(200) * 3])
    got = _unary_kernel(name, params, x)
    with torch.no_grad():
        expected = fn(x)
    # transcendental functions: a few ulp of fp32 (the interpreter runs numpy's fp32 math)
    torch.testing.assert_close(got, expected, rtol=4e-6, atol=1e-6, equal_nan=True)


BINARY_CASES = [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                ("div", operator.truediv), ("maximum", torch.maximum), ("minimum", torch.minimum)]


@pytest.mark.parametrize("name,fn", BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
def test_binary_expression_matches_torch(name, fn):
    e = torch.tensor(EDGE)
    a, c = torch.meshgrid(e, e, indexing="ij")
    a, c = a.reshape(-1).contiguous(), c.reshape(-1).contiguous()
    shape = tuple(a.shape)
    b = IRBuilder(shape)
    b.add_input(torch.float32)
    b.add_input(torch.float32)
    m = IndexMap(0, (1,))
    v = b.op(name, [b.load(0, m), b.load(1, m)])
    b.store(v, torch.float32)
    (out,), _ = _run_ir(b.build(), a, c)
    torch.testing.assert_close(out, fn(a, c), rtol=0, atol=0, equal_nan=True)


def test_literals_round_trip():
    for v in [0.1, 1 / 3, 1e-45, 3.4028234663852886e38, -2.5, 7]:
        assert float(eval(literal(v))) == float(v)
    assert literal(math.inf) == "1e999" and eval(literal(-math.inf)) == -math.inf
    assert math.isnan(eval(literal(math.nan)))
    assert literal(True) == "1"


def test_every_table_op_has_a_canonical_target():
    for op in BY_NAME.values():
        assert POINTWISE[op.target] is op


@pytest.mark.parametrize("exponent", [0.0, 1.0, 2.0, -2.0, 4.0, -4.0, 5.0, -5.0, 6.0, -7.0, 0.5, -0.5, 1.5, -1.5,
                                      2.5, 1.7])
def test_pow_by_scalar_matches_torch_on_edge_values(exponent):
    """Every branch of the pow expression (products, sqrt, rsqrt, odd/even exp2-log2, fractional),
    with -0, +-inf and nan: (-0) ** -5 == -inf and (-0) ** -0.5 == -inf, as torch gives."""
    x = torch.cat([torch.tensor(EDGE), torch.linspace(-4, 4, 81), torch.rand(50) * 10])
    got = _unary_kernel("pow", {"exponent": exponent}, x)
    torch.testing.assert_close(got, torch.pow(x, exponent), rtol=4e-6, atol=1e-6, equal_nan=True)
    assert torch.equal(torch.signbit(got[:2]), torch.signbit(torch.pow(x[:2], exponent)))   # +0 and -0


@pytest.mark.parametrize("params", [{"min": math.nan}, {"max": math.nan}, {"min": -1.0, "max": math.nan},
                                    {"min": -math.inf, "max": math.inf}, {"min": 0.5, "max": -0.5}],
                         ids=["min-nan", "max-nan", "both-max-nan", "infinite", "min-above-max"])
def test_clamp_bounds_match_torch(params):
    x = torch.cat([torch.tensor(EDGE), torch.randn(40)])
    got = _unary_kernel("clamp", params, x)
    torch.testing.assert_close(got, torch.clamp(x, **params), rtol=0, atol=0, equal_nan=True)


def _kernel_sections(text):
    """(kernel name, source) for each kernel explain(kernels=True) printed."""
    for part in text.split("\n# ---- ")[1:]:
        header, _, source = part.partition("\n")
        yield header.split(" ", 1)[0], source


def test_every_source_explain_prints_compiles(tmp_path):
    import ast

    from fxfuse.kernel_cache import KernelCache

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(13, 7)
            self.fc2 = nn.Linear(7, 5)

        def forward(self, x):
            h = F.gelu(self.fc1(x))
            y = self.fc2(h)
            return torch.tanh(y) * 2, y.sigmoid() - 1, h.clamp(min=-0.1) ** 3

    model = M().eval()
    x = torch.randn(9, 13)
    opt = fxfuse.optimize(model, x, strict=True, **NO_MLP)
    assert_matches_eager(opt, model, x)
    text = fxfuse.explain(opt, kernels=True)
    sections = list(_kernel_sections(text))
    assert len(sections) == fxfuse.stats(opt)["fused_kernels"] >= 2
    for name, source in sections:
        compile(source, f"<{name}>", "exec")
        tree = ast.parse(source)
        functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        kernel = functions[name]
        assert kernel.args.args[-1].arg == "BLOCK"
        assert all(isinstance(d, ast.Attribute) and d.attr == "jit" for d in kernel.decorator_list)
        called = {n.func.id for n in ast.walk(kernel) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert called <= set(functions), f"{name} calls undefined helpers {called - set(functions)}"
        stores = [n for n in ast.walk(kernel) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                  and n.func.attr == "store"]
        assert stores and all(any(k.arg == "mask" for k in s.keywords) for s in stores)
        assert KernelCache(tmp_path).load(source, name).fn.__name__ == name   # @triton.jit (or interpreted)


class PowBy(nn.Module):
    def __init__(self, exponent):
        super().__init__()
        self.exponent = exponent

    def forward(self, x):
        return (x * 1.0) ** self.exponent


@pytest.mark.parametrize("exponent", [2.7, -1.5, 6, 7, 8.5])
def test_pow_is_accurate_to_fp32_rounding_over_a_wide_range(exponent):
    """exp2(e * log2(x)) in fp32 was off by up to 4e-6 relative for large |e * log2(x)|; in fp64 it
    is within fp32 rounding (assert_close's default fp32 tolerance is 1.3e-6 relative)."""
    model = PowBy(exponent).eval()
    x = torch.logspace(-3, 3, 7 * 37).reshape(7, 37)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        torch.testing.assert_close(opt(-x), model(-x), equal_nan=True)   # negative bases: sign or nan
    assert_fast_path(opt)


@pytest.mark.parametrize("name,params,fn", [c for c in UNARY_CASES if c[0] in (
    "celu", "softsign", "logsigmoid", "tanhshrink", "hardshrink", "softshrink", "threshold")])
def test_shrink_and_threshold_keep_the_sign_of_zero(name, params, fn):
    """Zeros signed as CUDA eager's: a later 1 / y or copysign tells them apart. softshrink's
    are +0 there (an H100, stop 37; so is CPU eager's vectorized loop from 16 elements, where its
    scalar loop computes x * 0: fuzz37a), hardshrink's +0, the others keep their input's sign."""
    x = torch.tensor([-0.0, 0.0, -0.3, 0.3, -1e-30, 1e-30, 0.5, -0.5])
    got, want = _unary_kernel(name, params, x), fn(x)
    if name == "softshrink":
        want = want.abs()
    assert torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)
