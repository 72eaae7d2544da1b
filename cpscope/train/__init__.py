"""The torch runtime of hybrid CP: from a plan to this rank's tensors, the step, gradient sync and calibration.

* :mod:`~cpscope.train._prepare` — pack, label, pad and shard each planned microbatch: this rank's
  :class:`~cpscope.train.LocalMicrobatch` es (and which microbatch type is which).
* :mod:`~cpscope.train._loop` — bind each microbatch's group and run it: ``run_microbatches``, ``run_step``.
* :mod:`~cpscope.train._collectives` — the data-parallel reductions, over a group that is always named
  (``dp_group=dist.group.WORLD`` for the world; ``None`` is this rank alone).
* :mod:`~cpscope.train._sync` — one gradient synchronisation per step for a plain module, DDP or FSDP2.
* :mod:`~cpscope.train._calibrate` — fit the per-variant communication cost model on this machine.
* :mod:`~cpscope.train._auto` — ``comm="auto"`` at run time: find the job's calibration and install its choice.

The public names are this package's ``__all__`` (the modules above are private). The planner itself (pure, numpy
only) is :mod:`cpscope.hybrid`.

Example::

    from cpscope.train import DDPSync, prepare_microbatches, run_step
    dp = dist.group.WORLD
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
    result = run_step(ddp_model, mbs, dp_group=dp, sync=DDPSync(ddp_model, dp_group=dp))
"""

from ._auto import use_calibration
from ._calibrate import calibrate
from ._collectives import allreduce_gradients, allreduce_sum
from ._loop import global_num_targets, run_microbatches, run_step, token_loss_sum
from ._prepare import LocalMicrobatch, prepare_microbatch, prepare_microbatches
from ._sync import DDPSync, FSDPSync, ManualSync, gradient_sync

__all__ = [
    "prepare_microbatches",
    "prepare_microbatch",
    "LocalMicrobatch",
    "run_step",
    "run_microbatches",
    "global_num_targets",
    "token_loss_sum",
    "allreduce_sum",
    "allreduce_gradients",
    "gradient_sync",
    "ManualSync",
    "DDPSync",
    "FSDPSync",
    "calibrate",
    "use_calibration",
]

# For cpscope's integrations: importable here, not part of ``__all__``.
from ._prepare import IGNORE_INDEX, pad_and_shard, planned_group  # noqa: E402
from ._sync import GradientSync  # noqa: E402
