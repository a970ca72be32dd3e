"""GPU tests of the runtime: output handout, graph copies by input address, inputs through the
graph's memcpy node, programmatic dependent launch, cuGraphLaunch. Split from test_gpu.py.

Run on a CUDA machine with the interpreter off: TRITON_INTERPRET=0 python -m pytest tests -m cuda
"""
import pytest
import torch
import torch.nn as nn

import fxfuse
from conftest import relative_error as rel_err
from fxfuse.demo import seed_network
from fxfuse.handout import HANDOUT_SLOTS

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ieee_fp32")]   # skipped without CUDA (conftest)


def _spec(opt):
    return next(iter(opt._specializations.values()))


def test_outputs_handed_out_without_clone_while_not_held():
    """Dropped outputs are reused (no clone); any kept output, view or list of them is never
    overwritten; once every graph copy's outputs are held the call clones."""
    model = seed_network(96, 3).cuda()
    xs = [torch.randn(5, 96, device="cuda") for _ in range(8)]
    opt = fxfuse.optimize(model, xs[0], strict=True)
    spec = _spec(opt)
    with torch.no_grad():
        want = [model(x) for x in xs]
        for x, w in zip(xs, want):            # the usual loop: the previous output is dropped
            y = opt(x)
            assert rel_err(y, w) < 1e-6
        assert spec.cloned == 0 and spec.handed_out == len(xs) and len(spec.handout) <= HANDOUT_SLOTS
        assert "pools of their own" in spec.handout_note   # small pools: outputs handed out, no copy kernel
        kept = [opt(x) for x in xs]           # all held: slots run out, later calls clone
        view = opt(xs[0])[1:3]                # only a view of the output survives
        again = [opt(x) for x in xs[1:4]]
        torch.cuda.synchronize()
        for k, w in zip(kept, want):
            assert rel_err(k, w) < 1e-6
        assert rel_err(view, want[0][1:3]) < 1e-6
        for a, w in zip(again, want[1:4]):
            assert rel_err(a, w) < 1e-6
        assert spec.cloned > 0


def _small_model_and_three_inputs():
    """(model, inputs, opt, its specialization): a graph of a few us, three input buffers."""
    model = seed_network(64, 2).cuda()
    xs = [torch.randn(3, 64, device="cuda") for _ in range(3)]
    opt = fxfuse.optimize(model, xs[0], strict=True)
    return model, xs, opt, _spec(opt)


def test_recurring_input_addresses_settle_on_graph_copies_of_their_own(monkeypatch):
    """A loop over a few input buffers: each buffer gets the graph copy whose memcpy node already
    reads it, so once settled no call re-points a node (a driver call of host time). The timing
    rule is pinned open: this graph once timed above AFFINITY_MAX_GPU_US on a busy H100 (stop 36),
    and the test is about the settling, not the rule (the next test checks the rule)."""
    monkeypatch.setattr(fxfuse.handout, "AFFINITY_MAX_GPU_US", 1e9)
    model, xs, opt, spec = _small_model_and_three_inputs()
    with torch.no_grad():
        for x in xs * 2:
            assert rel_err(opt(x), model(x)) < 1e-6
        repoints = sum(slot.inputs.repoints for slot in spec.handout)
        for x in xs * 3:
            assert rel_err(opt(x), model(x)) < 1e-6
    assert len(spec.handout) == len(xs) and spec.cloned == 0 and spec.affinity
    assert sum(slot.inputs.repoints for slot in spec.handout) == repoints
    fresh = [torch.randn(3, 64, device="cuda") for _ in range(HANDOUT_SLOTS)]   # the loop moves on
    with torch.no_grad():
        for x in fresh * 2:
            assert rel_err(opt(x), model(x)) < 1e-6
        repoints = sum(slot.inputs.repoints for slot in spec.handout)
        for x in fresh * 2:
            assert rel_err(opt(x), model(x)) < 1e-6
    assert sum(slot.inputs.repoints for slot in spec.handout) == repoints, "did not settle on the new buffers"
    assert "graph copies by input address" in fxfuse.explain(opt)


def test_gpu_bound_graphs_keep_one_graph_copy(monkeypatch):
    """Where the graph's GPU time is over AFFINITY_MAX_GPU_US (here: a threshold of 0), calls
    re-point the first free copy instead of launching different copies in turn."""
    import fxfuse.handout
    monkeypatch.setattr(fxfuse.handout, "AFFINITY_MAX_GPU_US", 0.0)
    model, xs, opt, spec = _small_model_and_three_inputs()
    with torch.no_grad():
        for x in xs * 3:
            assert rel_err(opt(x), model(x)) < 1e-6
    assert not spec.affinity and len(spec.handout) == 1 and spec.handout[0].inputs.repoints >= 8
    assert "no graph copies by input address" in fxfuse.explain(opt)


def test_handout_with_tuple_outputs_and_an_output_that_is_the_input():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(40, 24)

        def forward(self, x):
            return torch.relu(self.lin(x)), x

    model = Two().cuda().eval()
    xs = [torch.randn(7, 40, device="cuda") for _ in range(4)]
    opt = fxfuse.optimize(model, xs[0], strict=True)
    with torch.no_grad():
        outs = [opt(x) for x in xs]
        torch.cuda.synchronize()
        for x, (y, same) in zip(xs, outs):
            assert rel_err(y, model(x)[0]) < 1e-6
            assert torch.equal(same, x)
        assert all(same.data_ptr() != x.data_ptr() for x, (_, same) in zip(xs, outs))
    assert _spec(opt).handed_out > 0   # the static input buffer itself is never handed out: a copy is
    assert not _spec(opt).own_pool_slots and "pools of their own" not in _spec(opt).handout_note


def test_handout_buffers_never_share_memory_with_a_graph():
    """The H100 failure of the first handout version: a handed-out output lived in a block the
    first graph used for an intermediate, so a later clone-path call overwrote it. Mixed
    held/dropped outputs over several widths must all stay intact."""
    for width in (96, 256, 1024):
        model = seed_network(width, 4).cuda()
        xs = [torch.randn(3, width, device="cuda") for _ in range(6)]
        opt = fxfuse.optimize(model, xs[0], strict=True)
        with torch.no_grad():
            want = [model(x) for x in xs]
            held = []
            for round_ in range(3):
                for k, x in enumerate(xs):
                    y = opt(x)
                    if (k + round_) % 2 == 0:
                        held.append((y, want[k]))
            torch.cuda.synchronize()
            for y, w in held:
                assert rel_err(y, w) < 1e-6
        spec = _spec(opt)
        assert spec.handed_out > 0 and spec.cloned > 0


def test_handout_in_inference_mode_then_no_grad():
    """Slots first captured inside torch.inference_mode() hand out plain tensors later under
    no_grad, which the caller may modify in place, as eager's outputs."""
    model = seed_network(64, 2).cuda()
    xs = [torch.randn(4, 64, device="cuda") for _ in range(3)]
    opt = fxfuse.optimize(model, xs[0], strict=True)
    with torch.inference_mode():
        first = opt(xs[0])
    with torch.no_grad():
        second = opt(xs[1])
        second.add_(1.0)
        assert rel_err(second, model(xs[1]) + 1.0) < 1e-6
    assert rel_err(first, model(xs[0]).detach()) < 1e-6
    assert _spec(opt).handed_out == 2


def test_built_in_inference_mode_then_called_outside_it():
    """A specialization built inside torch.inference_mode() keeps plain static buffers: calls
    under no_grad (contiguous or strided input) work, and the handout copies still hand out."""
    model = seed_network(64, 2).cuda()
    xs = [torch.randn(4, 64, device="cuda") for _ in range(3)]
    with torch.inference_mode():
        opt = fxfuse.optimize(model, xs[0], strict=True)
        first = opt(xs[0])
    with torch.no_grad():
        for x in xs:
            assert rel_err(opt(x), model(x)) < 1e-6
    assert rel_err(first, model(xs[0]).detach()) < 1e-6
    with torch.inference_mode():   # a strided input is copied into its static buffer with copy_
        opt_strided = fxfuse.optimize(model, torch.randn(64, 4, device="cuda").t(), strict=True)
    with torch.no_grad():
        strided = torch.randn(64, 4, device="cuda").t()
        assert rel_err(opt_strided(strided), model(strided)) < 1e-6
    spec = _spec(opt)
    assert spec.handout is not None and spec.handed_out >= 3 and "pools of their own" in spec.handout_note


# ------------------------------------------------------------------ per-call host cost and PDL

class _SharedResidual(nn.Module):
    """One Linear applied twice back to back (the same kernel module launched twice in a row,
    sharing its split-K workspace) and a residual that reads an earlier activation."""

    def __init__(self, width):
        super().__init__()
        self.a, self.shared, self.b = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        h = torch.relu(self.a(x))
        g = torch.relu(self.shared(h))
        g = torch.relu(self.shared(g))
        return torch.tanh(self.b(g)) + h


@pytest.mark.parametrize("batch,width", [(1, 1024), (5, 300), (64, 512), (200, 96)])
def test_pdl_gemm_chains_match_eager(batch, width):
    """Every epilogue GEMM is launched with programmatic dependent launch on Hopper: its
    weight tile is read before gdc_wait, everything else after. Kept outputs and fresh inputs
    over several calls catch a kernel that read its input or wrote before the previous one ended."""
    from fxfuse.kernel import pdl_available
    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_available(torch.device("cuda"))
    from fxfuse.gemm_kernel import EpilogueGemm
    model = _SharedResidual(width).cuda().eval()
    x = torch.randn(batch, width, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True, gemm="force", fused_mlp="off")
    assert fxfuse.stats(opt)["fused_kernels"] >= 4
    gemms = [m for m in next(iter(opt._specializations.values())).gm.modules() if isinstance(m, EpilogueGemm)]
    assert gemms and all(m.use_pdl for m in gemms)              # inside the captured graph only
    no_graph = fxfuse.optimize(model, x, strict=True, gemm="force", fused_mlp="off", cuda_graphs=False)
    assert not any(m.use_pdl for m in next(iter(no_graph._specializations.values())).gm.modules()
                   if isinstance(m, EpilogueGemm))
    with torch.no_grad():
        pairs = []
        for _ in range(4):
            fresh = torch.randn_like(x)
            pairs.append((opt(fresh), model(fresh)))
        torch.cuda.synchronize()
        for got, want in pairs:
            assert rel_err(got, want) < 1e-5
    assert fxfuse.stats(opt)["reference_fallbacks"] == 0


def test_inputs_come_in_through_the_graphs_memcpy_node():
    """Contiguous inputs: each graph (the first and its handout copies) starts with a memcpy
    node re-pointed at the caller's tensor; non-contiguous ones are copied with copy_. Inputs
    overwritten and freed right after the call, and calls on a side stream, still give eager's
    results: the update applies to the launch that follows it."""
    model = seed_network(128, 2).cuda()
    x = torch.randn(4, 128, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    spec = next(iter(opt._specializations.values()))
    assert "no host copy" in spec.inputs.note and "no host copy" in fxfuse.explain(opt)
    with torch.no_grad():
        results = []
        for _ in range(6):
            fresh = torch.randn_like(x)
            results.append((opt(fresh), model(fresh)))
            fresh.mul_(3)                                   # after the call: must not be seen
            del fresh
        for got, want in results:
            assert rel_err(got, want) < 1e-6
        updates = spec.inputs.node_updates + sum(slot.inputs.node_updates for slot in spec.handout)
        assert updates == 6 and len(spec.handout) <= HANDOUT_SLOTS
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fresh = torch.randn_like(x)
            got = opt(fresh).clone()
            want = model(fresh)
        side.synchronize()
        assert rel_err(got, want) < 1e-6
        xt = torch.randn(128, 4, device="cuda").t()        # strides (1, 4): guarded, copied by copy_
        opt_t = fxfuse.optimize(model, xt, strict=True)
        spec_t = next(iter(opt_t._specializations.values()))
        assert spec_t.inputs.copied and not spec_t.inputs.bound
        for _ in range(3):
            fresh = torch.randn(128, 4, device="cuda").t()
            assert rel_err(opt_t(fresh), model(fresh)) < 1e-6


def test_two_inputs_one_bound_one_copied():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, a, b):
            return torch.relu(self.lin(a)) * b.t()

    model = TwoInputs().cuda().eval()
    a, b = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda").t()
    opt = fxfuse.optimize(model, (a, b), strict=True)
    spec = next(iter(opt._specializations.values()))
    assert [k for k, _ in spec.inputs.bound] == [0] and [k for k, _ in spec.inputs.copied] == [1]
    with torch.no_grad():
        for _ in range(4):
            fa, fb = torch.randn_like(a), torch.randn(8, 64, device="cuda").t()
            assert rel_err(opt(fa, fb), model(fa, fb)) < 1e-6


def test_conjugated_complex_input_through_the_graph():
    """z.conj() has the bytes of z and a flag; the memcpy node must not skip the conjugation."""
    class Imag(nn.Module):
        def forward(self, z):
            return torch.relu(torch.imag(z * 2)) + torch.real(z)

    model = Imag().eval()
    z = torch.randn(4, 33, dtype=torch.complex64, device="cuda")
    opt = fxfuse.optimize(model, z, strict=True)
    assert [k for k, _ in next(iter(opt._specializations.values())).inputs.bound] == [0]   # the node path
    with torch.no_grad():
        for _ in range(2):
            fresh = torch.randn_like(z)
            assert torch.allclose(opt(fresh.conj()), model(fresh.conj()))
            assert torch.allclose(opt(fresh), model(fresh))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_chains_round_like_eager_without_fma(dtype):
    """Eager rounds x * y to fp16 before adding z; an FMA contracted across the kernel's cast
    (Triton's default) would not: 1 ulp off. Also a 0-dim fp32 buffer, rounded to fp16 first."""
    class MulAdd(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b0", torch.tensor(0.3333333))

        def forward(self, x, y, z):
            return x * y + z + self.b0

    model = MulAdd().eval().cuda()
    args = tuple((torch.randn(64, 160, device="cuda") * 3).to(dtype) for _ in range(3))
    opt = fxfuse.optimize(model, args, strict=True)
    with torch.no_grad():
        fresh = tuple(torch.randn_like(a) * 3 for a in args)
        assert torch.equal(opt(*fresh), model(*fresh))
    assert fxfuse.stats(opt)["fused_kernels"] == 1


def test_replays_go_through_cuGraphLaunch_and_match_eager():
    """graph_launch.py: a graph without random numbers is launched with cuGraphLaunch, slots too,
    and calls with alternating inputs still match eager."""
    model = seed_network(96, 4).cuda()
    x1, x2 = torch.randn(5, 96, device="cuda"), torch.randn(5, 96, device="cuda")
    opt = fxfuse.optimize(model, x1, strict=True)
    spec = next(iter(opt._specializations.values()))
    assert spec.launcher.note == "cuGraphLaunch" and not spec.draws_random
    with torch.no_grad():
        for x in (x1, x2, x1, x2):
            assert rel_err(opt(x), model(x)) < 1e-5
    launchers = [spec.launcher] + [slot.launcher for slot in spec.handout]
    assert sum(l.direct for l in launchers) == 4 and sum(l.replays for l in launchers) == 0


def test_graph_that_draws_random_numbers_keeps_torchs_replay():
    """Random numbers in a graph: torch's replay moves the generator on (new numbers per replay);
    a bare cuGraphLaunch would repeat them, which is why GraphLauncher leaves such graphs alone."""
    from fxfuse.graph_launch import GraphLauncher, generator_offset
    dev = torch.cuda.current_device()
    before = generator_offset(dev)
    static = torch.rand(1000, device="cuda")   # warm-up, as Specialization._capture runs one
    assert generator_offset(dev) != before     # what _capture detects
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = torch.rand(1000, device="cuda")
    launcher = GraphLauncher(graph, dev, draws_random=True)
    launcher.replay()
    first = static.clone()
    launcher.replay()
    assert not torch.equal(first, static) and launcher.direct == 0
    direct = GraphLauncher(graph, dev, draws_random=False)
    direct.replay()
    again = static.clone()
    direct.replay()
    torch.cuda.synchronize()
    assert direct.direct == 2 and torch.equal(again, static)   # the same numbers twice


@pytest.mark.parametrize("options", [{}, {"cuda_graphs": False}, {"gemm": "force"}, {"fused_mlp": "force"}])
def test_round4_fixes_on_gpu(options):
    """The fuzzing fixes of 2026-11-25 on compiled kernels: a write through a view recorded from
    `v += y`, matmul spellings of a Linear, an input with a pending negation."""
    from test_usage_round4 import LinearReluResidual, LinearSpellings
    from test_writes_round4 import WriteThroughView

    torch.manual_seed(0)
    for model, shape in ((WriteThroughView(), (4, 8)), (LinearSpellings(), (5, 7)), (LinearReluResidual(), (3, 17))):
        model = model.eval().cuda()
        opt = fxfuse.optimize(model, torch.rand(*shape, device="cuda"), strict=True, **options)
        with torch.no_grad():
            for x in (torch.rand(*shape, device="cuda") * 5, torch._neg_view(torch.randn(*shape, device="cuda"))):
                torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
        assert fxfuse.stats(opt)["fused_kernels"] >= 1


def test_a_returned_torch_size_stays_a_size_through_the_graph():
    """Outputs pass through pytree on the graph path (handout slots, clones): a torch.Size must
    come back as a Size, not the tuple pytree rebuilds."""
    class ReturnsSize(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            h = torch.relu(self.lin(x))
            return h.shape, {"y": h, "size": h.size()}

    model = ReturnsSize().cuda().eval()
    x = torch.randn(4, 32, device="cuda")
    opt = fxfuse.optimize(model, x, strict=True)
    assert _spec(opt).graph is not None
    with torch.no_grad():
        kept = [opt(torch.randn(4, 32, device="cuda")) for _ in range(HANDOUT_SLOTS + 2)]   # handed out, then cloned
        want = model(x)
        shape, rest = opt(x)
    assert all(type(k[0]) is torch.Size and type(k[1]["size"]) is torch.Size for k in kept)
    assert type(shape) is torch.Size and shape == want[0] and rel_err(rest["y"], want[1]["y"]) < 1e-6

