"""What one attention call computes and moves, per communication variant: the features of the per-call cost model.

The rules of which variant runs at a shape (:func:`variant_allowed`, :func:`default_inner`, the head checks), the
timed :class:`Sample`, and its feature vector (:data:`FEATURES`: attention work, per-token work, bytes received,
rounds, one call) as :mod:`cpscope.hybrid._comm_cost`'s docstring writes them; :func:`halo_rows` for windowed
``p2p``. Pure numpy. The public names are re-exported by :mod:`cpscope.hybrid._comm_cost`, their one public home.

Example::

    >>> from cpscope.hybrid._comm_features import Sample, features
    >>> features(Sample("p2p", "bfloat16", 2, (8,), 4, 4, 8, True, None, 1.0)).tolist()
    [512.0, 128.0, 512.0, 1.0, 1.0]
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np
import numpy.typing as npt

from .._variants import check_variants

__all__ = [
    "BYTES", "FEATURES", "LOCAL", "Sample", "check_shape", "default_inner", "dtype_name", "features", "halo_rows",
    "heads_split", "padded", "parts", "variant_allowed", "window_pairs",
]

LOCAL = "local"  # the CP1 fit, shared by every variant
FEATURES = ("attn", "tokens", "bytes", "rounds", "call")
BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}




def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"torch.bfloat16"`` → ``"bfloat16"`` (no torch import).

    Raises:
        ValueError: a dtype the model has no element size for.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of the floating dtypes the cost model knows: {sorted(BYTES)}")
    return name


def check_shape(cp: int, heads: int, kv_heads: int, head_dim: int) -> None:
    for name, value in (("cp", cp), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")


def heads_split(n: int, heads: int, kv_heads: int) -> bool:
    """Can an all-to-all over ``n`` ranks give each rank whole heads: q and k/v heads both divisible by ``n``
    (the rule of ``cpscope.attention``'s ``a2a``)."""
    return heads % n == 0 and kv_heads % n == 0


def default_inner(cp: int, heads: int, kv_heads: int) -> Optional[int]:
    """The ``a2a+p2p`` sub-group size ``cpscope.attention`` uses by default: the largest ``n ≤ 8`` with
    ``1 < n < cp`` dividing ``cp`` and both head counts; ``None`` if there is none.

    Example::

        >>> default_inner(8, 32, 8), default_inner(4, 16, 1)
        (4, None)
    """
    ok = [n for n in range(2, min(cp - 1, 8) + 1) if cp % n == 0 and heads_split(n, heads, kv_heads)]
    return max(ok) if ok else None


def variant_allowed(variant: str, cp: int, heads: int, kv_heads: int, inner: Optional[int] = None) -> bool:
    """Whether ``variant`` can run at ``cp`` with these heads (the rules of ``cpscope.attention``).

    ``p2p`` and ``all_gather``: always. ``a2a`` (Ulysses): ``heads`` and ``kv_heads`` divisible by ``cp``.
    ``a2a+p2p``: an all-to-all inside sub-groups of ``inner`` ranks (default :func:`default_inner`; it must
    satisfy ``1 < inner < cp``, divide ``cp`` and both head counts) and a ring across them. At ``cp = 1`` every
    variant is allowed (none communicates).

    Example::

        >>> variant_allowed("a2a", 4, heads=32, kv_heads=8), variant_allowed("a2a", 16, heads=32, kv_heads=8)
        (True, False)
    """
    check_variants([variant], what="variant")
    if cp == 1 or variant in ("p2p", "all_gather"):
        return True
    if variant == "a2a":
        return heads_split(cp, heads, kv_heads)
    inner = default_inner(cp, heads, kv_heads) if inner is None else inner
    return inner is not None and 1 < inner < cp and cp % inner == 0 and heads_split(inner, heads, kv_heads)


class Sample(NamedTuple):
    """One timed call: ``seconds`` of forward + backward at CP size ``cp`` (slowest rank, median of repeats)."""

    variant: str  # one of VARIANTS, or "local" for cp = 1
    dtype: str
    cp: int
    lengths: tuple[int, ...]  # global document lengths of the microbatch (multiples of 2·cp)
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    inner: Optional[int]  # the a2a sub-group size of a2a+p2p (else None)
    seconds: float


def parts(variant: str, cp: int, heads: int, kv_heads: int, head_dim: int, elem: int, causal: bool,
           inner: Optional[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-document feature weights and fixed features: ``(w2, w1, fixed)`` such that a document of padded
    length ``Lp`` has features ``w2 · Lp² + w1 · Lp`` (``[5]`` each) and a call adds ``fixed`` once."""
    h, g, d = float(heads), float(kv_heads), float(head_dim)
    w2 = np.array([(0.5 if causal else 1.0) * h * d / cp, 0.0, 0.0, 0.0, 0.0])
    w1 = np.array([0.0, h * d / cp, 0.0, 0.0, 0.0])
    fixed = np.array([0.0, 0.0, 0.0, 0.0, 1.0])
    if cp > 1 and variant != LOCAL:
        if variant in ("p2p", "all_gather"):
            w1[2] = 2.0 * g * d * elem * (cp - 1) / cp
            fixed[3] = cp - 1.0
        elif variant == "a2a":
            w1[2] = 2.0 * (h + g) * d * elem * (cp - 1) / cp**2
            fixed[3] = cp - 1.0
        else:  # a2a+p2p
            inner = default_inner(cp, heads, kv_heads) if inner is None else inner
            if inner is None:
                raise ValueError(f"a2a+p2p has no sub-group size at cp={cp} with heads={heads}, kv_heads={kv_heads}")
            a, r = float(inner), cp / float(inner)
            w1[2] = (2.0 * (h + g) * d * elem * (a - 1) / (cp * a)
                     + 2.0 * (g / a) * d * elem * (r - 1) / r)
            fixed[3] = (a - 1.0) + (r - 1.0)
    return w2, w1, fixed


def padded(lengths: npt.ArrayLike, cp: int) -> np.ndarray:
    lp = np.asarray(lengths, dtype=np.int64).ravel()
    if lp.size == 0 or np.any(lp <= 0):
        raise ValueError(f"document lengths must be a non-empty list of ints > 0, got {np.asarray(lengths)[:8]}")
    step = 2 * cp
    return (-(-lp // step) * step).astype(np.float64)


def halo_rows(lengths: npt.ArrayLike, cp: int, window: tuple[int, int], causal: bool = True) -> float:
    """The most K/V rows one rank receives in one pass of the windowed ``p2p`` exchange: for zigzag rank ``t``
    holding chunks ``t`` and ``2cp-1-t`` (``c`` tokens) of each document, the keys its chunks' queries see
    (``[x·c - left, (x+1)·c + right)``) that are not its own. ``window``: ``(left, right)``, ``-1`` unbounded.

    Example::

        >>> halo_rows([65536], 4, (256, 0))       # two neighbours' 256-token halos
        512.0
    """
    lp = padded(lengths, cp)
    c = lp / (2 * cp)
    left = math.inf if window[0] == -1 else float(window[0])
    right = 0.0 if causal else (math.inf if window[1] == -1 else float(window[1]))
    worst = 0.0
    for t in range(cp):
        (a0, a1), (b0, b1) = ((np.maximum(0.0, x * c - left), np.minimum(lp, (x + 1) * c + right))
                              for x in (t, 2 * cp - 1 - t))
        both = np.maximum(0.0, np.minimum(a1, b1) - np.maximum(a0, b0))
        worst = max(worst, float(np.sum((a1 - a0) + (b1 - b0) - both - 2 * c)))
    return worst


def window_pairs(lp: np.ndarray, window: tuple[int, int], causal: bool) -> float:
    """Σ over documents of the (query, key) pairs a window leaves, in units of ``Lp²`` (what ``attn`` counts)."""
    left = math.inf if window[0] == -1 else float(window[0])
    right = 0.0 if causal else (math.inf if window[1] == -1 else float(window[1]))
    total = 0.0
    for n in lp:
        i = np.arange(n)
        total += float(np.sum(np.minimum(n - 1, i + right) - np.maximum(0, i - left) + 1))
    return total


def features(sample: Sample) -> np.ndarray:
    w2, w1, fixed = parts(sample.variant, sample.cp, sample.heads, sample.kv_heads, sample.head_dim,
                           BYTES[sample.dtype], sample.causal, sample.inner)
    lp = padded(sample.lengths, sample.cp)
    return w2 * float(np.sum(lp * lp)) + w1 * float(np.sum(lp)) + fixed
