"""Groups for tensor parallelism beside runtime CP: per CP size, the CP group and the ``[tp, cp]`` group.

With tensor parallelism of ``t``, the ranks of a ``[tp, dp, cp]`` domain are numbered as Megatron numbers them
(``order="tp-cp-ep-dp-pp"``: the TP rank runs fastest): ``ranks[i]`` has TP rank ``i % t`` and sits at DP×CP
position ``i // t``. A CP-``k`` microbatch runs on ``k`` consecutive positions; per CP size the registry then needs

``cp``
    the ``k`` ranks of those positions with this rank's TP rank (attention's ring, RoPE's rows, the zigzag shard:
    what :func:`cpscope.runtime_cp` binds);
``tp_cp``
    all ``k · t`` ranks of those positions (the MoE router's ``tp_cp_group``: its auxiliary losses and token counts);
``tp_dp_cp``
    the whole domain (the router's ``tp_dp_cp_group``: the global auxiliary loss), the same for every size.

:func:`new_tp_cp_groups` creates them all, collectively and once, before training, through the registry's own
creation path (each rank only its own groups; a block equal to one :func:`~cpscope.groups.new_cp_groups` made is
shared). A consumer inside a forward only looks them up with :func:`lookup_tp_cp`, which never communicates.

Example::

    # 8 ranks, TP2: positions 0-3, TP rank = global rank % 2
    g = new_tp_cp_groups([1, 2, 4], tp_size=2)
    g[2].cp        # rank 5: ranks [5, 7] (its TP rank, positions 2-3)
    g[2].tp_cp     # rank 5: ranks [4, 5, 6, 7]
    g[1].tp_cp     # rank 5: ranks [4, 5] (its TP group); g[1].cp is None (CP1)
    lookup_tp_cp(g[2].cp, tp_ranks=[4, 5])   # in a forward: g[2].tp_cp, no collective
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional, Sequence

import torch.distributed as dist

from . import _registry as _reg
from ._rank_blocks import Block, as_int
from ._create import digest, resolve_method

__all__ = ["TPCPGroups", "TPCPPlan", "plan_tp_cp_blocks", "new_tp_cp_groups", "lookup_tp_cp"]

logger = logging.getLogger(__name__)

_WHERE = "new_tp_cp_groups"


class TPCPGroups(NamedTuple):
    """This rank's groups for one CP size (``None`` where the group would have one rank)."""

    cp: Optional[dist.ProcessGroup]
    tp_cp: Optional[dist.ProcessGroup]
    tp_dp_cp: Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class TPCPPlan:
    """The blocks of :func:`new_tp_cp_groups` (pure: every rank computes the same plan).

    ``cp[k]`` / ``tp_cp[k]``: per CP size the blocks (sorted tuples of global ranks) partitioning ``ranks``;
    ``domain``: all of ``ranks``, sorted (the ``[tp, dp, cp]`` block).
    """

    tp: int
    ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    cp: dict[int, tuple[Block, ...]]
    tp_cp: dict[int, tuple[Block, ...]]
    domain: Block

    def block_of(self, rank: int, blocks: Sequence[Block]) -> Optional[Block]:
        return next((b for b in blocks if rank in b), None)


def plan_tp_cp_blocks(sizes: Iterable[int], tp_size: int, ranks: Optional[Sequence[int]], *,
                      world: int) -> TPCPPlan:
    """Validate :func:`new_tp_cp_groups`' arguments and plan its blocks (module docstring; no collective).

    Example::

        >>> p = plan_tp_cp_blocks([1, 2], 2, None, world=4)
        >>> p.cp[2], p.tp_cp[2], p.tp_cp[1]
        (((0, 2), (1, 3)), ((0, 1, 2, 3),), ((0, 1), (2, 3)))

    Raises:
        ValueError: ``tp_size`` not an int ≥ 1 dividing ``len(ranks)``; a CP size that does not divide the
            ``len(ranks) / tp_size`` DP×CP positions; ranks that are not distinct global ranks.
    """
    tp = as_int(tp_size, "tp_size", _WHERE)
    domain = list(range(world)) if ranks is None else [as_int(r, "rank", _WHERE) for r in ranks]
    wanted = [as_int(s, "CP size", _WHERE) for s in sizes]
    if not domain or len(set(domain)) != len(domain) or min(domain) < 0 or max(domain) >= world:
        raise ValueError(f"{_WHERE}: ranks must be distinct global ranks in [0, {world}), got {domain[:16]}")
    if tp < 1 or len(domain) % tp:
        raise ValueError(f"{_WHERE}: tp_size {tp} does not divide the {len(domain)} ranks of the [tp, dp, cp] domain")
    positions = len(domain) // tp
    bad = [s for s in wanted if s < 1 or positions % s]
    if bad:
        divisors = [d for d in range(1, positions + 1) if positions % d == 0]
        raise ValueError(
            f"{_WHERE}: CP sizes {bad} do not divide the {positions} DP×CP positions ({len(domain)} ranks / "
            f"tp_size {tp}); use divisors of {positions}: {divisors}"
        )
    distinct = tuple(dict.fromkeys(wanted))
    cp: dict[int, tuple[Block, ...]] = {}
    tp_cp: dict[int, tuple[Block, ...]] = {}
    for s in distinct:
        cp[s] = tuple(tuple(sorted(domain[(b * s + j) * tp + t] for j in range(s)))
                      for b in range(positions // s) for t in range(tp))
        tp_cp[s] = tuple(tuple(sorted(domain[b * s * tp:(b + 1) * s * tp])) for b in range(positions // s))
    return TPCPPlan(tp, tuple(domain), distinct, cp, tp_cp, tuple(sorted(domain)))


def _steps(plan: TPCPPlan) -> list[tuple[Block, ...]]:
    """The blocks to create, step by step (each a partition of the domain); single ranks need no group."""
    steps = [plan.cp[s] for s in plan.sizes] + [plan.tp_cp[s] for s in plan.sizes] + [(plan.domain,)]
    seen: set = set()
    out = []
    for blocks in steps:
        if len(blocks[0]) > 1 and blocks not in seen:
            seen.add(blocks)
            out.append(blocks)
    return out


def new_tp_cp_groups(sizes: Iterable[int], *, tp_size: int, ranks: Optional[Sequence[int]] = None,
                     method: str = "auto") -> dict[int, TPCPGroups]:
    """Create (once) the CP, ``[tp, cp]`` and ``[tp, dp, cp]`` groups of each CP size; this rank's, per size.

    **Collective**: every rank of the job calls it with the same arguments, before training. ``ranks`` (default:
    the whole world) is the ``[tp, dp, cp]`` domain in Megatron's order, TP rank fastest (module docstring). Each
    rank creates only its own groups, by the registry's creation path (``method`` as
    :func:`~cpscope.groups.new_cp_groups`; a block it has made already is shared). Calling again with the same
    arguments performs no collective. With ``tp_size=1``, ``cp`` and ``tp_cp`` are :func:`new_cp_groups`' groups.

    Args:
        sizes: CP sizes, each dividing the ``len(ranks) / tp_size`` DP×CP positions (3, 5, 6 ... work).
        tp_size: the model's tensor-parallel size.
        ranks: the domain's global ranks (one pipeline stage's), TP fastest; default the whole world.
        method: ``"auto"`` | ``"split"`` | ``"local"`` | ``"global"``.

    Returns:
        ``{size: TPCPGroups(cp, tp_cp, tp_dp_cp)}`` for this rank (a rank outside ``ranks`` gets ``{}``).

    Raises:
        ValueError: bad sizes, ``tp_size`` or ranks (:func:`plan_tp_cp_blocks`); arguments differing between ranks.
        RuntimeError: ``torch.distributed`` is not initialised.

    Example::

        g = cpscope.groups.new_tp_cp_groups([1, 2], tp_size=2)     # 4 ranks: TP pairs (0, 1), (2, 3)
        with cpscope.runtime_cp(g[2].cp):                           # ranks (0, 2) or (1, 3)
            ...                                                     # MoE routers use g[2].tp_cp (all 4)
    """
    layer = _reg._LAYER
    if not layer.is_initialized():
        raise RuntimeError(f"{_WHERE} needs torch.distributed to be initialised (dist.init_process_group)")
    plan = plan_tp_cp_blocks(sizes, tp_size, ranks, world=layer.world_size())
    with _reg._LOCK:
        how = resolve_method(method, layer, _WHERE, members_only=False)
        key = (_WHERE, plan.sizes, plan.tp, plan.ranks, how)
        reg = _reg._registry()
        if key in reg.calls:
            return _answer(plan, _reg._cached_hit(reg.calls[key], _WHERE))
        me = layer.rank()
        steps = _steps(plan)
        mine = [plan.block_of(me, blocks) for blocks in steps]
        summary = f"sizes={list(plan.sizes)}, tp_size={plan.tp}, {len(plan.ranks)} ranks, method={how}"
        handles = _reg._create(steps, mine, plan.ranks, how, digest(*key), summary, None,
                               range(layer.world_size()), _WHERE)
        entry = {b: (b, weakref.ref(h)) for b, h in zip(mine, handles) if b is not None and h is not None}
        reg.calls[key] = entry
        return _answer(plan, _reg._cached_hit(entry, _WHERE))


def _answer(plan: TPCPPlan, by_block: dict) -> dict[int, TPCPGroups]:
    """Per size, this rank's groups from ``{block: group}``; recorded for :func:`lookup_tp_cp` as well."""
    me = _reg._LAYER.rank()
    if me not in plan.ranks:
        return {}
    table = _table()
    i = plan.ranks.index(me) // plan.tp * plan.tp
    tp_b = tuple(sorted(plan.ranks[i:i + plan.tp]))  # this rank's TP block
    out = {}
    for s in plan.sizes:
        cp_b, tp_cp_b = plan.block_of(me, plan.cp[s]), plan.block_of(me, plan.tp_cp[s])
        out[s] = group = TPCPGroups(by_block.get(cp_b), by_block.get(tp_cp_b), by_block.get(plan.domain))
        table[(cp_b, tp_b)] = (None if group.tp_cp is None else weakref.ref(group.tp_cp), tp_cp_b)
    return out


def _table() -> dict:
    """(CP block, TP block) -> ([tp, cp] group, its block), kept on the registry (so it goes with it)."""
    return _reg._registry().__dict__.setdefault("tp_cp", {})


def lookup_tp_cp(cp_group: Optional[dist.ProcessGroup], *, tp_ranks: Sequence[int]) -> Optional[Any]:
    """The ``[tp, cp]`` group :func:`new_tp_cp_groups` made for this CP group and TP group, or ``None`` when it has
    not been made on this rank. **Never communicates, never creates a group** (for a forward or a recompute).

    ``tp_ranks``: the global ranks of this rank's TP group (``group_ranks(model.pg_collection.tp)``). ``cp_group``
    ``None`` (CP1) asks for the TP group's own block.

    Raises:
        ValueError: the CP group holds another rank of this rank's TP group (a CP group across TP ranks: build CP
            groups with :func:`new_tp_cp_groups`).
        RuntimeError: the group found has been destroyed.

    Example::

        tp_cp = lookup_tp_cp(scope.group, tp_ranks=group_ranks(router.tp_group))
        if tp_cp is None:
            raise ValueError("call cpscope.groups.new_tp_cp_groups(sizes, tp_size=...) on every rank first")
    """
    me = _reg._LAYER.rank()
    cp = tuple(_reg.group_ranks(cp_group)) if cp_group is not None else (me,)
    tp = tuple(sorted(as_int(r, "TP rank", "lookup_tp_cp") for r in tp_ranks))
    shared = sorted(set(cp) & set(tp) - {me})
    if shared:
        raise ValueError(
            f"lookup_tp_cp: the CP group {list(cp)} holds ranks {shared} of this rank's TP group {list(tp)}; a CP "
            "group must hold one rank per TP group (same TP rank): build it with new_tp_cp_groups(..., tp_size=...)"
        )
    with _reg._LOCK:
        hit = _table().get((cp, tp))
    if hit is None:
        return None
    ref, block = hit
    group = _reg._live(ref) if ref is not None else None
    if ref is not None and group is None:
        raise RuntimeError(f"lookup_tp_cp: the cached [tp, cp] group {list(block)} has been destroyed; call "
                           "cpscope.clear_cp_group_cache() on every rank, then new_tp_cp_groups again")
    return group
