"""Hybrid context parallelism: plan a CP size per sequence of a global batch and balance the work over CP groups.

The main API: :func:`plan_hybrid` returns a :class:`Plan` — for every rank the ordered :class:`Microbatch` list
(CP size, block of ranks, sequences) — under a measurable :class:`CostModel` (for hybrid models, whose
linear-attention, state-space or convolution layers cost linear time: :meth:`CostModel.for_layer_mix` with a
:class:`LayerMix`); :func:`plan_static` and :func:`plan_greedy` are baselines; :func:`lower_bound` bounds any
plan's makespan. Pure logic: its modules use numpy only — no torch, no process group.

Running a plan is the job of :mod:`cpscope.train` (pack, pad, shard and bind each microbatch: ``run_step``;
gradient synchronisation once per step for a plain module, ``DistributedDataParallel`` or FSDP2: ``gradient_sync``).

Example::

    from cpscope.hybrid import CostModel, plan_hybrid
    plan = plan_hybrid(lengths, n_ranks=world_size, capacity=16384, cost=CostModel.fit(L, cp, seconds))
    for mb in plan.microbatches_for_rank(rank):
        ...  # run mb.seqs with the CP group of size mb.cp that holds this rank
"""
from ._baselines import plan_greedy, plan_static
from ._bound import lower_bound
from ._cost import CostModel, padded_length
from ._data import long_tail_lengths
from ._layer_mix import LayerMix
from ._plan import Microbatch, Plan
from ._planner import plan_hybrid
from ._problem import cp_candidates

__all__ = [
    "CostModel",
    "LayerMix",
    "Microbatch",
    "Plan",
    "long_tail_lengths",
    "lower_bound",
    "padded_length",
    "plan_greedy",
    "plan_hybrid",
    "plan_static",
]

# Communication variants chosen per microbatch: the per-call cost model (cpscope.hybrid._comm_cost), the pure choice
# (cpscope.hybrid._cheapest_variant) and the planner's cost built on them. Timing them on the machine (cpscope.train._calibrate)
# and installing the choice for comm="auto" (cpscope.train._auto) is the torch runtime's job.
from ._comm_cost import CommCostModel  # noqa: E402
from ._data import sft_like_lengths  # noqa: E402
from ._step_cost import StepCost  # noqa: E402

__all__ += ["CommCostModel", "StepCost", "sft_like_lengths"]

# For cpscope's other rooms (attention, train, cli): importable here, not part of ``__all__``.
from ._comm_cost import (LOCAL, Sample, cache_dir, cache_key, cache_path, default_inner, dtype_name,  # noqa: E402
                         halo_rows, load_cached, variant_allowed)
from ._data import uniform_lengths  # noqa: E402
from ._cheapest_variant import choose as choose_variant  # noqa: E402
