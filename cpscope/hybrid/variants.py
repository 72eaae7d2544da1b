"""``comm="auto"``: the communication variant with the least predicted time for one microbatch.

:func:`choose` is pure: given a fitted :class:`~cpscope.hybrid.comm_cost.CommCostModel` and the microbatch's
shape it returns the variant name — what the attention dispatch calls for ``comm="auto"`` (with the cached model
of the running job, :func:`cached_cost`) and what the planner uses per microbatch. ``a2a`` is only considered
when the heads divide ``cp`` (:func:`~cpscope.hybrid.comm_cost.variant_allowed`), ``a2a+p2p`` only with an
``inner`` sub-group size; ties go to the earlier of ``VARIANTS`` (the ring first). :func:`auto_chooser` wraps it
for ``cpscope.attention.set_auto_chooser``; :func:`use_calibration` installs the job's cached model there.

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
from typing import Any, Callable, Optional, Sequence

import numpy as np
import numpy.typing as npt

from .comm_cost import (
    VARIANTS,
    CommCostModel,
    _check_shape,
    _padded,
    cache_dir,
    default_inner,
    dtype_name,
    variant_allowed,
)

__all__ = ["VARIANTS", "auto_chooser", "cached_cost", "choose", "predict", "use_calibration", "variant_allowed"]

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
    """The calibration cached for this job (:mod:`cpscope.train.calibrate` writes it), or ``None``.

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


def auto_chooser(cost: CommCostModel, *, inner: Optional[int] = None,
                 fallback: Optional[Callable[[Any], str]] = None) -> Callable[[Any], str]:
    """A chooser for ``comm="auto"`` in ``cpscope.attention`` (``set_auto_chooser(auto_chooser(cost))``).

    The returned function takes the dispatch's query (attributes ``cp``, ``heads``, ``kv_heads``, ``head_dim``,
    ``causal``, ``seq_lens``, ``dtype``) and returns :func:`choose`'s answer, ``"a2a+p2p:N"`` with its sub-group
    size. Where the query cannot be priced — no ``seq_lens`` (e.g. a TE module bound before its forward), or
    no ``dtype`` and a model of several dtypes — it returns ``fallback(query)`` (default ``"p2p"``). Pure and
    deterministic: every rank of a group, asked the same query, answers the same.

    Example::

        from cpscope.attention import set_auto_chooser
        set_auto_chooser(auto_chooser(cached_cost(device=..., world_size=...)))
    """
    dtypes = cost.dtypes()

    def chooser(query: Any) -> str:
        lens = tuple(getattr(query, "seq_lens", ()) or ())
        dtype = getattr(query, "dtype", None)
        if dtype is None and len(dtypes) == 1:
            dtype = dtypes[0]
        if query.cp == 1:
            return "p2p"
        if not lens or dtype is None or dtype_name(dtype) not in dtypes:
            return fallback(query) if fallback is not None else "p2p"
        name = choose(cost, lens, cp=query.cp, heads=query.heads, kv_heads=query.kv_heads,
                      head_dim=query.head_dim, dtype=dtype, causal=bool(query.causal), inner=inner)
        if name == "a2a+p2p":
            sub = inner if inner is not None else cost.inner
            name = f"a2a+p2p:{sub if sub is not None else default_inner(query.cp, query.heads, query.kv_heads)}"
        return name

    return chooser


def use_calibration(cost: Optional[CommCostModel] = None, *, directory: Optional[str] = None) -> CommCostModel:
    """Make ``comm="auto"`` follow a calibrated cost model (default: this job's cached one); returns it.

    Call it on every rank at start-up (after ``torch.distributed`` is initialised). Falls back to ``"p2p"``
    for queries it cannot price (see :func:`auto_chooser`).

    Raises:
        ValueError: no cost model given and none cached for this device / world size / versions (run
            ``benchmarks/calibrate_comm.py`` or :func:`cpscope.train.calibrate.calibrate` first).
        RuntimeError: this cpscope's attention has no ``set_auto_chooser`` (communication variants missing).
    """
    try:
        from ..attention import set_auto_chooser
    except ImportError as err:
        raise RuntimeError("this cpscope has no cpscope.attention.set_auto_chooser (no communication variants)"
                           ) from err
    if cost is None:
        import torch
        import torch.distributed as dist

        from ..train.calibrate import _pick_device, device_name

        device = _pick_device(None)
        world = dist.get_world_size() if dist.is_initialized() else 1
        cost = cached_cost(device=device_name(device), world_size=world, directory=directory)
        if cost is None:
            raise ValueError(f"no calibrated communication cost model cached for {device_name(device)!r}, world "
                             f"size {world}, torch {torch.__version__} in {directory or cache_dir()}; run "
                             f"benchmarks/calibrate_comm.py (or cpscope.train.calibrate.calibrate) first")
    set_auto_chooser(auto_chooser(cost))
    return cost
