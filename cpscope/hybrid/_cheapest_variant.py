"""The communication variant with the least predicted time for one microbatch (pure: numpy only).

:func:`choose` is pure: given a fitted :class:`~cpscope.hybrid.CommCostModel` and the microbatch's
shape it returns the variant name — what the planner uses per microbatch and what ``comm="auto"`` answers once a
calibrated model is installed. ``a2a`` is only considered when the heads divide ``cp``
(:func:`~cpscope.hybrid._comm_cost.variant_allowed`), ``a2a+p2p`` only with an ``inner`` sub-group size; ties go to
the earlier of ``VARIANTS`` (the ring first). :func:`predict` gives every allowed variant's time.

Plugging it into the attention's ``comm="auto"`` (a job's cached calibration, the chooser the dispatch calls) is
the torch runtime's job: :mod:`cpscope.train._auto` (``use_calibration``, ``auto_chooser``, ``cached_cost``).

Example::

    >>> from cpscope.hybrid._comm_cost import CommCostModel
    >>> # the ring hides most of its traffic but pays per step; Ulysses exposes its traffic, in one step
    >>> fit = {"bfloat16": {"p2p": (1e-12, 0, 1e-11, 2e-4, 1e-4), "a2a": (1e-12, 0, 1e-10, 0, 1e-4)}}
    >>> cost = CommCostModel(fit)
    >>> choose(cost, [131072], cp=8, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")  # long: ring
    'p2p'
    >>> choose(cost, [1024] * 4, cp=8, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")  # short: a2a
    'a2a'
    >>> choose(cost, [1024] * 4, cp=8, heads=12, kv_heads=12, head_dim=128, dtype="bfloat16")  # 12 % 8: no a2a
    'p2p'
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import numpy.typing as npt

from .._variants import VARIANTS, check_variants
from ._comm_features import check_shape, dtype_name, padded, variant_allowed
from ._comm_cost import CommCostModel

__all__ = ["choose", "predict"]


def predict(cost: CommCostModel, lengths: npt.ArrayLike, *, cp: int, heads: int, kv_heads: int, head_dim: int,
            dtype: Any, causal: bool = True, inner: Optional[int] = None,
            candidates: Optional[Sequence[str]] = None,
            window: Optional[tuple[int, int]] = None) -> dict[str, float]:
    """Predicted seconds of one call (forward + backward) for every variant that is fitted for ``dtype``,
    allowed at this shape and among ``candidates`` (default: all of ``VARIANTS``), in ``VARIANTS`` order.

    ``lengths`` are the global document lengths of the microbatch (``[b · s]`` repeated ``b`` times for
    ``bshd`` / ``sbhd``); ``inner`` defaults to the model's (``cost.inner``); ``window`` (``(left, right)``,
    ``-1`` unbounded) prices a sliding window (:meth:`CommCostModel.time`: fewer score pairs, and ``p2p`` receives
    only its halos).

    Raises:
        ValueError: bad shapes or lengths, an unknown candidate, or a dtype the model has no fit for.
    """
    check_shape(cp, heads, kv_heads, head_dim)
    dt = dtype_name(dtype)
    if dt not in cost.coefficients:
        raise ValueError(f"the cost model has no fit for dtype {dt!r}; calibrated: {list(cost.dtypes())}")
    wanted = VARIANTS if candidates is None else check_variants(candidates, what="candidates")
    inner = cost.inner if inner is None else inner
    lp = padded(lengths, cp)
    s2, s1 = float(np.dot(lp, lp)), float(lp.sum())
    out = {}
    for v in cost.variants(dt):
        if v in wanted and variant_allowed(v, cp, heads, kv_heads, inner):
            if window is not None:
                out[v] = cost.time(v, lengths, cp=cp, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dt,
                                   causal=causal, inner=inner, window=window)
                continue
            q2, q1, fixed = cost.split(v, cp=cp, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dt,
                                       causal=causal, inner=inner)
            out[v] = q2 * s2 + q1 * s1 + fixed
    return out


def choose(cost: CommCostModel, lengths: npt.ArrayLike, *, cp: int, heads: int, kv_heads: int, head_dim: int,
           dtype: Any, causal: bool = True, inner: Optional[int] = None,
           candidates: Optional[Sequence[str]] = None, window: Optional[tuple[int, int]] = None) -> str:
    """The variant with the least predicted time for this microbatch (``"p2p"`` at ``cp = 1``).

    Pure and deterministic (ties to the earlier of ``VARIANTS``). Arguments as :func:`predict`.

    Raises:
        ValueError: as :func:`predict`, or when no candidate is both fitted and allowed at this shape.
    """
    if cp == 1:
        check_shape(cp, heads, kv_heads, head_dim)
        return "p2p"
    times = predict(cost, lengths, cp=cp, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                    causal=causal, inner=inner, candidates=candidates, window=window)
    if not times:
        raise ValueError(f"no communication variant is both fitted (for {dtype_name(dtype)}: "
                         f"{list(cost.variants(dtype))}) and allowed at cp={cp}, heads={heads}, kv_heads={kv_heads}"
                         f" among {list(candidates) if candidates is not None else list(VARIANTS)}")
    return min(times, key=times.__getitem__)  # dict order is VARIANTS order: ties to the earlier
