"""The torch runtime of hybrid CP: the microbatch loop, gradient synchronisation and calibration.

* :mod:`~cpscope.train.loop` — pack, pad, shard and bind each planned microbatch; ``run_microbatches``,
  ``run_step``.
* :mod:`~cpscope.train.sync` — one gradient synchronisation per step for a plain module, DDP or FSDP2.
* :mod:`~cpscope.train.calibrate` — fit the per-variant communication cost model on this machine.
* :mod:`~cpscope.train.auto` — ``comm="auto"`` at run time: find the job's calibration and install its choice.

The planner itself (pure, numpy only) is :mod:`cpscope.hybrid`.

Example::

    from cpscope.train.loop import run_step
    from cpscope.train.sync import DDPSync
    loss = run_step(model, microbatches, num_targets=n, sync=DDPSync(ddp_model))
"""
