"""The Triton helpers every generated kernel module starts with (fxfuse.ops.PRELUDE): correctly
rounded division and square root, exp, tanh, rounding and the other scalar functions the
pointwise ops' expressions call."""

# Source put at the top of every generated kernel module. Division and square root are the
# correctly rounded forms (Triton's `/` and tl.sqrt are approximate on the GPU), so fp32
# results match eager to the last bits where eager itself is exact.
PRELUDE = '''
@triton.jit
def _neg_zero():
    # -0.0 from its bits: Triton (3.6, on the GPU) made a -0.0 constant +0.0
    return tl.full((), -2147483648, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _div(a, b):
    return tl.div_rn(a, b)


@triton.jit
def _sqrt(a):
    return tl.sqrt_rn(a)


@triton.jit
def _maximum(a, b):
    # nan propagates, as torch.maximum; zeros as CUDA eager (IEEE: -0 < +0, so maximum(+0, -0)
    # is +0 in either order: a + b there); no `|`: the interpreter cannot or a 0-d mask with a block
    return tl.where(a != a, a, tl.where(a == b, tl.where(a == 0, a + b, a), tl.where(a > b, a, b)))


@triton.jit
def _minimum(a, b):
    # minimum(+0, -0) is -0 in either order: -(-a + -b) there (Triton's unary minus is 0 - x)
    return tl.where(a != a, a, tl.where(a == b, tl.where(a == 0, ((a * -1.0) + (b * -1.0)) * -1.0, a),
                                        tl.where(a < b, a, b)))


@triton.jit
def _lerp(a, b, w):
    # each branch one fma, as eager (ops._fma): the fp32 product is exact in fp64
    d = (b - a).to(tl.float64)
    near_a = a.to(tl.float64) + w.to(tl.float64) * d
    near_b = b.to(tl.float64) - d * (1.0 - w).to(tl.float64)
    return tl.where(tl.abs(w) < 0.5, near_a, near_b).to(tl.float32)


@triton.jit
def _floor(x):
    # the GPU's floor flushes a subnormal x to zero first: floor(-1e-40) came out 0, not -1 (fuzz34e)
    return tl.where(x < 0, tl.where(x > -1.1754943508222875e-38, -1.0, tl.floor(x)), tl.floor(x))


@triton.jit
def _ceil(x):
    return tl.where(x > 0, tl.where(x < 1.1754943508222875e-38, 1.0, tl.ceil(x)), tl.ceil(x))


@triton.jit
def _trunc(x):
    return tl.where(x < 0, _ceil(x), _floor(x))


@triton.jit
def _round(x):
    # half to even, as torch.round (rint): r + 1 above the half, r below, at a tie whichever is
    # even; a zero result takes x's sign (round(-0.4) is -0.0); inf and nan come through
    r = _floor(x)
    d = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    out = tl.where(d > 0.5, r + 1.0, tl.where(d < 0.5, r, tl.where(odd, r + 1.0, r)))
    return tl.where(out == 0.0, x * 0.0, out)


@triton.jit
def _pow2(k):
    # 2 ** k, exact, for an integer-valued fp32 k in [-126, 127]: the exponent field written directly
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exp(x):
    # exp(x) = 2 ** n * exp(r) with r = x - n ln2 in [-0.35, 0.35] (Cody and Waite): tl.exp on the
    # GPU is ex2.approx(x * log2(e)), whose product rounds away |x| * 6e-8 of relative accuracy (13
    # ulp at x = 12, 4e-6 near 88; CUDA's expf is within 2 ulp). n ln2 is taken off in two parts,
    # the first exact in fp32 for |n| < 2 ** 9; 2 ** n is two exact factors, so results near the
    # overflow and in the subnormal range come out as eager's. Clamped beyond the range where exp
    # is finite and nonzero; a nan stays nan (the clamp's comparisons are false for it).
    xc = tl.where(x > 89.0, 89.0, tl.where(x < -104.0, -104.0, x))
    n = tl.floor(tl.where(x == x, xc, 0.0) * 1.4426950408889634 + 0.5)
    r = xc - n * 0.693145751953125
    r = r - n * 1.4286068202862268e-06
    h = tl.floor(n * 0.5)
    return tl.exp2(r * 1.4426950408889634) * _pow2(h) * _pow2(n - h)


@triton.jit
def _sigmoid(x):
    # tl.exp here, not _exp: sigmoid's result is within 1.3e-6 relative either way, and _exp's extra
    # work cost GPT-2's GELU-tanh GEMM epilogue 2% on the H100 (tanh below; stop 37's A/B)
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # tanh |x| = -m / (m + 2) with m = expm1(-2 |x|) in (-1, 0]: no cancellation, where
    # (1 - e) / (1 + e) lost up to 7.5 ulp past the series' range (fuzz36d); near 0 a short
    # series is exact to fp32 (and keeps -0.0)
    ax = tl.abs(x)
    m = _expm1_of(-2.0 * ax, tl.exp(-2.0 * ax))   # exp of a non-positive argument: tl.exp is enough (see _sigmoid)
    t = _div(-m, m + 2.0)
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 - x2 * 0.05396825396825397)))
    return tl.where(ax < 0.0625, series, tl.where(x < 0, -t, t))


@triton.jit
def _expm1(x):
    return _expm1_of(x, _exp(x))


@triton.jit
def _expm1_of(x, e):
    # e is exp(x), as accurate as the caller needs it
    # a Taylor series to x^9 below |x| = 0.5 (its first left-out term is 1e-9 of the sum), exp(x)
    # - 1 above, where it cancels at most 1.6 bits: exp(x) - 1 from |x| = 0.1 lost up to 18 ulp
    # (fuzz36d); the polynomial is evaluated from the small end
    series = x * (1.0 + x * (0.5 + x * (0.16666666666666666 + x * (0.041666666666666664 + x * (
        0.008333333333333333 + x * (0.001388888888888889 + x * (0.0001984126984126984 + x * (
            2.48015873015873e-05 + x * 2.7557319223985893e-06))))))))
    return tl.where(tl.abs(x) < 0.5, series, e - 1.0)


@triton.jit
def _log1p(x):
    u = 1.0 + x
    # log(u) * x / (u - 1) cancels the rounding of 1 + x (Goldberg's trick)
    small = tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))
    return tl.where(tl.abs(x) < 0.5, small, tl.log(u))


@triton.jit
def _softplus(x, beta, threshold):
    bx = x * beta
    return tl.where(bx > threshold, x, _log1p(_exp(bx)) / beta)
'''
