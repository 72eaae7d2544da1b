"""Gradient synchronisation for the hybrid-CP loop: once per step, a SUM over the data-parallel ranks.

Under hybrid CP the ranks run **different numbers of microbatches** in a step (a rank may run none). The usual
wrappers count on the opposite:

* ``DistributedDataParallel`` all-reduces gradients in every backward and broadcasts buffers in every forward;
* FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers parameters in every forward (and again in backward
  when it resharded after forward) and reduce-scatters gradients in every backward.

Their collectives would differ in number between ranks — a hang — and both *average* over the ranks, where the
loop wants a *sum*: every rank divides its loss by the global number of targets (:mod:`cpscope.train.loop`), so
the world-sum of the gradients is the gradient of the global per-token mean.

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

    sync = gradient_sync(model)               # DDP, FSDP2 or a plain module; validated once
    for step in range(steps):
        mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
        result = run_step(model, mbs, sync=sync)   # forward/backward every microbatch, gradients synced once
        optimizer.step(); optimizer.zero_grad()

The protocol, for a strategy of your own: ``begin_step()`` before the first forward, ``before_last_microbatch()``
before the forward of the last microbatch, ``end_step()`` after the last backward. Every rank calls each exactly
once per step, whatever its number of microbatches; a strategy whose sync happens *inside* a backward sets
``needs_backward``: its last microbatch is then always CP1 — the rank's own last one when it is CP1, else one
empty microbatch (zero gradients) added after the others.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

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

_DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


# ------------------------------------------------------------------------------------------------------------
# Collectives


def allreduce_sum(value: Union[int, float, torch.Tensor], *, group: Optional[dist.ProcessGroup] = None,
                  device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """Sum a scalar (or tensor) over ``group`` (default: the world); float64 for floats, int64 for ints.

    Note: here, as in ``torch.distributed``, ``group=None`` means the **world**, not CP1 — to reduce over a
    microbatch's CP group, skip the call when ``mb.group is None``.

    ``device`` must suit the backend (a CUDA device for NCCL). Without ``torch.distributed`` it returns the value.

    Example::

        n = allreduce_sum(local_count).item()
    """
    t = torch.as_tensor(value).detach().clone()
    t = t.to(torch.int64 if not t.is_floating_point() else torch.float64)
    if device is not None:
        t = t.to(device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> Iterator[list[nn.Parameter]]:
    """Consecutive runs of parameters of one (device, dtype) holding at most ``bucket_bytes`` (at least one)."""
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and (size + nbytes > bucket_bytes or (p.grad.device, p.grad.dtype) != (
                bucket[0].grad.device, bucket[0].grad.dtype)):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket


def allreduce_gradients(
    model_or_params: Union[nn.Module, Iterable[nn.Parameter]],
    *,
    group: Optional[dist.ProcessGroup] = None,
    average: bool = False,
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
) -> None:
    """Sum (or average) the gradients of every parameter over ``group`` (default: the world), in place.

    With the loop's normalisation (:func:`cpscope.train.loop.run_microbatches`) the **sum** is the gradient of the
    global per-token loss; use ``average=True`` only with a loss normalised per rank. A parameter without ``.grad``
    on this rank (no local token reached it) takes part as zeros, so every rank issues the same collectives; one
    that has no gradient on **any** rank keeps ``grad = None`` (as DDP leaves unused parameters, so an optimizer
    skips it exactly as a single process would). Gradients are reduced in buckets of at most ``bucket_bytes``
    of one (device, dtype), in parameter order, plus one small all-reduce of which parameters have a gradient.
    Without ``torch.distributed`` it does nothing.

    Example::

        allreduce_gradients(model)             # after the last backward of the step
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    params = [p for p in params if p.requires_grad]
    if not dist.is_initialized() or not params:
        return
    device = next((p.grad.device for p in params if p.grad is not None), params[0].device)
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.SUM, group=group)
    used = has.cpu().tolist()
    params = [p for p, n in zip(params, used) if n > 0]  # unused everywhere: stays None, no traffic
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size(group)
    order = sorted(range(len(params)), key=lambda i: (str(params[i].grad.device), str(params[i].grad.dtype), i))
    for bucket in _buckets([params[i] for i in order], bucket_bytes):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if average:
            flat /= world
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


# ------------------------------------------------------------------------------------------------------------
# Strategies


class GradientSync:
    """How one step's gradients are synchronised; the loop calls the hooks on every rank, once per step.

    Attributes:
        model: what the user passed (the wrapper).
        module: what the microbatches' ``forward`` is called on (DDP: its ``.module``).
        group: the data-parallel process group the loss is normalised over and the gradients summed over
            (``None``: the world).
        needs_backward: the sync happens inside a backward, so a rank without microbatches runs an empty one.
    """

    needs_backward: bool = False

    def __init__(self, model: nn.Module, module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
        self.model, self.module, self.group = model, module, group

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
    """A plain module (no DDP / FSDP wrapper): one bucketed SUM of the gradients over ``group`` after the step.

    Example::

        run_step(model, mbs, sync=ManualSync(model))     # what gradient_sync(model) returns for a plain module
    """

    def __init__(self, model: nn.Module, *, group: Optional[dist.ProcessGroup] = None,
                 bucket_bytes: int = _DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(model, model, group)
        self.bucket_bytes = bucket_bytes

    def end_step(self) -> None:
        allreduce_gradients(self.module, group=self.group, bucket_bytes=self.bucket_bytes)


class DDPSync(GradientSync):
    """``DistributedDataParallel`` under hybrid CP: its ``.module`` runs the microbatches, one SUM at the end.

    DDP would all-reduce in the backward of every microbatch; here its forward (and so its reducer, which only
    acts after a DDP forward) is bypassed: ``forward`` receives ``ddp.module``. At the start of the step the buffers
    are broadcast from rank 0 of DDP's group when ``broadcast_buffers`` is on — what DDP itself does once per
    accumulation window under ``no_sync`` — and after the last backward the gradients of the parameters DDP
    synchronises (not its ignored ones) are summed over ``ddp.process_group`` in buckets of DDP's
    ``bucket_bytes_cap``. No collective depends on the number of microbatches.

    Raises:
        ValueError: a communication hook is registered (it would be skipped), DDP's own ``mixed_precision`` is
            set (its casts live in the bypassed forward), or the DDP module contains FSDP modules.

    Example::

        ddp = DistributedDataParallel(model)
        sync = DDPSync(ddp)
        result = run_step(ddp, mbs, sync=sync)
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel) -> None:
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
        super().__init__(ddp, ddp.module, ddp.process_group)
        ignore = set(getattr(ddp, "parameters_to_ignore", ()))
        self._params = [p for n, p in ddp.module.named_parameters() if n not in ignore and p.requires_grad]
        self._buffers = [b for n, b in ddp.module.named_buffers() if n not in ignore] if ddp.broadcast_buffers else []
        self.bucket_bytes = int(getattr(ddp, "bucket_bytes_cap", _DEFAULT_BUCKET_BYTES))

    def begin_step(self) -> None:
        if self._buffers and dist.get_world_size(self.group) > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for b in self._buffers:
                dist.broadcast(b, src=src, group=self.group)

    def end_step(self) -> None:
        allreduce_gradients(self._params, group=self.group, bucket_bytes=self.bucket_bytes)


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
        sync = FSDPSync(model)
        result = run_step(model, mbs, sync=sync)
    """

    needs_backward = True

    def __init__(self, model: nn.Module) -> None:
        root = getattr(model, "_orig_mod", model)  # torch.compile(model) wraps it
        fsdp = [m for m in root.modules() if _is_fsdp2(m)]
        if not fsdp:
            raise ValueError(f"FSDPSync: {type(model).__name__} has no FSDP2 module (fully_shard was not applied)")
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
        group = meshes[0].get_group() if meshes else None
        ranks = {tuple(dist.get_process_group_ranks(mm.get_group())) for mm in meshes}
        if len(ranks) > 1:
            raise ValueError(f"FSDPSync: the FSDP modules are sharded over different groups of ranks {sorted(ranks)}")
        from torch.distributed.tensor import DTensor

        plain = [n for n, p in root.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if plain:
            raise ValueError(
                f"FSDPSync: {len(plain)} trainable parameter(s) are not sharded by FSDP2 (e.g. {plain[:3]}), so no "
                f"reduce-scatter would sum their gradients; apply fully_shard to the root module too"
            )
        super().__init__(model, model, group)
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


def _roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP modules that no other FSDP module contains (FSDP's roots)."""
    roots: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if _is_fsdp2(m) and not any(name == r or name.startswith(r + ".") or r == "" for r, _ in roots):
            roots.append((name, m))
    return [m for _, m in roots]


def gradient_sync(model: nn.Module, *, group: Optional[dist.ProcessGroup] = None) -> GradientSync:
    """The :class:`GradientSync` for ``model``: :class:`DDPSync`, :class:`FSDPSync` or :class:`ManualSync`.

    ``group`` (the data-parallel group, default the world) only applies to a plain module; DDP and FSDP2 bring
    their own.

    Raises:
        ValueError: ``torch.compile`` applied to the DDP wrapper (compile the inner module or its blocks instead);
            FSDP1 (``FullyShardedDataParallel``); an unsupported DDP or FSDP2 setting (see the classes).

    Example::

        sync = gradient_sync(model)
        result = run_step(model, mbs, sync=sync)
    """
    inner = getattr(model, "_orig_mod", None)  # torch.compile(model) → OptimizedModule
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "gradient_sync: torch.compile was applied to the DistributedDataParallel wrapper; the hybrid loop runs "
            "DDP's inner module, which this compiled wrapper does not cover. Compile the model (or its blocks) "
            "before wrapping it: DistributedDataParallel(torch.compile(model))"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDPSync(model)
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
        if group is not None:
            raise ValueError("gradient_sync: group= is for plain modules; FSDP2 uses its device mesh's group")
        return FSDPSync(model)
    return ManualSync(model, group=group)
