"""LPT list scheduling onto aligned blocks: tallest item first, each onto the least-loaded block, by a deadline.

Loads are integers (or floats for the baselines), updated in place; ties go to the lower block index.

Example::

    >>> import numpy as np
    >>> loads = np.zeros(2, dtype=np.int64)
    >>> lpt_prefix(loads, np.array([5, 4, 3, 2]), t_q=6).tolist(), loads.tolist()   # 3 would end at 7 > 6
    ([0, 1], [5, 4])
"""
from __future__ import annotations

import heapq

import numpy as np

__all__ = ["NO_LIMIT", "lpt_heap", "lpt_prefix"]

NO_LIMIT = np.iinfo(np.int64).max
_KEY_LIMIT = 2**62  # argsort keys load·n_blocks + block must stay below this
_HEAP_BLOCKS = 64  # below this many blocks, a heap beats numpy rounds
_SHORT_ROUND = 16  # a numpy round placing fewer items than this hands over to the heap


def lpt_heap(loads: np.ndarray, heights: np.ndarray, t_q: float) -> list[int]:
    """:func:`lpt_prefix`, one item at a time with a heap of (load, block)."""
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


def lpt_prefix(loads: np.ndarray, heights: np.ndarray, t_q: int) -> np.ndarray:
    """LPT: items (``heights`` sorted descending) one at a time onto the least-loaded block (ties: lower index),
    ``loads`` updated in place, stopping before the first item that would end after ``t_q``. Returns the blocks
    of the items placed. With many blocks it runs in numpy rounds, in which items land on the blocks in load
    order for as long as that provably equals the one-at-a-time result (a heap takes over if rounds get short)."""
    n, nb = heights.size, loads.size
    if nb <= _HEAP_BLOCKS:
        return np.asarray(lpt_heap(loads, heights, t_q), dtype=np.int64)
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
            rest = lpt_heap(loads, heights[pos:], t_q)
            out[pos:pos + len(rest)] = rest
            pos += len(rest)
            break
    return out[:pos]
