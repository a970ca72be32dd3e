"""GPU tests: real compiled kernels, CUDA-graph capture, output safety at real sizes.

Run on a CUDA machine with the interpreter off: TRITON_INTERPRET=0 python -m pytest tests -m cuda
"""
import pytest
import torch
import torch.nn as nn

import fxfuse
from conftest import relative_error as rel_err
from fxfuse.demo import seed_network

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def test_seed_network_compiled_and_captured():
    model = seed_network(1024, 8).cuda()
    x = torch.randn(64, 1024, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    spec = next(iter(opt._specializations.values()))
    assert spec.cuda_graph_note.startswith("captured")
    with torch.no_grad():
        fresh = torch.randn(64, 1024, device="cuda")
        assert rel_err(opt(fresh), model(fresh)) < 1e-6
    s = fxfuse.stats(opt)
    # 8 Linear+ReLU layers: the library GEMM + a fused epilogue each, or (batch 64 fp32: the
    # row-wise GEMM, per the shipped calibration) one epilogue-fused GEMM each
    assert s["fused_kernels"] == 8 and s["library_calls"] in (0, 8)
    assert s["kernel_launches"] > 0 and s["reference_fallbacks"] == 0


def test_outputs_never_overwritten_and_inputs_untouched():
    model = seed_network(256, 4).cuda()
    x1, x2 = torch.randn(16, 256, device="cuda"), torch.randn(16, 256, device="cuda")
    opt = fxfuse.optimize(model, x1, strict=True)
    with torch.no_grad():
        x1_copy, x2_copy = x1.clone(), x2.clone()
        out1 = opt(x1)
        kept = out1.clone()
        out2 = opt(x2)
        torch.cuda.synchronize()
        assert torch.equal(out1, kept)
        assert not torch.equal(out1, out2)
        assert torch.equal(x1, x1_copy) and torch.equal(x2, x2_copy)
        assert rel_err(out2, model(x2)) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float32, 1e-6)])
def test_pointwise_dtypes(dtype, tol):
    class M(nn.Module):
        def forward(self, x, y):
            return torch.sigmoid(x) * torch.tanh(y) + nn.functional.gelu(x - y, approximate="tanh")

    x = torch.randn(1823, 781, device="cuda", dtype=dtype)
    y = torch.randn(1823, 781, device="cuda", dtype=dtype)
    opt = fxfuse.optimize(M().eval(), (x, y), strict=True)
    with torch.no_grad():
        x, y = torch.randn_like(x), torch.randn_like(y)
        assert rel_err(opt(x, y), M()(x.float(), y.float())) < tol
    assert fxfuse.stats(opt)["fused_kernels"] == 1


def test_non_contiguous_and_broadcast_inputs():
    class M(nn.Module):
        def forward(self, x, b):
            return torch.relu(x.t() * 2 + b)

    x = torch.randn(513, 257, device="cuda")
    b = torch.randn(513, device="cuda")
    opt = fxfuse.optimize(M().eval(), (x, b), strict=True)
    with torch.no_grad():
        x, b = torch.randn_like(x), torch.randn_like(b)
        assert torch.allclose(opt(x, b), M()(x, b), rtol=1e-6, atol=1e-6)


def test_cnn_with_batchnorm_on_gpu():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 8, 3), nn.BatchNorm2d(8), nn.SiLU()).cuda()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    model.eval()
    x = torch.randn(4, 3, 33, 35, device="cuda")
    torch.backends.cudnn.allow_tf32 = False
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        x = torch.randn_like(x)
        assert rel_err(opt(x), model(x)) < 1e-5
    assert fxfuse.stats(opt)["fused_kernels"] == 2


def test_new_shape_builds_new_specialization_on_gpu():
    model = seed_network(128, 2).cuda()
    opt = fxfuse.optimize(model, torch.randn(8, 128, device="cuda"), strict=True)
    with torch.no_grad():
        x = torch.randn(3, 128, device="cuda")
        assert rel_err(opt(x), model(x)) < 1e-6
    assert fxfuse.stats(opt)["specializations"] == 2


@pytest.mark.parametrize("batch,hidden", [(1, 1024), (64, 1024), (37, 300)])
def test_fused_gemm_seed_network(batch, hidden):
    model = seed_network(hidden, 4).cuda()
    x = torch.randn(batch, hidden, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, gemm="force", fused_mlp="off")
    with torch.no_grad():
        for _ in range(3):
            fresh = torch.randn_like(x)
            assert rel_err(opt(fresh), model(fresh)) < 1e-5
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] == 4 and s["library_calls"] == 0 and s["reference_fallbacks"] == 0


# ------------------------------------------------------------------ Strassen at real sizes

def _bmm_count(opt):
    gm = next(iter(opt._specializations.values())).gm
    return sum(n.op == "call_function" and n.target is torch.bmm for n in gm.graph.nodes)


def _strassen_error_ratio(opt, model, x):
    """(Strassen error, classical fp32 error) against float64 on x."""
    import copy
    ref = copy.deepcopy(model).double()(x.double())
    with torch.no_grad():
        return rel_err(opt(x), ref), rel_err(model(x), ref)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("batch,hidden", [(1024, 2048), (1000, 1030)])   # even, and padded
def test_strassen_chain_on_gpu(levels, batch, hidden):
    model = seed_network(hidden, 3).cuda()
    x = torch.randn(batch, hidden, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, strassen="force", strassen_levels=levels)
    spec = next(iter(opt._specializations.values()))
    assert spec.cuda_graph_note.startswith("captured")
    assert _bmm_count(opt) == 3
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] == 4 and s["reference_fallbacks"] == 0      # n + 1 kernels for n layers
    for _ in range(2):
        err, classical = _strassen_error_ratio(opt, model, torch.randn_like(x))
        assert err <= 3 * classical + 1e-7, (err, classical)


def test_strassen_residual_three_d_and_fp16_on_gpu():
    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(h, h), nn.Linear(h, h)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    model = Block(1024).cuda().eval()
    x = torch.randn(4, 250, 1024, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, strassen="force", strassen_levels=2)
    assert _bmm_count(opt) == 2
    err, classical = _strassen_error_ratio(opt, model, torch.randn_like(x))
    assert err <= 3 * classical + 1e-7, (err, classical)
    half = seed_network(2048, 2).cuda().half()
    xh = torch.randn(512, 2048, device="cuda", dtype=torch.float16)
    opt = fxfuse.optimize(half, xh, strict=True, strassen="force", strassen_levels=1)
    assert _bmm_count(opt) == 2
    with torch.no_grad():
        xh = torch.randn_like(xh)
        assert rel_err(opt(xh), half.float()(xh.float())) < 1e-2


def test_cost_model_plan_and_measured_explain():
    """The shipped H100 calibration (or the roofline elsewhere) plans every Linear; explain shows
    the plan and, with measure=True, the graph's measured time next to the estimate."""
    model = seed_network(64, 8).cuda()
    x = torch.randn(16, 64, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    gm = next(iter(opt._specializations.values())).gm
    assert len(gm.meta["fxfuse_plans"]) == 8
    text = fxfuse.explain(opt, measure=True)
    assert "cost model:" in text and "# measured:" in text and "us per graph replay" in text
    with torch.no_grad():
        fresh = torch.randn_like(x)
        assert rel_err(opt(fresh), model(fresh)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_relu_in_library_gemm_on_gpu(monkeypatch, dtype, tol):
    """linear_relu (cuBLASLt bias + ReLU epilogue) forced on: same answers as eager, a 3-D
    input, captured in the graph, and NaN where eager has NaN (relu keeps NaN; fmax would not)."""
    import fxfuse.passes.linear_epilogue as pass_module

    monkeypatch.setattr(pass_module, "relu_in_library_gemm", lambda *a: (True, "forced by the test"))
    model = seed_network(96, 3).to(device="cuda", dtype=dtype)
    x = torch.randn(4, 5, 96, device="cuda", dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True, fused_mlp="off", gemm="off")
    spec = next(iter(opt._specializations.values()))
    assert [n.target for n in spec.gm.graph.nodes].count(pass_module.linear_relu) == 3
    assert spec.cuda_graph_note.startswith("captured")
    with torch.no_grad():
        fresh = torch.randn(4, 5, 96, device="cuda", dtype=dtype)
        assert rel_err(opt(fresh), model(fresh)) < tol
        fresh[1, 2, 7] = float("nan")
        got, want = opt(fresh), model(fresh)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN lost in the library epilogue"


def test_relu_in_library_gemm_measured_choice_on_gpu():
    """The measured choice runs and says why, whichever way it goes."""
    from fxfuse.library_choice import relu_in_library_gemm
    for batch, width in ((16, 128), (256, 2048)):
        fused, reason = relu_in_library_gemm(batch, width, width, torch.float32, torch.device("cuda"), False)
        assert isinstance(fused, bool) and "measured" in reason


def test_linear_relu_keeps_nan_wherever_it_may_be_chosen():
    """Review: cuBLASLt's fp16 ReLU epilogue turned NaN into 0 at 7 x 13 -> 29; linear_relu is
    now allowed for fp32 at any shape and half types only with K, N multiples of 8."""
    from fxfuse.passes.linear_epilogue import _epilogue_safe, linear_relu
    shapes = [(1, 13, 29), (7, 13, 29), (33, 100, 77), (7, 16, 32), (300, 64, 40), (5, 1000, 1000),
              (256, 1024, 1024), (64, 8, 24)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for m, k, n in shapes:
            if not _epilogue_safe(dtype, k, n):
                continue
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            b = torch.randn(n, device="cuda", dtype=dtype)
            x[-1, 0] = float("nan")
            b[1] = float("nan")
            want = torch.relu(torch.nn.functional.linear(x, w, b))
            got = linear_relu(x, w, b)
            assert torch.equal(torch.isnan(got), torch.isnan(want)), (dtype, m, k, n)


@pytest.mark.parametrize("plan", [{"gemm": "force"}, {"fused_mlp": "force"}, {"strassen": "force"}])
def test_in_place_weight_edits_reach_the_replayed_graph(plan):
    """Weights edited in place after optimize (an EMA update under no_grad): the generated GEMM
    reads W and a lone fp32 bias live, so its CUDA graph sees the edit with no rebuild; the
    fused MLP's packed weights and Strassen's operands are copies, watched, and rebuilt."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU()).cuda().eval()
    x = torch.randn(64 if "strassen" not in plan else 512, 256, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, **plan)
    spec = next(iter(opt._specializations.values()))
    assert spec.graph is not None and fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        for step in range(2):
            for p in model.parameters():
                p.mul_(0.9).add_(0.01 * (step + 1))
            assert rel_err(opt(x), model(x)) < 1e-5
        model[2].bias.add_(1.0)
        assert rel_err(opt(x), model(x)) < 1e-5
    copied = spec.gm.meta["fxfuse_copied"]
    assert bool(copied) == ("gemm" not in plan)   # plans as forced: only copies are watched
    assert (next(iter(opt._specializations.values())) is not spec) == bool(copied)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_around_an_optimized_module_on_gpu(backend):
    """torch.compile of a model holding opt compiles the original module's code (Dynamo once
    traced into fxfuse's runtime and failed inside Triton's launcher); opt still runs its own
    graph when called by itself."""
    model = seed_network(256, 4).cuda()
    x = torch.randn(16, 256, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    head = nn.Linear(256, 10).cuda().eval()
    compiled = torch.compile(nn.Sequential(opt, head).eval(), backend=backend)
    torch._dynamo.reset()
    with torch.no_grad():
        for _ in range(3):
            fresh = torch.randn(16, 256, device="cuda")
            assert rel_err(compiled(fresh), head(model(fresh))) < 1e-5
        assert rel_err(opt(fresh), model(fresh)) < 1e-6
    assert sum(opt._original_calls.values()) == 0 and opt._miss_count == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("epilogue", ["linear_relu", "split_k", "measured"])
def test_library_layers_read_weights_stored_in_out_through_views_on_gpu(monkeypatch, epilogue):
    """`relu(x @ W + b)` with W stored [in, out] and left to the library: F.linear, linear_relu
    and split_k_partials read W.t() (a view; passes/weight_views.py), captured in the graph,
    and no transposed copy stays in the module."""
    import fxfuse.passes.linear_epilogue as pass_module

    if epilogue == "linear_relu":
        monkeypatch.setattr(pass_module, "relu_in_library_gemm", lambda *a: (True, "forced by the test"))
    elif epilogue == "split_k":
        monkeypatch.setattr(pass_module, "relu_in_library_gemm", lambda *a: (False, "forced by the test"))
        monkeypatch.setattr(pass_module, "split_k_library_gemm", lambda *a: (2, "forced by the test"))

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.ParameterList([nn.Parameter(torch.randn(256, 256) / 16) for _ in range(3)])
            self.b = nn.ParameterList([nn.Parameter(torch.randn(256)) for _ in range(3)])

        def forward(self, x):
            for w, b in zip(self.w, self.b):
                x = torch.relu(x @ w + b)
            return x

    model = Chain().cuda().eval()
    x = torch.randn(32, 256, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, fused_mlp="off", gemm="off")
    spec = next(iter(opt._specializations.values()))
    assert spec.cuda_graph_note.startswith("captured")
    views = [n for n in spec.gm.graph.nodes if n.op == "call_method" and n.target == "t"]
    assert len(views) == 3 and all(len(v.users) == 1 for v in views)
    if epilogue == "linear_relu":
        assert all(next(iter(v.users)).target is pass_module.linear_relu for v in views)
    if epilogue == "split_k":
        assert all(next(iter(v.users)).target is pass_module.split_k_partials for v in views)
    assert not any(name.endswith("_T") for name, _ in spec.gm.named_buffers())
    with torch.no_grad():
        fresh = torch.randn(32, 256, device="cuda")
        assert rel_err(opt(fresh), model(fresh)) < 1e-5


@pytest.mark.parametrize("dtype,exponent", [(torch.float32, 1e-50), (torch.float32, 2.00000001),
                                            (torch.float16, 2.0001), (torch.float32, float("inf")),
                                            (torch.float16, float("nan"))])
def test_pow_exponents_as_cuda_eager_reads_them(dtype, exponent):
    """The fused kernel's x ** e against CUDA eager at the values where the exponent's dtype
    matters (e rounded to the tensor's dtype first) and for non-finite exponents (C pow)."""
    class Power(nn.Module):
        def forward(self, x):
            return (x ** exponent) * 1.0

    special = torch.tensor([[-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, float("inf"), float("-inf"), float("nan")]],
                           device="cuda", dtype=dtype)
    model = Power().eval()
    opt = fxfuse.optimize(model, (torch.rand(1, 10, device="cuda") + 0.5).to(dtype), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        torch.testing.assert_close(opt(special), model(special), equal_nan=True)


@pytest.mark.parametrize("module", [nn.Hardshrink(0.3), nn.Softshrink(0.3), nn.Threshold(0.3, 0.1)],
                         ids=["hardshrink", "softshrink", "threshold"])
def test_fp16_activation_parameters_are_read_in_fp16_as_cuda_reads_them(module):
    """CUDA's kernels convert lambd / threshold / value to the tensor's dtype first: an input of
    exactly fp16(0.3) = 0.30005 lies on the edge there, not above it."""
    edge = [0.300048828125, -0.300048828125, 0.2998046875, 0.30029296875, 0.5, -2.0]
    x = torch.tensor(edge, dtype=torch.float16, device="cuda").repeat(7, 1)
    model = nn.Sequential(module).eval()
    opt = fxfuse.optimize(model, torch.randn(7, 6, dtype=torch.float16, device="cuda"), strict=True, verify=False)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["swiglu-packed", "lstm-by-hand", "wavenet"])
def test_ops_moved_past_slices_on_gpu(name, dtype):
    """hoist_slices on the GPU: the blocks' gated units (chunk/split of a packed projection or
    conv) in a CUDA graph, against eager."""
    from benchmarks import blocks
    torch.manual_seed(0)
    factory, shape, _ = blocks.CASES[name]
    model = factory().cuda().eval().to(dtype)
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True)
    assert next(iter(opt._specializations.values())).cuda_graph_note.startswith("captured")
    with torch.no_grad():
        fresh = torch.randn(*shape, device="cuda", dtype=dtype)
        assert rel_err(opt(fresh), model(fresh)) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_division_by_a_number_as_cuda_eager_computes_it(dtype):
    """CUDA's eager `x / c` multiplies by 1/c (computed once in fp32); a true division differs in
    the last bit of about a third of the values for c = 3 (fuzz33d). Bit for bit, in a kernel."""
    class Scaled(nn.Module):
        def forward(self, x):
            return torch.relu(x / 3.0) + x / 0.3, (x * 2) / 7, torch.relu(x / 1e-3) - 1

    torch.manual_seed(0)
    model = Scaled().cuda().eval()
    x = torch.randn(64, 33, device="cuda", dtype=dtype)
    opt = fxfuse.optimize(model, x, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    with torch.no_grad():
        fresh = torch.randn(64, 33, device="cuda", dtype=dtype)
        for got, want in zip(opt(fresh), model(fresh)):
            assert torch.equal(got, want)
