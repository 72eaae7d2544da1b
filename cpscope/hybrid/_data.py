"""Synthetic sequence-length distributions for simulating the hybrid-CP planner.

Example::

    >>> lengths = long_tail_lengths(1024, seed=0)
    >>> int(lengths.min()) >= 128 and int(lengths.max()) <= 131072 and bool(np.all(lengths % 128 == 0))
    True
"""
from __future__ import annotations

import numpy as np

__all__ = ["long_tail_lengths", "sft_like_lengths", "uniform_lengths"]


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

    Example:

        >>> from cpscope.hybrid import long_tail_lengths
        >>> long_tail_lengths(4, seed=0).tolist()
        [2560, 1792, 5376, 2432]
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


def sft_like_lengths(
    n: int,
    *,
    seed: int = 0,
    long_fraction: float = 1 / 128,
    median: int = 1024,
    sigma: float = 1.0,
    min_len: int = 128,
    short_max: int = 16384,
    long_min: int = 122880,
    long_max: int = 131072,
    granularity: int = 128,
) -> np.ndarray:
    """``n`` document lengths of an SFT-like mix: mostly short documents and a few of 122 880–131 072 tokens.

    Short documents: ``clip(round_up(median · exp(sigma · z), granularity), min_len, short_max)``; then
    ``max(1, round(long_fraction · n))`` of them, at positions drawn without replacement, are replaced by lengths
    uniform in ``[long_min, long_max]`` (multiples of ``granularity``). All from
    ``numpy.random.default_rng(seed)``; deterministic given the arguments. With the defaults (2 documents per
    rank: one long document per 64 ranks) the mean length is about 2.6k tokens, and the 0.8 % long documents
    hold about 40 % of the tokens and 95 % of the attention work (∝ L²).

    Example::

        >>> lengths = sft_like_lengths(1024, seed=0)
        >>> int((lengths >= 122880).sum()), int(np.median(lengths))
        (8, 1024)
    """
    if (n < 0 or granularity < 1 or not 1 <= min_len <= short_max or median <= 0 or sigma < 0
            or not 0 <= long_fraction <= 1 or not 1 <= long_min <= long_max):
        raise ValueError(
            f"sft_like_lengths: need n ≥ 0, granularity ≥ 1, 1 ≤ min_len ≤ short_max, median > 0, sigma ≥ 0, "
            f"0 ≤ long_fraction ≤ 1, 1 ≤ long_min ≤ long_max; got n={n}, granularity={granularity}, "
            f"min_len={min_len}, short_max={short_max}, median={median}, sigma={sigma}, "
            f"long_fraction={long_fraction}, long_min={long_min}, long_max={long_max}"
        )
    rng = np.random.default_rng(seed)
    raw = median * np.exp(sigma * rng.standard_normal(n))
    lengths = np.clip(np.ceil(raw / granularity).astype(np.int64) * granularity, min_len, short_max)
    if n == 0 or long_fraction == 0:
        return lengths
    n_long = min(n, max(1, int(round(long_fraction * n))))
    where = rng.choice(n, n_long, replace=False)
    lo, hi = -(-long_min // granularity), long_max // granularity
    lengths[where] = rng.integers(lo, max(lo, hi), n_long, endpoint=True) * granularity
    return lengths


def uniform_lengths(n: int, *, seed: int = 0, min_len: int = 32768, max_len: int = 131072,
                    granularity: int = 128) -> np.ndarray:
    """``n`` document lengths uniform in ``[min_len, max_len]`` (multiples of ``granularity``): a long-context mix
    in which every document is long (the defaults: 32k-128k tokens), from ``numpy.random.default_rng(seed)``.

    Example::

        >>> lengths = uniform_lengths(256, seed=0)
        >>> int(lengths.min()) >= 32768 and int(lengths.max()) <= 131072 and bool(np.all(lengths % 128 == 0))
        True
    """
    if n < 0 or granularity < 1 or not 1 <= min_len <= max_len:
        raise ValueError(f"uniform_lengths: need n ≥ 0, granularity ≥ 1, 1 ≤ min_len ≤ max_len; got n={n}, "
                         f"granularity={granularity}, min_len={min_len}, max_len={max_len}")
    lo, hi = -(-min_len // granularity), max_len // granularity
    if lo > hi:
        raise ValueError(f"uniform_lengths: no multiple of {granularity} in [{min_len}, {max_len}]")
    return np.random.default_rng(seed).integers(lo, hi, n, endpoint=True).astype(np.int64) * granularity
