"""The torch runtime of hybrid CP: from a plan to this rank's tensors, the step, gradient sync and calibration.

* :mod:`~cpscope.train.prepare` — pack, label, pad and shard each planned microbatch: this rank's
  :class:`~cpscope.train.prepare.LocalMicrobatch` es (and which microbatch type is which).
* :mod:`~cpscope.train.loop` — bind each microbatch's group and run it: ``run_microbatches``, ``run_step``.
* :mod:`~cpscope.train.collectives` — the data-parallel reductions, over a group that is always named
  (``dp_group=dist.group.WORLD`` for the world; ``None`` is this rank alone).
* :mod:`~cpscope.train.sync` — one gradient synchronisation per step for a plain module, DDP or FSDP2.
* :mod:`~cpscope.train.calibrate` — fit the per-variant communication cost model on this machine.
* :mod:`~cpscope.train.auto` — ``comm="auto"`` at run time: find the job's calibration and install its choice.

The planner itself (pure, numpy only) is :mod:`cpscope.hybrid`.

Example::

    from cpscope.train.loop import prepare_microbatches, run_step
    from cpscope.train.sync import DDPSync
    dp = dist.group.WORLD
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
    result = run_step(ddp_model, mbs, dp_group=dp, sync=DDPSync(ddp_model, dp_group=dp))
"""

__all__: list[str] = []  # a namespace: the names live in its modules (prepare, loop, sync, ...)
