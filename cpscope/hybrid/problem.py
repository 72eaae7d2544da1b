"""The planning problem every planner reads: validated inputs, the allowed CP sizes and per-sequence tables.

:class:`_Problem` checks ``lengths`` / ``n_ranks`` / ``capacity`` / ``max_cp`` once (``ValueError`` naming the
values) and tabulates, for every allowed CP size (row) and sequence (column), the padded length, the time of
the sequence alone in a microbatch and its work in rank-seconds.

Example::

    >>> cp_candidates(24).tolist(), cp_candidates(64, max_cp=8).tolist()
    ([1, 2, 4, 8], [1, 2, 4, 8])
    >>> p = _Problem([65536, 512], n_ranks=8, capacity=16384, cost=None, max_cp=None)
    >>> p.cps[p.kmin].tolist()   # memory-minimum CP size of each sequence
    [4, 1]
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import numpy.typing as npt

from .cost import CostModel, padded_length

__all__ = ["cp_candidates"]


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
