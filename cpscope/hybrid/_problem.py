"""The planning problem every planner reads: validated inputs, the allowed CP sizes and per-sequence tables.

:class:`Problem` checks ``lengths`` / ``n_ranks`` / ``capacity`` / ``max_cp`` / ``cp_sizes`` once (``ValueError``
naming the values) and tabulates, for every allowed CP size (row) and sequence (column), the padded length, the time
of the sequence alone in a microbatch and its work in rank-seconds.

**CP sizes.** Any size that divides ``n_ranks`` may run: by default every divisor (at most ``max_cp``), or the set
given as ``cp_sizes`` (``"pow2"`` keeps the powers of two only). A set whose sizes each divide the next (powers of
two, or ``1, 3, 6, 12``) is *nested*: its aligned blocks nest, which the planners exploit (:attr:`Problem.nested`).

The cost is anything with ``_tables(padded [K, n], cps [K])`` returning ``(variants, seq [V, K, n], fixed [V, K],
allowed [V, K])``: per communication variant, each sequence's per-rank seconds and each microbatch's fixed
seconds (:class:`~cpscope.hybrid.CostModel` is the one-variant case, ``"p2p"``;
:class:`~cpscope.hybrid.StepCost` has one row per variant). A microbatch runs one variant; the tables
the planners read are the envelopes over the allowed variants: ``alone`` = min over v of (seq + fixed),
``seq`` = min over v of seq and ``lat`` = min over v of fixed, and ``pref`` the variant that gives ``alone``.

Example::

    >>> cp_candidates(24).tolist(), cp_candidates(24, cp_sizes="pow2").tolist(), cp_candidates(64, max_cp=8).tolist()
    ([1, 2, 3, 4, 6, 8, 12, 24], [1, 2, 4, 8], [1, 2, 4, 8])
    >>> p = Problem([65536, 512], n_ranks=8, capacity=16384, cost=None, max_cp=None)
    >>> p.cps[p.kmin].tolist()   # memory-minimum CP size of each sequence
    [4, 1]
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Iterable, Optional, Union

import numpy as np
import numpy.typing as npt

from ._cost import CostModel, padded_length

if TYPE_CHECKING:
    from ._step_cost import StepCost

Cost = Union[CostModel, "StepCost"]
CpSizes = Union[None, str, Iterable[int]]

__all__ = ["Cost", "CpSizes", "Problem", "cp_candidates", "divisors", "first_within", "is_nested"]


class Problem:
    """Validated inputs and the ``[n_cp, n_seqs]`` tables every planner reads (row k: CP size ``cps[k]``)."""

    def __init__(self, lengths: npt.ArrayLike, n_ranks: int, capacity: int, cost: Optional[Cost],
                 max_cp: Optional[int], cp_sizes: CpSizes = None) -> None:
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
        self.n, self.n_ranks, self.capacity = self.lengths.size, int(n_ranks), int(capacity)
        self.cost = CostModel() if cost is None else cost
        if not callable(getattr(self.cost, "_tables", None)):
            raise ValueError(f"cost must be a CostModel or a StepCost (or None), got {type(cost).__name__}")
        self.cps = cp_candidates(self.n_ranks, max_cp, cp_sizes)
        cps = self.cps[:, None]
        lp = padded_length(self.lengths[None, :], cps)  # [K, n]
        self.lp = lp
        fits = lp <= self.capacity * cps
        if not np.all(fits[-1]):
            i = int(np.argmin(fits[-1]))
            raise ValueError(
                f"sequence {i} of length {int(self.lengths[i])} does not fit: it needs more than the largest CP "
                f"size {int(self.cps[-1])} available with n_ranks={self.n_ranks} (max_cp={max_cp}, CP sizes "
                f"{self.cps.tolist()}) at a per-rank "
                f"capacity of {self.capacity} tokens; raise capacity or n_ranks, or split the sequence"
            )
        self.fits = fits
        # the cost tables, on the distinct lengths (batches repeat lengths a lot), then one column per sequence
        _, first, inv, count = np.unique(self.lengths, return_index=True, return_inverse=True, return_counts=True)
        self.inv = inv.reshape(-1)  # sequence -> its column in the compact tables
        self.first, self.count = first, count  # a sequence of each distinct length, and how many have it
        variants, seq_v, fixed_v, allowed = self.cost._tables(lp[:, first], self.cps)
        self.variants: tuple[str, ...] = tuple(variants)
        if not np.all(allowed.any(axis=0)):
            bad = self.cps[~allowed.any(axis=0)].tolist()
            raise ValueError(f"the cost model allows no communication variant at CP sizes {bad}")
        if seq_v.shape[0] == 1:  # one variant (CostModel): no envelope to take
            seq_u, self.lat = seq_v[0], fixed_v[0]
            pref_u = np.zeros(seq_u.shape, dtype=np.int64)
            alone_u = seq_u + self.lat[:, None]
        else:
            seq_m = np.where(allowed[:, :, None], seq_v, np.inf)  # [V, K, u]; a variant not allowed: never
            fixed_m = np.where(allowed, fixed_v, np.inf)  # [V, K]
            alone_v = seq_m + fixed_m[:, :, None]
            pref_u = np.argmin(alone_v, axis=0)  # the variant of a sequence alone at each CP size
            alone_u = np.take_along_axis(alone_v, pref_u[None], axis=0)[0]
            seq_u, self.lat = seq_m.min(axis=0), fixed_m.min(axis=0)
        self.seq, self.pref = seq_u[:, self.inv], pref_u[:, self.inv]  # [K, n]
        self.seq_v, self.fixed_v, self.allowed = seq_v, fixed_v, allowed  # compact [V, K, u]: per-microbatch choice
        self.alone = np.where(fits, alone_u[:, self.inv], np.inf)  # time alone in a microbatch (best variant)
        self.work = np.where(fits, self.seq * cps, np.inf)  # rank-seconds, without the per-microbatch part
        self.rows = np.arange(self.n)
        self._derive()

    def _derive(self) -> None:
        self.nested = is_nested(self.cps.tolist())
        self.kmin = np.argmax(self.fits, axis=0)  # index of the memory-minimum CP size
        self.fastest = np.argmin(self.alone, axis=0)
        self.prefix_min = np.minimum.accumulate(self.alone, axis=0)  # running minimum over CP sizes

    def subset(self, sizes: Iterable[int]) -> Optional["Problem"]:
        """The same problem with only ``sizes`` (a subset of :attr:`cps`) allowed, from the same tables; ``None``
        when some sequence fits none of them."""
        rows = np.flatnonzero(np.isin(self.cps, np.asarray(list(sizes), dtype=np.int64)))
        if not np.all(self.fits[rows].any(axis=0)):
            return None
        sub = copy.copy(self)
        for name in ("cps", "lp", "fits", "seq", "pref", "alone", "work", "lat"):
            setattr(sub, name, getattr(self, name)[rows])
        for name in ("seq_v", "fixed_v", "allowed"):
            setattr(sub, name, getattr(self, name)[:, rows])
        sub._derive()
        return sub


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order.

    Example::

        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def is_nested(sizes: Iterable[int]) -> bool:
    """Whether each of the (increasing) ``sizes`` divides the next: then aligned blocks of different sizes nest.

    Example::

        >>> is_nested([1, 2, 4, 8]), is_nested([1, 3, 6, 12]), is_nested([1, 2, 3, 6])
        (True, True, False)
    """
    s = sorted(sizes)
    return all(b % a == 0 for a, b in zip(s, s[1:]))


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be an int ≥ 1, got {value!r}")
    return int(value)


def cp_candidates(n_ranks: int, max_cp: Optional[int] = None, cp_sizes: CpSizes = None) -> np.ndarray:
    """The CP sizes a plan may use, increasing: every divisor of ``n_ranks`` that is at most ``max_cp``.

    ``cp_sizes`` narrows the choice: ``None`` or ``"divisors"`` (the default: all divisors), ``"pow2"`` (the
    powers of two among them), or an explicit collection of sizes, each of which must divide ``n_ranks`` (and not
    exceed ``max_cp``, when given).

    Raises:
        ValueError: ``n_ranks`` or ``max_cp`` not an int ≥ 1; an explicit size that does not divide ``n_ranks``,
            exceeds ``max_cp`` or is not an int ≥ 1; an empty set; an unknown name.

    Example:

        >>> from cpscope.hybrid import cp_candidates
        >>> cp_candidates(8).tolist()
        [1, 2, 4, 8]
        >>> cp_candidates(12, max_cp=6).tolist()
        [1, 2, 3, 4, 6]
    """
    n_ranks = _check_int(n_ranks, "n_ranks")
    limit = n_ranks if max_cp is None else _check_int(max_cp, "max_cp")
    if cp_sizes is None or isinstance(cp_sizes, str):
        name = "divisors" if cp_sizes is None else cp_sizes
        if name not in ("divisors", "pow2"):
            raise ValueError(f"cp_sizes must be 'divisors', 'pow2' or a collection of ints, got {cp_sizes!r}")
        sizes = [d for d in divisors(n_ranks) if d <= limit and (name == "divisors" or d & (d - 1) == 0)]
    else:
        sizes = sorted({_check_int(c, "every CP size in cp_sizes") for c in cp_sizes})
        bad = [c for c in sizes if n_ranks % c or c > limit]
        if bad or not sizes:
            raise ValueError(f"cp_sizes {sizes}: every size must divide n_ranks={n_ranks} and be at most max_cp="
                             f"{max_cp} (offending: {bad or 'none given'})")
    return np.asarray(sizes, dtype=np.int64)


def first_within(prefix_min: np.ndarray, fastest: np.ndarray, target: float) -> np.ndarray:
    """Per sequence, the index of the smallest CP size whose time alone is ≤ target (else the fastest one),
    from the running minimum over CP sizes ``[K, n]`` (non-increasing, so a count finds it)."""
    k = np.count_nonzero(prefix_min > target, axis=0)
    return np.where(k == prefix_min.shape[0], fastest, k)
