"""Gradient synchronisation for the hybrid-CP loop: once per step, a SUM over the data-parallel ranks.

Under hybrid CP the ranks run **different numbers of microbatches** in a step (a rank may run none). The usual
wrappers count on the opposite:

* ``DistributedDataParallel`` all-reduces gradients in every backward and broadcasts buffers in every forward;
* FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers parameters in every forward (and again in backward
  when it resharded after forward) and reduce-scatters gradients in every backward.

Their collectives would differ in number between ranks — a hang — and both *average* over the ranks, where the
loop wants a *sum*: every rank divides its loss by the global number of targets (:mod:`cpscope.train.loop`), so
the sum of the gradients over the data-parallel group is the gradient of the global per-token mean. That group is
always named — ``dp_group=dist.group.WORLD`` for the world; ``None`` is this rank alone, as everywhere in cpscope
(:mod:`cpscope.train.collectives`).

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
it cannot run correctly. :func:`cpscope.train.loop.run_step` is the loop that uses it.

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
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..groups import group_ranks
from .collectives import DEFAULT_BUCKET_BYTES, allreduce_gradients, allreduce_sum, check_dp_group, group_size

__all__ = [
    "GradientSync",
    "ManualSync",
    "DDPSync",
    "FSDPSync",
    "gradient_sync",
    "allreduce_gradients",
    "allreduce_sum",
]

logger = logging.getLogger(__name__)

Group = Optional[dist.ProcessGroup]


def _same_ranks(dp_group: Group, theirs: Group, what: str, where: str) -> None:
    """``ValueError`` unless the wrapper's own group ``theirs`` has the members of ``dp_group``."""
    mine, other = group_ranks(dp_group), group_ranks(theirs)
    if sorted(mine) != sorted(other):
        raise ValueError(f"{where}: dp_group has global ranks {mine} but {what} reduces over ranks {other}; pass the "
                         f"data-parallel group the wrapper was built with (dist.group.WORLD when it is the world)")


# ------------------------------------------------------------------------------------------------------------
# Strategies


class GradientSync:
    """How one step's gradients are synchronised; the loop calls the hooks on every rank, once per step.

    Attributes:
        model: what the user passed (the wrapper).
        module: what the microbatches' ``forward`` is called on (DDP: its ``.module``).
        dp_group: the data-parallel group the loss is normalised over and the gradients summed over, always
            named (:mod:`cpscope.train.collectives`): ``dist.group.WORLD`` for the world, ``None`` for this rank
            alone.
        needs_backward: the sync happens inside a backward, so a rank without microbatches runs an empty one.
    """

    needs_backward: bool = False

    def __init__(self, model: nn.Module, module: nn.Module, dp_group: Group) -> None:
        self.model, self.module = model, module
        self.dp_group = check_dp_group(dp_group, type(self).__name__)

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters (where counts and losses are reduced)."""
        for p in self.module.parameters():
            return p.device  # FSDP2's DTensor parameters report their local device
        return torch.device("cpu")

    def begin_step(self) -> None:
        """Before the first forward of the step (collectives allowed: every rank calls it)."""

    def before_last_microbatch(self) -> None:
        """Before the forward of the step's last microbatch (the empty one on a rank without microbatches)."""

    def end_step(self) -> None:
        """After the last backward (collectives allowed: every rank calls it)."""

    def abort_step(self) -> None:
        """A microbatch raised: undo what :meth:`begin_step` changed, without collectives (best effort)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__})"


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
        if any(_is_fsdp2(m) for m in ddp.module.modules()):
            raise ValueError("DDPSync: the DDP module contains FSDP2 modules; shard with fully_shard alone")
        _same_ranks(dp_group, ddp.process_group, "DistributedDataParallel's process_group", "DDPSync")
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


def _is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _param_groups(module: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one FSDP module (torch ≥ 2.13: a list; earlier: one or none)."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined]
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


# The FSDP2 settings a step changes (per parameter group) and restores afterwards.
_GROUP_SETTINGS = ("reduce_grads", "all_reduce_grads", "reshard_after_backward", "post_forward_mesh_info",
                   "gradient_divide_factor", "force_sum_reduction_for_comms")


class FSDPSync(GradientSync):
    """FSDP2 (``fully_shard``) under hybrid CP: unshard once, accumulate without communication, reduce once.

    Per step, on every rank:

    1. ``begin_step``: every FSDP module gets ``set_requires_gradient_sync(False)``, ``set_reshard_after_forward(
       False)``, ``set_reshard_after_backward(False)``, a gradient divide factor of 1 with sum-only collectives
       (a SUM: the loss is already the global mean), and is ``unshard()``-ed — one all-gather per parameter
       group, in module order, the same on every rank. No forward or backward then communicates for FSDP: the
       parameters are already unsharded and the gradients accumulate unsharded (in ``reduce_dtype`` under a
       ``MixedPrecisionPolicy``).
    2. ``before_last_microbatch``: gradient sync back on, so the next backward reduce-scatters every parameter
       group once (FSDP's own reduce-scatter, overlapped with that backward). That backward is the rank's last
       microbatch when it is CP1; otherwise — a CP microbatch last, or no microbatch at all — :func:`run_step`
       runs one empty CP1 microbatch after the others (``needs_backward``). A reduce-scatter must never run inside a
       ring microbatch's backward: the ring's members for which that microbatch is not the last go on to the next
       layer's ring exchange, which waits for the rank blocked in the reduce-scatter — a deadlock that a schedule as
       simple as "rank 2 runs only the CP4 microbatch, rank 0 runs CP4 then CP2" produces.
    3. ``end_step``: every module ``reshard()``-ed (the sharded gradients are ready for the optimizer) and its own
       settings — ``reshard_after_forward`` / ``_backward``, gradient sync, divide factor — restored.

    Cost: the unsharded parameters (``param_dtype``) and unsharded gradients (``reduce_dtype``) of the whole model
    are held for the whole step, i.e. ``P · (param bytes + grad bytes)`` per rank instead of FSDP's per-layer
    working set — the price of ranks that run different numbers of microbatches without waiting for each other.
    Communication is the minimum: one all-gather and one reduce-scatter per parameter group per step.

    Only a one-dimensional mesh (plain FSDP, no HSDP) is supported, and every trainable parameter must be FSDP's
    (``fully_shard`` on the root too), else ``ValueError``.

    Example::

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:  # blocks get the fp32 RoPE table as an input: do not cast it to bf16
            fully_shard(block, mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
        fully_shard(model, mp_policy=policy)
        sync = FSDPSync(model, dp_group=dist.group.WORLD)      # the mesh's group: here the world
        result = run_step(model, mbs, dp_group=dist.group.WORLD, sync=sync)
    """

    needs_backward = True

    def __init__(self, model: nn.Module, *, dp_group: Group) -> None:
        root = getattr(model, "_orig_mod", model)  # torch.compile(model) wraps it
        fsdp = [m for m in root.modules() if _is_fsdp2(m)]
        if not fsdp:
            raise ValueError(f"FSDPSync: {type(model).__name__} has no FSDP2 module (fully_shard was not applied)")
        from torch.distributed.tensor import DTensor

        plain = [n for n, p in root.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if plain:
            raise ValueError(
                f"FSDPSync: {len(plain)} trainable parameter(s) are not sharded by FSDP2 (e.g. {plain[:3]}), so no "
                f"reduce-scatter would sum their gradients; apply fully_shard to the root module too"
            )
        _same_ranks(dp_group, _mesh_group(fsdp), "the FSDP2 device mesh", "FSDPSync")
        super().__init__(model, model, dp_group)
        self._fsdp = fsdp
        self._roots = _roots(root)
        self._saved: Optional[list[tuple[Any, dict[str, Any]]]] = None

    def _save(self) -> None:
        saved = []
        for m in self._fsdp:
            state = m._get_fsdp_state()
            if hasattr(state, "_auto_reshard_after_forward"):  # set_reshard_after_forward clears it
                saved.append((state, {"_auto_reshard_after_forward": state._auto_reshard_after_forward}))
            for g in _param_groups(m):
                saved.append((g, {k: getattr(g, k) for k in _GROUP_SETTINGS if hasattr(g, k)}))
        self._saved = saved

    def _restore(self) -> None:
        for obj, values in self._saved or ():
            for k, v in values.items():
                setattr(obj, k, v)
        self._saved = None

    def begin_step(self) -> None:
        for m in self._roots:  # FSDP's root set-up (normally at the first forward) before changing its settings
            m._get_fsdp_state()._lazy_init()
        self._save()
        for m in self._fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            set_factor = getattr(m, "set_gradient_divide_factor", None) or m.set_reduce_scatter_divide_factor
            set_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # SUM without a PREMUL_SUM op (gloo has none)
                m.set_force_sum_reduction_for_comms(True)
        for m in self._fsdp:  # one all-gather per parameter group, in module order, on every rank
            m.unshard()

    def before_last_microbatch(self) -> None:
        for m in self._fsdp:
            m.set_requires_gradient_sync(True, recurse=False)

    def end_step(self) -> None:
        for m in self._fsdp:
            m.reshard()
        self._restore()

    def abort_step(self) -> None:
        try:
            for m in self._roots:
                if hasattr(m, "reset_iter_state"):
                    m.reset_iter_state()
            for m in self._fsdp:
                m.reshard()
        finally:
            self._restore()


def _mesh_group(fsdp: list[nn.Module]) -> Group:
    """The one group every FSDP module is sharded over (``ValueError`` for HSDP's 2-D mesh or several groups)."""
    meshes = []
    for m in fsdp:
        for g in _param_groups(m):
            mesh = g.mesh_info.mesh
            if mesh.ndim != 1:
                raise ValueError(
                    f"FSDPSync supports FSDP over a 1-D device mesh; {type(m).__name__} is sharded over a "
                    f"{mesh.ndim}-D mesh {tuple(mesh.shape)} (HSDP is not supported by the hybrid loop yet)"
                )
            meshes.append(mesh)
    ranks = {tuple(dist.get_process_group_ranks(mm.get_group())) for mm in meshes}
    if len(ranks) > 1:
        raise ValueError(f"FSDPSync: the FSDP modules are sharded over different groups of ranks {sorted(ranks)}")
    return meshes[0].get_group() if meshes else None


def _roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP modules that no other FSDP module contains (FSDP's roots)."""
    roots: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if _is_fsdp2(m) and not any(name == r or name.startswith(r + ".") or r == "" for r, _ in roots):
            roots.append((name, m))
    return [m for _, m in roots]


def gradient_sync(model: nn.Module, *, dp_group: Group) -> GradientSync:
    """The :class:`GradientSync` for ``model``: :class:`DDPSync`, :class:`FSDPSync` or :class:`ManualSync`.

    ``dp_group`` is the data-parallel group the gradients are summed over (:mod:`cpscope.train.collectives`):
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
    if any(_is_fsdp2(m) for m in root.modules()):
        return FSDPSync(model, dp_group=dp_group)
    return ManualSync(model, dp_group=dp_group)
