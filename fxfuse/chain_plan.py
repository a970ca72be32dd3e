"""The chain decision: which candidate runs each Linear layer of a chain, chosen for the
whole chain at once (DESIGN.md, "Cost model"; issue: decisions along the chain).

A choice at layer i changes what fuses at the boundary with layer i+1 (two Strassen layers
with the same level share one kernel between them; a fused-MLP run replaces a whole range
of layers), so plan_chain minimises the chain's total estimated time by dynamic programming
over layer boundaries, with costs from fxfuse.cost_model.CostModel, and reports for every
rejected candidate the best chain that would have used it.
"""
import functools
import math
from dataclasses import dataclass, field

from .cost_model import CANDIDATES, CostModel


@dataclass
class LayerPlan:
    choice: str                        # a candidate name
    estimates: dict                    # candidate -> Estimate (legal ones, in the chosen context)
    reasons: dict                      # candidate -> why not chosen
    segment: tuple | None = None       # for "mlp": (first, last) layer indices of the fused run
    chain_us: dict = field(default_factory=dict)   # candidate -> best total chain time with it here


@dataclass(frozen=True)
class _Unit:
    start: int
    end: int          # exclusive
    name: str


def plan_chain(model: CostModel, layers: list, legal: list, mlp_legal=None) -> list:
    """Exact minimum of the chain's total estimated time over the legal candidates.

    Dynamic programming over layer boundaries with the previous choice as state: the total is
    a sum of unit costs (a layer's body, or a whole fused-MLP run) and boundary costs (layer
    i's tail + layer i+1's head, which depend on both choices). A forward and a backward pass
    give, for every (layer, candidate), the best chain with that candidate there: the reason
    a candidate lost is stated against the chain, not against the layer alone.
    """
    n = len(layers)
    if len(legal) != n:
        raise ValueError(f"{n} layers but {len(legal)} legality dicts")
    for i, d in enumerate(legal):
        unknown = set(d) - set(CANDIDATES)
        if unknown:
            raise ValueError(f"layer {i}: unknown candidate(s) {sorted(unknown)}")
    units = [[_Unit(i, i + 1, c) for c in CANDIDATES if c != "mlp" and c in legal[i] and legal[i][c] is None]
             for i in range(n)]
    if mlp_legal is not None:
        for i in range(n):
            units[i] += [_Unit(i, j + 1, "mlp") for j in range(i, n) if mlp_legal(i, j) is None]

    @functools.lru_cache(maxsize=None)
    def unit_cost(u):
        if u.name == "mlp":
            return model.estimate_mlp(layers[u.start:u.end]).us
        return model._body(u.name, layers[u.start]).us

    @functools.lru_cache(maxsize=None)
    def edge(e, a, b):   # boundary before layer e: tail of the unit named a, head of the one named b
        tail = model._tail(a, layers[e - 1], b).us if a and a != "mlp" else 0.0
        head = model._head(b, layers[e], a).us if b and b != "mlp" else 0.0
        return tail + head

    fwd = {(0, None): (0.0, None)}   # (boundary, name of the unit ending there) -> (cost, (state, unit))
    for e in range(n):
        for (pos, a), (cost, _) in [item for item in fwd.items() if item[0][0] == e]:   # ~5 states
            for u in units[e]:
                c = cost + edge(e, a, u.name) + unit_cost(u)
                key = (u.end, u.name)
                if key not in fwd or c < fwd[key][0]:
                    fwd[key] = (c, ((pos, a), u))
    bwd = {(n, a): edge(n, a, None) for (pos, a) in fwd if pos == n}
    for e in range(n - 1, -1, -1):
        for (pos, a) in [k for k in fwd if k[0] == e]:
            bwd[(e, a)] = min((edge(e, a, u.name) + unit_cost(u) + bwd[(u.end, u.name)] for u in units[e]),
                              default=math.inf)
    ends = [k for k in fwd if k[0] == n]
    if not ends:
        raise ValueError("no plan of legal candidates covers every layer")
    final = min(ends, key=lambda k: fwd[k][0] + bwd[k])
    chosen, key = [], final
    while fwd[key][1] is not None:
        key, u = fwd[key][1]
        chosen.append(u)
    chosen.reverse()

    at = {}
    for (pos, a), (cost, _) in fwd.items():
        at.setdefault(pos, []).append((a, cost))

    def marginal(u):   # the best chain that runs u
        return min((cost + edge(u.start, a, u.name) + unit_cost(u) + bwd[(u.end, u.name)]
                    for a, cost in at.get(u.start, ())), default=math.inf)

    best_total = bwd[(0, None)]
    by_layer = {i: u for u in chosen for i in range(u.start, u.end)}
    return [_layer_plan(model, layers, legal, mlp_legal, units, by_layer, i, marginal, best_total)
            for i in range(n)]


def _layer_plan(model, layers, legal, mlp_legal, units, by_layer, i, marginal, best_total) -> LayerPlan:
    """Estimates in the chosen context, chain totals per candidate, and every "no" with its reason."""
    u = by_layer[i]
    prev = by_layer[i - 1].name if i > 0 else None
    nxt = by_layer[i + 1].name if i + 1 < len(layers) else None
    covering = [v for j in range(i + 1) for v in units[j] if v.name == "mlp" and v.end > i]
    estimates, chain, best_mlp = {}, {}, None
    for c in CANDIDATES:
        if c == "mlp" and covering:
            best_mlp = u if u.name == "mlp" else min(covering, key=marginal)
            estimates[c], chain[c] = model.estimate_mlp(layers[best_mlp.start:best_mlp.end]), marginal(best_mlp)
        elif c != "mlp" and legal[i].get(c, "x") is None:
            estimates[c] = model.estimate(c, layers[i], prev, nxt)
            chain[c] = marginal(_Unit(i, i + 1, c))
    what = f"mlp (layers {u.start}..{u.end - 1})" if u.name == "mlp" else u.name
    reasons = {}
    for c in CANDIDATES:
        if c == u.name:
            continue
        if c in estimates:
            reasons[c] = (f"est {estimates[c].us:.1f} us vs {estimates[u.name].us:.1f} us for {what}; best chain "
                          f"with {c} here {chain[c]:.1f} us vs {best_total:.1f} us")
        elif c == "mlp":
            reasons[c] = ("no fused-MLP candidate offered" if mlp_legal is None
                          else mlp_legal(i, i) or "no legal fused-MLP run covers this layer")
        else:
            reasons[c] = legal[i].get(c) or "not offered by the pass"
    segment = (u.start, u.end - 1) if u.name == "mlp" else None
    return LayerPlan(u.name, estimates, reasons, segment, chain)
