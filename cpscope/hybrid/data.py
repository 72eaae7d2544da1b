"""Synthetic sequence-length distributions for simulating the hybrid-CP planner.

Example::

    >>> lengths = long_tail_lengths(1024, seed=0)
    >>> int(lengths.min()) >= 128 and int(lengths.max()) <= 131072 and bool(np.all(lengths % 128 == 0))
    True
"""
from __future__ import annotations

import numpy as np

__all__ = ["long_tail_lengths"]


def long_tail_lengths(
    n: int,
    *,
    seed: int = 0,
    median: int = 2048,
    sigma: float = 1.5,
    min_len: int = 128,
    max_len: int = 131072,
    granularity: int = 128,
) -> np.ndarray:
    """``n`` document lengths from a clipped log-normal: many short documents, a long tail of long ones.

    ``L = clip(round_up(median · exp(sigma · z), granularity), min_len, max_len)`` with ``z ~ N(0, 1)`` drawn from
    ``numpy.random.default_rng(seed)``; deterministic given the arguments. With the defaults the mean is about
    6.1k tokens, ~1 % of documents exceed 64k and ~0.3 % sit at the 128k cap, and that longest 1 % holds about
    half of the attention work (∝ L²). ``granularity`` 128 keeps every length divisible by ``2·cp`` up to CP64.

    Returns:
        int64 array of shape ``[n]``.
    """
    if n < 0 or granularity < 1 or not 1 <= min_len <= max_len or median <= 0 or sigma < 0:
        raise ValueError(
            f"long_tail_lengths: need n ≥ 0, granularity ≥ 1, 1 ≤ min_len ≤ max_len, median > 0, sigma ≥ 0; "
            f"got n={n}, granularity={granularity}, min_len={min_len}, max_len={max_len}, median={median}, "
            f"sigma={sigma}"
        )
    rng = np.random.default_rng(seed)
    raw = median * np.exp(sigma * rng.standard_normal(n))
    rounded = np.ceil(raw / granularity).astype(np.int64) * granularity
    return np.clip(rounded, min_len, max_len)
