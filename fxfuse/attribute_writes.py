"""Tensor attributes forward() assigns before it reads them: scratch values the graph writes back.

Why: Time-Series-Library's RevIN (used by PatchTST, iTransformer, TimeMixer, ...) stores the
input's statistics on itself in its 'norm' call (`self.mean = x.mean(1, keepdim=True)`) and reads
them back in its 'denorm' call later in the same forward(). Every call assigns them before it
reads them, so nothing carries over between calls, but the model holds the last call's values
afterwards. The trace records the assignment (torch.fx hands back the Proxy it stored), so the
graph already computes with them; a node at its end assigns the values to the module as eager
does (fuzz41b: the whole family was refused as "changes the module's state"). Where the trace
read the attribute's value from before the call (a get_attr of it), it is state, and refused
as before. Such a graph is not captured in a CUDA graph: its replay would run no Python.
"""
import itertools
import re
import weakref

import torch
import torch.fx

_WRITERS: dict = {}   # writer id -> (the module, weakly, the attribute's name)
_IDS = itertools.count()


def write_attribute(value, writer: int, label: str = ""):
    """The graph's write-back of one attribute (nn.Module.__setattr__, as forward()'s own).
    `label` names it in the graph's code and explain(). A Parameter arrives where the passes
    dropped the detach() forward() applied (`self.a = self.w.detach()`): eager stores a plain
    tensor, which setattr must not register as a parameter (review41b)."""
    module, name = _WRITERS[writer]
    module = module()
    if module is not None:
        setattr(module, name, value.detach() if isinstance(value, torch.nn.Parameter) else value)


torch.fx.node._side_effectful_functions.add(write_attribute)   # dead code elimination keeps it


def _forget(writer: int) -> None:
    _WRITERS.pop(writer, None)


class _Unreadable:
    """Stands for an assigned attribute while forward() is traced again (assigned_first): any use
    of it fails that trace. Its existence alone differs too (`hasattr`, `is None` of an absent one)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("fxfuse: an attribute forward() assigns was read before the assignment")

    for _name in ("__bool__", "__float__", "__int__", "__index__", "__len__", "__iter__", "__getitem__",
                  "__call__", "__array__"):   # (no __torch_function__: torch warns of one not a classmethod)
        locals()[_name] = _refuse
    for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
                "lshift", "rshift"):
        for _form in ("__{}__", "__r{}__", "__i{}__"):
            locals()[_form.format(_op)] = _refuse
    for _name in ("__neg__", "__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__", "__ge__"):
        locals()[_name] = _refuse
    del _name, _op, _form

    def __getattr__(self, name):
        raise TypeError(f"fxfuse: an attribute forward() assigns was read (.{name}) before the assignment")


_ABSENT = object()


def assigned_first(model, assigned: list, retrace, graph) -> list:
    """Those of `assigned` forward() assigns before it reads them: traced again (retrace()) with
    each set to an _Unreadable, the trace must succeed and record the same graph. A value computed
    at trace time from the earlier one (`0.9 * self.running`, a constant in the graph) is no node
    to find: this is how such a read shows."""
    saved = []
    for path, name, _ in assigned:
        module = model.get_submodule(path)
        saved.append((module, name, module.__dict__.get(name, _ABSENT)))
        module.__dict__[name] = _Unreadable()
    try:
        again = retrace()
    except Exception:  # noqa: BLE001 -- it read one: none is written back
        again = None
    finally:
        for module, name, value in saved:
            if value is _ABSENT:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
    def shape(g):   # with the arguments: a branch may differ in a constant only (review41b); torch.fx
        #             numbers its tensor constants on, trace by trace (review41c): named by their values
        return [re.sub(r"_tensor_constant\d+", lambda m: _constant_text(getattr(model, m.group(0), None)),
                       n.format_node()) for n in g.nodes]
    return assigned if again is not None and shape(again) == shape(graph) else []


def _constant_text(t) -> str:
    """A tensor constant by its values (review41d: `torch.tensor(0.5 if self.prev is None else 2.0)`)."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    flat = t.detach().reshape(-1)
    return f"tensor{tuple(t.shape)}{t.dtype}{flat[:64].tolist()}{flat.double().sum().item() if flat.numel() else 0}"


def plan_attribute_writes(gm: torch.fx.GraphModule, model: torch.nn.Module, assigned: list) -> list:
    """For each (module path, name, Proxy) of `assigned` (assigned_first's), a write_attribute
    node before the output. Returns [(module, name, snapshot label)] of those written back
    (build_state: not a change of state)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    written = []
    for path, name, proxy in assigned:
        if not isinstance(proxy, torch.fx.Proxy) or proxy.node.graph is not gm.graph or proxy.node.op == "get_attr":
            continue   # (a parameter or buffer itself assigned: eager registers it, which is state)
        module = model.get_submodule(path)
        if name in module._parameters or name in module._buffers or name in module._modules:
            continue
        writer = next(_IDS)
        _WRITERS[writer] = (weakref.ref(module), name)
        weakref.finalize(gm, _forget, writer)
        with gm.graph.inserting_before(output):
            label = f"{path or type(model).__name__}.{name}"
            gm.graph.call_function(write_attribute, (proxy.node, writer, label))
        written.append((module, name, label))
    if written:
        gm.recompile()
    return written


def writes_attributes(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is write_attribute for n in gm.graph.nodes)
