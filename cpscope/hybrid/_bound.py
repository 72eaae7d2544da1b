"""A lower bound on the makespan of any plan: the yardstick every planner is measured against.

Example::

    >>> one = lower_bound([4096], n_ranks=1, capacity=4096)
    >>> lower_bound([4096] * 8, n_ranks=8, capacity=4096) == one   # 8 equal sequences on 8 ranks: no better
    True
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import numpy.typing as npt

from ._problem import Cost, CpSizes, Problem

__all__ = ["lower_bound", "problem_bound"]


_DFF_K = (1, 2, 3)  # the dual feasible functions u^(k) the fixed-part charge is tried with


def _dff(x: np.ndarray, k: int) -> np.ndarray:
    """Fekete and Schepers' dual feasible function ``u^(k)`` on ``[0, 1]``: ``x`` where ``(k + 1)·x`` is an
    integer, else ``⌊(k + 1)·x⌋ / k``. Any values summing to at most 1 have images summing to at most 1."""
    y = (k + 1) * x
    fl = np.floor(y)
    return np.where(y == fl, x, fl / k)


class _Tables(NamedTuple):
    """The problem's tables with one column per distinct length (equal lengths have equal columns)."""

    alone: np.ndarray  # [K, u]
    work: np.ndarray  # [K, u]
    seq: np.ndarray  # [K, u]
    fixed: np.ndarray  # [K, 1]: cp · lat, the least fixed rank-seconds of a microbatch
    lat: np.ndarray  # [K, 1]
    count: np.ndarray  # [u]: sequences of each distinct length


def _tables(p: Problem) -> _Tables:
    first, count = p.first, p.count
    lat = p.lat[:, None]
    return _Tables(p.alone[:, first], p.work[:, first], p.seq[:, first], p.cps[:, None] * lat, lat,
                   count.astype(np.float64))


def _needed_work(tab: _Tables, t: float) -> float:
    """Least rank-seconds any plan of makespan ``t`` spends, or ``inf`` if some sequence cannot end by ``t``
    (the largest of the estimates below; each one is valid on its own).

    Per sequence, the least over the CP sizes at which it runs alone within ``t`` of its work plus a share
    ``u(x) · cp · lat`` of a microbatch's fixed part, with ``x = seq / (t − lat)`` and ``u`` a dual feasible
    function: the sequences of one microbatch have ``Σ x ≤ 1`` (they end by ``t``), so ``Σ u(x) ≤ 1`` and the
    shares never add up to more than the fixed part that microbatch pays. ``u^(1)`` charges the whole fixed part
    to *big* sequences (``x > 1/2``: two never share a microbatch); ``u^(2)``, ``u^(3)`` charge halves and thirds
    to sequences of which at most two or three fit together."""
    ok = tab.alone <= t
    if not np.all(ok.any(axis=0)):
        return np.inf
    room = t - tab.lat
    x = np.minimum(tab.seq / np.where(room > 0, room, np.inf), 1.0)  # room ≤ 0: nothing is ok there anyway
    best = 0.0
    for k in _DFF_K:
        charged = np.where(ok, tab.work + tab.fixed * _dff(x, k), np.inf)
        best = max(best, float(charged.min(axis=0) @ tab.count))
    return best


def problem_bound(p: Problem, rtol: float = 1e-4) -> float:
    critical = float(np.max(p.prefix_min[-1]))
    n = float(p.n_ranks)
    tab = _tables(p)

    def feasible(t: float) -> bool:  # can every sequence end by t while the work needed fits in n·t?
        return _needed_work(tab, t) <= n * t

    lo = max(critical, float(np.min(tab.work, axis=0) @ tab.count) / n)  # the classic bound: a valid start
    if lo <= 0.0 or feasible(lo):
        return lo
    hi = lo * 1.0625
    while not feasible(hi):  # terminates: at t ≥ every alone, the work needed is finite and fixed
        lo, hi = hi, hi * 1.25
    while hi > lo * (1.0 + rtol):  # invariant: lo infeasible, hi feasible
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return lo


def lower_bound(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[Cost] = None, *,
                max_cp: Optional[int] = None, cp_sizes: CpSizes = None) -> float:
    """A lower bound ``T*`` on the makespan of **any** plan (any allowed CP sizes, variants, packing and
    assignment, waits included).

    With ``alone_i(cp)`` the time of sequence ``i`` alone in a microbatch at ``cp`` (fixed part included, best
    variant), ``seq_i(cp)`` its per-rank time without the fixed part and ``lat(cp)`` the least fixed part of a
    microbatch at ``cp`` (the ring's ``latency · (cp − 1)`` under :class:`CostModel`), a plan of makespan ``T``
    runs each ``i`` at a ``cp`` with ``alone_i(cp) ≤ T`` and spends ``cp · (Σ seq + lat)`` rank-seconds per
    microbatch. In a microbatch the ``x_i = seq_i / (T − lat)`` add up to at most 1, so for a dual feasible
    function ``u`` (values summing to ≤ 1 map to values summing to ≤ 1) the shares ``u(x_i) · cp · lat`` never
    exceed the fixed part the microbatch pays. Hence the plan spends at least
    ``F_u(T) = Σ_i min over cp with alone_i(cp) ≤ T of cp · (seq_i(cp) + u(x_i) · lat(cp))`` rank-seconds, which
    fit on ``n_ranks`` ranks only if ``F_u(T) ≤ n_ranks · T``. ``T*`` is the least ``T`` passing these tests
    for Fekete and Schepers' ``u^(1)``, ``u^(2)``, ``u^(3)`` (``u^(1)`` charges the whole fixed part to a
    sequence with ``x > 1/2``: no two of them share a microbatch). ``F_u`` does not increase with ``T``, so ``T*``
    is found by bisection (returned from the infeasible side, within 1e-4 relative). It is at least the classic
    ``max(Σ_i min_cp work_i(cp) / n_ranks, max_i min_cp alone_i(cp))``; the fixed-part charge is what makes it
    tight when long sequences must run at large CP sizes (the ``cp − 1`` ring steps of their microbatches are
    paid by every rank that runs them).

    It holds for any set of CP sizes, nested or not: it only counts rank-seconds and the time of each sequence
    alone, and a plan whose blocks wait for each other only spends more. A smaller set of sizes (``cp_sizes``)
    can only raise it; the bound over all divisors bounds the plans over powers of two as well.

    Example::

        from cpscope.hybrid import lower_bound, plan_hybrid
        lengths = [8192, 2048, 1024, 1024, 512, 512]
        plan = plan_hybrid(lengths, n_ranks=4, capacity=4096)
        gap = plan.makespan / lower_bound(lengths, n_ranks=4, capacity=4096) - 1   # how far from optimal, at most
    """
    return problem_bound(Problem(lengths, n_ranks, capacity, cost, max_cp, cp_sizes))
