"""Strassen as data: bilinear algorithms as coefficient tables, and how to apply them in torch.

A bilinear algorithm of rank r for 2x2 blocks computes C = A @ B from r products

    M_t = (sum_i U[t, i] A_i) @ (sum_j V[t, j] B_j)        t = 0 .. r-1
    C_k = sum_t W[k, t] M_t                                 k = 0 .. 3

with blocks numbered row-major (0 = top left, 1 = top right, 2 = bottom left, 3 = bottom right).
Applying it to the blocks of the blocks (L levels) is the Kronecker product of the tables:
rank 7^L over a 2^L x 2^L grid of blocks (`levels`). Code generation (passes/strassen.py)
and the torch references below read only these tables, so another level count or another
bilinear algorithm is a new table, not new code. Entries are small integers (here -1, 0, 1),
so every combination is exact in any dtype and the tables themselves are checked exactly
(Brent's equations, and integer matrices multiplied in float64) by tests/test_strassen.py.
"""
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Bilinear:
    name: str
    U: tuple   # r x 4: left operand of each product, from A's blocks
    V: tuple   # r x 4: right operand of each product, from B's blocks
    W: tuple   # 4 x r: C's blocks from the products

    @property
    def rank(self) -> int:
        return len(self.U)


# Strassen (1969). M1 = (A11 + A22)(B11 + B22), M2 = (A21 + A22) B11, M3 = A11 (B12 - B22),
# M4 = A22 (B21 - B11), M5 = (A11 + A12) B22, M6 = (A21 - A11)(B11 + B12),
# M7 = (A12 - A22)(B21 + B22); C11 = M1 + M4 - M5 + M7, C12 = M3 + M5, C21 = M2 + M4,
# C22 = M1 - M2 + M3 + M6. Its error bound is the better one of the two variants below.
STRASSEN = Bilinear(
    "strassen",
    U=((1, 0, 0, 1), (0, 0, 1, 1), (1, 0, 0, 0), (0, 0, 0, 1), (1, 1, 0, 0), (-1, 0, 1, 0), (0, 1, 0, -1)),
    V=((1, 0, 0, 1), (1, 0, 0, 0), (0, 1, 0, -1), (-1, 0, 1, 0), (0, 0, 0, 1), (1, 1, 0, 0), (0, 0, 1, 1)),
    W=((1, 0, 0, 1, -1, 0, 1), (0, 0, 1, 0, 1, 0, 0), (0, 1, 0, 1, 0, 0, 0), (1, -1, 1, 0, 0, 1, 0)),
)

# Winograd's variant (15 additions instead of 18 when sums are shared), written out in full.
# Here every sum is formed in registers of a fused kernel, so the shared sums buy nothing; it
# is kept as the proof that another algorithm is only another table.
WINOGRAD = Bilinear(
    "winograd",
    U=((1, 0, 0, 0), (0, 1, 0, 0), (1, 1, -1, -1), (0, 0, 0, 1), (0, 0, 1, 1), (-1, 0, 1, 1), (1, 0, -1, 0)),
    V=((1, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, -1, -1, 1), (-1, 1, 0, 0), (1, -1, 0, 1), (0, -1, 0, 1)),
    W=((1, 1, 0, 0, 0, 0, 0), (1, 0, 1, 0, 1, 1, 0), (1, 0, 0, -1, 0, 1, 1), (1, 0, 0, 0, 1, 1, 1)),
)

ALGORITHMS = {a.name: a for a in (STRASSEN, WINOGRAD)}


@lru_cache(maxsize=None)
def _tables(n: int, name: str) -> tuple:
    alg = ALGORITHMS[name]
    U1, V1, W1 = (torch.tensor(t, dtype=torch.float64) for t in (alg.U, alg.V, alg.W))
    U = V = W = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(n):
        U, V, W = torch.kron(U, U1), torch.kron(V, V1), torch.kron(W, W1)
    return U, V, W


def levels(n: int, algorithm: str = "strassen") -> tuple:
    """(U, V, W) of n levels as float64 tensors: U, V [7^n, 4^n], W [4^n, 7^n].

    Column (or row of W) p numbers a block of the 2^n x 2^n grid as in `block_position`.
    n = 0 is the classical product (one block, one product).
    """
    if n < 0:
        raise ValueError(f"levels must be >= 0, got {n}")
    U, V, W = _tables(n, algorithm)
    return U.clone(), V.clone(), W.clone()


def block_position(p: int, n: int) -> tuple:
    """(row, col) in the 2^n x 2^n grid of block p of an n-level table.

    The Kronecker product numbers blocks outer level first: p = sum_l 4^(n-1-l) (2 r_l + c_l)
    with (r_l, c_l) the quadrant at level l, so row = sum_l 2^(n-1-l) r_l, same for col.
    """
    row = col = 0
    for level in range(n):
        quadrant = (p >> (2 * (n - 1 - level))) & 3
        row = 2 * row + quadrant // 2
        col = 2 * col + quadrant % 2
    return row, col


def terms(row) -> list:
    """Nonzero (index, coefficient) pairs of one table row, in index order: the summation
    order every kernel and every reference uses, so the two agree bit for bit in fp32."""
    return [(k, int(c)) if float(c).is_integer() else (k, float(c))
            for k, c in enumerate(row.tolist()) if c != 0]


def combine(blocks, row):
    """sum_k row[k] * blocks[k] in index order, starting from the first term."""
    acc = None
    for k, c in terms(row):
        if acc is None:
            acc = blocks[k] if c == 1 else (-blocks[k] if c == -1 else c * blocks[k])
        elif c == 1:
            acc = acc + blocks[k]
        elif c == -1:
            acc = acc - blocks[k]
        else:
            acc = acc + c * blocks[k]
    return acc if acc is not None else torch.zeros_like(blocks[0])


def combine_ir(b, values: list, row) -> int:
    """`combine` in the fused-kernel IR: b is an fxfuse.ir.IRBuilder, values are its value ids.
    Same terms in the same order as `combine`, so kernel and torch reference agree bit for bit
    in fp32 (the tables stay the single source of truth for both)."""
    acc = None
    for k, c in terms(row):
        v = values[k]
        if acc is None:
            acc = v if c == 1 else (b.op("neg", [v]) if c == -1 else b.op("mul", [b.const(c), v]))
        elif c == 1:
            acc = b.op("add", [acc, v])
        elif c == -1:
            acc = b.op("sub", [acc, v])
        else:
            acc = b.op("add", [acc, b.op("mul", [b.const(c), v])])
    return acc if acc is not None else b.const(0.0)


def split_blocks(t: torch.Tensor, n: int) -> list:
    """The 4^n blocks of a 2-d tensor whose sizes divide by 2^n, numbered as in `levels`."""
    s = 1 << n
    rows, cols = t.shape[0] // s, t.shape[1] // s
    out = []
    for p in range(4 ** n):
        r, c = block_position(p, n)
        out.append(t[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols])
    return out


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32, as in the kernels; float64 stays float64 (the exactness tests use it)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def prefix_ref(x2d: torch.Tensor, n: int, out_dtype=None, algorithm: str = "strassen") -> torch.Tensor:
    """The 7^n left operands [7^n, B/2^n, K/2^n] of a padded [B, K] input, formed in fp32
    (the compute type of the generated prefix kernel) and stored in out_dtype."""
    U = levels(n, algorithm)[0]
    blocks = [b.to(_compute_dtype(x2d)) for b in split_blocks(x2d, n)]
    return torch.stack([combine(blocks, U[t]) for t in range(U.shape[0])]).to(out_dtype or x2d.dtype)


def suffix_ref(products: torch.Tensor, n: int, out_dtype=None, algorithm: str = "strassen") -> torch.Tensor:
    """C [B, N] (padded sizes) from the 7^n products [7^n, B/2^n, N/2^n], formed in fp32."""
    W = levels(n, algorithm)[2]
    m = [p.to(_compute_dtype(products)) for p in products]
    s = 1 << n
    rows, cols = products.shape[1], products.shape[2]
    out = torch.empty(rows * s, cols * s, dtype=_compute_dtype(products), device=products.device)
    for k in range(W.shape[0]):
        r, c = block_position(k, n)
        out[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols] = combine(m, W[k])
    return out.to(out_dtype or products.dtype)


def right_operands(weight_t: torch.Tensor, n: int, algorithm: str = "strassen") -> torch.Tensor:
    """The 7^n right operands [7^n, K/2^n, N/2^n] of a padded [K, N] matrix, combined in
    float64 and rounded once to weight_t's dtype (done once, at optimize time)."""
    V = levels(n, algorithm)[1]
    blocks = [b.double() for b in split_blocks(weight_t, n)]
    return torch.stack([combine(blocks, V[t]) for t in range(V.shape[0])]).to(weight_t.dtype).contiguous()


def strassen_matmul(a: torch.Tensor, b: torch.Tensor, n: int, algorithm: str = "strassen") -> torch.Tensor:
    """a @ b by n levels of the algorithm with one batched product (sizes divide by 2^n)."""
    p = prefix_ref(a, n, algorithm=algorithm)
    q = right_operands(b, n, algorithm)
    return suffix_ref(torch.bmm(p, q), n, out_dtype=a.dtype, algorithm=algorithm)


def _ceil_to(n: int, s: int) -> int:
    return -(-n // s) * s


def padded_right_operands(weight: torch.Tensor, n: int, algorithm: str = "strassen") -> torch.Tensor:
    """Right operands of a Linear's weight [N, K]: W.T zero-padded to multiples of 2^n, then
    combined as in `right_operands` ([7^n, Kp/2^n, Np/2^n]). Zeros, so padding adds nothing."""
    s = 1 << n
    N, K = weight.shape
    wt = torch.nn.functional.pad(weight.detach().t(), (0, _ceil_to(N, s) - N, 0, _ceil_to(K, s) - K))
    return right_operands(wt, n, algorithm)


def strassen_linear(x2d: torch.Tensor, right: torch.Tensor, n: int, out_features: int,
                    algorithm: str = "strassen", bmm=torch.bmm) -> torch.Tensor:
    """F.linear(x2d, W) for x2d [B, K] via n levels, with `right` = padded_right_operands(W):
    zero-pad x, prefix, one bmm, suffix, slice. The torch twin of what passes/strassen.py
    builds, used by its numerics guard (bmm: the products as the built graph computes them,
    e.g. fxfuse.tf32x3.tf32x3_bmm)."""
    s = 1 << n
    B, K = x2d.shape
    xp = torch.nn.functional.pad(x2d, (0, _ceil_to(K, s) - K, 0, _ceil_to(B, s) - B))
    products = bmm(prefix_ref(xp, n, algorithm=algorithm), right)
    return suffix_ref(products, n, out_dtype=x2d.dtype, algorithm=algorithm)[:B, :out_features]


def relative_error(got: torch.Tensor, ref64: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (Frobenius) against a float64 reference; NaN where the reference
    is all zeros (a zero example input): no rounding error shows there, and the guards took
    0.0 for a pass (fuzz33f), so such an input counts as one the error cannot be measured on."""
    denom = ref64.norm().item()
    return (got.double() - ref64).norm().item() / denom if denom > 0 else float("nan")


def measure_levels(x2d: torch.Tensor, weight: torch.Tensor, max_levels: int, tolerance=None,
                   factor: float = 3.0, floor: float = 1e-5, bmm=torch.bmm) -> dict:
    """The numerics guard of one Linear on one input: the most levels (max_levels .. 1) whose
    error against float64 is within tolerance (default: factor x the classical product's
    error measured the same way, at least floor). Returns levels (0: none passed), right
    (their combined weights, to keep), and the measured errors."""
    ref64 = x2d.double() @ weight.double().t()
    classical = relative_error(torch.nn.functional.linear(x2d, weight), ref64)
    tol = tolerance if tolerance is not None else max(factor * classical, floor)
    out = {"levels": 0, "right": None, "classical_error": classical, "tolerance": tol, "errors_by_levels": {}}
    for n in range(max_levels, 0, -1):
        right = padded_right_operands(weight, n)
        err = relative_error(strassen_linear(x2d, right, n, weight.shape[0], bmm=bmm), ref64)
        out["errors_by_levels"][n] = err
        if err <= tol:
            out.update(levels=n, right=right, error=err)
            break
    return out
