"""Where a Linear's bias (and a ReLU after it) is applied: in the library GEMM's epilogue, or in
the fused kernel.

normalize splits every Linear into `F.linear(x, W)` plus a pointwise bias add, so fusion can
absorb the bias into the activation's kernel. On the GPU the library's kernel choice for the
two spellings differs a lot with shape (fxfuse/library_choice.py measures it), so for each
such pair this pass measures once per shape and, where the GEMM with bias wins, puts the
bias back into the library call. Where a ReLU that fuses with nothing else follows the bias,
a third spelling is measured too: one cuBLASLt call with bias and ReLU in its epilogue
(`linear_relu`), which saves the kernel over the output. Where the GEMM's output has too few
tiles to fill the GPU, split-K is measured as well (`split_k_partials`): one batched GEMM over
S slices of K, its S partials summed by the fused kernel that already adds the bias. The
decision and its numbers go to explain().
"""
import operator

import torch
import torch.fx
import torch.nn.functional as F

from fxfuse.library_choice import bias_in_library_gemm, relu_in_library_gemm, split_k_library_gemm, split_k_mm
from fxfuse.ops import HALF_DTYPES, is_pointwise_target
from fxfuse.precision import matmul_allows_tf32
from fxfuse.node_meta import fetch_attr
from fxfuse.tracing import fxfuse_meta, tensor_metadata

from .normalize import FRESH_FUNCTIONS
from .normalize_layers import LINEAR_BIAS, register_constant
from .spellings import CONV_FUNCTIONS

LIBRARY_EPILOGUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_REASON = ("bias in the library GEMM: in fp16/bf16 it adds the bias before its one rounding, as eager's "
               "Linear (F.linear, addmm) does; the product rounded to fp16 with the bias added after would round "
               "twice (up to ~1.7x eager's error against float64). A bias the model adds itself (x @ W.T + b) "
               "rounds twice in eager too and stays out of the GEMM")


def _epilogue_safe(dtype, k: int, n: int) -> bool:
    """Where cuBLASLt's ReLU epilogue was seen to keep NaN (H100, torch 2.11): fp32 at every
    shape tried; fp16 lost it (NaN -> 0) at 7 x 13 -> 29, so half types only with K and N
    multiples of 8 (where the tests saw NaN kept)."""
    if dtype == torch.float32:
        return True
    return dtype in LIBRARY_EPILOGUE_DTYPES and k % 8 == 0 and n % 8 == 0


def linear_relu(x, weight, bias):
    """relu(F.linear(x, weight, bias)) as ONE cuBLASLt call, bias and ReLU in its epilogue."""
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


FRESH_FUNCTIONS.update((linear_relu, split_k_mm))   # new tensors: a write into one writes no input (specialization)


def split_k_partials(x, weight, splits: int) -> tuple:
    """The S partial products whose sum is F.linear(x, weight), from ONE batched library GEMM
    (library_choice.split_k_mm): S views of one [S, M, N] buffer, each shaped like the Linear's
    output, which the epilogue's fused kernel reads and adds."""
    parts = split_k_mm(x.reshape(-1, x.shape[-1]), weight, splits)
    return tuple(p.view(*x.shape[:-1], weight.shape[0]) for p in parts.unbind(0))


def _split_k(gm, linear, splits: int, reason: str, device) -> None:
    """linear -> split_k_partials + the sum of its S outputs (pointwise adds, which fuse with
    the bias add after them)."""
    graph, meta = gm.graph, linear.meta["tensor_meta"]
    with graph.inserting_before(linear):
        call = graph.call_function(split_k_partials, (linear.args[0], linear.args[1], splits))
        earlier = fxfuse_meta(linear).get("decision")
        call.meta["fxfuse"] = {"decision": f"{earlier}; {reason}" if earlier else reason, "device": device}
        call.meta["tensor_meta"] = (meta,) * splits
        total = None
        for i in range(splits):
            part = graph.call_function(operator.getitem, (call, i))
            part.meta = {"tensor_meta": meta, "fxfuse": {"device": device}}
            if total is not None:
                part = graph.call_function(operator.add, (total, part))
                part.meta = {"tensor_meta": meta, "fxfuse": {"device": device}}
            total = part
    linear.replace_all_uses_with(total)
    graph.erase_node(linear)


def _lone_relu(add):
    """The ReLU that is the bias add's only reader, where no pointwise op reads it (so taking
    it into the GEMM leaves no kernel behind); else None."""
    if len(add.users) != 1:
        return None
    relu = next(iter(add.users))
    if relu.op != "call_function" or relu.target is not torch.relu or relu.args != (add,) or relu.kwargs:
        return None
    if any(u.op == "call_function" and is_pointwise_target(u.target) for u in relu.users):
        return None
    return relu


def _carried(gm, linear, new, reason: str, device) -> dict:
    """The new library call's fxfuse meta: the Linear's plan and earlier decision, then this
    pass's; and the plan's record renamed to it (explain() matches the plan rows by name)."""
    old = fxfuse_meta(linear)
    earlier = old.get("decision")
    meta = {"decision": f"{earlier}; {reason}" if earlier else reason, "device": device}
    if "plan" in old:
        meta["plan"] = old["plan"]
    for record in gm.meta.get("fxfuse_plans", []):
        if record.get("node") == linear.name:
            record["node"] = new.name
    return meta


def _lone(add) -> bool:
    """Whether no pointwise op reads the bias add (a view its reader broadcasts, a chunk, a
    norm, the output): fusion would leave the add a kernel of its own (fuzz34j: DiT's adaLN
    chunks, a UNet's time embedding `emb(t)[:, :, None, None]`)."""
    return not any(u.op == "call_function" and is_pointwise_target(u.target) for u in add.users)


def _linear_bias_pairs(gm):
    """(F.linear(x, W), its bias add): a bias the model holds ([N]), or, in fp16/bf16, any bias
    of a Linear, addmm or F.linear (normalize's LINEAR_BIAS: an input, a computed one, [1, N]). Not
    a 0-d one (a dot product plus a number: fuzz47f)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.linear and len(node.args) == 2 \
                and not node.kwargs and len(node.users) == 1:
            add = next(iter(node.users))
            if add.op == "call_function" and add.target is operator.add and add.args[0] is node \
                    and isinstance(add.args[1], torch.fx.Node):
                bias_meta = add.args[1].meta.get("tensor_meta")
                out = node.meta.get("tensor_meta")
                if bias_meta is None or out is None or not out.shape or bias_meta.dtype != out.dtype \
                        or bias_meta.shape.numel() != out.shape[-1] or bias_meta.shape[-1:] != out.shape[-1:]:
                    continue   # (an addmm bias of another shape stays an add: on the H200 CUDA's fp16 addmm with an
                    #            [M, N] bias overflowed as the separate add does, where the CPU's rounds once)
                if _held_bias(add) or _rounds_once(add):
                    yield node, add


def _held_bias(add) -> bool:
    """Whether the bias is a [N] tensor the model holds (measured, and cuBLASLt's ReLU epilogue)."""
    bias = add.args[1]
    return bias.op == "get_attr" and len(bias.meta["tensor_meta"].shape) == 1


def _rounds_once(add) -> bool:
    """Whether eager added this bias inside its GEMM, before the one rounding of a half type, or of
    a dtype no fused kernel takes (fp64: the add would be a library call of its own, one more pass
    over the output and another rounding; fuzz39b)."""
    dtype = add.meta["tensor_meta"].dtype if add.meta.get("tensor_meta") is not None else None
    return (dtype in HALF_DTYPES or dtype is not None and dtype not in LIBRARY_EPILOGUE_DTYPES) \
        and add.meta.get(LINEAR_BIAS, False)


def linear_epilogue(gm: torch.fx.GraphModule, options=None) -> torch.fx.GraphModule:
    changed = False
    for linear, add in list(_linear_bias_pairs(gm)):
        meta = linear.meta["tensor_meta"]
        if meta.dtype in HALF_DTYPES and not add.meta.get(LINEAR_BIAS, False):
            continue   # eager rounds the product to fp16 before the model adds its bias: inside the GEMM, a
            #            product past 65504 came back finite and others an ulp off (fuzz48h)
        device = fxfuse_meta(linear).get("device", torch.device("cpu"))
        n = meta.shape[-1]
        batch = meta.shape.numel() // max(n, 1)
        k = linear.args[1].meta["tensor_meta"].shape[-1]
        allow_tf32 = matmul_allows_tf32()
        relu = _lone_relu(add) if _held_bias(add) and _epilogue_safe(meta.dtype, k, n) and batch > 0 else None
        if relu is not None:
            fused, reason = relu_in_library_gemm(batch, k, n, meta.dtype, device, allow_tf32)
            if fused:
                with gm.graph.inserting_before(relu):
                    new = gm.graph.call_function(linear_relu, (linear.args[0], linear.args[1], add.args[1]))
                new.meta = dict(relu.meta)
                new.meta["fxfuse"] = _carried(gm, linear, new, reason, device)
                relu.replace_all_uses_with(new)
                for node in (relu, add, linear):
                    gm.graph.erase_node(node)
                changed = True
                continue
        one_rounding = _rounds_once(add)
        if one_rounding:
            use_library, reason = True, HALF_REASON if meta.dtype in HALF_DTYPES else \
                f"bias in the library GEMM: no fused kernel takes {meta.dtype} (eager's addmm adds it, one rounding)"
        elif options is not None and not options.fuse:   # no kernel to take the add: the library's is free
            use_library, reason = True, "bias in the library GEMM: fuse=False (no pointwise kernel to take it)"
        else:
            use_library, reason = bias_in_library_gemm(batch, k, n, meta.dtype, device, allow_tf32, _lone(add))
        # a 1-D weight (F.linear as a matrix-vector product), K = 0 or no rows, half types: never split, never timed
        splittable = batch > 0 and k > 0 and tuple(linear.args[1].meta["tensor_meta"].shape) == (n, k) \
            and not one_rounding
        splits, split_reason = split_k_library_gemm(batch, k, n, meta.dtype, device, allow_tf32) \
            if splittable else (1, "")
        if splits > 1 and k % splits == 0:   # against the faster of both spellings: the bias stays out
            _split_k(gm, linear, splits, split_reason, device)
            changed = True
            continue
        reason = f"{reason}; {split_reason}" if split_reason else reason
        if not use_library:   # keep what earlier passes decided about this Linear (fuse_gemm's "no")
            earlier = fxfuse_meta(linear).get("decision")
            fxfuse_meta(linear)["decision"] = f"{earlier}; {reason}" if earlier else reason
            continue
        with gm.graph.inserting_before(add):
            new = gm.graph.call_function(F.linear, (linear.args[0], linear.args[1], add.args[1]))
        new.meta = dict(add.meta)
        new.meta["fxfuse"] = _carried(gm, linear, new, reason, device)
        add.replace_all_uses_with(new)
        gm.graph.erase_node(add)
        gm.graph.erase_node(linear)
        changed = True
    changed |= _conv_bias_back(gm)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _conv_bias_back(gm) -> bool:
    """normalize splits a Conv's bias into a pointwise add so that an activation's kernel takes
    it; where no pointwise op reads the sum (conv -> conv, -> pooling, -> an unfolded norm) the
    add would be a kernel of its own, a pass over the output eager does not make: the bias goes
    back into the conv call (fuzz38i)."""
    changed = False
    for conv in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in CONV_FUNCTIONS.values()]:
        add = next(iter(conv.users)) if len(conv.users) == 1 else None
        if add is None or add.target is not operator.add or add.args[0] is not conv or add.kwargs \
                or len(conv.args) < 3 or conv.args[2] is not None or conv.kwargs or not _lone(add):
            continue
        bias, out = add.args[1], conv.meta.get("tensor_meta")
        value = fetch_attr(gm, bias.target) if isinstance(bias, torch.fx.Node) and bias.op == "get_attr" else None
        nd = next(k for k, f in CONV_FUNCTIONS.items() if f is conv.target)   # batched only: an unbatched
        if not isinstance(value, torch.Tensor) or out is None or value.dtype != out.dtype \
                or len(out.shape) != nd + 2 or tuple(value.shape) != (out.shape[1],) + (1,) * nd:   # conv1d's [C, L]
            continue   # has no channel dim 1 (review38d)
        with gm.graph.inserting_before(add):
            flat = gm.graph.get_attr(register_constant(gm, bias.target, value.view(-1)))
            new = gm.graph.call_function(conv.target, (conv.args[0], conv.args[1], flat, *conv.args[3:]))
        flat.meta["tensor_meta"] = tensor_metadata(value.view(-1))
        new.meta = dict(add.meta)
        fxfuse_meta(new)["decision"] = "bias in the conv call: nothing pointwise reads the sum"
        add.replace_all_uses_with(new)
        gm.graph.erase_node(add)
        gm.graph.erase_node(conv)
        changed = True
    return changed
