"""What the in-place ops normalize kept may write (an input, a parameter, a view: no functional
form), so fusion keeps every read of those values on its side of the write. Used by
passes/fuse_pointwise.py and the passes that must not move such reads (hoist_permutes, sink_views, ...)."""
import operator

import torch
import torch.fx

from fxfuse.data_dependent import op_name
from fxfuse.state_writes import schema_writes
from fxfuse.tracing import fetch_attr

from .normalize import _reads_without_alias


def _kept_writes(gm) -> list:
    """The in-place ops normalize kept (on an input, a parameter, a view: no functional form)."""
    kept = set(gm.meta.get("fxfuse_inplace_kept", []))
    return [n for n in gm.graph.nodes if n.name in kept]


def _may_alias(gm, node, kept) -> bool:
    """Whether node's result may share storage with one of its inputs (a view, an in-place op,
    an op nothing says is fresh)."""
    return node in kept or node.op in ("call_function", "call_method", "call_module") \
        and not _reads_without_alias(gm, node)


def _attribute_groups(gm) -> dict:
    """get_attr node -> every get_attr node over the same storage: each read of `self.c` traces
    to a node of its own (and a tied weight has two names), and a write through one is a write
    into all."""
    groups = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                value = fetch_attr(gm, n.target)
            except AttributeError:
                value = None
            key = value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else n.target
            groups.setdefault(key, []).append(n)
    return {n: nodes for nodes in groups.values() for n in nodes}


def _written_operands(write) -> list:
    """The nodes an in-place op writes: its schema's written arguments (else its first), and `out=`."""
    written = schema_writes(write) or ([write.args[0]] if write.args else [])
    written += [write.kwargs["out"]] if write.kwargs.get("out") is not None else []
    return [w for w in written if isinstance(w, torch.fx.Node)]


def _aliases(gm, write, kept, attributes) -> set:
    """Nodes whose value may share storage with what `write` writes: the written operand (and
    an `out=` tensor), the op's own result, and, transitively, what those are views of, what is
    a view of them, and other reads of the same attribute (`attributes`: _attribute_groups)."""
    written = _written_operands(write)
    out, stack = {write}, written or list(write.all_input_nodes)
    stack += [u for u in write.users if _may_alias(gm, u, kept)]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        if n in kept and op_name(n) != "set_":   # another in-place op: its result is what it writes, not what
            stack.extend(_written_operands(n) or n.all_input_nodes)   # it reads (fuzz44a: `b[:, 1:] += x[:, :-1]`
            #   held x back); h.set_(g) makes h g's alias (review44h)
        elif _may_alias(gm, n, kept):   # a slice aliases its base, not the numbers that bound it
            stack.extend([n.args[0]] if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)
                         else n.all_input_nodes)
        stack.extend(u for u in n.users if _may_alias(gm, u, kept))
        stack.extend(attributes.get(n, ()))
    return out


def write_aliases(gm) -> dict:
    """Each in-place op kept by normalize -> the values it may write (_aliases)."""
    kept = set(_kept_writes(gm))
    attributes = _attribute_groups(gm) if kept else {}
    return {w: _aliases(gm, w, kept, attributes) for w in kept}


def _mutated_values(gm, writes: dict | None = None) -> set:
    """Values an in-place op kept by normalize may write (see _aliases): an op reading one of
    them must not join a fused kernel, which would move the read across the write."""
    writes = write_aliases(gm) if writes is None else writes
    return set().union(*writes.values())


def write_order_edges(gm, writes: dict) -> list:
    """(before, after) pairs that keep every op touching a written value on its side of the
    write: the graph's data edges do not order a read of x before `x.mul_(2)` (or after it)."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    edges = []
    for write, alias in writes.items():
        for n in gm.graph.nodes:
            touches = (n in alias and n.op not in ("placeholder", "get_attr")) or any(
                a in alias for a in n.all_input_nodes)
            if n is not write and touches:
                edges.append((n, write) if order[n] < order[write] else (write, n))
    return edges
