"""Stop 35: lerp, addcmul and addcdiv join fused kernels (they stayed library calls), in every spelling."""
import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # until tests/conftest.py sets it

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fxfuse  # noqa: E402

aten = torch.ops.aten


class _Three(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, a, b, c):
        return self.f(a, b, c)


SPELLINGS = {
    "lerp_number": lambda a, b, c: torch.lerp(a.relu(), b, 0.3).sigmoid(),
    "lerp_far_end": lambda a, b, c: torch.lerp(a, b * 2, 0.75) * 3,
    "lerp_negative": lambda a, b, c: torch.lerp(a, b, -0.7) + 1,
    "lerp_tensor_weight": lambda a, b, c: torch.lerp(a, b, c.sigmoid() * 1.5 - 0.25) * 2,
    "lerp_method": lambda a, b, c: (a * 2).lerp(b, 0.5) - 1,
    "lerp_inplace": lambda a, b, c: (a * 2).lerp_(b, c) - 1,
    "lerp_keywords": lambda a, b, c: torch.lerp(a * 2, end=b, weight=0.1).abs(),
    "aten_lerp_scalar": lambda a, b, c: aten.lerp.Scalar(a * 2, b, 0.9).abs(),
    "aten_lerp_tensor": lambda a, b, c: aten.lerp.Tensor(a * 2, b, c).abs(),
    "addcmul": lambda a, b, c: torch.addcmul(a, b, c).relu(),
    "addcmul_value": lambda a, b, c: torch.addcmul(a, b, c, value=-0.3).relu(),
    "addcmul_method": lambda a, b, c: (a + 1).addcmul(b, c, value=2).relu(),
    "addcmul_inplace": lambda a, b, c: (a + 1).addcmul_(b, c, value=2).relu(),
    "addcdiv": lambda a, b, c: torch.addcdiv(a, b, c.abs() + 0.1, value=0.5).tanh(),
    "addcdiv_inplace": lambda a, b, c: (a * 1).addcdiv_(b, c.abs() + 0.1).tanh(),
    "aten_addcmul": lambda a, b, c: aten.addcmul.default(a * 1, b, c, value=3).tanh(),
    "broadcast": lambda a, b, c: torch.addcmul(a, b[0], c[:, :1], value=0.5).relu(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_lerp_addcmul_addcdiv_fuse_with_their_neighbours(name, dtype):
    torch.manual_seed(0)
    model = _Three(SPELLINGS[name]).eval()
    example = tuple(torch.randn(3, 5, dtype=dtype) for _ in range(3))
    opt = fxfuse.optimize(model, example, strict=True)
    assert fxfuse.stats(opt)["fused_kernels"] == 1
    assert not any(n.target in (torch.lerp, torch.addcmul, torch.addcdiv) or "lerp" in str(n.target)
                   or "addc" in str(n.target) for n in opt.specializations[next(iter(opt.specializations))].gm.graph.nodes
                   if n.op != "call_module")   # inside the kernel, not a library call
    for _ in range(2):
        args = tuple(torch.randn(3, 5, dtype=dtype) * 3 for _ in range(3))
        with torch.no_grad():
            got, want = opt(*(a.clone() for a in args)), model(*(a.clone() for a in args))
        torch.testing.assert_close(got, want, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=1e-5 if dtype ==
                                   torch.float32 else 1e-3)


def test_lerp_ends_and_special_weights_as_eager():
    """From the nearer end (ATen's Lerp.h): lerp(a, b, 1) is b exactly, lerp(a, b, 0) is a."""
    a, b = torch.randn(64) * 1e3, torch.randn(64) * 1e-3
    for w in (0.0, 1.0, 0.5, 0.49999997, -2.0, 3.0, float("inf"), float("nan")):
        model = _Three(lambda x, y, z, w=w: torch.lerp(x, y, w) + z).eval()
        z = torch.randn(64)
        opt = fxfuse.optimize(model, (a, b, z), strict=True, verify=False)
        assert fxfuse.stats(opt)["fused_kernels"] == 1
        with torch.no_grad():
            got, want = opt(a, b, z), model(a, b, z)
        exact = w in (0.0, 1.0)   # elsewhere 1 ulp: the CPU's eager kernel uses an fma, numpy does not
        torch.testing.assert_close(got, want, rtol=0 if exact else 3e-7, atol=0, equal_nan=True)
        if exact:
            torch.testing.assert_close(got, (a if w == 0.0 else b) + z, rtol=0, atol=0)


def test_deprecated_addcmul_argument_order_stays_in_the_library():
    """torch.addcmul(x, value, t1, t2) (deprecated) must not be read as (x, t1, t2, value)."""
    model = _Three(lambda a, b, c: torch.addcmul(a, 0.5, b, c).relu()).eval()
    args = tuple(torch.randn(3, 5) for _ in range(3))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch's deprecation warning
            want = model(*args)
    except (TypeError, RuntimeError):
        pytest.skip("this torch has no deprecated addcmul overload")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxfuse.optimize(model, args)
        with torch.no_grad():
            torch.testing.assert_close(opt(*args), want)
