"""Runtime on the CPU: signatures, specializations by stride and scalar args, inputs never
mutated, outputs of one call independent of the next, and the Linear-bias placement pass."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import unittest.mock  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse  # noqa: E402
from conftest import assert_fast_path, assert_matches_eager  # noqa: E402
from fxfuse.specialization import describe_mismatch, signature  # noqa: E402


class Residual(nn.Module):
    def __init__(self, n=13):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


def test_signature_names_the_mismatch():
    a = signature((torch.randn(3, 4),))
    b = signature((torch.randn(5, 4),))
    assert "shape" in describe_mismatch(a, b) and "(5, 4)" in describe_mismatch(a, b)
    c = signature((torch.randn(3, 4).half(),))
    assert "dtype" in describe_mismatch(a, c)
    d = signature((torch.randn(4, 3).t(),))
    assert "stride" in describe_mismatch(a, d)


def test_strided_input_gets_its_own_specialization_and_right_answer():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(6, 13), strict=True)
    x = torch.randn(13, 6).t()          # same shape, other strides
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    s = fxfuse.stats(opt)
    assert s["specializations"] == 2 and s["reference_fallbacks"] == 0


def test_inputs_not_mutated_and_outputs_independent():
    model = nn.Sequential(nn.Linear(9, 9), nn.ReLU(inplace=True), nn.Linear(9, 9), nn.ReLU(inplace=True)).eval()
    x1, x2 = torch.randn(4, 9), torch.randn(4, 9)
    opt = fxfuse.optimize(model, x1, strict=True)
    keep1, keep2 = x1.clone(), x2.clone()
    with torch.no_grad():
        out1 = opt(x1)
        snapshot = out1.clone()
        out2 = opt(x2)
    assert torch.equal(x1, keep1) and torch.equal(x2, keep2)
    assert torch.equal(out1, snapshot) and not torch.equal(out1, out2)
    assert fxfuse.stats(opt)["kernel_launches"] > 0


def test_scalar_argument_is_specialized_and_guarded():
    class Scale(nn.Module):
        def forward(self, x, k: float):
            return torch.relu(x * k + 1)

    opt = fxfuse.optimize(Scale().eval(), (torch.randn(3, 5), 2.0), strict=True)
    x = torch.randn(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, 2.0), Scale()(x, 2.0))
        torch.testing.assert_close(opt(x, 3.0), Scale()(x, 3.0))   # other value: new specialization
    assert fxfuse.stats(opt)["specializations"] == 2


def test_cuda_graphs_option_on_cpu_is_harmless():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 13), cuda_graphs=False, strict=True)
    assert "off" in next(iter(opt._specializations.values())).cuda_graph_note
    with torch.no_grad():
        x = torch.randn(2, 13)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


def test_unknown_option_is_a_clear_error():
    with pytest.raises(fxfuse.FxfuseError, match="unknown option"):
        fxfuse.optimize(Residual().eval(), torch.randn(2, 13), fuse_everything=True)


def test_bias_moved_into_library_gemm_when_measured_faster(monkeypatch):
    import fxfuse.passes.linear_epilogue as pass_module

    monkeypatch.setattr(pass_module, "bias_in_library_gemm", lambda *a: (True, "bias in the library GEMM: test"))
    model = nn.Sequential(nn.Linear(11, 7), nn.ReLU(), nn.Linear(7, 5), nn.Tanh()).eval()
    opt = fxfuse.optimize(model, torch.randn(3, 11), strict=True, fused_mlp="off")  # narrow: would be one kernel
    gm = next(iter(opt._specializations.values())).gm
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 2 and all(len(n.args) == 3 for n in linears)
    assert fxfuse.stats(opt)["fused_kernels"] == 2      # relu, tanh alone
    with torch.no_grad():
        x = torch.randn(3, 11)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert all("bias in the library GEMM" in n.meta["fxfuse"]["decision"] for n in linears)
    assert "library GEMM: test" in fxfuse.explain(opt)   # after the plan's line, wrapped in the table



def test_relu_moved_into_library_gemm_when_measured_faster(monkeypatch):
    """A Linear + bias + ReLU whose ReLU fuses with nothing else becomes one cuBLASLt call
    (linear_relu) where measured faster; a ReLU that feeds another pointwise op stays a kernel."""
    import fxfuse.passes.linear_epilogue as pass_module

    monkeypatch.setattr(pass_module, "relu_in_library_gemm", lambda *a: (True, "bias and ReLU in the library GEMM's epilogue: test"))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(11, 9), nn.Linear(9, 7), nn.Linear(7, 5)

        def forward(self, x):
            h = torch.relu(self.b(F.relu(self.a(x))))     # both ReLUs read only by a Linear
            return torch.relu(self.c(h)) * 2               # this ReLU feeds a multiply: kept in a kernel

    model = Net().eval()
    opt = fxfuse.optimize(model, torch.randn(2, 3, 11), strict=True, fused_mlp="off", gemm="off")
    gm = next(iter(opt._specializations.values())).gm
    assert [n.target for n in gm.graph.nodes].count(pass_module.linear_relu) == 2
    assert fxfuse.stats(opt)["fused_kernels"] == 1      # c's bias, ReLU and the multiply
    assert fxfuse.stats(opt)["library_epilogues"] == 2
    with torch.no_grad():
        x = torch.randn(2, 3, 11)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert "ReLU in the library GEMM's epilogue" in fxfuse.explain(opt)

def test_quiet_by_default(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(Residual().eval(), torch.randn(2, 13), strict=True)
        with torch.no_grad():
            opt(torch.randn(2, 13))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


class _FakeDriver:
    """Stands in for libcuda: records where each memcpy node points, fails on request."""

    def __init__(self, fail_at=()):
        self.sources, self.calls, self.fail_at = {}, 0, set(fail_at)

    def cuCtxGetCurrent(self, ref):
        return 0

    def cuGraphExecMemcpyNodeSetParams(self, exe, node, params_ref, context):
        self.calls += 1
        if self.calls in self.fail_at or "all" in self.fail_at:
            return 999
        self.sources[node.value] = params_ref._obj.srcDevice
        return 0


class _FakeGraph:
    def raw_cuda_graph_exec(self):
        return 1


def _graph_inputs(fake, monkeypatch):
    import fxfuse.input_copy as ic
    statics = {0: torch.empty(3, 5), 1: torch.empty(4)}
    bound = [(0, torch.randn(3, 5)), (1, torch.randn(4))]
    nodes = [(ic.ctypes.c_void_p(10 + k), ic.CUDA_MEMCPY3D()) for k in range(2)]
    monkeypatch.setattr(ic, "_driver", fake)
    monkeypatch.setattr(ic, "_memcpy_nodes", lambda graph, pairs: nodes)
    return ic.GraphInputs(_FakeGraph(), True, [], bound, statics), bound


def test_graph_inputs_repoint_memcpy_nodes_at_the_callers_tensors(monkeypatch):
    fake = _FakeDriver()
    inputs, _ = _graph_inputs(fake, monkeypatch)
    assert "no host copy" in inputs.note
    x, y = torch.randn(3, 5), torch.randn(4)
    assert inputs.load([x, y])
    assert fake.sources == {10: x.data_ptr(), 11: y.data_ptr()} and inputs.node_updates == 1
    assert inputs.load([x, y]) and fake.calls == 2 and inputs.node_updates == 2   # same tensors: no driver call
    z = torch.randn(4)
    assert inputs.load([x, z]) and fake.calls == 3 and fake.sources[11] == z.data_ptr()


def test_graph_inputs_failed_update_restores_the_sources_and_copies(monkeypatch):
    """A failed update leaves no node pointing at a caller's tensor: the nodes go back to
    their sources, the input is copied there (the graph's memcpy carries it on), and so on."""
    fake = _FakeDriver(fail_at={4})            # the second load's update of y; the restores succeed
    inputs, bound = _graph_inputs(fake, monkeypatch)
    assert inputs.load([torch.randn(3, 5), torch.randn(4)])
    x, y = torch.randn(3, 5), torch.randn(4)
    assert inputs.load([x, y])
    assert fake.sources == {10: bound[0][1].data_ptr(), 11: bound[1][1].data_ptr()}
    assert torch.equal(bound[0][1], x) and torch.equal(bound[1][1], y) and inputs.copies == 1
    assert inputs.exec is None and inputs.load([x * 2, y * 2]) and torch.equal(bound[0][1], x * 2)


def test_graph_inputs_unrestorable_node_stops_the_graph(monkeypatch):
    fake = _FakeDriver(fail_at={"all"})
    inputs, _ = _graph_inputs(fake, monkeypatch)
    assert not inputs.load([torch.randn(3, 5), torch.randn(4)])


@pytest.mark.parametrize("strassen", ["off", "force"])
def test_optimize_imports_neither_dynamo_nor_sympy(strassen):
    """The first optimize in a process paid for torch._dynamo (meta kernels written as Python
    refs) and sympy (ShapeProp, torch.broadcast_shapes, meta bmm in the Strassen rewrite): 5
    of its 6.4 s at 4096 x 8192 on the H100 host; networkx (fusion's convexity check) cost
    ~0.2 s more. None of them is needed for real example tensors."""
    import subprocess
    import sys
    code = ("import sys, torch, fxfuse\n"
            "from fxfuse.demo import seed_network\n"
            "m = seed_network(32, 2).eval()\n"
            f"opt = fxfuse.optimize(m, torch.randn(3, 32), strict=True, strassen='{strassen}')\n"
            "assert fxfuse.stats(opt)['fused_kernels'] > 0\n"
            f"assert ('Strassen 1 level' in fxfuse.explain(opt)) == ('{strassen}' == 'force')\n"
            "print(sorted(k for k in ('torch._dynamo', 'sympy', 'torch.fx.experimental.symbolic_shapes', 'networkx') "
            "if k in sys.modules))\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_graph_inputs_resolve_a_pending_conjugation_before_the_node_reads(monkeypatch):
    """x.conj() of a complex tensor is the same bytes with a flag: the memcpy node must read
    the conjugated values, so such an input goes through `source` (copy_ resolves the flag)."""
    import fxfuse.input_copy as ic
    fake = _FakeDriver()
    statics = {0: torch.empty(4, dtype=torch.complex64)}
    bound = [(0, torch.zeros(4, dtype=torch.complex64))]
    monkeypatch.setattr(ic, "_driver", fake)
    monkeypatch.setattr(ic, "_memcpy_nodes", lambda graph, pairs: [(ic.ctypes.c_void_p(10), ic.CUDA_MEMCPY3D())])
    inputs = ic.GraphInputs(_FakeGraph(), True, [], bound, statics)
    z = torch.randn(4, dtype=torch.complex64)
    assert inputs.load([z.conj()])
    assert fake.sources[10] == bound[0][1].data_ptr() and torch.equal(bound[0][1], z.conj().resolve_conj())
    assert inputs.load([z]) and fake.sources[10] == z.data_ptr()


def test_sparse_intermediate_traces():
    class ToSparseAndBack(nn.Module):
        def forward(self, x):
            return x.to_sparse_csr().to_dense() * 2 + 1

    model, x = ToSparseAndBack().eval(), torch.randn(3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # torch: "Sparse CSR tensor support is in beta state"
        opt = fxfuse.optimize(model, x, strict=True)
        fresh = torch.randn(3, 5)
        assert torch.allclose(opt(fresh), model(fresh))
    assert fxfuse.stats(opt)["fused_kernels"] == 1 and fxfuse.stats(opt)["kernel_launches"] >= 1


def test_graph_inputs_without_a_kept_graph_copy_into_the_source(monkeypatch):
    """A torch without keep_graph: the nodes cannot be found, so the input goes into `source`
    and the graph's own memcpy carries it on; no driver call is made."""
    import fxfuse.input_copy as ic
    fake = _FakeDriver(fail_at={"all"})
    monkeypatch.setattr(ic, "_driver", fake)
    bound = [(0, torch.zeros(6))]
    inputs = ic.GraphInputs(_FakeGraph(), False, [], bound, {0: torch.empty(6)})
    x = torch.randn(6)
    assert inputs.exec is None and "copied, then" in inputs.note
    assert inputs.load([x]) and torch.equal(bound[0][1], x) and fake.calls == 0 and inputs.copies == 1


# ---- the module's lifecycle: weights, mode, pickling, warnings --------------------------------

def _bn_mlp():
    bn = nn.BatchNorm1d(12)
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)
    return nn.Sequential(nn.Linear(6, 12), bn, nn.ReLU(), nn.Linear(12, 5)).eval()


def test_load_state_dict_drops_specializations_and_rebuilds():
    """Folded BatchNorm holds copies of the weights: a load must not leave them stale."""
    model, x = _bn_mlp(), torch.randn(4, 6)
    opt = fxfuse.optimize(model, x, strict=True)
    with torch.no_grad():
        opt(torch.randn(2, 6))                      # a second specialization, dropped too
    model.load_state_dict(_bn_mlp().state_dict())
    assert not opt._specializations and [n for n, _ in opt.named_children()] == ["original"]
    assert_matches_eager(opt, model, x)
    assert fxfuse.stats(opt)["specializations"] == 1 and not opt._misses
    assert_fast_path(opt)
    other = fxfuse.optimize(_bn_mlp(), x, strict=True)
    assert list(other.state_dict()) == list(other.original.state_dict())   # derived tensors are not state
    opt.load_state_dict(other.state_dict())         # through the OptimizedModule itself
    assert_matches_eager(opt, other.original, x)
    assert fxfuse.stats(opt)["specializations"] == 1


def test_load_state_dict_hook_keeps_model_picklable_and_opt_collectable():
    import copy
    import gc
    import io
    import weakref
    model, x = _bn_mlp(), torch.randn(4, 6)
    opt = fxfuse.optimize(model, x, strict=True)
    torch.save(model, io.BytesIO())
    clone = copy.deepcopy(model)
    clone.load_state_dict(_bn_mlp().state_dict())   # a copy's load leaves opt alone
    assert len(opt._specializations) == 1
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None and not model[0]._load_state_dict_post_hooks


def test_training_flag_follows_the_model_and_reoptimize_takes_the_original():
    model = Residual().eval()
    opt = fxfuse.optimize(model, torch.randn(3, 13), strict=True)
    assert not any(m.training for m in opt.modules())
    with torch.no_grad():
        opt(torch.randn(5, 13))                     # a new specialization is in eval mode too
    assert not any(m.training for m in opt.modules())
    model.train()                                   # opt.training reads the model's mode
    assert opt.training
    opt.eval()
    assert not opt.training and not model.training
    model.train()
    opt.train(False)
    assert not model.training and not opt.training
    again = fxfuse.optimize(opt, torch.randn(3, 13), strict=True)
    assert again.original is model
    assert_matches_eager(again, model, torch.randn(3, 13))


def test_pickling_is_a_clear_type_error():
    import io
    opt = fxfuse.optimize(Residual().eval(), torch.randn(3, 13), strict=True)
    with pytest.raises(TypeError, match=r"opt\.original"):
        torch.save(opt, io.BytesIO())


def test_no_cuda_warning_once_at_the_users_line(monkeypatch):
    import fxfuse.api as api
    monkeypatch.setattr(api, "interpreting", lambda: False)
    monkeypatch.setattr(api, "kernels_available", lambda device: False)
    model = Residual().eval()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, torch.randn(3, 13))
        for batch in (1, 2):                        # new specializations
            opt(torch.randn(batch, 13))
    assert fxfuse.stats(opt)["specializations"] == 3
    assert len(caught) == 1 and "no CUDA device" in str(caught[0].message)
    assert caught[0].filename == __file__


def test_export_traced_model_leaks_no_warning_and_switches_mode():
    model = nn.LSTM(4, 4, batch_first=True).eval()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        opt = fxfuse.optimize(model, torch.randn(2, 3, 4), strict=True)
        x = torch.randn(1, 3, 4)                    # a second build through torch.export
        torch.testing.assert_close(opt(x), model(x))
    assert not caught, [str(w.message)[:80] for w in caught]
    opt.train()
    opt.eval()                                      # export's module() alone refuses train()/eval()
    assert not any(m.training for m in opt.modules())


# ---- graph replay through cuGraphLaunch (graph_launch.py), with a stand-in driver ---------------

class _FakeLaunchDriver:
    def __init__(self, status=0):
        self.status, self.launches = status, []

    def cuGraphLaunch(self, exe, stream):
        self.launches.append((exe.value, getattr(stream, "value", stream)))   # the real one has argtypes
        return self.status


class _ReplayCounter:
    def __init__(self):
        self.replays = 0

    def raw_cuda_graph_exec(self):
        return 77

    def replay(self):
        self.replays += 1


def _launcher(monkeypatch, status=0, draws_random=False, device=0):
    import fxfuse.graph_launch as gl
    fake, graph = _FakeLaunchDriver(status), _ReplayCounter()
    monkeypatch.setattr(gl, "driver", lambda: fake)
    monkeypatch.setattr(gl, "_current_device", lambda: device)
    monkeypatch.setattr(gl, "_current_stream", lambda d: 1234)
    return gl.GraphLauncher(graph, 0, draws_random), fake, graph


def test_graph_launcher_launches_directly_on_the_current_stream(monkeypatch):
    launcher, fake, graph = _launcher(monkeypatch)
    launcher.replay()
    launcher.replay()
    assert fake.launches == [(77, 1234)] * 2 and graph.replays == 0 and launcher.note == "cuGraphLaunch"


def test_graph_launcher_error_falls_back_to_torch_for_good(monkeypatch):
    launcher, fake, graph = _launcher(monkeypatch, status=400)
    launcher.replay()
    launcher.replay()
    assert len(fake.launches) == 1 and graph.replays == 2 and "returned 400" in launcher.note


@pytest.mark.parametrize("case", ["random", "other device"])
def test_graph_launcher_leaves_random_graphs_and_other_devices_to_torch(monkeypatch, case):
    """A graph that draws random numbers needs torch's replay prologue (new numbers per call);
    another current device needs torch's device guard."""
    launcher, fake, graph = _launcher(monkeypatch, draws_random=case == "random", device=0 if case == "random" else 1)
    launcher.replay()
    assert fake.launches == [] and graph.replays == 1


@pytest.mark.parametrize("body, random", [
    (lambda x: torch.relu(x) * 2, False),
    (lambda x: x + torch.rand_like(x), True),
    (lambda x: F.dropout(x, 0.5, True), True),
    (lambda x: x + torch.randn(x.shape), True),
    (lambda x: x + torch.empty_like(x).normal_(), True),
], ids=["relu", "rand_like", "dropout", "randn", "normal_"])
def test_random_ops_are_recognised(body, random):
    from fxfuse.graph_launch import draws_random_numbers

    class M(nn.Module):
        def forward(self, x):
            return body(x)
    assert draws_random_numbers(torch.fx.symbolic_trace(M())) == random
    assert draws_random_numbers(torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1))))


def test_own_pool_handout_only_for_outputs_inside_the_pool():
    """handout.inside: a graph copy's outputs are handed out as they are only when each lies in
    that copy's own pool segments (not an input, a weight, or another pool's block)."""
    from fxfuse.handout import inside
    t = torch.randn(64)
    start, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    assert inside([(start, size)], [t, t[3:9]])
    assert not inside([(start + 4, size)], [t])                  # starts inside, ends past the segment
    assert not inside([(start, size)], [t, torch.randn(3)])     # another allocation: outside t's bytes
    assert not inside([], [t])
    assert inside([(start, size)], [t, torch.empty(0)])           # no bytes: nothing to overwrite


def test_output_slot_is_held_by_a_view_or_a_kept_storage():
    """OutputSlots.free(): a handed-out tensor, a view of it, or only its storage object keeps
    the slot from being replayed over it."""
    from fxfuse.handout import OutputSlots
    slot = OutputSlots(None, torch.randn(4, 3), None)
    assert slot.free()
    y = slot.hand_out()
    assert not slot.free()
    v = y[1:]
    del y
    assert not slot.free()
    s = v.untyped_storage()
    del v
    assert not slot.free()
    del s
    assert slot.free()
    pair = OutputSlots(None, (torch.randn(2), [torch.randn(3)]), None)
    a, (b,) = pair.hand_out()
    del a
    assert not pair.free()
    del b
    assert pair.free()


def test_bias_spelling_ties_go_to_eagers_addmm():
    """Within timing noise the GEMM with bias (eager's addmm) is kept: a GEMM-bound layer must
    not come out slower than eager by one timing's noise (8 x 2048 at batch 4096 was 0.5% slower
    with mm 702.8 vs addmm 700.4 us per layer)."""
    from fxfuse.library_choice import _bias_in_gemm
    assert _bias_in_gemm(plain=702.8, with_bias=700.4)
    assert _bias_in_gemm(plain=700.0, with_bias=705.0)        # within 1%: a tie
    assert not _bias_in_gemm(plain=700.0, with_bias=720.0)    # measured slower: mm + the fused kernel
