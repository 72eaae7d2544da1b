"""A lower bound on the makespan of any plan: the yardstick every planner is measured against.

Example::

    >>> one = lower_bound([4096], n_ranks=1, capacity=4096)
    >>> lower_bound([4096] * 8, n_ranks=8, capacity=4096) == one   # 8 equal sequences on 8 ranks: no better
    True
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import numpy.typing as npt

from .cost import CostModel
from .problem import _first_within, _Problem

__all__ = ["lower_bound"]


def _lower_bound(p: _Problem, rtol: float = 1e-4) -> float:
    critical = float(np.max(p.prefix_min[-1]))
    n = float(p.n_ranks)

    def feasible(t: float) -> bool:  # can every sequence run within t while total work fits in n·t?
        return float(p.work[_first_within(p.prefix_min, p.fastest, t), p.rows].sum()) <= n * t

    lo = max(critical, float(p.work[p.kmin, p.rows].sum()) / n)
    if lo <= 0.0 or feasible(lo):
        return lo
    hi = max(critical, float(p.work[_first_within(p.prefix_min, p.fastest, critical), p.rows].sum()) / n)
    while hi > lo * (1.0 + rtol):  # invariant: lo infeasible, hi feasible
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return lo


def lower_bound(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[CostModel] = None, *,
                max_cp: Optional[int] = None) -> float:
    """A lower bound ``T*`` on the makespan of **any** plan (any CP sizes, packing and assignment).

    With ``alone_i(cp)`` the time of sequence ``i`` alone at ``cp`` and ``work_i(cp) = cp · seq_cost_i(cp)`` its
    rank-seconds (non-decreasing in ``cp``), a plan of makespan ``T`` must run each ``i`` at a ``cp`` with
    ``alone_i(cp) ≤ T``, so its total work is at least ``F(T) = Σ_i work_i(smallest such cp)``, and that work
    fits on ``n_ranks`` ranks only if ``F(T) ≤ n_ranks · T``. ``T*`` is the least ``T`` passing both tests,
    found by bisection (returned from the infeasible side, within 1e-4 relative). It is at least the classic
    ``max(Σ_i work_i(cp_min_i) / n_ranks, max_i min_cp alone_i(cp))``. Microbatch latency is left out of the
    work (packing shares it), so the bound is valid for every packing.
    """
    return _lower_bound(_Problem(lengths, n_ranks, capacity, cost, max_cp))
