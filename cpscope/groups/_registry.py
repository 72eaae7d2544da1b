"""A registry of pre-built CP groups: :func:`new_cp_groups`, :func:`hierarchical_cp_groups` and :func:`group_ranks`.

Hybrid CP switches groups per microbatch, and creating a process group is a collective that costs milliseconds,
so every group is created once, up front, and cached. Each rank creates **only its own** groups (one per size):
``split_group`` from the world communicator under NCCL bound to a device, else ``new_group(...,
use_local_synchronization=True)`` among the block's members (:mod:`cpscope.groups._create`); with
``sizes=[1, 2, 4, …, N]`` a rank makes ~log₂N calls instead of ~2N.

**Member order.** A group's CP ranks are its members in **ascending global rank** — torch's own numbering, which
``dist.get_rank(group)`` and so :func:`cpscope.cp_rank`, the zigzag shards, the ring's neighbours and TE's
``cp_global_ranks`` all follow. The order of ``ranks`` inside a block only chooses membership: a block listed out
of order (``ranks=[2, 3, 0, 1]`` at size 4, a cross-node interleaving ``[0, 4, 1, 5, …]``) is sorted (and logged at
INFO). :func:`group_ranks` always returns ``torch.distributed.get_process_group_ranks(group)``.

**Stale entries.** The registry holds its groups weakly (torch keeps a group alive until it is destroyed) and
checks them before returning them. After ``dist.destroy_process_group()`` and a new ``init_process_group`` the
registry starts afresh on its own. A cached group destroyed on its own (``destroy_process_group(group)``) is never
returned: the call raises ``RuntimeError`` asking for :func:`clear_cp_group_cache` on every rank first.

Example::

    dist.init_process_group("gloo")                      # 4 ranks
    groups = cpscope.new_cp_groups([1, 2, 4])            # {1: None, 2: <ranks 0-1 or 2-3>, 4: <all>}
    inner, outer = cpscope.groups.hierarchical_cp_groups(groups[4], 2)   # a2a inside pairs, ring across them
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import torch.distributed as dist

from ._rank_blocks import Block, as_int, hierarchical_blocks, plan_cp_blocks
from ._create import Report, TorchLayer, create_blocks, digest, resolve_method

__all__ = ["new_cp_groups", "hierarchical_cp_groups", "lookup_hierarchical", "group_ranks", "clear_cp_group_cache"]

logger = logging.getLogger(__name__)

_TORCH = TorchLayer()
_LAYER = _TORCH  # creation goes through this; a SimulatedLayer stands in for it in simulations
_LOCK = threading.RLock()
_LAST_REPORT: Optional[Report] = None


@dataclass
class _Registry:
    """Everything cached for one world (one default process group)."""

    world: "weakref.ref[Any]"
    blocks: dict[Block, "weakref.ref[Any]"] = field(default_factory=dict)  # own blocks -> group
    calls: dict[tuple, dict[int, Optional[tuple[Block, "weakref.ref[Any]"]]]] = field(default_factory=dict)


_STATE: Optional[_Registry] = None
# Per world, the torch group counts already used to name each block locally (kept across clear_cp_group_cache:
# a destroyed group's name must not come back, its stale addresses are still in the store).
_USED: "weakref.WeakKeyDictionary[Any, dict[Block, int]]" = weakref.WeakKeyDictionary()


def _registry() -> _Registry:
    global _STATE
    world = _LAYER.world()
    if _STATE is None or _STATE.world() is not world:  # first use, or a new world after destroy + init
        _STATE = _Registry(weakref.ref(world))
    return _STATE


def _live(ref: Optional["weakref.ref[Any]"]) -> Any:
    group = ref() if ref is not None else None
    return group if group is not None and _LAYER.registered(group) else None


def _cached_hit(entry: dict, where: str) -> dict:
    out = {}
    for key, item in entry.items():
        if item is None:
            out[key] = None
            continue
        block, ref = item
        group = _live(ref)
        if group is None:
            raise RuntimeError(
                f"{where}: the cached group {key!r} (global ranks {list(block)}) has been destroyed; call "
                f"cpscope.clear_cp_group_cache() on every rank, then create the groups again"
            )
        out[key] = group
    return out


def _create(steps: Sequence[Sequence[Block]], mine: Sequence[Optional[Block]], domain: Sequence[int], how: str,
            fingerprint: str, summary: str, participants: Any, participant_ranks: Sequence[int],
            where: str) -> list[Any]:
    global _LAST_REPORT
    reg = _registry()
    handles, report = create_blocks(
        _LAYER, steps, mine=mine, domain=domain, method=how, fingerprint=fingerprint, summary=summary,
        participants=participants,
        participant_ranks=participant_ranks, cached=lambda b: _live(reg.blocks.get(b)), where=where,
        used=_USED.setdefault(_LAYER.world(), {}),
    )
    for block, handle in zip(mine, handles):
        if block is not None and handle is not None:
            reg.blocks[block] = weakref.ref(handle)
    _LAST_REPORT = report
    logger.info("%s: %s — %d group calls (%d in lockstep), %d groups created, %d placeholders, %.3f s",
                where, how, report.calls, report.lockstep, report.created, report.placeholders, report.seconds)
    return handles


def new_cp_groups(
    sizes: Iterable[int], ranks: Optional[Sequence[int]] = None, *, method: str = "auto",
    hierarchical: Union[bool, Iterable[int]] = False,
) -> dict[int, Optional[dist.ProcessGroup]]:
    """Create (once) the CP groups of each size and return, per size, the group this rank belongs to.

    **Collective**: every rank of the job calls it with the same arguments. For each size ``s``, ``ranks``
    (default: all ranks, in order) is split into aligned contiguous blocks ``ranks[0:s], ranks[s:2s], …``; the result
    maps ``s`` to the group of the block holding this rank. Size 1 maps to ``None`` (CP1). A rank that is not in
    ``ranks`` gets no entries. A group's CP ranks ascend with the global ranks, whatever the order inside the block
    (module docstring). Calling again with the same arguments performs no collective and returns the same groups.

    Each rank creates only its own blocks: ``method="auto"`` uses ``split_group`` when the default group is bound to
    an NCCL device, else ``new_group(..., use_local_synchronization=True)`` by the members only; ``"split"``,
    ``"local"`` force one, ``"global"`` is torch's every-rank-every-block ``new_group`` (for comparison, MPI).
    Creating starts with one small ``all_gather`` over the world (five int64 per rank), so arguments that differ
    between ranks raise ``ValueError`` instead of hanging.

    Args:
        sizes: CP sizes wanted, e.g. ``[1, 2, 4]``. Each must be ≥ 1 and divide ``len(ranks)``.
        ranks: the global ranks to split (e.g. one data-parallel replica's ranks); default the whole world.
        method: ``"auto"`` | ``"split"`` | ``"local"`` | ``"global"``.
        hierarchical: also make, up front, the ``(inner, outer)`` sub-groups of ``comm="a2a+p2p:N"``
            (:func:`hierarchical_cp_groups`) for every group made: ``True`` for every proper divisor ``N`` of each
            size, or the inner sizes wanted (those dividing a size are made for it). Attention never creates them.

    Raises:
        ValueError: a size that is < 1 or does not divide ``len(ranks)``; duplicate or out-of-range ranks; a method
            that cannot work here (``"local"`` with a device-bound NCCL default group would hang); arguments that
            differ between ranks.
        RuntimeError: ``torch.distributed`` is not initialised; a cached group was destroyed (see
            :func:`clear_cp_group_cache`).

    Example::

        dist.init_process_group("gloo")                 # 4 ranks
        groups = cpscope.new_cp_groups([1, 2, 4])       # {1: None, 2: <group of 2>, 4: <group of 4>}
        with cpscope.runtime_cp(groups[2]):
            ...
        cpscope.new_cp_groups([4], ranks=[2, 3, 0, 1])[4]   # ranks 0, 1, 2, 3 with CP ranks 0, 1, 2, 3
    """
    if not _LAYER.is_initialized():
        raise RuntimeError("new_cp_groups needs torch.distributed to be initialised (dist.init_process_group)")
    plan = plan_cp_blocks(sizes, ranks, world=_LAYER.world_size())
    with _LOCK:
        how = resolve_method(method, _LAYER, "new_cp_groups", members_only=False)
        key = ("new_cp_groups", plan.sizes, plan.ranks, how)
        reg = _registry()
        if key in reg.calls:
            out = _cached_hit(reg.calls[key], "new_cp_groups")
            _make_hierarchical(out, hierarchical, method)
            return out
        if plan.reordered:
            logger.info("new_cp_groups: blocks %s are numbered in ascending global rank (torch's group order): %s",
                        list(map(list, plan.reordered[:4])), [sorted(b) for b in plan.reordered[:4]])
        ranks_short = list(plan.ranks[:8]) + (["…"] if len(plan.ranks) > 8 else [])
        summary = f"sizes={list(plan.sizes)}, ranks={ranks_short} ({len(plan.ranks)}), method={how}"
        me = _LAYER.rank()
        mine = [plan.block_of(me, s) for s in plan.sizes if s > 1]
        handles = iter(_create(plan.steps(), mine, plan.ranks, how, digest(*key), summary, None,
                               range(_LAYER.world_size()), "new_cp_groups"))
        entry: dict[int, Optional[tuple[Block, Any]]] = {}
        out: dict[int, Optional[dist.ProcessGroup]] = {}
        for s in plan.sizes:
            handle = next(handles) if s > 1 else None
            block = plan.block_of(me, s)
            if block is None:
                continue
            out[s] = handle
            entry[s] = None if s == 1 else (block, weakref.ref(handle))
        reg.calls[key] = entry
    _make_hierarchical(out, hierarchical, method)
    return out


def _make_hierarchical(groups: dict[int, Optional[dist.ProcessGroup]], inners: Union[bool, Iterable[int]],
                       method: str) -> None:
    """:func:`hierarchical_cp_groups` for each group of ``groups`` and each wanted inner size (see
    :func:`new_cp_groups`); every member of each group runs the same calls, in the same order."""
    if inners is False:
        return
    wanted = None if inners is True else sorted({as_int(m, "hierarchical", "new_cp_groups") for m in inners})
    for size, group in sorted(groups.items()):
        for m in range(2, size):
            if size % m == 0 and (wanted is None or m in wanted):
                hierarchical_cp_groups(group, m, method=method)


def _hierarchy(group: Optional[dist.ProcessGroup], inner: int, where: str) -> tuple[Optional[tuple], Any]:
    """``(None, (inner, outer))`` when the answer needs no new group (CP1, ``inner`` 1 or the CP size), else
    ``((cp_ranks, inner_blocks, outer_blocks), None)``; ``ValueError`` for a bad ``inner`` or group."""
    try:
        cp_ranks = [_LAYER.rank()] if group is None else _LAYER.ranks_of(group)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if len(cp_ranks) == 1:
        m = as_int(inner, "inner", where)
        if m != 1:
            raise ValueError(f"{where}: inner {m} does not divide the CP size 1 (CP1); use inner=1")
        return None, (None, None)
    inner_blocks, outer_blocks = hierarchical_blocks(cp_ranks, inner, where)
    m, n = len(inner_blocks[0]), len(cp_ranks)
    if m == n:
        return None, (group, None)
    if m == 1:
        return None, (None, group)
    return (tuple(cp_ranks), inner_blocks, outer_blocks), None


def hierarchical_cp_groups(
    group: Optional[dist.ProcessGroup], inner: int, *, method: str = "auto"
) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """This rank's ``(inner, outer)`` sub-groups of a CP group, for all-to-all inside and a ring across.

    For a CP group of size ``n`` and ``inner = m`` dividing ``n``: the inner group holds the ``m`` consecutive CP
    ranks ``m·⌊c/m⌋ … m·⌊c/m⌋+m-1`` around this rank's CP rank ``c``; the outer group the ``n/m`` CP ranks with the
    same index ``c mod m`` inside their inner group. Both number their members in CP order: this rank is rank
    ``c mod m`` of the inner group and rank ``⌊c/m⌋`` of the outer one, so a zigzag ring over the outer group visits
    the inner groups in CP order. Size-1 sub-groups are ``None``; ``m == n`` returns ``(group, None)``, ``m == 1``
    ``(None, group)``. Any ``m`` dividing ``n`` works (``n = 6``: ``m`` in 1, 2, 3, 6).

    **Collective among the CP group's members only** (each calls it with the same ``inner``); other ranks do
    nothing. Created once (``split_group`` from ``group`` under NCCL bound to a device, else locally synchronised
    ``new_group`` calls) and cached; a sub-group equal to an existing registry block is shared with it. Create
    them up front, before training: a consumer inside a forward (attention's ``comm="a2a+p2p"``) only looks them up
    (:func:`lookup_hierarchical`), since a collective there could run during recompute or graph capture.

    Raises:
        ValueError: ``inner`` not an int ≥ 1 dividing the CP size; a CP group whose ranks do not ascend (every
            group from :func:`new_cp_groups` ascends); this rank not a member; ``inner`` differing between
            members.

    Example::

        groups = cpscope.new_cp_groups([8])             # 8 ranks, 2 nodes of 4
        inner, outer = hierarchical_cp_groups(groups[8], 4)
        # inner: this node's 4 ranks (Ulysses all-to-all), outer: the 2 ranks with the same local index (ring)
    """
    where = "hierarchical_cp_groups"
    todo, trivial = _hierarchy(group, inner, where)
    if todo is None:
        return trivial
    cp_ranks, inner_blocks, outer_blocks = todo
    m, n = len(inner_blocks[0]), len(cp_ranks)
    with _LOCK:
        how = resolve_method(method, _LAYER, where, members_only=True)
        key = (where, cp_ranks, m, how)
        reg = _registry()
        if key in reg.calls:
            hit = _cached_hit(reg.calls[key], where)
            return hit["inner"], hit["outer"]
        summary = f"CP group {list(cp_ranks[:8])}{'…' if n > 8 else ''} ({n}), inner={m}, method={how}"
        c = cp_ranks.index(_LAYER.rank())
        mine = [inner_blocks[c // m], outer_blocks[c % m]]
        pair = _create([inner_blocks, outer_blocks], mine, cp_ranks, how, digest(*key), summary, group,
                       cp_ranks, where)
        reg.calls[key] = {"inner": (mine[0], weakref.ref(pair[0])), "outer": (mine[1], weakref.ref(pair[1]))}
        return pair[0], pair[1]


def lookup_hierarchical(
    group: Optional[dist.ProcessGroup], inner: int
) -> Optional[tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]]:
    """The ``(inner, outer)`` pair :func:`hierarchical_cp_groups` returned for ``group`` and ``inner``, or ``None``
    when it has not been created yet on this rank. **Never communicates, never creates a group**.

    For a forward, a backward or a recompute, where creating a group (a collective) must not happen: a consumer
    looks the pair up and, on ``None``, refuses with an error that says to call
    ``hierarchical_cp_groups(group, inner)`` on every member up front. Pairs that need no new group — CP1, ``inner``
    1 or the CP size — are answered at once (``(None, None)``, ``(None, group)``, ``(group, None)``). A pair created
    with any ``method`` is found.

    Raises:
        ValueError: as :func:`hierarchical_cp_groups` (``inner`` not dividing the CP size, a non-member, ranks that
            do not ascend).
        RuntimeError: the cached pair was destroyed (call :func:`clear_cp_group_cache` on every rank, then create
            the pair again).

    Example::

        pair = lookup_hierarchical(group, 4)
        if pair is None:
            raise ValueError("comm='a2a+p2p:4' needs cpscope.hierarchical_cp_groups(group, 4) on every member "
                             "before training")
        inner, outer = pair
    """
    where = "lookup_hierarchical"
    todo, trivial = _hierarchy(group, inner, where)
    if todo is None:
        return trivial
    cp_ranks, inner_blocks, _ = todo
    m = len(inner_blocks[0])
    with _LOCK:
        reg = _registry()
        for key, entry in reg.calls.items():
            if key[:3] == ("hierarchical_cp_groups", cp_ranks, m):
                hit = _cached_hit(entry, where)
                return hit["inner"], hit["outer"]
    return None


def group_ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    """Global ranks of ``group`` by group rank — ``torch.distributed.get_process_group_ranks(group)``, the order
    :func:`cpscope.cp_rank` follows (TE's ``cp_global_ranks``); ``[this rank]`` for CP1 (``None``).

    Raises:
        ValueError: ``group`` is ``GroupMember.NON_GROUP_MEMBER`` (this rank is not in it) or is not registered
            with ``torch.distributed`` (destroyed).

    Example::

        groups = cpscope.new_cp_groups([2])            # on 4 ranks
        cpscope.group_ranks(groups[2])                 # [0, 1] on ranks 0-1, [2, 3] on ranks 2-3
    """
    if group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    try:
        return _TORCH.ranks_of(group)
    except ValueError as e:
        raise ValueError(f"group_ranks: {e}") from None


def clear_cp_group_cache() -> None:
    """Forget every cached group (it does not destroy them). Call it on **every** rank, or on none: a rank that
    still has a call cached returns at once while the others create collectively.

    Needed only after destroying a group that the registry returned (the next call would otherwise raise); after
    ``dist.destroy_process_group()`` and a new ``init_process_group`` the registry starts afresh by itself.

    Example::

        dist.destroy_process_group(groups[2])          # on the members of that group
        cpscope.clear_cp_group_cache()                 # on every rank
        groups = cpscope.new_cp_groups([1, 2])         # new groups
    """
    global _STATE
    with _LOCK:
        _STATE = None
