"""``comm="auto"``: the communication variant with the least predicted time for one microbatch.

:func:`choose` is pure: given a fitted :class:`~cpscope.hybrid.comm_cost.CommCostModel` and the microbatch's
shape it returns the variant name — what the attention dispatch calls for ``comm="auto"`` (with the cached model
of the running job, :func:`cached_cost`) and what the planner uses per microbatch. ``a2a`` is only considered
when the heads divide ``cp`` (:func:`~cpscope.hybrid.comm_cost.variant_allowed`), ``a2a+p2p`` only with an
``inner`` sub-group size; ties go to the earlier of ``VARIANTS`` (the ring first).

Example::

    >>> from cpscope.hybrid.comm_cost import CommCostModel
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

import functools
import logging
import os
from typing import Any, Optional, Sequence

import numpy as np
import numpy.typing as npt

from .comm_cost import (
    VARIANTS,
    CommCostModel,
    _check_shape,
    _padded,
    cache_dir,
    dtype_name,
    variant_allowed,
)

__all__ = ["VARIANTS", "cached_cost", "choose", "predict", "variant_allowed"]

logger = logging.getLogger(__name__)


def predict(cost: CommCostModel, lengths: npt.ArrayLike, *, cp: int, heads: int, kv_heads: int, head_dim: int,
            dtype: Any, causal: bool = True, inner: Optional[int] = None,
            candidates: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Predicted seconds of one call (forward + backward) for every variant that is fitted for ``dtype``,
    allowed at this shape and among ``candidates`` (default: all of ``VARIANTS``), in ``VARIANTS`` order.

    ``lengths`` are the global document lengths of the microbatch (``[b · s]`` repeated ``b`` times for
    ``bshd`` / ``sbhd``); ``inner`` defaults to the model's (``cost.inner``).

    Raises:
        ValueError: bad shapes or lengths, an unknown candidate, or a dtype the model has no fit for.
    """
    _check_shape(cp, heads, kv_heads, head_dim)
    dt = dtype_name(dtype)
    if dt not in cost.coefficients:
        raise ValueError(f"the cost model has no fit for dtype {dt!r}; calibrated: {list(cost.dtypes())}")
    wanted = VARIANTS if candidates is None else tuple(candidates)
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown communication variants {unknown}; expected some of {VARIANTS}")
    inner = cost.inner if inner is None else inner
    lp = _padded(lengths, cp)
    s2, s1 = float(np.dot(lp, lp)), float(lp.sum())
    out = {}
    for v in cost.variants(dt):
        if v in wanted and variant_allowed(v, cp, heads, kv_heads, inner):
            q2, q1, fixed = cost.split(v, cp=cp, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dt,
                                       causal=causal, inner=inner)
            out[v] = q2 * s2 + q1 * s1 + fixed
    return out


def choose(cost: CommCostModel, lengths: npt.ArrayLike, *, cp: int, heads: int, kv_heads: int, head_dim: int,
           dtype: Any, causal: bool = True, inner: Optional[int] = None,
           candidates: Optional[Sequence[str]] = None) -> str:
    """The variant with the least predicted time for this microbatch (``"p2p"`` at ``cp = 1``).

    Pure and deterministic (ties to the earlier of ``VARIANTS``). Arguments as :func:`predict`.

    Raises:
        ValueError: as :func:`predict`, or when no candidate is both fitted and allowed at this shape.
    """
    if cp == 1:
        _check_shape(cp, heads, kv_heads, head_dim)
        return "p2p"
    times = predict(cost, lengths, cp=cp, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                    causal=causal, inner=inner, candidates=candidates)
    if not times:
        raise ValueError(f"no communication variant is both fitted (for {dtype_name(dtype)}: "
                         f"{list(cost.variants(dtype))}) and allowed at cp={cp}, heads={heads}, kv_heads={kv_heads}"
                         f" among {list(candidates) if candidates is not None else list(VARIANTS)}")
    return min(times, key=times.__getitem__)  # dict order is VARIANTS order: ties to the earlier


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int) -> CommCostModel:
    return CommCostModel.load(path)


def cached_cost(*, device: str, world_size: int, cp: Optional[int] = None, torch_version: Optional[str] = None,
                cpscope_version: Optional[str] = None, directory: Optional[str] = None) -> Optional[CommCostModel]:
    """The calibration cached for this job (:mod:`cpscope.hybrid.calibrate` writes it), or ``None``.

    Matches the device name, world size and versions (default: the running torch and cpscope); among the
    files that do, the one whose CP sizes include ``cp`` (when given), with the most CP sizes. Loaded models are
    kept in memory (re-read when the file changes), so calling this per attention call is cheap.
    """
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if cpscope_version is None:
        from .. import __version__ as cpscope_version
    folder = cache_dir() if directory is None else directory
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    best: Optional[tuple[int, str]] = None
    for name in sorted(names):
        if not (name.startswith("comm_cost-") and name.endswith(".json")):
            continue
        path = os.path.join(folder, name)
        try:
            model = _load(path, os.stat(path).st_mtime_ns)
        except (OSError, ValueError, KeyError) as err:
            logger.debug("skipping cost-model file %s: %s", path, err)
            continue
        m = model.meta
        if (m.get("device"), m.get("world_size"), m.get("torch"), m.get("cpscope")) != (
                device, world_size, torch_version, cpscope_version):
            continue
        sizes = list(m.get("cp_sizes", ()))
        if cp is not None and cp not in sizes:
            continue
        if best is None or len(sizes) > best[0]:
            best = (len(sizes), path)
    return None if best is None else _load(best[1], os.stat(best[1]).st_mtime_ns)
