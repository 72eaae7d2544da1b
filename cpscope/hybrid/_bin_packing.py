"""From a placement to a :class:`Plan`: each block's sequences packed into microbatches, with exact rank loads.

A planner decides a CP size (row of the problem's tables) and a block for every sequence; :func:`build_plan`
packs the sequences of each (CP size, block) into microbatches of at most ``capacity`` tokens per rank by first
fit (:func:`first_fit`), orders them for execution and sums the rank loads under the cost model.

Example::

    >>> first_fit([6, 5, 4, 3], capacity=10)   # bins [6, 4] and [5, 3]
    [0, 1, 0, 1]
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Optional

import numpy as np

from ._bound import problem_bound
from ._plan import Microbatch, Plan
from ._problem import Problem

__all__ = ["build_plan", "first_fit"]

logger = logging.getLogger(__name__)


def first_fit(tokens: list[int], capacity: int) -> list[int]:
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


def _finish_times(n_ranks: int, key: np.ndarray, cp: np.ndarray, block: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """When each rank finishes the microbatches listed in execution order (``key`` non-decreasing: one CP size and
    disjoint blocks per key), each starting once its last member is free.

    Example::

        >>> # 6 ranks: a CP3 microbatch on ranks 0-2 (1 s), then a CP2 one on ranks 2-3 waits for rank 2
        >>> _finish_times(6, np.array([0, 1]), np.array([3, 2]), np.array([0, 1]), np.array([1.0, 0.5])).tolist()
        [1.0, 1.0, 1.5, 1.5, 0.0, 0.0]
    """
    finish = np.zeros(n_ranks)
    cuts = np.flatnonzero(np.r_[True, np.diff(key) != 0]).tolist() + [key.size]
    for a, z in zip(cuts[:-1], cuts[1:]):
        s = int(cp[a])
        blocks, inv = np.unique(block[a:z], return_inverse=True)
        view = finish.reshape(-1, s)
        view[blocks] = (view[blocks].max(axis=1) + np.bincount(inv, weights=cost[a:z]))[:, None]
    return finish


def build_plan(p: Problem, method: str, k: np.ndarray, block: np.ndarray, decreasing: bool = True,
                lb: Optional[float] = None, microbatch_of: Optional[np.ndarray] = None,
                seg: Optional[np.ndarray] = None) -> Plan:
    """Pack each (cp, block)'s sequences into microbatches by first fit (longest first if ``decreasing``, else
    in the given order) unless ``microbatch_of`` already says which sequences share one; exact rank loads and
    finish times.

    The execution order is CP size descending, then block, unless ``seg`` gives each sequence's run segment (the
    planner's placement order where sizes do not nest): then segment, then block, and only the sequences of one
    (segment, block) run share microbatches.

    With several communication variants, a (cp, block)'s sequences are first split by the variant each prefers
    alone (``p.pref``), so a microbatch never costs more than the sum of its sequences' ``alone`` times (what
    the planners placed); each microbatch then runs the variant that is cheapest for all of it."""
    cp_seq = p.cps[k]
    lp = p.lp[k, p.rows]
    tokens = lp // cp_seq
    multi = len(p.variants) > 1
    inner = -tokens if decreasing else np.zeros_like(tokens)
    given = np.zeros(p.n, dtype=np.int64) if microbatch_of is None else microbatch_of
    pref = p.pref[k, p.rows] if multi and microbatch_of is None else np.zeros(p.n, dtype=np.int64)
    key = -cp_seq if seg is None else seg  # execution order: CP size descending, or the planner's run segments
    order = np.lexsort((p.rows, inner, given, pref, block, key))
    o_key, o_cp, o_block, o_pref, o_tok = key[order], cp_seq[order], block[order], pref[order], tokens[order]
    sub = given[order]  # microbatch index inside its (cp, block, variant) group
    new_group = np.r_[True, (np.diff(o_key) != 0) | (np.diff(o_block) != 0) | (np.diff(o_pref) != 0)]
    g_start = np.flatnonzero(new_group)
    g_end = np.r_[g_start[1:], p.n]
    if microbatch_of is None:
        too_big = np.flatnonzero(np.add.reduceat(o_tok, g_start) > p.capacity)  # groups needing several
        for a, z in zip(g_start[too_big].tolist(), g_end[too_big].tolist()):
            sub[a:z] = first_fit(o_tok[a:z].tolist(), p.capacity)
        if too_big.size:  # bring each microbatch's sequences together, keeping their order
            group_id = np.cumsum(new_group)
            regroup = np.lexsort((np.arange(p.n), sub, group_id))
            order, o_key, o_cp, o_block, o_tok, sub = (x[regroup] for x in (order, o_key, o_cp, o_block, o_tok, sub))
            o_pref = o_pref[regroup]
    starts = np.flatnonzero(np.r_[True, (np.diff(o_key) != 0) | (np.diff(o_block) != 0) | (np.diff(o_pref) != 0)
                                  | (np.diff(sub) != 0)])
    mb_cp, mb_block = o_cp[starts], o_block[starts]
    mb_level = k[order][starts]
    mb_tok = np.add.reduceat(o_tok, starts)
    if multi:  # every variant's cost of every microbatch; the cheapest allowed one runs it
        per_v = np.add.reduceat(p.seq_v[:, k[order], p.inv[order]], starts, axis=1)  # [V, microbatches]
        per_v = np.where(p.allowed[:, mb_level], per_v + p.fixed_v[:, mb_level], np.inf)
        mb_comm_i = np.argmin(per_v, axis=0)
        mb_cost = np.take_along_axis(per_v, mb_comm_i[None], axis=0)[0]
    else:
        mb_comm_i = np.zeros(starts.size, dtype=np.int64)
        mb_cost = np.add.reduceat(p.seq[k[order], order], starts) + p.lat[mb_level]
    names = np.asarray(p.variants, dtype=object)[mb_comm_i]
    namer = getattr(p.cost, "_comm_name", None)
    if namer is not None and multi:  # e.g. "a2a+p2p:4": the sub-group size the cost was computed with
        names = np.asarray([namer(v, c) for v, c in zip(names.tolist(), mb_cp.tolist())], dtype=object)
    order_l = order.tolist()
    seqs = [tuple(order_l[a:z]) for a, z in zip(starts.tolist(), starts[1:].tolist() + [p.n])]
    make = partial(tuple.__new__, Microbatch)  # Microbatch._make without its Python-level wrapper
    mbs = list(map(make, zip(mb_cp.tolist(), mb_block.tolist(), seqs, mb_tok.tolist(), mb_cost.tolist(),
                             names.tolist())))
    loads = np.zeros(p.n_ranks)
    for s in np.unique(mb_cp).tolist():
        sel = mb_cp == s
        loads += np.repeat(np.bincount(mb_block[sel], weights=mb_cost[sel], minlength=p.n_ranks // s), s)
    # nested sizes: nobody waits, a rank finishes when its work is done; else the schedule says when
    finish = loads if p.nested else _finish_times(p.n_ranks, o_key[starts], mb_cp, mb_block, mb_cost)
    plan = Plan(method=method, n_ranks=p.n_ranks, capacity=p.capacity, lengths=tuple(p.lengths.tolist()),
                cp_sizes=tuple(cp_seq.tolist()), microbatches=tuple(mbs), rank_loads=tuple(loads.tolist()),
                lower_bound=problem_bound(p) if lb is None else lb, padding_tokens=int((lp - p.lengths).sum()),
                rank_finish=tuple(finish.tolist()), cp_candidates=tuple(p.cps.tolist()))
    logger.debug("%s plan: %d seqs on %d ranks, %d microbatches, makespan %.4g (lower bound %.4g)", method, p.n,
                 p.n_ranks, len(mbs), plan.makespan, plan.lower_bound)
    return plan
