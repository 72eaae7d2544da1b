"""Creating planned blocks as process groups — each rank only its own — through one small dist layer.

:func:`create_blocks` makes, for each *step* (a set of disjoint blocks of global ranks), this rank's group, by one
of three methods:

``"split"``
    ``dist.split_group`` from a parent (the world, or the CP group): one call per step by every rank of the parent,
    each rank gets only its own communicator (NCCL ``ncclCommSplit``; no new bootstrap). Needs a default group bound
    to a device whose backend can split (NCCL with ``init_process_group(device_id=...)``).
``"local"``
    ``dist.new_group(block, use_local_synchronization=True)`` by the block's members only; other ranks make no
    call. gloo, and NCCL whose default group is *not* bound to a device (bound, torch would split every new group
    from the world communicator and a member would wait for non-members forever — torch PR #129965).
``"global"``
    ``dist.new_group(block)`` for every block by every rank (what torch's ``new_group`` demands without local
    synchronisation; the registry's behaviour before the local path existed). For MPI, TorchComms, or comparison.

Before creating, the participants (all ranks, or the CP group's members) exchange one small record each — a digest
of the arguments, how many groups torch has registered on the rank, whether its blocks are cached — by one
``all_gather`` of five int64 (a second, detailed exchange only when caches or counts differ between ranks).
Arguments that differ between ranks raise ``ValueError`` there instead of hanging later; a block is (re)created
when any member lacks it; and in ``"local"`` mode members whose torch group counts differ (torch names local groups
after that count) first create single-rank placeholder groups so that they agree
(:func:`cpscope.groups._rank_blocks.pad_schedule`).

:class:`TorchLayer` is the only place that calls ``torch.distributed``; a fake layer stands in for it to count the
calls at thousands of simulated ranks (``tests/_sim.py``, ``benchmarks/bench_groups.py``).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from ._rank_blocks import Block, pad_schedule

__all__ = ["TorchLayer", "Report", "create_blocks", "resolve_method", "METHODS", "digest"]

METHODS = ("auto", "split", "local", "global")


class TorchLayer:
    """The ``torch.distributed`` calls the registry makes (and nothing else)."""

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def world_size(self) -> int:
        return dist.get_world_size()

    def rank(self) -> int:
        return dist.get_rank()

    def world(self) -> Any:
        """The default group object; a new one after ``destroy_process_group()`` + ``init_process_group``."""
        return dist.group.WORLD

    def bound_device(self) -> Any:
        return getattr(dist.group.WORLD, "bound_device_id", None)

    def can_split(self) -> bool:
        device = self.bound_device()
        if device is None or not hasattr(dist, "split_group"):
            return False
        try:
            return bool(dist.group.WORLD._get_backend(device).supports_splitting)
        except Exception:  # noqa: BLE001 - no backend for that device: no split
            return False

    def local_name_count(self) -> Optional[int]:
        """What torch names a locally synchronised group after: its number of registered groups on this rank.
        ``None`` when torch's internals do not expose it (then the local path is not safe and is not used)."""
        world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
        names = getattr(world, "pg_names", None)
        return None if names is None else len(names)

    def local_ok(self) -> bool:
        c10d = getattr(dist, "distributed_c10d", None)
        torchcomms = getattr(c10d, "_use_torchcomms_enabled", lambda: False)
        return (dist.get_backend() != "mpi" and not torchcomms() and self.local_name_count() is not None)

    def all_gather(self, obj: Any, group: Any) -> list:
        out: list = [None] * (dist.get_world_size(group) if group is not None else dist.get_world_size())
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_gather_ints(self, values: Sequence[int], group: Any) -> list[list[int]]:
        """Every participant's ``values`` (same length everywhere): one ``all_gather`` of an int64 tensor on the
        group's device (a CUDA tensor for NCCL), or ``all_gather_object`` for other backends."""
        backend = str(dist.get_backend(group))
        if backend == "nccl":
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        elif "gloo" in backend:
            device = "cpu"
        else:
            return [list(v) for v in self.all_gather(list(values), group)]
        import torch

        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        n = dist.get_world_size(group) if group is not None else dist.get_world_size()
        out = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(out, mine, group=group)
        return torch.stack(out).cpu().tolist()

    def new_group(self, ranks: Sequence[int], *, local: bool) -> Any:
        return dist.new_group(list(ranks), use_local_synchronization=local)

    def split(self, parent: Any, split_ranks: Sequence[Sequence[int]]) -> Any:
        return dist.split_group(parent_pg=parent, split_ranks=[list(b) for b in split_ranks])

    def ranks_of(self, group: Any) -> list[int]:
        """``get_process_group_ranks(group)``; ``ValueError`` for the non-member sentinel or a destroyed group."""
        if group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
            raise ValueError("got GroupMember.NON_GROUP_MEMBER — this rank is not a member of that group")
        try:
            return list(dist.get_process_group_ranks(group))
        except KeyError:
            raise ValueError(
                f"{group!r} is not registered with torch.distributed (destroyed, or not a process group)"
            ) from None

    def registered(self, group: Any) -> bool:
        """``group`` is still a live process group (``destroy_process_group`` unregisters it)."""
        try:
            dist.get_process_group_ranks(group)
            return True
        except (KeyError, ValueError, RuntimeError):
            return False


@dataclass
class Report:
    """What one creation did on this rank (logged, and read by ``benchmarks/bench_groups.py``).

    ``calls``: ``new_group`` / ``split_group`` calls this rank made; ``lockstep``: how many of them every
    participant had to make too (each is a step of all participants; under NCCL bound to a device, a
    ``ncclCommSplit`` over the whole parent); ``created``: groups this rank is a member of, made now;
    ``placeholders``: single-rank groups made to align torch's local names; ``gathers``: record exchanges.
    """

    method: str
    calls: int = 0
    lockstep: int = 0
    created: int = 0
    placeholders: int = 0
    gathers: int = 0
    seconds: float = 0.0


def digest(*parts: Any) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def resolve_method(method: str, layer: TorchLayer, where: str, *, members_only: bool) -> str:
    """The concrete method for ``method`` (``"auto"`` picks split, else local, else global); ``ValueError`` if
    the asked one cannot work here."""
    if method not in METHODS:
        raise ValueError(f"{where}: method must be one of {METHODS}, got {method!r}")
    split_ok = layer.can_split()
    if method == "auto":
        if split_ok:
            return "split"
        if layer.bound_device() is None and layer.local_ok():
            return "local"
        if members_only:
            raise RuntimeError(
                f"{where}: cannot create groups among the CP group's members only with this backend (MPI or "
                f"TorchComms without a device-bound NCCL default group)"
            )
        return "global"
    if method == "split" and not split_ok:
        raise ValueError(
            f"{where}: method='split' needs a default group bound to a device whose backend can split (NCCL, "
            f"init_process_group(..., device_id=torch.device('cuda', local_rank))); bound device: "
            f"{layer.bound_device()}. Use method='auto'"
        )
    if method == "local":
        if layer.bound_device() is not None:
            raise ValueError(
                f"{where}: method='local' would hang: the default group is bound to {layer.bound_device()}, so "
                f"torch splits every new group from the world communicator and needs every rank in each split. "
                f"Use method='auto' (split_group)"
            )
        if not layer.local_ok():
            raise ValueError(f"{where}: method='local' is not available with this backend / torch build")
    if method == "global" and members_only:
        raise ValueError(f"{where}: method='global' needs every rank of the job; use 'auto', 'split' or 'local'")
    return method


def create_blocks(
    layer: TorchLayer,
    steps: Sequence[Sequence[Block]],
    *,
    mine: Sequence[Optional[Block]],
    domain: Sequence[int],
    method: str,
    fingerprint: str,
    summary: str,
    participants: Any,
    participant_ranks: Sequence[int],
    cached: Callable[[Block], Any],
    where: str,
    used: Optional[dict] = None,
) -> tuple[list[Any], Report]:
    """This rank's group for each step (``None`` where it is in no block), creating what is missing.

    ``steps[k]`` partitions ``domain`` (the ranks in blocks) and ``mine[k]`` is this rank's block in it (``None``
    off the domain). ``participants`` is the group every participant calls this through (``None``: the world)
    and ``participant_ranks`` its global ranks in group-rank order; it is also the parent for ``"split"``.
    ``cached(block)`` returns a live cached group for a block of this rank, or ``None``. ``used`` maps a block to
    the lowest torch group count not yet used to name it on this rank (``"local"``; updated here).

    The record exchange is one ``all_gather`` of five int64 per rank; only when the ranks' caches or torch group
    counts differ (a partial cache, groups of the user's own on some ranks) does a second, detailed one follow.
    """
    t0 = time.perf_counter()
    report = Report(method)
    if not steps:  # CP1 only: nothing to create, nothing that could hang
        return [], report
    job = _Creation(layer, steps, list(mine), domain, method, participants, participant_ranks, where,
                    {} if used is None else used, report)
    out = [cached(b) if b is not None else None for b in mine]
    todo, pads = job.exchange(out, fingerprint, summary)
    if method == "global":
        job.make_global(todo, out)
    elif method == "split":
        job.make_split(todo, out)
    else:
        job.make_local(todo, pads, out)
    report.seconds = time.perf_counter() - t0
    return out, report


@dataclass
class _Creation:
    """One :func:`create_blocks` call on this rank: the agreement on what to create, then the creation itself."""

    layer: TorchLayer
    steps: Sequence[Sequence[Block]]
    mine: list[Optional[Block]]
    domain: Sequence[int]
    method: str
    participants: Any
    participant_ranks: Sequence[int]
    where: str
    used: dict
    report: Report
    pos: dict[int, int] = field(default_factory=dict)  # a participant's global rank -> its rank among them

    def exchange(self, have: list[Any], fingerprint: str, summary: str) -> tuple[list[tuple], list[dict[int, int]]]:
        """Agree with the other participants on the blocks to create at each step (and, ``"local"``, the
        placeholders each member makes first); ``ValueError`` when their arguments differ."""
        mine, layer = self.mine, self.layer
        mask = sum(1 << k for k, (b, h) in enumerate(zip(mine, have)) if b is not None and h is None)
        count = layer.local_name_count() if self.method == "local" else 0
        floors = tuple(self.used.get(b, 0) if b is not None else 0 for b in mine)
        slack = max((f - k for k, f in enumerate(floors) if f), default=-1)  # pads are needed iff slack > count
        fp = int(fingerprint[:15], 16)
        mine_steps = sum(1 << k for k, b in enumerate(mine) if b is not None)
        brief = layer.all_gather_ints([fp, count, int(mask == mine_steps), int(mask == 0), slack], self.participants)
        self.report.gathers += 1
        odd = [self.participant_ranks[i] for i, rec in enumerate(brief) if rec[0] != fp]
        if odd:
            raise ValueError(
                f"{self.where} is collective: every rank must pass the same arguments. This rank ({layer.rank()}) "
                f"passed {summary}; ranks {odd[:8]}{' …' if len(odd) > 8 else ''} passed different ones"
            )
        self.pos = {r: i for i, r in enumerate(self.participant_ranks)}
        on = [brief[self.pos[r]] for r in self.domain]
        uniform_count = all(rec[1] == on[0][1] and rec[4] <= rec[1] for rec in on)
        if all(rec[2] for rec in on) and (self.method != "local" or uniform_count):
            # nothing cached anywhere; local names agree without pads
            return [tuple(blocks) for blocks in self.steps], [{} for _ in self.steps]
        if all(rec[3] for rec in on):  # everything cached everywhere
            return [() for _ in self.steps], [{} for _ in self.steps]
        records = layer.all_gather((mask, floors), self.participants)  # mixed: exchange the details
        self.report.gathers += 1
        todo = [tuple(b for b in blocks if any(records[self.pos[r]][0] >> k & 1 for r in b))
                for k, blocks in enumerate(self.steps)]
        floor = {b: max(records[self.pos[r]][1][k] for r in b) for k, blocks in enumerate(todo) for b in blocks}
        counts = {r: brief[self.pos[r]][1] for r in self.domain}
        return todo, (pad_schedule(todo, counts, floor) if self.method == "local" else [])

    def make_global(self, todo: list[tuple], out: list[Any]) -> None:
        """Every participant creates every block (torch's ``new_group`` without local synchronisation)."""
        for k, blocks in enumerate(todo):
            for b in blocks:
                h = self.layer.new_group(b, local=False)
                self.report.calls += 1
                self.report.lockstep += 1
                if b == self.mine[k]:
                    out[k] = h
                    self.report.created += 1

    def make_split(self, todo: list[tuple], out: list[Any]) -> None:
        """One ``split_group`` of the parent per step, by every participant."""
        for k, blocks in enumerate(todo):
            if not blocks:
                continue
            h = self.layer.split(self.participants, [[self.pos[r] for r in b] for b in blocks])  # parent ranks
            self.report.calls += 1
            self.report.lockstep += 1
            if self.mine[k] in blocks:
                out[k] = h
                self.report.created += 1

    def make_local(self, todo: list[tuple], pads: list[dict[int, int]], out: list[Any]) -> None:
        """Each member creates its own block, after the placeholders that align torch's local group names."""
        layer, me = self.layer, self.layer.rank()
        count = layer.local_name_count()
        for k, blocks in enumerate(todo):
            if self.mine[k] is None or self.mine[k] not in blocks:
                continue
            for _ in range(pads[k].get(me, 0)):
                layer.new_group([me], local=True)  # torch keeps it registered; it aligns the next name
                self.report.calls += 1
                self.report.placeholders += 1
                count += 1
            now = layer.local_name_count()
            if now != count:
                raise RuntimeError(
                    f"{self.where}: torch's group count on rank {me} is {now}, expected {count} (another thread "
                    f"creating process groups meanwhile?); refusing to create a group its peers would name otherwise"
                )
            out[k] = layer.new_group(self.mine[k], local=True)
            self.report.calls += 1
            self.report.created += 1
            count += 1
            self.used[self.mine[k]] = count  # its name used count - 1: never again for these ranks
