"""The hybrid-CP planner: a CP size for every sequence of a global batch, and which CP group runs it when.

Glossary: ``n_ranks`` ranks are split, for every CP size ``s`` (a power of two dividing ``n_ranks``), into aligned
*blocks* ``[b·s, (b+1)·s)`` — the groups :func:`cpscope.new_cp_groups` builds. A *microbatch* is a set of sequences
packed in ``thd`` and run together by one block at one CP size; its tokens per rank (``Σ padded L / cp``) must not
exceed ``capacity``.

**Deadlock-free order.** Every rank runs its microbatches by CP size *descending*, and within one size the
microbatches of its (single) block of that size in plan order. Because blocks of power-of-two sizes nest, the
ranks of a block of size ``s`` belong to the same blocks of every size ``> s``, so they have run exactly the same
microbatches before reaching size ``s``: they arrive together, no collective waits on a busy member, and the
plan's makespan is exactly the largest per-rank load (under the cost model).

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

import heapq
import logging
from dataclasses import dataclass
from functools import cached_property, partial
from typing import NamedTuple, Optional, Sequence

import numpy as np
import numpy.typing as npt

from .cost import CostModel, padded_length

__all__ = ["Microbatch", "Plan", "plan_hybrid", "plan_static", "plan_greedy", "lower_bound", "cp_candidates"]

logger = logging.getLogger(__name__)

DEFAULT_TARGETS = (1.02, 1.035, 1.05, 1.08, 1.12, 1.2, 1.35, 1.6, 2.0, 3.0, 5.0)
_HUGE = 2**50


class Microbatch(NamedTuple):
    """Sequences run together by ranks ``block·cp … (block+1)·cp − 1`` (positions in the planned rank list)."""

    cp: int
    block: int
    seqs: tuple[int, ...]  # indices into the planned ``lengths``, in packing order
    tokens_per_rank: int  # Σ padded length / cp  (≤ capacity)
    cost: float  # per-rank seconds under the cost model

    @property
    def ranks(self) -> range:
        """Positions of the member ranks (``ranks[i]`` if groups were built over a ``ranks`` list)."""
        return range(self.block * self.cp, (self.block + 1) * self.cp)


@dataclass(frozen=True, repr=False)
class Plan:
    """The result of a planner: microbatches in global execution order (CP size descending, block, packing).

    ``rank_loads[r]`` is rank ``r``'s total time; ``makespan`` its maximum; ``lower_bound`` the value of
    :func:`lower_bound` for the same inputs; ``padding_tokens`` the zigzag padding added over the batch.
    """

    method: str
    n_ranks: int
    capacity: int
    lengths: tuple[int, ...]
    cp_sizes: tuple[int, ...]
    microbatches: tuple[Microbatch, ...]
    rank_loads: tuple[float, ...]
    lower_bound: float
    padding_tokens: int

    def __repr__(self) -> str:
        return (f"Plan(method={self.method!r}, n_ranks={self.n_ranks}, sequences={len(self.lengths)}, "
                f"microbatches={len(self.microbatches)}, makespan={self.makespan:.6g}, "
                f"lower_bound={self.lower_bound:.6g})")

    @property
    def makespan(self) -> float:
        """Time at which the last rank finishes (exact under the cost model thanks to the phase order)."""
        return max(self.rank_loads)

    @cached_property
    def _by_group(self) -> dict[tuple[int, int], list[Microbatch]]:
        groups: dict[tuple[int, int], list[Microbatch]] = {}
        for mb in self.microbatches:
            groups.setdefault((mb.cp, mb.block), []).append(mb)
        return groups

    @cached_property
    def _sizes(self) -> list[int]:
        return sorted({mb.cp for mb in self.microbatches}, reverse=True)

    def microbatches_for_rank(self, rank: int) -> list[Microbatch]:
        """The ordered microbatches rank ``rank`` (a position in ``range(n_ranks)``) must run."""
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank {rank} is outside the planned ranks [0, {self.n_ranks})")
        out: list[Microbatch] = []
        for s in self._sizes:
            out.extend(self._by_group.get((s, rank // s), ()))
        return out


class _Problem:
    """Validated inputs and the ``[n_cp, n_seqs]`` tables every planner reads (row k: CP size ``cps[k]``)."""

    def __init__(self, lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[CostModel],
                 max_cp: Optional[int]) -> None:
        raw = np.asarray(lengths)
        if raw.ndim != 1 or raw.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-D sequence of ints, got shape {raw.shape}")
        if raw.dtype.kind not in "iu" and not (raw.dtype.kind == "f" and np.all(raw == np.round(raw))):
            raise ValueError(f"lengths must be integers, got dtype {raw.dtype}")
        self.lengths = raw.astype(np.int64)
        if np.any(self.lengths <= 0):
            bad = self.lengths[self.lengths <= 0][:5].tolist()
            raise ValueError(f"every sequence length must be > 0, got {bad}")
        for name, value in (("n_ranks", n_ranks), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
        if max_cp is not None and (not isinstance(max_cp, (int, np.integer)) or max_cp < 1
                                   or max_cp & (max_cp - 1)):
            raise ValueError(f"max_cp must be a power of two ≥ 1 (or None), got {max_cp!r}")
        self.n, self.n_ranks, self.capacity = self.lengths.size, int(n_ranks), int(capacity)
        self.cost = CostModel() if cost is None else cost
        self.cps = cp_candidates(self.n_ranks, max_cp)
        cps = self.cps[:, None]
        lp = padded_length(self.lengths[None, :], cps)  # [K, n]
        self.lp = lp
        fits = lp <= self.capacity * cps
        if not np.all(fits[-1]):
            i = int(np.argmin(fits[-1]))
            raise ValueError(
                f"sequence {i} of length {int(self.lengths[i])} does not fit: it needs more than the largest CP "
                f"size {int(self.cps[-1])} available with n_ranks={self.n_ranks} (max_cp={max_cp}) at a per-rank "
                f"capacity of {self.capacity} tokens; raise capacity or n_ranks, or split the sequence"
            )
        self.kmin = np.argmax(fits, axis=0)  # index of the memory-minimum CP size
        self.seq = self.cost.padded_seq_cost(lp, cps)  # no latency
        lat = self.cost.latency * (cps - 1.0)
        self.alone = np.where(fits, self.seq + lat, np.inf)  # time of the sequence alone in a microbatch
        self.work = np.where(fits, self.seq * cps, np.inf)  # rank-seconds (non-decreasing in cp)
        self.rows = np.arange(self.n)
        self.fastest = np.argmin(self.alone, axis=0)
        self.prefix_min = np.minimum.accumulate(self.alone, axis=0)  # running minimum over CP sizes


def cp_candidates(n_ranks: int, max_cp: Optional[int] = None) -> np.ndarray:
    """The CP sizes a plan may use: powers of two dividing ``n_ranks``, at most ``max_cp``."""
    sizes, s = [], 1
    while s <= n_ranks and n_ranks % s == 0 and (max_cp is None or s <= max_cp):
        sizes.append(s)
        s *= 2
    return np.asarray(sizes, dtype=np.int64)


def _first_within(prefix_min: np.ndarray, fastest: np.ndarray, target: float) -> np.ndarray:
    """Per sequence, the index of the smallest CP size whose time alone is ≤ target (else the fastest one),
    from the running minimum over CP sizes ``[K, n]`` (non-increasing, so a count finds it)."""
    k = np.count_nonzero(prefix_min > target, axis=0)
    return np.where(k == prefix_min.shape[0], fastest, k)


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


_NO_LIMIT = np.iinfo(np.int64).max
_KEY_LIMIT = 2**62  # argsort keys load·n_blocks + block must stay below this
_HEAP_BLOCKS = 64  # below this many blocks, a heap beats numpy rounds
_SHORT_ROUND = 16  # a numpy round placing fewer items than this hands over to the heap


def _lpt_heap(loads: np.ndarray, heights: np.ndarray, t_q: float) -> list[int]:
    """:func:`_lpt_prefix`, one item at a time with a heap of (load, block)."""
    heap = list(zip(loads.tolist(), range(loads.size)))
    heapq.heapify(heap)
    chosen = []
    for h in heights.tolist():
        load, b = heap[0]
        if load + h > t_q:
            break
        heapq.heapreplace(heap, (load + h, b))
        chosen.append(b)
    for load, b in heap:
        loads[b] = load
    return chosen


def _lpt_prefix(loads: np.ndarray, heights: np.ndarray, t_q: int) -> np.ndarray:
    """LPT: items (``heights`` sorted descending) one at a time onto the least-loaded block (ties: lower index),
    ``loads`` updated in place, stopping before the first item that would end after ``t_q``. Returns the blocks
    of the items placed. With many blocks it runs in numpy rounds, in which items land on the blocks in load
    order for as long as that provably equals the one-at-a-time result (a heap takes over if rounds get short)."""
    n, nb = heights.size, loads.size
    if nb <= _HEAP_BLOCKS:
        return np.asarray(_lpt_heap(loads, heights, t_q), dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    pos = 0
    while pos < n:
        if int(loads.max()) < _KEY_LIMIT // nb:
            by_load = np.argsort(loads * nb + np.arange(nb))  # unique keys: ties by block index
        else:
            by_load = np.argsort(loads, kind="stable")
        m = min(n - pos, nb)
        cur = loads[by_load[:m]]
        ends = cur + heights[pos:pos + m]
        over = np.flatnonzero(ends > t_q)
        j_fail = int(over[0]) if over.size else m
        # item j lands on by_load[j] only while that block stays below every block filled earlier this round
        stale = np.flatnonzero(cur[1:] >= np.minimum.accumulate(ends)[:-1])
        j_stale = int(stale[0]) + 1 if stale.size else m
        cnt = min(j_fail, j_stale)
        loads[by_load[:cnt]] = ends[:cnt]
        out[pos:pos + cnt] = by_load[:cnt]
        pos += cnt
        if j_fail < j_stale:  # the next item overflows even the least-loaded block
            break
        if cnt < _SHORT_ROUND and pos < n:
            rest = _lpt_heap(loads, heights[pos:], t_q)
            out[pos:pos + len(rest)] = rest
            pos += len(rest)
            break
    return out[:pos]


def _phase(p: _Problem, hq: np.ndarray, loads: np.ndarray, lev: int, items: np.ndarray, t_q: int,
           k: np.ndarray, block: np.ndarray, outer: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Place ``items`` at size ``cps[lev]`` on top of rank ``loads``; writes ``k`` and ``block``.

    Tallest first, each to the least-loaded block if it ends by ``t_q``. An item that does not is escalated at
    once to the next size (with the run of following items that cannot fit either), recursively. Items that fit
    at no size are returned by the escalated calls (``outer=False``) and run by the outermost call at its own
    size anyway, on the least-loaded block. Returns the new loads and those items."""
    s = int(p.cps[lev])
    top = lev == p.cps.size - 1
    heights = hq[lev, items]
    order = np.lexsort((items, -heights))
    items, heights = items[order], heights[order]
    neg = -heights
    start = loads.reshape(-1, s).max(axis=1)
    bl = start.copy()  # block loads; ranks inside a block differ only by what escalated items added
    left = [items[:0]]
    pos = 0
    while pos < items.size:
        got = _lpt_prefix(bl, heights[pos:], t_q)
        k[items[pos:pos + got.size]], block[items[pos:pos + got.size]] = lev, got
        pos += got.size
        if pos == items.size:
            break
        end = pos + int(np.searchsorted(neg[pos:], int(bl.min()) - t_q, side="left"))  # ≥ pos + 1
        run, pos = items[pos:end], end
        failed = run
        if not top:
            base = loads + np.repeat(bl - start, s)
            new_loads, failed = _phase(p, hq, base, lev + 1, run, t_q, k, block, outer=False)
            bl += (new_loads - base).reshape(-1, s)[:, 0]
        if failed.size and not outer:
            left.append(failed)
        elif failed.size:  # fits at no size: run it at its own size anyway, on the least-loaded block
            failed = failed[np.lexsort((failed, -hq[lev, failed]))]
            k[failed], block[failed] = lev, _lpt_prefix(bl, hq[lev, failed], _NO_LIMIT)
    return loads + np.repeat(bl - start, s), np.concatenate(left)


def _pack_to_target(p: _Problem, hq: np.ndarray, hq_min: np.ndarray,
                    t_q: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One pass of :func:`plan_hybrid` for the integer target ``t_q``: (level, block) per sequence and the
    makespan (in load units; above ``t_q`` when some sequence fit nowhere in time)."""
    k0 = _first_within(hq_min, p.fastest, t_q)
    k = k0.copy()
    block = np.zeros(p.n, dtype=np.int64)
    loads = np.zeros(p.n_ranks, dtype=np.int64)  # uniform inside every block of the current phase's size
    for lev in range(p.cps.size - 1, -1, -1):  # phases by CP size descending
        items = np.flatnonzero(k0 == lev)
        if items.size:
            loads, _ = _phase(p, hq, loads, lev, items, t_q, k, block)
    return k, block, int(loads.max())


def _first_fit(tokens: list[int], capacity: int) -> list[int]:
    """First fit of ``tokens`` (in the given order) into bins of ``capacity``; returns each item's bin."""
    if sum(tokens) <= capacity:
        return [0] * len(tokens)
    if len(tokens) <= 32:  # small: scan the open bins
        room: list[int] = []
        out = []
        for t in tokens:
            j = next((j for j, r in enumerate(room) if r >= t), len(room))
            if j == len(room):
                room.append(capacity)
            room[j] -= t
            out.append(j)
        return out
    size = 1
    while size < len(tokens):
        size *= 2
    tree = [capacity] * (2 * size)  # max remaining capacity per subtree; unused bins are full-size
    out = []
    for t in tokens:
        node = 1
        while node < size:  # leftmost bin with room (always exists: each item ≤ capacity)
            node = 2 * node if tree[2 * node] >= t else 2 * node + 1
        out.append(node - size)
        tree[node] -= t
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return out


def _build_plan(p: _Problem, method: str, k: np.ndarray, block: np.ndarray, decreasing: bool = True,
                lb: Optional[float] = None, microbatch_of: Optional[np.ndarray] = None) -> Plan:
    """Pack each (cp, block)'s sequences into microbatches by first fit (longest first if ``decreasing``, else
    in the given order) unless ``microbatch_of`` already says which sequences share one; exact rank loads."""
    cp_seq = p.cps[k]
    lp = p.lp[k, p.rows]
    tokens = lp // cp_seq
    seq_cost = p.seq[k, p.rows]
    inner = -tokens if decreasing else np.zeros_like(tokens)
    given = np.zeros(p.n, dtype=np.int64) if microbatch_of is None else microbatch_of
    order = np.lexsort((p.rows, inner, given, block, -cp_seq))
    o_cp, o_block, o_tok = cp_seq[order], block[order], tokens[order]
    sub = given[order]  # microbatch index inside its (cp, block) group
    g_start = np.flatnonzero(np.r_[True, (np.diff(o_cp) != 0) | (np.diff(o_block) != 0)])
    g_end = np.r_[g_start[1:], p.n]
    if microbatch_of is None:
        too_big = np.flatnonzero(np.add.reduceat(o_tok, g_start) > p.capacity)  # groups needing several
        for a, z in zip(g_start[too_big].tolist(), g_end[too_big].tolist()):
            sub[a:z] = _first_fit(o_tok[a:z].tolist(), p.capacity)
        if too_big.size:  # bring each microbatch's sequences together, keeping their order
            group_id = np.repeat(np.arange(g_start.size), g_end - g_start)
            regroup = np.lexsort((np.arange(p.n), sub, group_id))
            order, o_cp, o_block, o_tok, sub = (x[regroup] for x in (order, o_cp, o_block, o_tok, sub))
    starts = np.flatnonzero(np.r_[True, (np.diff(o_cp) != 0) | (np.diff(o_block) != 0) | (np.diff(sub) != 0)])
    latency = p.cost.latency
    mb_cp, mb_block = o_cp[starts], o_block[starts]
    mb_tok = np.add.reduceat(o_tok, starts)
    mb_cost = np.add.reduceat(seq_cost[order], starts) + latency * (mb_cp - 1)
    order_l = order.tolist()
    seqs = [tuple(order_l[a:z]) for a, z in zip(starts.tolist(), starts[1:].tolist() + [p.n])]
    make = partial(tuple.__new__, Microbatch)  # Microbatch._make without its Python-level wrapper
    mbs = list(map(make, zip(mb_cp.tolist(), mb_block.tolist(), seqs, mb_tok.tolist(), mb_cost.tolist())))
    loads = np.zeros(p.n_ranks)
    for s in np.unique(mb_cp).tolist():
        sel = mb_cp == s
        loads += np.repeat(np.bincount(mb_block[sel], weights=mb_cost[sel], minlength=p.n_ranks // s), s)
    plan = Plan(method=method, n_ranks=p.n_ranks, capacity=p.capacity, lengths=tuple(p.lengths.tolist()),
                cp_sizes=tuple(cp_seq.tolist()), microbatches=tuple(mbs), rank_loads=tuple(loads.tolist()),
                lower_bound=_lower_bound(p) if lb is None else lb, padding_tokens=int((lp - p.lengths).sum()))
    logger.debug("%s plan: %d seqs on %d ranks, %d microbatches, makespan %.4g (lower bound %.4g)", method, p.n,
                 p.n_ranks, len(mbs), plan.makespan, plan.lower_bound)
    return plan


def plan_hybrid(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[CostModel] = None, *,
                max_cp: Optional[int] = None, targets: Sequence[float] = DEFAULT_TARGETS) -> Plan:
    """Plan a global batch with a CP size per sequence, minimising the slowest rank's time.

    For a target makespan ``T = f · T*`` (``T*`` = :func:`lower_bound`, ``f`` from ``targets`` in order):

    1. every sequence takes the smallest CP size (at least its memory minimum) at which it runs alone within
       ``T`` — the least communication that can still meet ``T``;
    2. phases by CP size descending (the execution order): within size ``s``, longest sequence first, each goes
       to the least-loaded aligned block of ``s`` ranks (LPT, ties to the lower block; vectorised in rounds) if
       it ends by ``T`` there. A sequence that does not is escalated at once to the next larger CP size (shorter,
       at more communication), recursively; one that fits within ``T`` at no size runs at its original size on
       the least-loaded block. Before phase ``s`` the ranks of a block have equal loads, so a phase only tracks
       block loads.
    3. the first target whose plan meets it ends the search, after one more pass halfway back to the previous
       target (the best plan found is kept); each block's sequences are then packed, longest first, into
       microbatches of ≤ ``capacity`` tokens per rank.

    Deterministic (stable sorts, index tie-breaks, integer load arithmetic, no randomness): every rank computes
    the same plan from the same inputs and numpy build; otherwise compute it on one rank and broadcast it.

    Args:
        lengths: token count of every sequence of the global batch.
        n_ranks: ranks to plan over (blocks are positions in this list, as ``new_cp_groups`` splits ``ranks``).
        capacity: tokens one rank can hold in a microbatch (after padding, ``Σ padded L / cp``).
        cost: the cost model (default :class:`CostModel` ``()``).
        max_cp: largest CP size allowed (e.g. the GPUs of one node); default ``n_ranks``' largest power of two.
        targets: the target makespans tried, as multiples of the lower bound (increasing).

    Raises:
        ValueError: a non-positive or non-integer length, bad ``n_ranks`` / ``capacity`` / ``max_cp``, or a
            sequence that fits no allowed CP size.
    """
    p = _Problem(lengths, n_ranks, capacity, cost, max_cp)
    lb = _lower_bound(p)
    if lb <= 0.0:  # an all-zero cost model: any placement is optimal; spread sequences round-robin
        rank_in_level = np.zeros(p.n, dtype=np.int64)
        for lev in np.unique(p.kmin).tolist():
            sel = np.flatnonzero(p.kmin == lev)
            rank_in_level[sel] = np.arange(sel.size) % (p.n_ranks // int(p.cps[lev]))
        return _build_plan(p, "hybrid", p.kmin, rank_in_level, lb=lb)
    unit = lb / 2.0**24  # loads in integer units: exact, order-independent sums
    hq = np.where(np.isfinite(p.alone), np.ceil(p.alone / unit), _HUGE).astype(np.int64)
    hq_min = np.minimum.accumulate(hq, axis=0)
    if not targets:
        raise ValueError("plan_hybrid: targets must not be empty")
    best: Optional[tuple[int, np.ndarray, np.ndarray]] = None
    n_try = 0
    for i, f in enumerate(targets):
        tries = [f] if i == 0 else [f, (targets[i - 1] + f) / 2.0]  # met? one more try halfway back
        for g in tries:
            t_q = int(np.floor(g * 2.0**24))
            k, block, makespan_q = _pack_to_target(p, hq, hq_min, t_q)
            n_try += 1
            if best is None or makespan_q < best[0]:
                best = (makespan_q, k, block)
            if makespan_q > t_q:
                break
        if best[0] <= int(np.floor(f * 2.0**24)):
            break
    assert best is not None
    logger.debug("plan_hybrid: %d passes, makespan %.4g × lower bound", n_try, best[0] / 2.0**24)
    return _build_plan(p, "hybrid", best[1], best[2], lb=lb)


def plan_static(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[CostModel] = None, *,
                cp: Optional[int] = None) -> Plan:
    """Baseline: static CP — every sequence at one CP size ``cp``.

    ``cp`` defaults to the smallest allowed size that fits the longest sequence (the memory need of the batch).
    All sequences are packed, longest first, into microbatches of at most ``capacity`` tokens per rank
    (first-fit decreasing over the whole batch); the microbatches are then assigned by LPT (costliest first, to
    the least-loaded of the ``n_ranks / cp`` groups); a group runs its microbatches in packing order.

    Raises:
        ValueError: as :func:`plan_hybrid`, or a ``cp`` that is not allowed or too small for the longest sequence.
    """
    p = _Problem(lengths, n_ranks, capacity, cost, None)
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
    bins = np.asarray(_first_fit(tokens[order].tolist(), p.capacity), dtype=np.int64)
    n_bins = int(bins.max()) + 1
    bin_of = np.empty(p.n, dtype=np.int64)
    bin_of[order] = bins
    bin_cost = np.bincount(bin_of, weights=p.seq[ks], minlength=n_bins) + p.cost.latency * (s - 1)
    by_cost = np.lexsort((np.arange(n_bins), -bin_cost))  # LPT: costliest microbatch first
    bin_block = np.empty(n_bins, dtype=np.int64)
    bin_block[by_cost] = _lpt_heap(np.zeros(p.n_ranks // s), bin_cost[by_cost], np.inf)
    return _build_plan(p, "static", k, bin_block[bin_of], microbatch_of=bin_of)


def plan_greedy(lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[CostModel] = None, *,
                max_cp: Optional[int] = None) -> Plan:
    """Baseline: plain greedy — each sequence at its memory-minimum CP size, taken in the given order and put
    on the aligned block whose most-loaded rank is least loaded; each block's sequences are packed by first fit
    in the given order."""
    p = _Problem(lengths, n_ranks, capacity, cost, max_cp)
    loads = np.zeros(p.n_ranks)
    block = np.empty(p.n, dtype=np.int64)
    sizes, costs = p.cps[p.kmin].tolist(), p.alone[p.kmin, p.rows].tolist()
    for i, (s, c) in enumerate(zip(sizes, costs)):
        b = int(np.argmin(loads.reshape(-1, s).max(axis=1))) if s > 1 else int(np.argmin(loads))
        loads[b * s:(b + 1) * s] += c
        block[i] = b
    return _build_plan(p, "greedy", p.kmin, block, decreasing=False)
