"""Stop 40: the user's Python state. Dict memos are left as the check's eager run on the example
filled them (module_state._restore_container, build_state.kept_state)."""
import copy
import warnings

import torch
from torch import nn

import fxfuse
from fxfuse.runtime import OptimizedModule

from conftest import optimize_warned


class ArgumentMemo(nn.Module):
    """A memo keyed by a constant and filled from a non-tensor argument: eager keeps the first
    call's value for every later call."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x, scale: float = 1.0):
        if "s" not in self.cache:
            self.cache["s"] = torch.full((x.shape[-1],), scale)
        return torch.relu(x * self.cache["s"]) + 1


def test_a_dict_memo_filled_from_an_argument_keeps_the_examples_value():
    # before: the dict was emptied after each build, so the build for scale=3.0 filled it with 3.0
    # where eager (called on the example first) keeps 2.0: |opt - eager| = 1.8, silently
    model = ArgumentMemo().eval()
    example = (torch.randn(3, 5), 2.0)
    eager = copy.deepcopy(model)
    opt, messages = optimize_warned(model, example)
    assert isinstance(opt, OptimizedModule) and not messages
    assert torch.equal(model.cache["s"], torch.full((5,), 2.0))   # as after one eager call on the example
    eager(*example)
    for scale in (2.0, 3.0, 3.0):
        x = torch.randn(3, 5)
        torch.testing.assert_close(opt(x, scale), eager(x, scale))
    assert fxfuse.stats(opt)["specializations"] == 2 and fxfuse.stats(opt)["fused_kernels"] >= 1
    assert sum(s.calls for s in opt._specializations.values()) == 3


class RandomMemo(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        if "noise" not in self.cache:
            self.cache["noise"] = torch.randn(x.shape[-1])
        return x + self.cache["noise"]


def test_a_dict_memo_drawn_at_random_is_state():
    # before: optimized, and the graph drew new noise on every call where eager keeps the first draw
    model = RandomMemo().eval()
    opt, messages = optimize_warned(model, torch.randn(3, 5))
    assert opt is model and len(messages) == 1 and "state" in messages[0] and "cache" in messages[0]
    assert model.cache == {}


class MemoAndHistory(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache, self.history = {}, []

    def forward(self, x):
        if "ramp" not in self.cache:
            self.cache["ramp"] = torch.arange(x.shape[-1], dtype=x.dtype)
        self.history.append(1)
        return torch.relu(x) + self.cache["ramp"]


def test_a_refused_build_puts_its_memos_back_too():
    model = MemoAndHistory().eval()
    opt, messages = optimize_warned(model, torch.randn(3, 5))
    assert opt is model and len(messages) == 1 and "history" in messages[0]
    assert model.cache == {} and model.history == []


def test_without_verify_the_memo_is_put_back():
    model = ArgumentMemo().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxfuse.optimize(model, (torch.randn(3, 5), 2.0), verify=False)
    assert isinstance(opt, OptimizedModule) and model.cache == {}
    x = torch.randn(3, 5)
    torch.testing.assert_close(opt(x, 2.0), ArgumentMemo()(x, 2.0))


class MemoAndWrittenArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x, seen: list):
        if "s" not in self.cache:
            self.cache["s"] = torch.full((x.shape[-1],), 2.0)
        seen.append(1)   # refused after the build's state check had kept the memo
        return torch.relu(x * self.cache["s"])


def test_a_build_refused_after_the_state_check_puts_the_memo_back():
    model = MemoAndWrittenArgument().eval()
    opt, messages = optimize_warned(model, (torch.randn(3, 5), []))
    assert opt is model and len(messages) == 1 and "writes into a list" in messages[0]
    assert model.cache == {}   # before (this stop): the example's memo stayed


class MemoThroughEvalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache, self.drop = {}, nn.Dropout(0.1)

    def forward(self, x):
        if "scale" not in self.cache:
            self.cache["scale"] = self.drop(torch.linspace(1.0, 2.0, x.shape[-1]))   # eval: no draw
        return torch.relu(x) * self.cache["scale"]


def test_a_memo_computed_through_dropout_in_eval_is_no_random_draw():
    # before (this stop): refused as state ("dropout" by name)
    model = MemoThroughEvalDropout().eval()
    opt, messages = optimize_warned(model, torch.randn(3, 5))
    assert isinstance(opt, OptimizedModule) and not messages
    x = torch.randn(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
