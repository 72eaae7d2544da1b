"""The groups the sentinel checks over: who the members are (this rank, a scope's members, a scope in words), and the
sentinel's own collectives over them — small fixed-size exchanges, and gathers of a group's shards in global order.

Every collective here has a size that the ranks agree on before it runs (a fixed-length digest; a gather only
after the agreement digest matched), so a disagreement can be reported instead of hanging. Each one waits at most
``timeout`` seconds (the sentinel's ``timeout=``): a member that never joins — it runs without the sentinel, samples
another unit, stalled or died — gives a :class:`CollectiveTimeout` naming the collective and the group, not a hang.

Example::

    rows = exchange(group, {"cp_size": 2, "pending": 0}, collective_device(group))   # one dict per rank
    full = gather_zigzag(local, cu, scope, dim=1)        # [.., T, ..]: the group's shards back in global order
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..groups import group_ranks
from ..scope import CPScope
from ..sharding import zigzag_indices

__all__ = ["me", "group_of", "same_scope", "describe", "collective_device", "exchange", "exchange_objects",
           "gather_zigzag", "all_gather_list", "all_reduce", "CollectiveTimeout", "DEFAULT_TIMEOUT_S", "wait_for"]

DEFAULT_TIMEOUT_S = 300.0  # the sentinel's default bound on any of its collectives (seconds)


def me() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def same_scope(a: CPScope, b: CPScope) -> bool:
    """Whether two scopes bind the same group at the same rank (any two CP1 scopes are the same)."""
    return a is b or (a.size == b.size and a.rank == b.rank and (a.size == 1 or a.group is b.group))


def describe(scope: CPScope) -> str:
    """``"CP1"`` or ``"CP2 rank 1"``: a scope in words, for reports."""
    return "CP1" if scope.size == 1 else f"CP{scope.size} rank {scope.rank}"


def group_of(scope: CPScope) -> tuple[int, ...]:
    """Global ranks of ``scope``'s group, in group order (``(0,)`` without a process group)."""
    return tuple(group_ranks(scope.group)) if dist.is_initialized() else (0,)


class CollectiveTimeout(RuntimeError):
    """A sentinel collective that did not complete in time: some member of the group never joined it."""


def collective_device(group: Optional[dist.ProcessGroup], hint: Optional[torch.device] = None) -> torch.device:
    """Where small tensors for collectives on ``group`` must live: a CUDA device under NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if str(backend).lower() == "nccl":
        if hint is not None and hint.type == "cuda":
            return hint
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(
    group: Optional[dist.ProcessGroup], values: dict[str, int], device: torch.device, *,
    timeout: Optional[float] = None, what: str = "agreement digest",
) -> list[dict[str, int]]:
    """All-gather one int64 vector per rank (``values`` in insertion order; same keys on every rank)."""
    names = list(values)
    mine = torch.tensor([int(values[n]) for n in names], dtype=torch.int64, device=device)
    return [dict(zip(names, p.tolist())) for p in all_gather_list(mine, group, timeout=timeout, what=what)]


def exchange_objects(group: Optional[dist.ProcessGroup], obj: Any) -> list[Any]:
    """All-gather a small picklable object (only on the rare path where a mismatch needs its details)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_zigzag(local: torch.Tensor, cu: Sequence[int], scope: CPScope, *, dim: int = 0,
                  timeout: Optional[float] = None) -> torch.Tensor:
    """The group's zigzag shards of one packed stream (offsets ``cu``), back in global order along ``dim``.

    ``local`` is this rank's shard (``cu[-1] / cp`` entries along ``dim``, same shape on every rank); the result
    has ``cu[-1]`` entries there. Under CP1 it is ``local`` itself.
    """
    cp = scope.size
    if cp == 1:
        return local
    parts = all_gather_list(local.contiguous(), scope.group, timeout=timeout, what="gather of the group's shards")
    shape = list(local.shape)
    shape[dim] = int(cu[-1])
    full = local.new_empty(shape)
    view = full.movedim(dim, 0)
    for r, part in enumerate(parts):
        view[zigzag_indices(list(cu), cp, r, device=local.device)] = part.movedim(dim, 0)
    return full


def all_gather_list(t: torch.Tensor, group: Optional[dist.ProcessGroup], *, timeout: Optional[float] = None,
                    what: str = "all_gather") -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in group order; waits at most ``timeout`` seconds."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    wait_for(dist.all_gather(parts, t, group=group, async_op=True), group, f"all_gather ({what})", timeout)
    return parts


def all_reduce(t: torch.Tensor, group: Optional[dist.ProcessGroup], *, timeout: Optional[float] = None,
               what: str = "all_reduce", op: Any = None) -> None:
    """Reduce ``t`` over ``group`` in place (``op``: default the sum); waits at most ``timeout`` seconds."""
    work = dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=True)
    wait_for(work, group, f"all_reduce ({what})", timeout)


def wait_for(work: Any, group: Optional[dist.ProcessGroup], name: str, timeout: Optional[float]) -> None:
    """Wait for ``work``; past ``timeout`` seconds raise :class:`CollectiveTimeout` naming the collective."""
    limit = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    try:
        work.wait(timedelta(seconds=limit))
    except RuntimeError as e:
        raise CollectiveTimeout(
            f"cpscope sentinel: the {name} over the group {group_ranks(group)} did not complete within {limit:g} s "
            f"on rank {dist.get_rank()}: a member of the group never joined it — the sentinel is off there or was "
            f"switched on at another point or with other options, it samples another microbatch, or it stalled or "
            f"died ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
