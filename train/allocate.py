"""Per-layer sparsity budgets: which fraction of each (layer, site)'s channels to drop.

Each unit (layer, site) at level s costs an estimated NLL per token (`train.thresholds`,
from the dense model or from an operating point: the second-order term plus the first-order one where it is positive, made non-decreasing
in s; a negative first-order term is as likely the calibration text's noise as a real
gain, and trusting it would make a unit free at every level) and skips
the bytes of the matmuls that read the site. For a price lambda every unit takes the level
that maximises lambda * bytes - cost; raising lambda traces a path from dense to sparse
(`allocation_path`). `search` then walks that path with the real scorer on search text and
keeps the sparsest allocation whose measured perplexity cost stays within the budget.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dejavu_jax import activation_sparsity as act
from dejavu_jax.config import ModelConfig


def site_bytes(config: ModelConfig, sites) -> np.ndarray:
    """Weight elements [len(SITES)] one layer skips per unit of each site's level: the
    matmuls that read the site's channels (the up projection follows the gate site when
    there is one, else the gate_up site's channels). Sites not in `sites` skip nothing.
    The allocation treats the sites as independent, so with both the gate and the down
    site a down row is credited to each (the measured skip counts it once)."""
    m = act.matmul_elements(config)
    gate_site = "gate" in sites
    sizes = {"qkv": m["qkv"], "o": m["o"],
             "gate_up": m["gate"] + (0 if gate_site else m["up"]),
             "gate": m["up"] + m["down"] if gate_site else 0, "down": m["down"]}
    return np.asarray([sizes[s] if s in sites else 0 for s in act.SITES], np.float64)


def unit_costs(stats: dict) -> np.ndarray:
    """[L, len(SITES), 1 + len(levels)]: each unit's estimated NLL per token at level 0 and
    at each calibration level (see the module doc), non-decreasing in the level."""
    est = (np.asarray(stats["nll_second"], np.float64)
           + np.maximum(np.asarray(stats["nll_first"], np.float64), 0.0))
    est = np.concatenate([np.zeros(est.shape[:2] + (1,)), est], axis=-1)
    return np.maximum.accumulate(est, axis=-1)


def allocation(costs: np.ndarray, levels, unit_bytes: np.ndarray, price: float,
               min_level: np.ndarray | None = None) -> np.ndarray:
    """Levels [L, len(SITES)] that maximise price * bytes - cost for every unit, over
    level 0 and `levels`, none below `min_level` [L, len(SITES)] (an operating point the
    costs are measured from)."""
    grid = np.concatenate([[0.0], np.asarray(levels, np.float64)])
    gain = price * unit_bytes[None, :, None] * grid[None, None, :] - costs
    if min_level is not None:
        gain = np.where(grid[None, None, :] >= min_level[..., None] - 1e-9, gain, -np.inf)
    return grid[np.argmax(gain, axis=-1)]


def allocation_path(costs: np.ndarray, levels, unit_bytes: np.ndarray,
                    min_level: np.ndarray | None = None, points: int = 48, prices=None):
    """[(price, levels [L, len(SITES)])] from the first price that drops anything (beyond
    `min_level`) to the one that drops every unit to its highest level, prices spaced
    geometrically (or at the given `prices`, ascending); repeated allocations are left
    out."""
    grid = np.concatenate([[0.0], np.asarray(levels, np.float64)])
    step = (unit_bytes[None, :, None] * grid[None, None, 1:])
    ratio = costs[..., 1:] / np.maximum(step, 1e-30)
    useful = np.broadcast_to(step > 0, ratio.shape)
    if min_level is not None:
        useful = useful & (grid[None, None, 1:] > min_level[..., None] + 1e-9)
    positive = ratio[useful & (ratio > 0)]
    lo = positive.min() * 0.5 if positive.size else 1e-12
    hi = ratio[useful].max() * 4 if useful.any() else 1.0
    if prices is None:
        prices = np.geomspace(lo, max(hi, lo * 10), points)
    out, seen = [], set()
    for price in prices:
        lv = allocation(costs, levels, unit_bytes, price, min_level)
        key = lv.tobytes()
        if key not in seen and lv.any():
            seen.add(key)
            out.append((float(price), lv))
    return out


def predicted_skip(config: ModelConfig, sites, lv: np.ndarray) -> float:
    """The fraction of decoder matmul bytes an allocation skips if each level's fraction
    of channels drops, independently at each site (so under the gate site the down rows
    kept are the gate's survivors that the down site keeps); the scorer measures the real
    fraction."""
    m = act.matmul_elements(config)
    kept = {s: 1.0 - (lv[:, i] if s in sites else 0.0) for i, s in enumerate(act.SITES)}
    up = kept["gate"] if "gate" in sites else kept["gate_up"]
    read = (m["qkv"] * kept["qkv"] + m["o"] * kept["o"] + m["gate"] * kept["gate_up"]
            + m["up"] * up + m["down"] * kept["down"] * kept["gate"])
    return float(1.0 - np.mean(read) / act.layer_elements(config))


@dataclasses.dataclass
class SearchPoint:
    """One allocation the search measured."""

    price: float
    levels: np.ndarray
    nll_cost: float
    bytes_skipped: float
    nll_se: float = 0.0

    def within(self, budget_nll: float, margin: float) -> bool:
        """Whether the cost, plus `margin` standard errors, is within the budget."""
        return self.nll_cost + margin * self.nll_se <= budget_nll


def search(path: list, measure, budget_nll: float, progress=None,
           margin: float = 0.0) -> tuple[int, list]:
    """The index in `path` of the sparsest allocation whose measured NLL cost (`measure`
    (levels) -> (NLL cost per token, bytes skipped[, the cost's standard error])) plus
    `margin` standard errors is at most `budget_nll`, by bisection over the path (the cost
    grows along it), and every point measured; -1 when even the first point is over."""
    measured: dict[int, SearchPoint] = {}

    def at(i):
        if i not in measured:
            measured[i] = SearchPoint(path[i][0], path[i][1], *measure(path[i][1]))
            if progress is not None:
                progress(measured[i])
        return measured[i]

    lo, hi = -1, len(path)  # invariant: lo within the budget (or -1), hi over it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid).within(budget_nll, margin):
            lo = mid
        else:
            hi = mid
    return lo, [measured[i] for i in sorted(measured)]


def refined_search(costs: np.ndarray, levels, unit_bytes: np.ndarray, measure,
                   budget_nll: float, min_level: np.ndarray | None = None, progress=None,
                   refinements: int = 3, points: int = 12, margin: float = 0.0):
    """`search` along the allocation path, then `refinements` times again along a finer
    path between the sparsest allocation within the budget and the next one, which the
    path's geometric prices can leave far apart (a few percent of the bytes). Returns
    ((price, levels) of the sparsest allocation within the budget, or None; every point
    measured)."""
    path = allocation_path(costs, levels, unit_bytes, min_level)
    best, found = search(path, measure, budget_nll, progress, margin)
    for _ in range(refinements):
        if not path or best + 1 >= len(path):
            break
        low = path[best][0] if best >= 0 else path[0][0] / 4
        prices = np.geomspace(low, path[best + 1][0], points + 2)[1:-1]
        ends = {path[i][1].tobytes() for i in (best, best + 1) if i >= 0}
        finer = [p for p in allocation_path(costs, levels, unit_bytes, min_level,
                                            prices=prices) if p[1].tobytes() not in ends]
        if not finer:
            break
        sub_best, more = search(finer, measure, budget_nll, progress, margin)
        found += more
        head = [path[best]] if best >= 0 else []
        path = head + finer + [path[best + 1]]
        best = sub_best + len(head) if sub_best >= 0 else len(head) - 1
    found.sort(key=lambda p: p.price)
    return (path[best] if best >= 0 else None), found
