"""The process's random number streams (torch's, Python's, numpy's) kept across a build."""
import random
import sys
import threading

import torch

from .code_walk import globals_read


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
        self.generators = [(name, g, g.get_state()) for name, g in _held_generators(model)]
        self.alone = threading.active_count() == 1
        if not self.alone:
            return
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> list:
        """Put every stream back; the Python-side ones and the model's generators forward() moved, by name."""
        drawn = []
        for name, g, state in self.generators:
            if not torch.equal(g.get_state(), state):
                drawn.append(f"it draws from the torch.Generator {name}, which a graph would not draw from")
                g.set_state(state)
        if not self.alone:
            return drawn
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        moved = []
        if random.getstate() != self.python:
            moved.append("Python's random module")
            random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and _numpy_state_moved(numpy.random.get_state(), self.numpy):
            moved.append("numpy.random")
            numpy.random.set_state(self.numpy)
        return drawn + [f"it draws from {m}, whose value a traced graph would keep" for m in moved]


def _held_generators(model) -> list:
    """(name, generator) for the torch.Generators on the model's modules and in the module-level
    names its code reads."""
    if not isinstance(model, torch.nn.Module):
        return []
    found = {}
    for prefix, m in model.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Generator):
                found.setdefault(id(v), (f"{prefix}.{k}" if prefix else k, v))
    for cls in {type(m) for m in model.modules()}:
        for name, v in globals_read(cls):
            if isinstance(v, torch.Generator):
                found.setdefault(id(v), (name, v))
    return list(found.values())


def _numpy_state_moved(now, before) -> bool:
    return any((a != b).any() if hasattr(a, "any") else a != b for a, b in zip(now, before))
