"""``comm="auto"`` at run time: the job's calibrated cost model, found on disk and installed in the attention.

The choice itself is pure and lives with the planner (:func:`cpscope.hybrid._cheapest_variant.choose`); this module is the
torch side around it:

* :func:`cached_cost` — the calibration :mod:`cpscope.train._calibrate` cached for this device, world size and
  versions (or ``None``);
* :func:`auto_chooser` — :func:`~cpscope.hybrid._cheapest_variant.choose` wrapped as the chooser that
  ``cpscope.attention.set_auto_chooser`` takes (it answers the dispatch's query);
* :func:`use_calibration` — both at once: make ``comm="auto"`` follow the job's cached (or a given) model;
* :func:`device_name`, :func:`calibration_device` — the device a calibration is timed on and named after.

Example::

    dist.init_process_group("nccl")
    cost = use_calibration()                   # on every rank; ValueError when nothing is cached for this job
    with cpscope.runtime_cp(groups[8], comm="auto"):
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)   # the cheapest variant
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .._tensor_cache import lru
from .._version import __version__
from ..attention import set_auto_chooser
from ..hybrid import CommCostModel, cache_dir, default_inner, dtype_name
from ..hybrid import choose_variant as choose

__all__ = ["auto_chooser", "cached_cost", "calibration_device", "device_name", "model_digest", "use_calibration"]

logger = logging.getLogger(__name__)


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices, else ``"<type>-<machine>"`` (e.g. ``"cpu-x86_64"``).

    Example::

        device_name(torch.device("cpu"))        # 'cpu-x86_64'
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{platform.machine() or 'unknown'}"


def calibration_device(device: Optional[torch.device] = None) -> torch.device:
    """``device`` if given; else the current CUDA device under NCCL or when CUDA is available; else the CPU."""
    if device is not None:
        return torch.device(device)
    if (dist.is_initialized() and dist.get_backend() == "nccl") or torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@lru(maxsize=16)
def _load(path: str, mtime_ns: int) -> CommCostModel:
    return CommCostModel.load(path)


def _matches(model: CommCostModel, want: tuple, cp: Optional[int]) -> Optional[int]:
    """How many CP sizes the file covers when it is this job's (device, world, versions) and holds ``cp``."""
    m = model.meta
    if (m.get("device"), m.get("world_size"), m.get("torch"), m.get("cpscope")) != want:
        return None
    sizes = list(m.get("cp_sizes", ()))
    return None if cp is not None and cp not in sizes else len(sizes)


def cached_cost(*, device: str, world_size: int, cp: Optional[int] = None, torch_version: Optional[str] = None,
                cpscope_version: Optional[str] = None, directory: Optional[str] = None) -> Optional[CommCostModel]:
    """The calibration cached for this job (:mod:`cpscope.train._calibrate` writes it), or ``None``.

    Matches the device name, world size and versions (default: the running torch and cpscope); among the
    files that do, the one whose CP sizes include ``cp`` (when given), with the most CP sizes. Loaded models are
    kept in memory (re-read when the file changes), so calling this per attention call is cheap.

    Example::

        cost = cached_cost(device=device_name(torch.device("cuda")), world_size=dist.get_world_size(), cp=8)
    """
    want = (device, world_size, torch.__version__ if torch_version is None else torch_version,
            __version__ if cpscope_version is None else cpscope_version)
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
            count = _matches(_load(path, os.stat(path).st_mtime_ns), want, cp)
        except (OSError, ValueError, KeyError) as err:
            logger.debug("skipping cost-model file %s: %s", path, err)
            continue
        if count is not None and (best is None or count > best[0]):
            best = (count, path)
    return None if best is None else _load(best[1], os.stat(best[1]).st_mtime_ns)


def auto_chooser(cost: CommCostModel, *, inner: Optional[int] = None,
                 fallback: Optional[Callable[[Any], str]] = None) -> Callable[[Any], str]:
    """A chooser for ``comm="auto"`` in ``cpscope.attention`` (``set_auto_chooser(auto_chooser(cost))``).

    The returned function takes the dispatch's query (attributes ``cp``, ``heads``, ``kv_heads``, ``head_dim``,
    ``causal``, ``seq_lens``, ``dtype``, ``window``) and returns :func:`~cpscope.hybrid._cheapest_variant.choose`'s answer,
    ``"a2a+p2p:N"`` with its sub-group size. Where the query cannot be priced — no ``seq_lens`` (e.g. a TE module
    bound before its forward), or no ``dtype`` and a model of several dtypes — it returns ``fallback(query)``
    (default ``"p2p"``). Pure and deterministic: every rank of a group, asked the same query, answers the same.

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
                      head_dim=query.head_dim, dtype=dtype, causal=bool(query.causal), inner=inner,
                      window=getattr(query, "window", None))
        if name == "a2a+p2p":
            sub = inner if inner is not None else cost.inner
            name = f"a2a+p2p:{sub if sub is not None else default_inner(query.cp, query.heads, query.kv_heads)}"
        return name

    return chooser


def use_calibration(cost: Optional[CommCostModel] = None, *, directory: Optional[str] = None) -> CommCostModel:
    """Make ``comm="auto"`` follow a calibrated cost model (default: this job's cached one); returns it.

    Call it on every rank at start-up (after ``torch.distributed`` is initialised): **collective** over the world
    (one small all-gather), the ranks agree that every one of them holds the same model — a node that found another
    file (or none) would choose another variant and meet the others' collectives with its own. Falls back to
    ``"p2p"`` for queries it cannot price (see :func:`auto_chooser`).

    Raises:
        ValueError: on every rank alike: no cost model given and none cached for this device / world size /
            versions on some rank (run ``benchmarks/calibrate_comm.py`` or
            :func:`cpscope.train.calibrate` first), or ranks holding different models.

    Example::

        use_calibration()                    # after init_process_group, on every rank
    """
    device = calibration_device(None)
    where = ""
    if cost is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        cost = cached_cost(device=device_name(device), world_size=world, directory=directory)
        where = (f" for {device_name(device)!r}, world size {world}, torch {torch.__version__} in "
                 f"{directory or cache_dir()}")
    _agree_on_model(cost, device, where)
    assert cost is not None
    set_auto_chooser(auto_chooser(cost))
    return cost


def model_digest(cost: Optional[CommCostModel]) -> int:
    """A signed 64-bit digest of a cost model's content (``0``: none)."""
    if cost is None:
        return 0
    raw = hashlib.blake2b(json.dumps(cost.to_json(), sort_keys=True, default=str).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True) or 1


def _agree_on_model(cost: Optional[CommCostModel], device: torch.device, where: str) -> None:
    """Every rank holds the same model, or the same ``ValueError`` on every rank (one all-gather of 2 int64)."""
    mine = model_digest(cost)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        parts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.tensor([mine], dtype=torch.int64, device=dev))
        digests = [int(p.item()) for p in parts]
    else:
        digests = [mine]
    missing = [r for r, d in enumerate(digests) if d == 0]
    if missing:
        raise ValueError(f"no calibrated communication cost model cached{where} on rank(s) {missing} of "
                         f"{len(digests)}; run benchmarks/calibrate_comm.py (or cpscope.train.calibrate) "
                         "first, with the calibration directory shared by every node (or pass the same model)")
    if len(set(digests)) > 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        shown = "; ".join(f"ranks {rs}: model #{d & 0xFFFFFFFFFFFFFFFF:016x}" for d, rs in groups.items())
        raise ValueError(f"the ranks hold different calibrated cost models ({shown}): comm='auto' would choose "
                         "other variants on different ranks and hang; give every rank the same file or model")
