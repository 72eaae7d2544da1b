"""cpscope's hybrid-CP planner behind the interface of Megatron's ``BalancedCPScheduler``.

megatron-core 0.19.2 schedules hybrid CP in ``HybridCPDataLoaderWrapper`` (``datasets/data_schedule.py``) with
``BalancedCPScheduler`` (``pipeline_parallel/hybrid_cp_schedule.py``): ``get_groups_and_subsamples(sample_id_seqlens,
config)`` returns ``(groups, sample_id_groups)`` where ``groups[g][r]`` lists the sequence lengths and
``sample_id_groups[g][r]`` the sample ids rank ``r`` (a position in the DP×CP group) runs in group ``g``; the ranks
that list a sample form its CP group (an aligned block of consecutive positions: Megatron's hybrid DP×CP groups).
Megatron fixes each sample's CP size from memory alone (``gpus_needed(L) = next_pow2(L / max_seq_len_per_rank)``)
and puts a barrier between groups.

:class:`PlannerScheduler` answers the same call with :func:`cpscope.hybrid.plan_hybrid`: CP sizes chosen per
sequence under a cost model (at least the memory minimum), balanced over aligned blocks. cpscope's execution order
(CP size descending, blocks nested) cannot deadlock without barriers, so the whole plan is returned as **one**
group. A rank's samples keep the plan's order; a microbatch that packs several sequences becomes those sequences in
a row (Megatron runs one sample per forward step).

Drop-in::

    wrapper = HybridCPDataLoaderWrapper(data_iterator, config, pg_collection)
    wrapper.cp_balancing_scheduler = PlannerScheduler.like(wrapper.cp_balancing_scheduler)

Example::

    >>> sched = PlannerScheduler(max_seq_len_per_rank=8192, dp_cp_group=4)
    >>> groups, ids = sched.get_groups_and_subsamples([(0, 32768), (1, 4096), (2, 4096), (3, 2048)], None)
    >>> len(groups), [rank_ids[0] for rank_ids in ids[0]]     # one group; every rank first runs sample 0 at CP4
    (1, [0, 0, 0, 0])
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import numpy as np

from ...hybrid import CostModel, Plan, plan_hybrid

__all__ = ["PlannerScheduler"]

logger = logging.getLogger(__name__)


class PlannerScheduler:
    """``BalancedCPScheduler``'s interface (``get_groups_and_subsamples``) backed by :func:`cpscope.hybrid.plan_hybrid`.

    Args:
        max_seq_len_per_rank: tokens one rank may hold in a microbatch (Megatron's ``max_seqlen_per_dp_cp_rank``);
            the planner's ``capacity``.
        dp_cp_group: the DP×CP process group (only its ``size()`` is used), or its size as an int.
        cost: the planner's :class:`cpscope.hybrid.CostModel` (default ``CostModel()``; fit your own).
        max_cp: the largest CP size to use (default: the DP×CP size).

    Example::

        sched = PlannerScheduler(16384, parallel_state.get_data_parallel_group(with_context_parallel=True))
        groups, sample_id_groups = sched.get_groups_and_subsamples(global_id_seqlens, config)
    """

    def __init__(self, max_seq_len_per_rank: int, dp_cp_group: Union[int, Any], *, cost: Optional[CostModel] = None,
                 max_cp: Optional[int] = None) -> None:
        size = dp_cp_group if isinstance(dp_cp_group, int) else dp_cp_group.size()
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"dp_cp_group must be a process group or a positive int size, got {dp_cp_group!r}")
        if isinstance(max_seq_len_per_rank, bool) or not isinstance(max_seq_len_per_rank, int) or max_seq_len_per_rank < 1:
            raise ValueError(f"max_seq_len_per_rank must be a positive int, got {max_seq_len_per_rank!r}")
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.total_hdp_gpus = size
        self.cost = CostModel() if cost is None else cost
        self.max_cp = max_cp
        self.last_plan: Optional[Plan] = None

    @classmethod
    def like(cls, scheduler: Any, **kwargs: Any) -> "PlannerScheduler":
        """A :class:`PlannerScheduler` with the capacity and size of a Megatron ``BalancedCPScheduler``."""
        return cls(scheduler.max_seq_len_per_rank, scheduler.total_hdp_gpus, **kwargs)

    def plan(self, seqlens: Sequence[int]) -> Plan:
        """The cpscope :class:`~cpscope.hybrid.Plan` for these sequence lengths."""
        return plan_hybrid(np.asarray(seqlens, dtype=np.int64), self.total_hdp_gpus, self.max_seq_len_per_rank, self.cost,
                           max_cp=self.max_cp)

    def get_groups_and_subsamples(
        self, sample_id_seqlens: Sequence[tuple[int, int]], config: Any = None
    ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """Megatron's call: ``(groups, sample_id_groups)``, one group, ``[g][rank]`` lists of lengths / sample ids.

        ``config`` is accepted for interface compatibility and unused. The plan is kept as :attr:`last_plan`.

        Raises:
            ValueError: a length that is not a positive int, or duplicate sample ids.
        """
        ids = [int(s) for s, _ in sample_id_seqlens]
        lengths = [int(n) for _, n in sample_id_seqlens]
        if len(set(ids)) != len(ids):
            raise ValueError("get_groups_and_subsamples: sample ids must be unique")
        if any(n < 1 for n in lengths):
            raise ValueError(f"get_groups_and_subsamples: sequence lengths must be ≥ 1, got {min(lengths)}")
        n = self.total_hdp_gpus
        if not lengths:
            return [[[] for _ in range(n)]], [[[] for _ in range(n)]]
        plan = self.plan(lengths)
        self.last_plan = plan
        seq_lists: list[list[int]] = [[] for _ in range(n)]
        id_lists: list[list[int]] = [[] for _ in range(n)]
        for mb in plan.microbatches:  # global execution order: a rank's own order is its members' subsequence
            mb_lens = [lengths[i] for i in mb.seqs]
            mb_ids = [ids[i] for i in mb.seqs]
            for rank in mb.ranks:
                seq_lists[rank] += mb_lens
                id_lists[rank] += mb_ids
        return [seq_lists], [id_lists]
