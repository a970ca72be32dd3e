"""Stop 39: tracing and the user's Python state (module-level values read through helper modules).
Numerics and fusion: test_fuzz39.py."""
import types

import pytest
import torch
from torch import nn

import fxfuse

HELPERS = '''
import torch
TABLE = torch.zeros(8)
TABLE.add_(torch.arange(8.))          # written once, at import
def scale(x):
    return x * TABLE
def scale_and_write(x):
    TABLE.mul_(1.0)                   # a write on every call: a written constant of the trace
    return x * TABLE
'''


def _model(call: str) -> nn.Module:
    """A model whose forward reads a helper module's function (`helpers.scale(x)`), as a model in a
    file importing its project's utilities does."""
    helpers = types.ModuleType("fxfuse_test_helpers39")
    exec(HELPERS, helpers.__dict__)
    scope = {"__name__": "fxfuse_test_models39", "torch": torch, "nn": nn, "helpers": helpers}
    exec(f"class ReadsAHelperModule(nn.Module):\n    def forward(self, x):\n"
         f"        return torch.relu(helpers.{call}(x)) + 1\n", scope)
    return scope["ReadsAHelperModule"]().eval()


def test_a_tensor_written_at_import_and_read_through_a_helper_module_is_optimized():
    # the helper module's TABLE was not among the tensors the model holds, so its version (moved at import)
    # counted as a write of the trace (stop 38's note: refused as "writes in place into a tensor it makes
    # from constants")
    model = _model("scale")
    opt = fxfuse.optimize(model, torch.randn(3, 8), strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] >= 1
    for _ in range(2):
        x = torch.randn(3, 8)
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)


def test_a_helper_module_function_that_writes_its_table_on_every_call_is_still_refused():
    with pytest.raises(fxfuse.UnsupportedError, match="writes in place"):
        fxfuse.optimize(_model("scale_and_write"), torch.randn(3, 8), strict=True)


def test_the_aliasing_guard_knows_a_helper_modules_table():
    # a forward writing its input in place, called with the helper module's own table: eager writes the
    # table first, then reads it; the graph holds it as a constant
    helpers = types.ModuleType("fxfuse_test_helpers39b")
    exec(HELPERS, helpers.__dict__)
    scope = {"__name__": "fxfuse_test_models39", "torch": torch, "nn": nn, "helpers": helpers}
    exec("class WritesItsInput(nn.Module):\n    def forward(self, x):\n        x.mul_(2)\n"
         "        return torch.relu(helpers.scale(x)) + 1\n", scope)
    model = scope["WritesItsInput"]().eval()
    opt = fxfuse.optimize(model, torch.randn(8))
    with pytest.warns(fxfuse.FxfuseWarning, match="share memory"):
        got = opt(helpers.TABLE)
    helpers.TABLE.copy_(torch.arange(8.))
    torch.testing.assert_close(got, model(helpers.TABLE))
