"""What a planner returns: the :class:`Plan` and its :class:`Microbatch` es, in a deadlock-free execution order.

A microbatch is a set of sequences packed in ``thd`` and run together by one aligned *block* of ``cp`` ranks
(positions ``block·cp … (block+1)·cp − 1``); a plan lists them in one global execution order and each rank runs
its own in that order (see :mod:`cpscope.hybrid._planner` for why that cannot deadlock). Plain data: no numpy, no
process group.

Example::

    >>> mb = Microbatch(cp=2, block=1, seqs=(0, 3), tokens_per_rank=4096, cost=0.5)
    >>> list(mb.ranks), mb.comm
    ([2, 3], 'p2p')
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

__all__ = ["Microbatch", "Plan"]


class Microbatch(NamedTuple):
    """Sequences run together by ranks ``block·cp … (block+1)·cp − 1`` (positions in the planned rank list).

    ``comm`` is the communication variant planned for its attention (``"p2p"``, ``"all_gather"``, ``"a2a"``,
    ``"a2a+p2p"``): bind it with the group, ``runtime_cp(group, comm=mb.comm)``. Under a plain
    :class:`~cpscope.hybrid.CostModel` (the ring alone) it is ``"p2p"``; at ``cp == 1`` there is no exchange
    and the value does not matter.

    Example::

        plan = cpscope.hybrid.plan_hybrid([8192, 2048, 1024, 1024, 512, 512], n_ranks=4, capacity=4096)
        mb = plan.microbatches_for_rank(0)[0]   # Microbatch(cp=4, block=0, seqs=(0,), tokens_per_rank=2048, ...)
        group = groups[mb.cp]                    # the size-mb.cp group that holds this rank (block mb.block)
    """

    cp: int
    block: int
    seqs: tuple[int, ...]  # indices into the planned ``lengths``, in packing order
    tokens_per_rank: int  # Σ padded length / cp  (≤ capacity)
    cost: float  # per-rank seconds under the cost model (with the variant ``comm``)
    comm: str = "p2p"  # the communication variant of its attention

    @property
    def ranks(self) -> range:
        """Positions of the member ranks (``ranks[i]`` if groups were built over a ``ranks`` list)."""
        return range(self.block * self.cp, (self.block + 1) * self.cp)


@dataclass(frozen=True, repr=False)
class Plan:
    """The result of a planner: microbatches in global execution order (nested CP sizes: size descending, block,
    packing; other sets: the planner's placement order).

    ``rank_loads[r]`` is rank ``r``'s busy time, ``rank_finish[r]`` when it finishes (the same, unless a
    microbatch of it waited for a busier member: possible only where CP sizes do not nest); ``makespan`` the
    last finish; ``lower_bound`` the value of :func:`lower_bound` for the same inputs; ``padding_tokens`` the
    zigzag padding added over the batch; ``cp_candidates`` the CP sizes the planner could choose from and
    :attr:`sizes_used` those it picked.

    Example::

        from cpscope.hybrid import plan_hybrid
        plan = plan_hybrid([8192, 2048, 1024, 1024, 512, 512], n_ranks=4, capacity=4096)
        plan.cp_sizes                    # (4, 2, 1, 1, 2, 2): one CP size per sequence
        plan.makespan, plan.lower_bound  # predicted seconds of the slowest rank, and a bound no plan beats
        for mb in plan.microbatches_for_rank(rank):
            ...                          # run mb.seqs under runtime_cp(groups[mb.cp])
    """

    method: str
    n_ranks: int
    capacity: int
    lengths: tuple[int, ...]
    cp_sizes: tuple[int, ...]
    microbatches: tuple[Microbatch, ...]
    rank_loads: tuple[float, ...]
    lower_bound: float
    padding_tokens: int
    rank_finish: tuple[float, ...] = ()
    cp_candidates: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return (f"Plan(method={self.method!r}, n_ranks={self.n_ranks}, sequences={len(self.lengths)}, "
                f"microbatches={len(self.microbatches)}, makespan={self.makespan:.6g}, "
                f"lower_bound={self.lower_bound:.6g})")

    @property
    def makespan(self) -> float:
        """Time at which the last rank finishes, waits included (exact under the cost model)."""
        return max(self.rank_finish or self.rank_loads)

    @property
    def sizes_used(self) -> tuple[int, ...]:
        """The CP sizes the plan runs, increasing."""
        return tuple(sorted({mb.cp for mb in self.microbatches}))

    @cached_property
    def _by_group(self) -> dict[tuple[int, int], list[tuple[int, Microbatch]]]:
        groups: dict[tuple[int, int], list[tuple[int, Microbatch]]] = {}
        for i, mb in enumerate(self.microbatches):
            groups.setdefault((mb.cp, mb.block), []).append((i, mb))
        return groups

    @cached_property
    def _sizes(self) -> list[int]:
        return sorted({mb.cp for mb in self.microbatches}, reverse=True)

    def microbatches_for_rank(self, rank: int) -> list[Microbatch]:
        """The microbatches rank ``rank`` (a position in ``range(n_ranks)``) must run, in the plan's order."""
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank {rank} is outside the planned ranks [0, {self.n_ranks})")
        mine: list[tuple[int, Microbatch]] = []
        for s in self._sizes:
            mine.extend(self._by_group.get((s, rank // s), ()))
        mine.sort(key=lambda item: item[0])
        return [mb for _, mb in mine]
