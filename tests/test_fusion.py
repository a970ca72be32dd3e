"""Fusion regression tests: how many fused kernels and library calls a model becomes
(fxfuse.stats), that groups stay convex, and that the kernels (not references) ran.

The fully fused MLP pass is turned off (NO_MLP) so that these counts are pointwise fusion's.
"""
import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from conftest import NO_MLP, assert_fast_path, assert_matches_eager, optimized_graph
from fxfuse.kernel import FusedKernel


def optimize(model, example, **options):
    return fxfuse.optimize(model, example, strict=True, **NO_MLP, **options)


def counts(opt):
    s = fxfuse.stats(opt)
    return s["library_calls"], s["fused_kernels"]


def kernels(opt):
    gm = optimized_graph(opt)
    return [gm.get_submodule(n.target) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), FusedKernel)]


def test_linear_relu_is_one_matmul_and_one_kernel():
    model = nn.Sequential(nn.Linear(12, 9), nn.ReLU()).eval()
    x = torch.randn(4, 12)
    opt = optimize(model, x)
    assert counts(opt) == (1, 1)
    (k,) = kernels(opt)
    assert len(k.ir.outputs) == 1 and len(k.ir.inputs) == 2       # matmul result, bias
    before = fxfuse.stats(opt)["kernel_launches"]                 # the build's verification run
    assert_matches_eager(opt, model, x)
    s = assert_fast_path(opt)
    assert s["kernel_launches"] == before + 1


def test_seed_network_eight_layers_eight_kernels():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(16, 16), nn.ReLU(inplace=True)]
    model = nn.Sequential(*layers).eval()
    x = torch.randn(2, 16)
    opt = optimize(model, x)
    assert counts(opt) == (8, 8)
    before = fxfuse.stats(opt)["kernel_launches"]
    assert_matches_eager(opt, model, x)
    assert_matches_eager(opt, model, x)
    s = assert_fast_path(opt)
    assert s["kernel_launches"] == before + 16          # 8 per call, 2 calls
    assert s["specializations"] == 1


def test_pointwise_chain_of_five_is_one_kernel():
    class M(nn.Module):
        def forward(self, x):
            return torch.sigmoid(torch.exp(x) * 3 + 1).tanh()

    model = M().eval()
    x = torch.randn(5, 11)
    opt = optimize(model, x)
    assert counts(opt) == (0, 1)
    (k,) = kernels(opt)
    assert len(k.members) == 5
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


def test_two_outputs_from_one_group():
    class M(nn.Module):
        def forward(self, x):
            a = torch.sigmoid(x) * 2
            return a + 1, a.tanh(), (x - 1).relu()

    model = M().eval()
    x = torch.randn(3, 7)
    opt = optimize(model, x)
    assert counts(opt) == (0, 1)
    (k,) = kernels(opt)
    assert len(k.ir.outputs) == 3 and len(k.ir.inputs) == 1
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


def test_intermediate_read_outside_is_stored_once():
    """A value read by a library call and by the rest of the group is a kernel output."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            a = torch.relu(x * 2)
            return self.fc(a), a + 1

    model = M().eval()
    x = torch.randn(4, 6)
    opt = optimize(model, x)
    assert_matches_eager(opt, model, x)
    # {mul, relu, add}; the Linear's bias, which nothing pointwise reads, in its library call (stop 35)
    assert counts(opt) == (1, 1)
    assert sorted(len(k.ir.outputs) for k in kernels(opt)) == [2]


def test_convexity_path_through_a_matmul_splits_the_group():
    """relu -> linear -> add and relu -> mul -> add: relu and add in one kernel would need the
    linear's result inside the kernel that produces its input."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            a = torch.relu(x)
            m = F.linear(a, self.w)
            return a * 2 + m

    model = M().eval()
    x = torch.randn(3, 8)
    opt = optimize(model, x)
    assert counts(opt) == (1, 2)
    gm = optimized_graph(opt)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    (linear,) = [n for n in gm.graph.nodes if n.target is F.linear]
    producer = linear.args[0]
    assert order[producer] < order[linear] < min(order[u] for u in linear.users)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


def test_convexity_longer_detour():
    """exp -> (softmax, a library reduction) -> mul, and exp -> mul directly."""
    class M(nn.Module):
        def forward(self, x):
            e = torch.exp(x - 1)
            s = F.softmax(e, dim=-1)
            return (e + 1) * s

    model = M().eval()
    x = torch.randn(4, 5)
    opt = optimize(model, x)
    lib, fused = counts(opt)
    assert (lib, fused) == (1, 2)
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


def test_siblings_sharing_an_input_fuse():
    class M(nn.Module):
        def forward(self, x):
            return torch.sigmoid(x), torch.tanh(x), x * x

    model = M().eval()
    x = torch.randn(2, 9)
    opt = optimize(model, x)
    assert counts(opt) == (0, 1)
    assert len(kernels(opt)[0].ir.outputs) == 3
    assert_matches_eager(opt, model, x)


def test_small_operand_is_recomputed_not_stored():
    """bias * 2 has the bias's shape; it is computed per point inside x's kernel."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.randn(7))

        def forward(self, x):
            return torch.relu(x + self.b * 2)

    model = M().eval()
    x = torch.randn(5, 7)
    opt = optimize(model, x)
    assert counts(opt) == (0, 1)
    assert len(kernels(opt)[0].ir.outputs) == 1
    assert_matches_eager(opt, model, x)


def test_fuse_false_leaves_no_kernels():
    model = nn.Sequential(nn.Linear(12, 9), nn.ReLU()).eval()
    x = torch.randn(4, 12)
    opt = optimize(model, x, fuse=False)
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] == 0 and s["library_calls"] >= 2
    assert_matches_eager(opt, model, x)


def test_stats_after_calls():
    model = nn.Sequential(nn.Linear(12, 9), nn.GELU(), nn.Linear(9, 3), nn.Tanh()).eval()
    x = torch.randn(4, 12)
    opt = optimize(model, x)
    before = fxfuse.stats(opt)["kernel_launches"]
    assert_matches_eager(opt, model, x)
    s = fxfuse.stats(opt)
    assert s["kernel_launches"] == before + 2 and s["reference_fallbacks"] == 0
    assert s["specializations"] == 1 and s["optimized"]


def test_reference_fallback_counted_without_kernels():
    model = nn.Sequential(nn.Linear(12, 9), nn.ReLU()).eval()
    x = torch.randn(4, 12)
    opt = optimize(model, x, use_kernels=False)
    assert_matches_eager(opt, model, x)
    s = fxfuse.stats(opt)
    assert s["fused_kernels"] == 1 and s["kernel_launches"] == 0 and s["reference_fallbacks"] > 0


def test_canonical_targets_only_inside_kernels():
    model = nn.Sequential(nn.Linear(10, 10), nn.SiLU(), nn.Linear(10, 4)).eval()
    opt = optimize(model, torch.randn(2, 10))
    gm = optimized_graph(opt)
    leftover = [n for n in gm.graph.nodes if n.op == "call_function"
                and n.target in (operator.add, F.silu, torch.relu)]
    assert not leftover, leftover


class TransposedIntermediate(nn.Module):
    def forward(self, x):
        a = (x.t() * 2).relu()                 # eager keeps the transposed layout of x.t()
        return torch.softmax(a, -1) * a        # softmax splits a's readers into two kernels


def test_kernel_reading_a_kernel_output_takes_the_fast_path():
    model = TransposedIntermediate().eval()
    x = torch.randn(5, 7)
    opt = optimize(model, x)
    assert counts(opt) == (1, 2) and fxfuse.stats(opt)["views"] == 1   # the softmax; the transpose
    assert_matches_eager(opt, model, x)
    assert_fast_path(opt)


class InplaceOnInputThenLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x.relu_()                              # kept in place: x is the caller's tensor
        return F.gelu(self.fc(x)) * 2          # reads x only through the Linear


def test_inplace_op_does_not_block_unrelated_fusion():
    model = InplaceOnInputThenLayer().eval()
    x = torch.randn(3, 8)
    opt = optimize(model, x.clone())
    assert_matches_eager(opt, model, x)
    assert fxfuse.stats(opt)["fused_kernels"] == 1         # bias + gelu + mul after the matmul
    assert_fast_path(opt)


class ZeroDimShift(nn.Module):
    """fp16/bf16 activations and 0-dim fp32 buffers: the result dtype is the activations'."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b0", torch.tensor(0.3333333))
        self.register_buffer("b1", torch.tensor(0.1234567))
        self.register_buffer("n", torch.tensor(2049))          # an int64 0-dim tensor, not exact in fp16

    def forward(self, x):
        return torch.where(x > 0, (x + self.b0).relu() - self.b1, x + self.n)


def test_zero_dim_fp32_operand_rounded_to_the_result_dtype():
    """Eager converts a 0-dim fp32 (or int) tensor operand to the fp16 result dtype before adding;
    the kernel rounds it likewise, so the result matches to the bit. (fp16 only: the interpreter
    truncates fp32 -> bf16 where the GPU rounds to nearest.)"""
    model = ZeroDimShift().eval()
    x = (torch.randn(6, 33) * 3).half()
    opt = fxfuse.optimize(model, x, strict=True)
    assert_matches_eager(opt, model, x, rtol=0, atol=0)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert_fast_path(opt)
