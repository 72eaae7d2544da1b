"""Pure planning for the CP group registry: which blocks of ranks form groups, in which member order.

No process group is needed here: :mod:`cpscope.groups` turns these plans into ``torch.distributed`` groups.

Member order. torch numbers a group's members by ascending global rank (``new_group`` and ``split_group`` sort the
ranks they are given), and that numbering is what ``dist.get_rank(group)`` — hence :func:`cpscope.cp_rank`, the
zigzag shard a rank holds, the ring's neighbours and TE's ``cp_global_ranks`` — follows. So every block here is a
**sorted** tuple of global ranks: the order of ``ranks`` *inside* a block chooses membership only. A block that the
caller listed out of order is reported in :attr:`BlockPlan.reordered` (the registry logs it).

Example::

    >>> p = plan_cp_blocks([1, 2, 4], [2, 3, 0, 1], world=4)
    >>> p.blocks[2], p.blocks[4]
    (((2, 3), (0, 1)), ((0, 1, 2, 3),))
    >>> hierarchical_blocks([0, 1, 2, 3], 2)
    (((0, 1), (2, 3)), ((0, 2), (1, 3)))
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

__all__ = ["BlockPlan", "plan_cp_blocks", "hierarchical_blocks", "pad_schedule", "as_int"]

Block = tuple[int, ...]


def as_int(value: object, what: str, where: str = "new_cp_groups") -> int:
    """``value`` as an int; bools, floats and strings are refused rather than silently truncated."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: every {what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


@dataclass(frozen=True)
class BlockPlan:
    """The aligned blocks of every requested CP size over a list of global ranks.

    Attributes:
        world: the job's world size.
        ranks: the global ranks being split, in the caller's order (default ``0 … world-1``).
        sizes: the distinct requested sizes, in the caller's order.
        blocks: per size, the blocks ``ranks[i·s:(i+1)·s]``, each as a sorted tuple (the group's member order).
        reordered: the caller's blocks (as listed) that were not ascending.
    """

    world: int
    ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    blocks: Mapping[int, tuple[Block, ...]]
    reordered: tuple[Block, ...]
    _pos: Mapping[int, int] = field(repr=False, compare=False, default_factory=dict)

    def block_of(self, rank: int, size: int) -> Optional[Block]:
        """The block of ``size`` holding global ``rank`` (``None`` if ``rank`` is not among :attr:`ranks`)."""
        pos = self._pos.get(rank)
        return None if pos is None else self.blocks[size][pos // size]

    def steps(self) -> list[tuple[Block, ...]]:
        """The blocks to create as groups, size by size in the caller's order (size 1 is CP1: no group)."""
        return [self.blocks[s] for s in self.sizes if s > 1]


def plan_cp_blocks(sizes: Iterable[int], ranks: Optional[Sequence[int]], *, world: int) -> BlockPlan:
    """Validate ``new_cp_groups``' arguments and plan its blocks (pure; no collective).

    Raises:
        ValueError: a size that is not an int, is < 1 or does not divide ``len(ranks)``; ranks that are not ints,
            are duplicated or lie outside ``[0, world)``; an empty ``ranks``.
    """
    domain = list(range(world)) if ranks is None else [as_int(r, "rank") for r in ranks]
    wanted = [as_int(s, "CP size") for s in sizes]
    if not domain:
        raise ValueError("new_cp_groups: ranks is empty")
    if len(set(domain)) != len(domain) or min(domain) < 0 or max(domain) >= world:
        raise ValueError(f"new_cp_groups: ranks must be distinct global ranks in [0, {world}), got {domain}")
    bad = [s for s in wanted if s < 1 or len(domain) % s != 0]
    if bad:
        raise ValueError(
            f"new_cp_groups: CP sizes {bad} do not divide the {len(domain)} ranks being split (sizes {wanted}); "
            f"every size must be ≥ 1 and a divisor of len(ranks) so the ranks split into aligned blocks"
        )
    distinct = tuple(dict.fromkeys(wanted))  # de-duplicated, caller's order (identical on every rank)
    blocks: dict[int, tuple[Block, ...]] = {}
    reordered: list[Block] = []
    for s in distinct:
        cut = [tuple(domain[i : i + s]) for i in range(0, len(domain), s)]
        blocks[s] = tuple(tuple(sorted(b)) for b in cut)
        reordered.extend(b for b in cut if list(b) != sorted(b))
    return BlockPlan(
        world=world, ranks=tuple(domain), sizes=distinct, blocks=blocks, reordered=tuple(reordered),
        _pos={r: i for i, r in enumerate(domain)},
    )


def hierarchical_blocks(cp_ranks: Sequence[int], inner: int, where: str = "hierarchical_cp_groups"
                        ) -> tuple[tuple[Block, ...], tuple[Block, ...]]:
    """Inner blocks (``inner`` consecutive CP ranks) and outer blocks (same index inside the inner block).

    ``cp_ranks`` is the CP group's member order (global ranks by CP rank), which must ascend. CP rank ``c`` is then
    rank ``c % inner`` of inner block ``c // inner`` and rank ``c // inner`` of outer block ``c % inner``: both
    sub-groups keep the CP order, so a ring over an outer group visits the inner blocks in CP order. Any ``inner``
    dividing the CP size works (3 of 6, 2 of 6, 5 of 10 ...).

    Raises:
        ValueError: ``inner`` not an int ≥ 1 dividing the CP size; ``cp_ranks`` not ascending.
    """
    m = as_int(inner, "inner", where)
    ranks = [as_int(r, "rank", where) for r in cp_ranks]
    n = len(ranks)
    if m < 1 or n % m != 0:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"{where}: inner {m} does not divide the CP size {n}; use a divisor of {n} ({divisors}), e.g. the "
            f"number of the group's ranks per node"
        )
    if ranks != sorted(ranks):
        raise ValueError(
            f"{where}: the CP group's ranks must ascend (as groups from new_cp_groups do), got {ranks}; sub-groups "
            f"created by torch number their members ascending, so they could not keep this order"
        )
    inner_blocks = tuple(tuple(ranks[i : i + m]) for i in range(0, n, m))
    outer_blocks = tuple(tuple(ranks[j::m]) for j in range(m))
    return inner_blocks, outer_blocks


def pad_schedule(
    steps: Sequence[Sequence[Block]], counts: Mapping[int, int], floors: Optional[Mapping[Block, int]] = None
) -> list[dict[int, int]]:
    """How many placeholder groups each member creates before each block so that all members agree on its name.

    torch names a group made with ``use_local_synchronization=True`` after its ranks **and the number of groups
    this rank has registered** (``len(_world.pg_names)``); members that disagree on that number wait for each other
    under different store keys — a hang. And a name used before by a destroyed group of the same ranks finds that
    group's stale addresses in the store (gloo: "connection refused"). ``counts`` is every participant's number
    before the first step; ``steps[k]`` the blocks created at step ``k`` (each rank in at most one); ``floors[b]``
    the lowest number not used for block ``b`` yet. A member first creates as many single-rank groups as it is
    behind ``max(floor, the most advanced member of its block)``. Returns, per step, ``{rank: placeholders}``
    (ranks with 0 are left out). Pure: every rank computes the same schedule from the same gathered records.
    """
    now = dict(counts)
    floors = floors or {}
    out: list[dict[int, int]] = []
    for blocks in steps:
        pads: dict[int, int] = {}
        for b in blocks:
            top = max(floors.get(b, 0), max(now[r] for r in b))
            for r in b:
                if top > now[r]:
                    pads[r] = top - now[r]
                now[r] = top + 1
        out.append(pads)
    return out
