"""The data-parallel reductions of a hybrid-CP step, over a group that is always named.

Every function here takes its group explicitly, and ``None`` means what it means everywhere in cpscope: **this
rank alone** (nothing to reduce) — never the world, as it does in ``torch.distributed``. The world is passed as
``dist.group.WORLD``. (Under tensor parallelism the data-parallel group is not the world: the ranks of a
tensor-parallel group hold the same tokens, and a reduction over the world would count their targets twice.)

The *data-parallel group* ``dp_group`` of a step is the set of ranks that hold **different** targets of the global
batch: the ranks the plan's CP groups were carved from (every CP group lies inside it). Without tensor or pipeline
parallelism it is the world.

* :func:`allreduce_sum` — one scalar (or tensor) summed over a group;
* :func:`allreduce_gradients` — every parameter's gradient summed over ``dp_group`` (bucketed; missing gradients
  count as zeros);
* :func:`check_dp_group` / :func:`check_within` — the checks the loop and the syncs make before any collective.

Example::

    n = allreduce_sum(local_count, group=dist.group.WORLD).item()
    allreduce_gradients(model, dp_group=dp_group)          # after the step's last backward
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..groups import group_ranks

__all__ = ["allreduce_sum", "allreduce_gradients", "check_dp_group", "check_within", "group_size", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    """``1`` for ``None`` (this rank alone), else ``dist.get_world_size(group)``."""
    return 1 if group is None else dist.get_world_size(group)


def check_dp_group(dp_group: Any, where: str) -> Group:
    """``dp_group`` if it is ``None`` or a process group this rank belongs to, else ``ValueError`` naming it.

    Example::

        check_dp_group(dist.group.WORLD, "run_step")
    """
    if dp_group is None:
        return None
    if dp_group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
        raise ValueError(f"{where}: dp_group is GroupMember.NON_GROUP_MEMBER — this rank is not a member of it")
    if not isinstance(dp_group, dist.ProcessGroup):
        raise ValueError(f"{where}: dp_group must be a torch.distributed ProcessGroup (dist.group.WORLD for the "
                         f"world) or None (this rank alone), got {type(dp_group).__name__} {dp_group!r}")
    try:
        group_ranks(dp_group)
    except ValueError as e:
        raise ValueError(f"{where}: dp_group {dp_group!r}: {e}") from None
    return dp_group


def check_within(groups: Iterable[Group], dp_group: Group, where: str) -> None:
    """Every (CP) group must lie inside ``dp_group``: the targets are counted and the gradients summed over it.

    Raises:
        ValueError: a group with a rank outside ``dp_group``, naming both (before any collective).

    Example::

        check_within([mb.group for mb in mbs], dist.group.WORLD, "run_microbatches")
    """
    if dp_group is not None and dp_group is dist.group.WORLD:
        return  # every group lies inside the world
    members: Optional[set[int]] = None
    seen: set[int] = set()
    for g in groups:
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        members = set(group_ranks(dp_group)) if members is None else members
        outside = sorted(set(group_ranks(g)) - members)
        if outside:
            raise ValueError(
                f"{where}: a CP group with global ranks {group_ranks(g)} reaches outside the data-parallel group "
                f"{sorted(members)} (ranks {outside}); targets are counted and gradients summed over dp_group, so "
                f"it must hold every rank of the plan's CP groups (build them with new_cp_groups(..., ranks=<the "
                f"dp ranks>), or pass the right dp_group: dist.group.WORLD without tensor parallelism)"
            )


def allreduce_sum(value: Union[int, float, torch.Tensor], *, group: Group,
                  device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """Sum a scalar (or tensor) over ``group``; float64 for floats, int64 for ints. Collective over ``group``.

    ``group=None`` is this rank alone (no collective: the value itself); the world is ``dist.group.WORLD``.
    ``device`` must suit the backend (a CUDA device for NCCL). Without ``torch.distributed`` every group is this
    rank alone.

    Example::

        n = allreduce_sum(local_count, group=dist.group.WORLD).item()
    """
    t = torch.as_tensor(value).detach().clone()
    t = t.to(torch.int64 if not t.is_floating_point() else torch.float64)
    if device is not None:
        t = t.to(device)
    if group is not None and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> Iterator[list[nn.Parameter]]:
    """Consecutive runs of parameters of one (device, dtype) holding at most ``bucket_bytes`` (at least one)."""
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and (size + nbytes > bucket_bytes or (p.grad.device, p.grad.dtype) != (
                bucket[0].grad.device, bucket[0].grad.dtype)):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket


def allreduce_gradients(
    model_or_params: Union[nn.Module, Iterable[nn.Parameter]],
    *,
    dp_group: Group,
    average: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sum (or average) the gradients of every parameter over ``dp_group``, in place. Collective over it.

    ``dp_group`` is the data-parallel group (module docstring; ``dist.group.WORLD`` without tensor parallelism,
    ``None`` for one rank: nothing to do). With the loop's normalisation (:func:`cpscope.train.run_microbatches`)
    the **sum** is the gradient of the global per-token loss; use ``average=True`` only with a loss normalised per
    rank. A parameter without ``.grad`` on this rank (no local token reached it) takes part as zeros, so every rank
    issues the same collectives; one that has no gradient on **any** rank keeps ``grad = None`` (as DDP leaves
    unused parameters, so an optimizer skips it exactly as a single process would). Gradients are reduced in
    buckets of at most ``bucket_bytes`` of one (device, dtype), in parameter order, plus one small all-reduce of
    which parameters have a gradient.

    Example::

        allreduce_gradients(model, dp_group=dist.group.WORLD)     # after the last backward of the step
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    dp_group = check_dp_group(dp_group, "allreduce_gradients")
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    params = [p for p in params if p.requires_grad]
    if dp_group is None or not dist.is_initialized() or not params:
        return
    device = next((p.grad.device for p in params if p.grad is not None), params[0].device)
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.SUM, group=dp_group)
    params = [p for p, n in zip(params, has.cpu().tolist()) if n > 0]  # unused everywhere: stays None, no traffic
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    order = sorted(range(len(params)), key=lambda i: (str(params[i].grad.device), str(params[i].grad.dtype), i))
    for bucket in _buckets([params[i] for i in order], bucket_bytes):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
        if average:
            flat /= group_size(dp_group)
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
