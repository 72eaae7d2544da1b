"""The hybrid-CP planner: a CP size for every sequence of a global batch, and which CP group runs it when.

Glossary: ``n_ranks`` ranks are split, for every allowed CP size ``s`` (by default every divisor of ``n_ranks``;
see :func:`cp_candidates`), into aligned *blocks* ``[b·s, (b+1)·s)`` — the groups :func:`cpscope.new_cp_groups`
builds. A *microbatch* is a set of sequences packed in ``thd`` and run together by one block at one CP size; its
tokens per rank (``Σ padded L / cp``) must not exceed ``capacity``. Two microbatches overlap in time only if
their blocks are disjoint.

**Deadlock-free order.** A plan lists its microbatches in one global order and every rank runs its own in that
order (its members' subsequence): the first unfinished microbatch of the list always has all its members at it,
so no collective waits forever. A microbatch starts when its last member is free; the plan's makespan is the
finish time of the last rank under the cost model, waits included (``Plan.rank_finish``).

* *Nested sizes* (each divides the next: powers of two, or ``1, 3, 6, 12``): the order is CP size descending.
  Blocks nest, so the ranks of a block of size ``s`` belong to the same blocks of every size ``> s`` and have run
  exactly the same microbatches before reaching size ``s``: they arrive together, nobody ever waits, and the
  makespan is exactly the largest per-rank load.
* *Other sets* (``1, 2, 3, 4, 6, 12``): blocks of different sizes straddle each other, so a block may wait for its
  busiest member. The planner then tracks when each block can start (its last member's finish), places sequences
  where they can start first, and the order is the order in which it placed them (by run, see :class:`_Runs`).

Three planners return the same :class:`Plan`: :func:`plan_hybrid` (the planner), :func:`plan_static` and
:func:`plan_greedy` (baselines). :func:`lower_bound` bounds every plan's makespan from below.

Example::

    >>> plan = plan_hybrid([65536, 8192, 4096, 2048, 1024, 512], n_ranks=8, capacity=16384)
    >>> plan.cp_sizes[0] >= 4 and plan.makespan >= plan.lower_bound
    True
    >>> [mb.seqs for mb in plan.microbatches_for_rank(0)][0]   # rank 0 first runs the 64k sequence
    (0,)
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import numpy.typing as npt

from ._baselines import plan_greedy, plan_static
from ._bound import problem_bound, lower_bound
from ._lpt import NO_LIMIT, lpt_prefix
from ._bin_packing import build_plan
from ._plan import Microbatch, Plan
from ._problem import Cost, CpSizes, first_within, Problem, cp_candidates

# Microbatch, Plan, cp_candidates, lower_bound, plan_static and plan_greedy live in their own modules now;
# they stay importable from here.
__all__ = ["plan_hybrid"]

logger = logging.getLogger(__name__)

DEFAULT_TARGETS = (1.02, 1.035, 1.05, 1.08, 1.12, 1.2, 1.35, 1.6, 2.0, 3.0, 5.0)
_HUGE = 2**50


class _Runs:
    """Where sizes do not nest: the creation order of *runs* (a block's sequences placed with no other placement
    on its ranks in between), which is the plan's execution order. ``seg[i]`` is the run segment of sequence ``i``:
    runs of one segment are disjoint blocks of one size, created between two escalations."""

    def __init__(self, n: int) -> None:
        self.seg = np.full(n, -1, dtype=np.int64)
        self.count = 0

    def epoch(self) -> list[Optional[int]]:
        return [None]  # the segment new runs of the current epoch get, allocated when the first one starts

    def mark(self, placed: np.ndarray, blocks: np.ndarray, run: np.ndarray, epoch: list[Optional[int]]) -> None:
        fresh = run[blocks] < 0
        if fresh.any():
            if epoch[0] is None:
                epoch[0], self.count = self.count, self.count + 1
            run[blocks[fresh]] = epoch[0]
        self.seg[placed] = run[blocks]


def _phase(p: Problem, hq: np.ndarray, loads: np.ndarray, lev: int, items: np.ndarray, t_q: int,
           k: np.ndarray, block: np.ndarray, runs: Optional[_Runs], outer: bool = True
           ) -> tuple[np.ndarray, np.ndarray]:
    """Place ``items`` at size ``cps[lev]`` on top of rank ``loads``; writes ``k`` and ``block``.

    Tallest first, each to the block that can start it first (LPT) if it ends by ``t_q``. An item that does not is
    escalated at once to the next size (with the run of following items that cannot fit either), recursively.
    Items that fit at no size are returned by the escalated calls (``outer=False``) and run by the outermost call
    at its own size anyway, on the least-loaded block. Returns the new loads and those items.

    Nested sizes (``runs is None``): a block's ranks have equal loads and an escalated item runs *before* this
    phase (the CP-size-descending order), so it shifts every rank of its larger block by its height. Otherwise a
    block starts when its last member is free, its ranks all end together, and an escalated item runs *after*
    what is already placed on its ranks (the execution order is the placement order, recorded in ``runs``)."""
    s = int(p.cps[lev])
    top = lev == p.cps.size - 1
    heights = hq[lev, items]
    order = np.lexsort((items, -heights))
    items, heights = items[order], heights[order]
    neg = -heights
    start = loads.reshape(-1, s).max(axis=1)
    bl = start.copy()  # block loads: when each block can start its next item
    touched = np.zeros(bl.size, dtype=bool)  # blocks given an item in this phase (their ranks end together)
    run = np.full(bl.size, -1, dtype=np.int64)  # the segment of each block's current run (non-nested only)
    epoch = runs.epoch() if runs is not None else [None]
    left = [items[:0]]
    pos = 0

    def place(chosen: np.ndarray, got: np.ndarray) -> None:
        k[chosen], block[chosen] = lev, got
        touched[got] = True
        if runs is not None:
            runs.mark(chosen, got, run, epoch)

    while pos < items.size:
        got = lpt_prefix(bl, heights[pos:], t_q)
        place(items[pos:pos + got.size], got)
        pos += got.size
        if pos == items.size:
            break
        end = pos + int(np.searchsorted(neg[pos:], int(bl.min()) - t_q, side="left"))  # ≥ pos + 1
        failed, pos = items[pos:end], end
        if not top:
            base = _current(loads, bl, start, touched, s, runs is None)
            new_loads, failed = _phase(p, hq, base, lev + 1, failed, t_q, k, block, runs, outer=False)
            if runs is None:
                bl += (new_loads - base).reshape(-1, s)[:, 0]
            else:
                run[(new_loads != base).reshape(-1, s).any(axis=1)] = -1  # those blocks start new runs
                loads, bl = new_loads, new_loads.reshape(-1, s).max(axis=1)
                epoch = runs.epoch()
        if failed.size and not outer:
            left.append(failed)
        elif failed.size:  # fits at no size: run it at its own size anyway, on the least-loaded block
            failed = failed[np.lexsort((failed, -hq[lev, failed]))]
            place(failed, lpt_prefix(bl, hq[lev, failed], NO_LIMIT))
    return _current(loads, bl, start, touched, s, runs is None), np.concatenate(left)


def _current(loads: np.ndarray, bl: np.ndarray, start: np.ndarray, touched: np.ndarray, s: int,
             nested: bool) -> np.ndarray:
    """Rank loads after a phase's placements so far: nested, what each block gained is added to its ranks; else the
    ranks of a block given an item end with it and the others keep their own loads."""
    if nested:
        return loads + np.repeat(bl - start, s)
    return np.where(np.repeat(touched, s), np.repeat(bl, s), loads)


def _pack_to_target(p: Problem, hq: np.ndarray, hq_min: np.ndarray,
                    t_q: int) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], int]:
    """One pass of :func:`plan_hybrid` for the integer target ``t_q``: (level, block) per sequence, the run segment
    of each (``None`` for nested sizes) and the makespan (in load units; above ``t_q`` when some sequence fit
    nowhere in time)."""
    k0 = first_within(hq_min, p.fastest, t_q)
    k = k0.copy()
    block = np.zeros(p.n, dtype=np.int64)
    runs = None if p.nested else _Runs(p.n)
    loads = np.zeros(p.n_ranks, dtype=np.int64)  # nested: uniform inside every block of the current phase's size
    for lev in range(p.cps.size - 1, -1, -1):  # phases by CP size descending
        items = np.flatnonzero(k0 == lev)
        if items.size:
            loads, _ = _phase(p, hq, loads, lev, items, t_q, k, block, runs)
    return k, block, None if runs is None else runs.seg, int(loads.max())


def plan_hybrid(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[Cost] = None, *,
                max_cp: Optional[int] = None, cp_sizes: CpSizes = None,
                targets: Sequence[float] = DEFAULT_TARGETS) -> Plan:
    """Plan a global batch with a CP size per sequence, minimising the slowest rank's time.

    For a target makespan ``T = f · T*`` (``T*`` = :func:`lower_bound`, ``f`` from ``targets`` in order):

    1. every sequence takes the smallest CP size (at least its memory minimum) at which it runs alone within
       ``T`` — the least communication that can still meet ``T``;
    2. phases by CP size descending (the execution order): within size ``s``, longest sequence first, each goes
       to the least-loaded aligned block of ``s`` ranks (LPT, ties to the lower block; vectorised in rounds) if
       it ends by ``T`` there. A sequence that does not is escalated at once to the next larger CP size (shorter,
       at more communication), recursively; one that fits within ``T`` at no size runs at its original size on
       the least-loaded block. A block's load is when it can start: with nested sizes its ranks have equal
       loads before phase ``s``; otherwise it is its busiest member's finish (the others wait).
    3. the first target whose plan meets it ends the search, after one more pass halfway back to the previous
       target (the best plan found is kept); each block's sequences are then packed, longest first, into
       microbatches of ≤ ``capacity`` tokens per rank.
    4. where the allowed sizes do not nest, the search also runs over two nested subsets of them — the chain that
       always steps to the smallest multiple (``1, 2, 4, 8, 24`` of 24 ranks) and the powers of two — unless a
       subset's own lower bound already exceeds the best makespan, and the shortest plan is returned: never
       longer than the plan over the powers of two alone.

    With a :class:`~cpscope.hybrid.StepCost` the plan also chooses the communication variant per
    microbatch: a sequence's time alone is that of its best variant at each CP size (so the CP size and the
    variant are chosen together), a block's sequences are packed by the variant they prefer, and each
    microbatch runs its cheapest allowed variant — ``Microbatch.comm``, to bind with
    ``runtime_cp(group, comm=mb.comm)``.

    Deterministic (stable sorts, index tie-breaks, integer load arithmetic, no randomness): every rank computes
    the same plan from the same inputs and numpy build; otherwise compute it on one rank and broadcast it.

    Args:
        lengths: token count of every sequence of the global batch.
        n_ranks: ranks to plan over (blocks are positions in this list, as ``new_cp_groups`` splits ``ranks``).
        capacity: tokens one rank can hold in a microbatch (after padding, ``Σ padded L / cp``).
        cost: the cost model: :class:`CostModel` (the ring alone; default ``CostModel()``) or
            :class:`~cpscope.hybrid.StepCost` (a communication variant per microbatch).
        max_cp: largest CP size allowed (e.g. the GPUs of one node); default ``n_ranks``.
        cp_sizes: the CP sizes allowed: ``None`` / ``"divisors"`` (every divisor of ``n_ranks`` up to ``max_cp``),
            ``"pow2"`` (the powers of two among them) or an explicit collection. ``Plan.cp_candidates`` says what
            was allowed, ``Plan.sizes_used`` what the plan picked.
        targets: the target makespans tried, as multiples of the lower bound (increasing).

    Raises:
        ValueError: a non-positive or non-integer length, bad ``n_ranks`` / ``capacity`` / ``max_cp`` /
            ``cp_sizes``, or a sequence that fits no allowed CP size.

    Example::

        plan = plan_hybrid([8192, 2048, 1024, 1024, 512, 512], n_ranks=4, capacity=4096)  # .cp_sizes (4, 2, 1, 1, 2, 2)
        mbs = plan.microbatches_for_rank(rank)    # run each under runtime_cp(groups[mb.cp]): cpscope.train._loop
    """
    p = Problem(lengths, n_ranks, capacity, cost, max_cp, cp_sizes)
    lb = problem_bound(p)
    if lb <= 0.0:  # an all-zero cost model: any placement is optimal; spread sequences round-robin
        rank_in_level = np.zeros(p.n, dtype=np.int64)
        for lev in np.unique(p.kmin).tolist():
            sel = np.flatnonzero(p.kmin == lev)
            rank_in_level[sel] = np.arange(sel.size) % (p.n_ranks // int(p.cps[lev]))
        return build_plan(p, "hybrid", p.kmin, rank_in_level, lb=lb)
    if not targets:
        raise ValueError("plan_hybrid: targets must not be empty")
    _, k, block, seg = _search(p, lb, targets)
    plan = build_plan(p, "hybrid", k, block, lb=lb, seg=seg)
    if p.nested:
        return plan
    tried = [plan]  # straddling blocks may wait: nested subsets (which never do) compete; the shortest plan wins
    for sizes in _nested_subsets(p.cps.tolist()):
        sub = p.subset(sizes)
        lb_sub = None if sub is None else problem_bound(sub)
        if lb_sub is None or lb_sub >= min(t.makespan for t in tried):  # fits nowhere, or cannot do better
            continue
        rows = np.flatnonzero(np.isin(p.cps, sub.cps))
        _, k, block, _ = _search(sub, lb_sub, targets)  # as plan_hybrid(cp_sizes=sizes) plans
        tried.append(build_plan(p, "hybrid", rows[k], block, lb=lb))
    best = min(tried, key=lambda plan: plan.makespan)  # ties: the first (all sizes)
    logger.debug("plan_hybrid: CP sizes %s allowed; makespans %s (all sizes, then nested subsets %s); picked %s",
                 p.cps.tolist(), [t.makespan for t in tried], _nested_subsets(p.cps.tolist()), best.sizes_used)
    return best


def _search(p: Problem, lb: float, targets: Sequence[float]) -> tuple[int, np.ndarray, np.ndarray,
                                                                        Optional[np.ndarray]]:
    """The target search of :func:`plan_hybrid` on ``p``: ``(makespan, level, block, run segment)`` of the best
    pass, the makespan in units of ``lb / 2**24``."""
    unit = lb / 2.0**24  # loads in integer units: exact, order-independent sums
    hq = np.where(np.isfinite(p.alone), np.ceil(p.alone / unit), _HUGE).astype(np.int64)
    hq_min = np.minimum.accumulate(hq, axis=0)
    best: Optional[tuple[int, np.ndarray, np.ndarray, Optional[np.ndarray]]] = None
    for i, f in enumerate(targets):
        tries = [f] if i == 0 else [f, (targets[i - 1] + f) / 2.0]  # met? one more try halfway back
        for g in tries:
            t_q = int(np.floor(g * 2.0**24))
            k, block, seg, makespan_q = _pack_to_target(p, hq, hq_min, t_q)
            if best is None or makespan_q < best[0]:
                best = (makespan_q, k, block, seg)
            if makespan_q > t_q:
                break
        if best[0] <= int(np.floor(f * 2.0**24)):
            break
    assert best is not None
    return best


def _nested_subsets(sizes: list[int]) -> list[list[int]]:
    """Nested subsets of a non-nested set of CP sizes that :func:`plan_hybrid` also tries: the chain that always
    steps to the smallest multiple (``1, 2, 4, 8, 24`` of the divisors of 24: the powers of two and the top size)
    and the powers of two alone.

    Example::

        >>> _nested_subsets([1, 2, 3, 4, 6, 8, 12, 24])
        [[1, 2, 4, 8, 24], [1, 2, 4, 8]]
    """
    chain = [sizes[0]]
    for c in sizes[1:]:
        if c % chain[-1] == 0:
            chain.append(c)
    pow2 = [c for c in sizes if c & (c - 1) == 0]
    return [chain] + ([pow2] if pow2 and pow2 != chain else [])
