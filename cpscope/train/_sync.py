"""Gradient synchronisation for the hybrid-CP loop: once per step, a SUM over the data-parallel ranks.

Under hybrid CP the ranks run **different numbers of microbatches** in a step (a rank may run none). The usual
wrappers count on the opposite:

* ``DistributedDataParallel`` all-reduces gradients in every backward and broadcasts buffers in every forward;
* FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers parameters in every forward (and again in backward
  when it resharded after forward) and reduce-scatters gradients in every backward.

Their collectives would differ in number between ranks — a hang — and both *average* over the ranks, where the
loop wants a *sum*: every rank divides its loss by the global number of targets (:mod:`cpscope.train._loop`), so
the sum of the gradients over the data-parallel group is the gradient of the global per-token mean. That group is
always named — ``dp_group=dist.group.WORLD`` for the world; ``None`` is this rank alone, as everywhere in cpscope
(:mod:`cpscope.train._collectives`).

A :class:`GradientSync` drives the collectives of one step so that every rank issues the same ones, once:

=====================  ==================================================================================
:class:`ManualSync`    plain module: one bucketed ``all_reduce`` (SUM) of the gradients after the last backward
:class:`DDPSync`       ``DistributedDataParallel``: DDP's forward and reducer are bypassed (its ``.module`` runs
                       the microbatches), buffers are broadcast once at the start of the step (as DDP does under
                       gradient accumulation), then one bucketed SUM over DDP's process group
:class:`FSDPSync`      FSDP2: every FSDP module is unsharded once at the start (one all-gather per parameter
                       group), kept unsharded with gradient sync off across the microbatches, and the last
                       microbatch's backward reduce-scatters the accumulated gradients once, as a SUM; then
                       resharded and the module's own settings restored
=====================  ==================================================================================

:func:`gradient_sync` picks the strategy from the model's wrapper and raises ``ValueError`` for wrappers or settings
it cannot run correctly. :func:`cpscope.train.run_step` is the loop that uses it.

Example::

    dp = dist.group.WORLD                      # the data-parallel group, always named (None: this rank alone)
    sync = gradient_sync(model, dp_group=dp)   # DDP, FSDP2 or a plain module; validated once
    for step in range(steps):
        mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
        result = run_step(model, mbs, dp_group=dp, sync=sync)   # forward/backward each, gradients synced once
        optimizer.step(); optimizer.zero_grad()

The protocol, for a strategy of your own: ``begin_step()`` before the first forward, ``before_last_microbatch()``
before the forward of the last microbatch, ``end_step()`` after the last backward. Every rank calls each exactly
once per step, whatever its number of microbatches; a strategy whose sync happens *inside* a backward sets
``needs_backward``: its last microbatch is then always CP1 — the rank's own last one when it is CP1, else one
empty microbatch (zero gradients) added after the others.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ._fsdp_sync import FSDPSync, is_fsdp2
from ._sync_protocol import GradientSync, Group, same_ranks
from ._collectives import DEFAULT_BUCKET_BYTES, allreduce_gradients, group_size

__all__ = [
    # the protocol and the FSDP2 strategy are defined in _sync_protocol / _fsdp_sync; this module is their home
    "GradientSync",
    "ManualSync",
    "DDPSync",
    "FSDPSync",
    "gradient_sync",
]

logger = logging.getLogger(__name__)


class ManualSync(GradientSync):
    """A plain module (no DDP / FSDP wrapper): one bucketed SUM of the gradients over ``dp_group`` after the step.

    Under tensor parallelism ``dp_group`` is the group of the ranks with this rank's tensor-parallel rank (the
    ranks holding different tokens), not the world: each parameter — a tensor-parallel shard or a replicated one —
    is summed over the ranks that computed it on different targets.

    Example::

        sync = ManualSync(model, dp_group=dist.group.WORLD)   # what gradient_sync(model, ...) gives a plain module
        run_step(model, mbs, dp_group=dist.group.WORLD, sync=sync)
    """

    def __init__(self, model: nn.Module, *, dp_group: Group, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(model, model, dp_group)
        self.bucket_bytes = bucket_bytes

    def end_step(self) -> None:
        allreduce_gradients(self.module, dp_group=self.dp_group, bucket_bytes=self.bucket_bytes)


class DDPSync(GradientSync):
    """``DistributedDataParallel`` under hybrid CP: its ``.module`` runs the microbatches, one SUM at the end.

    DDP would all-reduce in the backward of every microbatch; here its forward (and so its reducer, which only
    acts after a DDP forward) is bypassed: ``forward`` receives ``ddp.module``. At the start of the step the buffers
    are broadcast from rank 0 of DDP's group when ``broadcast_buffers`` is on — what DDP itself does once per
    accumulation window under ``no_sync`` — and after the last backward the gradients of the parameters DDP
    synchronises (not its ignored ones) are summed over ``ddp.process_group`` in buckets of DDP's
    ``bucket_bytes_cap``. No collective depends on the number of microbatches.

    ``dp_group`` must have the members of ``ddp.process_group`` (the group DDP was built with).

    Raises:
        ValueError: a communication hook is registered (it would be skipped), DDP's own ``mixed_precision`` is
            set (its casts live in the bypassed forward), the DDP module contains FSDP modules, or ``dp_group`` is
            not DDP's group.

    Example::

        ddp = DistributedDataParallel(model)                        # over the world
        sync = DDPSync(ddp, dp_group=dist.group.WORLD)
        result = run_step(ddp, mbs, dp_group=dist.group.WORLD, sync=sync)
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, *, dp_group: Group) -> None:
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            raise ValueError(f"DDPSync needs a DistributedDataParallel module, got {type(ddp).__name__}")
        if getattr(ddp, "mixed_precision", None) is not None:
            raise ValueError(
                "DDPSync: DDP's mixed_precision casts parameters in DDP's forward, which the hybrid loop bypasses; "
                "cast the model yourself (or use FSDP2's MixedPrecisionPolicy)"
            )
        hooks = getattr(ddp, "_comm_hooks", [])
        if hooks:
            raise ValueError(
                f"DDPSync: the DDP module has {len(hooks)} communication hook(s) registered "
                f"({[getattr(h, '__name__', h) for h, _ in hooks]}); the hybrid loop bypasses DDP's reducer (the "
                f"ranks run different numbers of backwards) and sums the gradients itself, so the hook would be "
                f"skipped. Remove it, or drive the step with a GradientSync of your own"
            )
        if any(is_fsdp2(m) for m in ddp.module.modules()):
            raise ValueError("DDPSync: the DDP module contains FSDP2 modules; shard with fully_shard alone")
        same_ranks(dp_group, ddp.process_group, "DistributedDataParallel's process_group", "DDPSync")
        super().__init__(ddp, ddp.module, dp_group)
        ignore = set(getattr(ddp, "parameters_to_ignore", ()))
        self._params = [p for n, p in ddp.module.named_parameters() if n not in ignore and p.requires_grad]
        self._buffers = [b for n, b in ddp.module.named_buffers() if n not in ignore] if ddp.broadcast_buffers else []
        self.bucket_bytes = int(getattr(ddp, "bucket_bytes_cap", DEFAULT_BUCKET_BYTES))

    def begin_step(self) -> None:
        if self._buffers and group_size(self.dp_group) > 1:
            src = dist.get_global_rank(self.dp_group, 0)
            for b in self._buffers:
                dist.broadcast(b, src=src, group=self.dp_group)

    def end_step(self) -> None:
        allreduce_gradients(self._params, dp_group=self.dp_group, bucket_bytes=self.bucket_bytes)


def gradient_sync(model: nn.Module, *, dp_group: Group) -> GradientSync:
    """The :class:`GradientSync` for ``model``: :class:`DDPSync`, :class:`FSDPSync` or :class:`ManualSync`.

    ``dp_group`` is the data-parallel group the gradients are summed over (:mod:`cpscope.train._collectives`):
    ``dist.group.WORLD`` without tensor parallelism, ``None`` for one process. DDP and FSDP2 bring a group of
    their own (DDP's ``process_group``, the FSDP2 mesh's): ``dp_group`` must have its members.

    Raises:
        ValueError: ``torch.compile`` applied to the DDP wrapper (compile the inner module or its blocks instead);
            FSDP1 (``FullyShardedDataParallel``); an unsupported DDP or FSDP2 setting (see the classes); a
            ``dp_group`` that is not the wrapper's group.

    Example::

        sync = gradient_sync(model, dp_group=dist.group.WORLD)
        result = run_step(model, mbs, dp_group=dist.group.WORLD, sync=sync)
    """
    inner = getattr(model, "_orig_mod", None)  # torch.compile(model) → OptimizedModule
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "gradient_sync: torch.compile was applied to the DistributedDataParallel wrapper; the hybrid loop runs "
            "DDP's inner module, which this compiled wrapper does not cover. Compile the model (or its blocks) "
            "before wrapping it: DistributedDataParallel(torch.compile(model))"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDPSync(model, dp_group=dp_group)
    root = inner if inner is not None else model
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]
    if any(isinstance(m, FullyShardedDataParallel) for m in root.modules()):
        raise ValueError(
            "gradient_sync: FSDP1 (FullyShardedDataParallel) is not supported by the hybrid loop; shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard)"
        )
    if any(is_fsdp2(m) for m in root.modules()):
        return FSDPSync(model, dp_group=dp_group)
    return ManualSync(model, dp_group=dp_group)
