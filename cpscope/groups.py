"""A registry of pre-built CP groups: :func:`new_cp_groups` and per-group facts.

Creating a process group is a collective over the whole job and costs milliseconds; hybrid CP switches groups per
microbatch. So every group is created once, up front, by every rank with the same arguments, and cached.
"""
from __future__ import annotations

import numbers
import threading
from typing import Iterable, Optional, Sequence

import torch.distributed as dist

__all__ = ["new_cp_groups", "group_ranks", "clear_cp_group_cache"]

# (size, block ranks) -> group handle this rank received for that block (ProcessGroup or NON_GROUP_MEMBER).
_CACHE: dict[tuple[int, tuple[int, ...]], object] = {}
_RANKS: dict[object, list[int]] = {}
_LOCK = threading.Lock()


def new_cp_groups(
    sizes: Iterable[int], ranks: Optional[Sequence[int]] = None
) -> dict[int, Optional[dist.ProcessGroup]]:
    """Create (once) the CP groups of each size and return, per size, the group this rank belongs to.

    **Collective**: every rank of the job must call it with the same arguments, in the same order. For each size
    ``s``, ``ranks`` (default: all ranks of the default group, in order) is split into aligned contiguous blocks
    ``ranks[0:s], ranks[s:2s], …``; the result maps ``s`` to the block holding this rank. Size 1 maps to ``None``
    (CP1). A rank that is not in ``ranks`` gets no entries. Calling again with the same arguments performs no
    collective and returns the same group objects.

    Args:
        sizes: CP sizes wanted, e.g. ``[1, 2, 4]``. Each must be ≥ 1 and divide ``len(ranks)``.
        ranks: the global ranks to split (e.g. one data-parallel replica's ranks); default the whole world.

    Raises:
        ValueError: a size that is < 1 or does not divide ``len(ranks)``; duplicate or out-of-range ranks.
        RuntimeError: ``torch.distributed`` is not initialised.

    Example::

        dist.init_process_group("gloo")                 # 4 ranks
        groups = cpscope.new_cp_groups([1, 2, 4])       # {1: None, 2: <group of 2>, 4: <group of 4>}
        with cpscope.runtime_cp(groups[2]):
            ...
    """
    if not dist.is_initialized():
        raise RuntimeError("new_cp_groups needs torch.distributed to be initialised (dist.init_process_group)")
    world = dist.get_world_size()
    domain = list(range(world)) if ranks is None else [_as_int(r, "rank") for r in ranks]
    sizes = [_as_int(s, "CP size") for s in sizes]
    if not domain:
        raise ValueError("new_cp_groups: ranks is empty")
    if len(set(domain)) != len(domain) or min(domain) < 0 or max(domain) >= world:
        raise ValueError(f"new_cp_groups: ranks must be distinct global ranks in [0, {world}), got {domain}")
    bad = [s for s in sizes if s < 1 or len(domain) % s != 0]
    if bad:
        raise ValueError(
            f"new_cp_groups: CP sizes {bad} do not divide the {len(domain)} ranks being split (sizes {sizes}); "
            f"every size must be ≥ 1 and a divisor of len(ranks) so the ranks split into aligned blocks"
        )
    me = dist.get_rank()
    out: dict[int, Optional[dist.ProcessGroup]] = {}
    for s in dict.fromkeys(sizes):  # de-duplicate, keep order (identical on every rank)
        if s == 1:
            if me in domain:
                out[1] = None
            continue
        for start in range(0, len(domain), s):
            block = tuple(domain[start : start + s])
            key = (s, block)
            with _LOCK:
                handle = _CACHE.get(key)
                if handle is None:
                    handle = dist.new_group(list(block))
                    _CACHE[key] = handle
                    if me in block:
                        _RANKS[handle] = list(block)
            if me in block:
                out[s] = handle  # type: ignore[assignment]
    return out


def _as_int(value: object, what: str) -> int:
    """``value`` as an int; bools, floats and strings are refused rather than silently truncated."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"new_cp_groups: every {what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def group_ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    """Global ranks of ``group`` in group-rank order (TE's ``cp_global_ranks``); ``[this rank]`` for CP1.

    Example::

        groups = cpscope.new_cp_groups([2])            # on 4 ranks
        cpscope.group_ranks(groups[2])                 # [0, 1] on ranks 0-1, [2, 3] on ranks 2-3
    """
    if group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    ranks = _RANKS.get(group)
    if ranks is None:
        ranks = list(dist.get_process_group_ranks(group))
        with _LOCK:
            _RANKS[group] = ranks
    return list(ranks)


def clear_cp_group_cache() -> None:
    """Forget cached groups (after ``dist.destroy_process_group``). Does not destroy them.

    Example::

        dist.destroy_process_group()
        cpscope.clear_cp_group_cache()                 # a new process group will get new CP groups
    """
    with _LOCK:
        _CACHE.clear()
        _RANKS.clear()
