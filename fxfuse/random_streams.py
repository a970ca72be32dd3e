"""The process's random number streams (torch's, Python's, numpy's) kept across a build."""
import random
import sys
import threading

import torch

from .code_walk import globals_read
from .module_state import WEAK_PROXIES


class RandomStreams:
    """torch's, Python's and numpy's global random states. A build runs forward() several times
    (trace, verify, probes): without this, optimize() would move the caller's streams (a seeded
    run then draws other numbers than eager), and a draw from Python's `random` (a random flip at
    test time) would be frozen into the graph as the value the trace drew. torch's random ops
    are graph nodes that draw again on every call; Python's and numpy's are not: refused.
    Only while this is the process's one thread: the streams are the process's, and another
    thread's draws would be rewound (repeated) and read as forward()'s."""

    def __init__(self, model=None):
        # a torch.Generator of the model's own (an attribute, a module-level one its code reads): its
        # draws are the model's, not another thread's; the build's forward() runs moved it (review39b)
        self.generators = []
        for name, g in _held_generators(model):
            try:
                self.generators.append((name, g, _state(g)))
            except (NotImplementedError, TypeError, ValueError):   # random.SystemRandom keeps no state
                pass
        self.alone = threading.active_count() == 1
        if not self.alone:
            return
        self.torch = torch_states()
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> list:
        """Put every stream back; the Python-side ones and the model's generators forward() moved, by name."""
        drawn = []
        for name, g, state in self.generators:
            if _moved(_state(g), state):
                kind = "torch.Generator" if isinstance(g, torch.Generator) else type(g).__name__
                drawn.append(f"it draws from the {kind} {name}, which a graph would not draw from")
                _set_state(g, state)
        if not self.alone:
            return drawn
        set_torch_states(self.torch)
        moved = []
        if random.getstate() != self.python:
            moved.append("Python's random module")
            random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and _numpy_state_moved(numpy.random.get_state(), self.numpy):
            moved.append("numpy.random")
            numpy.random.set_state(self.numpy)
        return drawn + [f"it draws from {m}, whose value a traced graph would keep" for m in moved]


def _generator_types() -> tuple:
    numpy = sys.modules.get("numpy")
    extra = (numpy.random.Generator, numpy.random.RandomState) if numpy is not None else ()
    return (torch.Generator, random.Random, *extra)


def _state(g):
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        return g.getstate()
    return g.bit_generator.state if hasattr(g, "bit_generator") else g.get_state()   # numpy's two kinds


def _set_state(g, state) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, random.Random):
        g.setstate(state)
    elif hasattr(g, "bit_generator"):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _moved(now, before) -> bool:
    if isinstance(now, torch.Tensor):
        return not torch.equal(now, before)
    if isinstance(now, dict):   # numpy Generator: nested dicts of ints (and arrays for some bit generators)
        return repr(now) != repr(before)
    return _numpy_state_moved(now, before) if isinstance(now, tuple) and len(now) == 5 and \
        isinstance(now[0], str) else now != before


def _held_generators(model) -> list:
    """(name, generator) for the random generators (torch's, Python's random.Random, numpy's) on the
    model's modules and in the module-level names its code reads: a build's runs of forward() must
    not move them (review39c: a random.Random was advanced)."""
    if not isinstance(model, torch.nn.Module):
        return []
    found, kinds = {}, _generator_types()
    for prefix, m in model.named_modules():
        for k, v in vars(m).items():
            if type(v) not in WEAK_PROXIES and isinstance(v, kinds):   # isinstance() of a dead proxy raises
                found.setdefault(id(v), (f"{prefix}.{k}" if prefix else k, v))
    for cls in {type(m) for m in model.modules()}:
        for name, v in globals_read(cls):
            if isinstance(v, kinds):
                found.setdefault(id(v), (name, v))
    return list(found.values())


def _numpy_state_moved(now, before) -> bool:
    return any((a != b).any() if hasattr(a, "any") else a != b for a, b in zip(now, before))


def torch_states() -> tuple:
    """torch's default generators' states: the CPU one, and each CUDA device's where CUDA is initialized."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return (torch.get_rng_state(), *cuda)


def set_torch_states(states: tuple) -> None:
    """Put torch's default generators back to torch_states()."""
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(list(states[1:]))


def refuse_frozen_draws(before: tuple, gm, model, retrace) -> None:
    """symbolic_trace runs a random factory whose arguments are no traced values (`torch.rand(4, 8)`,
    `torch.rand(())`, `torch.empty(4).uniform_()`) on the spot, and the graph keeps that draw as a
    constant: every call then added the same noise, and a branch on `torch.rand(()) < 0.5` took one
    way for ever (fuzz46g: silently wrong; verify passed, as it starts from the trace's state). A trace
    that moved torch's default generators (since `before`, torch_states) raises TraceError, with the
    generators put back: torch.export records such draws as nodes. Only while this is the process's
    one thread (another thread's draws would read as the trace's, and be rewound: RandomStreams), and
    not where each constant the graph holds stays held by a module after the trace and a second trace
    (`retrace`) draws nothing: a `functools.cached_property` that drew once is a memo eager reads
    too (review46i: not beside a random branch, which draws again)."""
    from .errors import TraceError
    now = torch_states()
    if threading.active_count() != 1 or all(torch.equal(a, b) for a, b in zip(now, before)):
        return
    constants = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"
                 and n.target.startswith("_tensor_constant")]
    held = {id(v) for m in model.modules() for k, v in vars(m).items() if not k.startswith("_tensor_constant")} \
        if isinstance(model, torch.nn.Module) else set()   # (torch.fx sets its constants on the root too)
    if constants and all(id(c) in held for c in constants):
        retrace()
        if all(torch.equal(a, b) for a, b in zip(torch_states(), now)):
            return
    set_torch_states(before)
    raise TraceError("forward() draws random numbers at trace time (a random factory or in-place fill that reads "
                     "no input, such as torch.rand(4, 8)): torch.fx would keep that one draw")
