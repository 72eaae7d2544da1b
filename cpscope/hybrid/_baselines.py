"""Baseline planners to measure :func:`~cpscope.hybrid.plan_hybrid` against: static CP and plain greedy.

Both return the same :class:`~cpscope.hybrid.Plan` as the planner, in the same deadlock-free order.

Example::

    >>> lengths = [65536, 8192, 4096, 2048, 1024, 512]
    >>> plan_static(lengths, n_ranks=8, capacity=16384).cp_sizes   # one CP size, set by the longest sequence
    (4, 4, 4, 4, 4, 4)
    >>> plan_greedy(lengths, n_ranks=8, capacity=16384).cp_sizes   # each sequence at its memory minimum
    (4, 1, 1, 1, 1, 1)
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import numpy.typing as npt

from ._lpt import lpt_heap
from ._bin_packing import build_plan, first_fit
from ._plan import Plan
from ._problem import Cost, CpSizes, Problem

__all__ = ["plan_static", "plan_greedy"]


def plan_static(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[Cost] = None, *,
                cp: Optional[int] = None, cp_sizes: CpSizes = None) -> Plan:
    """Baseline: static CP — every sequence at one CP size ``cp``.

    ``cp`` defaults to the smallest allowed size (one of ``cp_sizes``, as in :func:`plan_hybrid`) that fits the
    longest sequence (the memory need of the batch).
    All sequences are packed, longest first, into microbatches of at most ``capacity`` tokens per rank
    (first-fit decreasing over the whole batch); the microbatches are then assigned by LPT (costliest first, to
    the least-loaded of the ``n_ranks / cp`` groups); a group runs its microbatches in packing order.

    Raises:
        ValueError: as :func:`plan_hybrid`, or a ``cp`` that is not allowed or too small for the longest sequence.

    Example::

        from cpscope.hybrid import plan_hybrid, plan_static
        lengths = [8192, 2048, 1024, 1024, 512, 512]
        static = plan_static(lengths, n_ranks=4, capacity=4096, cp=2)   # every sequence at CP2
        gain = static.makespan / plan_hybrid(lengths, n_ranks=4, capacity=4096).makespan
    """
    p = Problem(lengths, n_ranks, capacity, cost, None, cp_sizes)
    if cp is None:
        ks = int(p.kmin.max())
    else:
        matches = np.flatnonzero(p.cps == cp)
        if matches.size == 0 or int(matches[0]) < int(p.kmin.max()):
            raise ValueError(f"plan_static: cp={cp} must be one of {p.cps.tolist()} and at least "
                             f"{int(p.cps[p.kmin.max()])} (the longest sequence's memory minimum)")
        ks = int(matches[0])
    s = int(p.cps[ks])
    k = np.full(p.n, ks, dtype=np.int64)
    tokens = p.lp[ks] // s
    order = np.lexsort((p.rows, -tokens))
    bins = np.asarray(first_fit(tokens[order].tolist(), p.capacity), dtype=np.int64)
    n_bins = int(bins.max()) + 1
    bin_of = np.empty(p.n, dtype=np.int64)
    bin_of[order] = bins
    bin_cost = np.bincount(bin_of, weights=p.seq[ks], minlength=n_bins) + p.lat[ks]  # (least variant)
    by_cost = np.lexsort((np.arange(n_bins), -bin_cost))  # LPT: costliest microbatch first
    bin_block = np.empty(n_bins, dtype=np.int64)
    bin_block[by_cost] = lpt_heap(np.zeros(p.n_ranks // s), bin_cost[by_cost], np.inf)
    return build_plan(p, "static", k, bin_block[bin_of], microbatch_of=bin_of)


def plan_greedy(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[Cost] = None, *,
                max_cp: Optional[int] = None, cp_sizes: CpSizes = None) -> Plan:
    """Baseline: plain greedy — each sequence at its memory-minimum CP size, taken in the given order and put
    on the aligned block whose most-loaded rank is least loaded; each block's sequences are packed by first fit
    in the given order (its blocks of non-nested sizes may wait for their busiest member: the plan says when each
    rank finishes).

    Example::

        from cpscope.hybrid import plan_greedy, plan_hybrid
        lengths = [8192, 2048, 1024, 1024, 512, 512]
        greedy = plan_greedy(lengths, n_ranks=4, capacity=4096)   # cp_sizes (2, 1, 1, 1, 1, 1)
        print(greedy.makespan / plan_hybrid(lengths, n_ranks=4, capacity=4096).makespan)
    """
    p = Problem(lengths, n_ranks, capacity, cost, max_cp, cp_sizes)
    loads = np.zeros(p.n_ranks)
    block = np.empty(p.n, dtype=np.int64)
    sizes, costs = p.cps[p.kmin].tolist(), p.alone[p.kmin, p.rows].tolist()
    for i, (s, c) in enumerate(zip(sizes, costs)):
        b = int(np.argmin(loads.reshape(-1, s).max(axis=1))) if s > 1 else int(np.argmin(loads))
        loads[b * s:(b + 1) * s] += c
        block[i] = b
    return build_plan(p, "greedy", p.kmin, block, decreasing=False)
