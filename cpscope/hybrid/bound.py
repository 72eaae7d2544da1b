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
from .problem import _Problem

__all__ = ["lower_bound"]


def _needed_work(p: _Problem, t: float) -> float:
    """Least rank-seconds any plan of makespan ``t`` spends, or ``inf`` if some sequence cannot end by ``t``.

    Per sequence, the least over the CP sizes at which it runs alone within ``t`` of its work plus, when it is
    *big* there (``seq > (t − lat) / 2``: no two such sequences fit in one microbatch by ``t``), the microbatch's
    fixed part ``cp · lat`` — at most one big sequence per microbatch, so each such charge is a different
    microbatch's own."""
    ok = p.alone <= t
    lat = p.lat[:, None]
    charged = p.work + np.where(p.seq > 0.5 * (t - lat), p.cps[:, None] * lat, 0.0)
    return float(np.where(ok, charged, np.inf).min(axis=0).sum())


def _lower_bound(p: _Problem, rtol: float = 1e-4) -> float:
    critical = float(np.max(p.prefix_min[-1]))
    n = float(p.n_ranks)

    def feasible(t: float) -> bool:  # can every sequence end by t while the work needed fits in n·t?
        return _needed_work(p, t) <= n * t

    lo = max(critical, float(np.min(p.work, axis=0).sum()) / n)  # the classic bound: a valid start
    if lo <= 0.0 or feasible(lo):
        return lo
    hi = lo * 1.0625
    while not feasible(hi):  # terminates: at t ≥ every alone, the work needed is finite and fixed
        lo, hi = hi, hi * 1.25
    while hi > lo * (1.0 + rtol):  # invariant: lo infeasible, hi feasible
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return lo


def lower_bound(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[CostModel] = None, *,
                max_cp: Optional[int] = None) -> float:
    """A lower bound ``T*`` on the makespan of **any** plan (any CP sizes, variants, packing and assignment).

    With ``alone_i(cp)`` the time of sequence ``i`` alone in a microbatch at ``cp`` (fixed part included, best
    variant), ``seq_i(cp)`` its per-rank time without the fixed part and ``lat(cp)`` the least fixed part of a
    microbatch at ``cp``, a plan of makespan ``T`` runs each ``i`` at a ``cp`` with ``alone_i(cp) ≤ T`` and
    spends, per microbatch, ``cp · (Σ seq + lat)`` rank-seconds. Two sequences with ``seq > (T − lat) / 2`` at
    the same ``cp`` cannot share a microbatch, so each such *big* one brings its own ``cp · lat``. Hence the plan
    spends at least ``F(T) = Σ_i min over cp with alone_i(cp) ≤ T of cp · (seq_i(cp) + [big] · lat(cp))``, which
    fits on ``n_ranks`` ranks only if ``F(T) ≤ n_ranks · T``. ``F`` does not increase with ``T``, so ``T*``, the
    least ``T`` passing both tests, is found by bisection (returned from the infeasible side, within 1e-4
    relative). It is at least the classic ``max(Σ_i work_i(cp_min_i) / n_ranks, max_i min_cp alone_i(cp))``; the
    fixed-part charge is what makes it tight when long sequences must run at large CP sizes (their microbatches'
    ``cp − 1`` ring steps are paid by every rank that runs them).
    """
    return _lower_bound(_Problem(lengths, n_ranks, capacity, cost, max_cp))
