"""The hybrid-CP step: run every local microbatch in its scope, normalise the loss globally, sync gradients once.

One training step of hybrid CP, on every rank::

    plan = plan_hybrid(lengths, n_ranks=world, capacity=cap)            # same plan on every rank
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)   # pack → pad → shard
    result = run_step(model, mbs, dp_group=dist.group.WORLD)   # forward/backward each in its scope; sync once
    optimizer.step(); optimizer.zero_grad()
    loss = result.global_loss()              # the global per-token loss (collective)

The microbatches are :class:`~cpscope.train.LocalMicrobatch` es — this rank's part of the planner's
:class:`cpscope.hybrid.Microbatch` es (:mod:`cpscope.train._prepare` says which microbatch type is which, and how
one is packed, labelled, padded and sharded).

:func:`run_step` counts the real targets of the whole global batch (:func:`global_num_targets`), runs every
microbatch (:func:`run_microbatches`) and synchronises the gradients **once**, however many microbatches each rank
ran — none included — through the :class:`~cpscope.train._sync.GradientSync` that suits the model: a plain
module, ``DistributedDataParallel`` or FSDP2 (:mod:`cpscope.train._sync`). The pieces stay usable on their own for
a hand-written loop: ``run_microbatches`` then ``allreduce_gradients(model, dp_group=...)`` is the plain-module step.

The data-parallel group ``dp_group`` is always named (:mod:`cpscope.train._collectives`): ``dist.group.WORLD`` for
the world, the group of ranks sharing this rank's tensor-parallel rank under tensor parallelism, ``None`` for one
process — never "``None`` means the world".

bind
    ``with runtime_cp(group, local_cp_size=cp, comm=mb.comm):`` around the forward; RoPE and attention read the
    group there. Backward runs outside the scope: cpscope's autograd functions use the scope they captured in
    forward.
loss normalisation
    Each rank's loss is ``Σ_local CE(token) / N``, where ``N`` is the number of real targets in the **global**
    batch (every microbatch of every rank of ``dp_group``). Every real target sits on exactly one rank of it, so
    the sum of the local losses over ``dp_group`` is the global per-token mean, and — because ring attention sends
    the gradient of remote keys and values back to their owners — the sum of the parameter gradients over
    ``dp_group`` (:func:`allreduce_gradients`) is the gradient of that mean: the single-rank gradient of the same
    global batch, whatever the CP sizes.

Example (the loop without :func:`run_step`, plain module)::

    dp = dist.group.WORLD
    groups = cpscope.new_cp_groups([1, 2, 4])
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
    n_targets = global_num_targets(mbs, dp_group=dp)
    for mb in mbs:
        with cpscope.runtime_cp(mb.group):
            logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)
            loss = token_loss_sum(logits, mb.labels) / n_targets
        loss.backward()
    allreduce_gradients(model, dp_group=dp)                             # SUM over the data-parallel group
"""
from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _hooks
from ..attention import verify_agreement
from ..groups import group_ranks
from ..scope import runtime_cp
from ._collectives import allreduce_gradients, allreduce_sum, check_dp_group, check_within
# The microbatches this loop runs on; their one home is cpscope.train._prepare (still importable here, not exported).
from ._prepare import (
    IGNORE_INDEX,
    LocalMicrobatch,
    empty_microbatch,
    next_token_labels,
    pack_documents,
    pad_and_shard,
    planned_group,
    prepare_microbatch,
    prepare_microbatches,
)
from ._sync import GradientSync, gradient_sync

__all__ = [
    "global_num_targets",
    "token_loss_sum",
    "run_microbatches",
    "run_step",
    "StepResult",
]

logger = logging.getLogger(__name__)

Group = Optional[dist.ProcessGroup]
Forward = Callable[[Any, LocalMicrobatch], Any]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def global_num_targets(
    microbatches: Iterable[LocalMicrobatch], *, dp_group: Group, device: Optional[Union[torch.device, str]] = None,
) -> int:
    """Real targets of the **global** batch: this rank's local counts summed over ``dp_group``.

    Collective over ``dp_group`` (``dist.group.WORLD`` for the world; ``None``: this rank alone). Every real
    target sits on exactly one rank of it (zigzag splits documents; CP1 documents live on one rank), so the sum
    counts each once — as long as ``dp_group`` holds only ranks with different tokens: under tensor parallelism
    the world would count a tensor-parallel group's shared targets once per member.

    Example::

        n = global_num_targets(mbs, dp_group=dist.group.WORLD)
    """
    dp_group = check_dp_group(dp_group, "global_num_targets")
    local = sum(mb.num_targets for mb in microbatches)
    n = int(allreduce_sum(local, group=dp_group, device=device).item())
    if n <= 0:
        raise ValueError(f"the global batch has {n} real targets; every document needs at least 2 tokens")
    return n


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-ignored targets (computed in fp32 at least).

    Example::

        loss_sum = token_loss_sum(model(mb.input_ids, cu_seqlens=mb.cu_seqlens), mb.labels)
    """
    compute = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(compute), labels, ignore_index=ignore_index, reduction="sum")


def _default_forward(model: Callable[..., torch.Tensor], mb: LocalMicrobatch) -> torch.Tensor:
    return model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)


def _check_count(num_targets: int) -> None:
    if isinstance(num_targets, bool) or not isinstance(num_targets, numbers.Integral) or num_targets <= 0:
        raise ValueError(
            f"num_targets must be the (positive) number of real targets in the global batch, got {num_targets!r}")


def run_microbatches(
    model: Callable[..., Any],
    microbatches: Iterable[LocalMicrobatch],
    *,
    num_targets: int,
    dp_group: Group,
    forward: Forward = _default_forward,
    loss_fn: LossFn = token_loss_sum,
    backward: bool = True,
    before_last: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """Forward (and backward) every microbatch in order, each under ``runtime_cp(mb.group)``.

    The loss backpropagated for a microbatch is ``loss_fn(output, labels) / num_targets`` where ``loss_fn``
    returns the **sum** of per-token losses over the local real targets and ``num_targets`` is the global count
    over ``dp_group`` (:func:`global_num_targets`). Every microbatch's CP group must lie inside ``dp_group``
    (checked before the first forward). Gradients accumulate in ``.grad``; call :func:`allreduce_gradients`
    afterwards — or use :func:`run_step`, which does both and also drives DDP and FSDP2.

    ``before_last`` (used by :func:`run_step`) is called right before the last microbatch runs.

    Returns:
        This rank's summed (un-normalised) loss, a float64 scalar tensor on the loss's device (no host sync);
        ``allreduce_sum`` it over ``dp_group`` and divide by ``num_targets`` for the global per-token loss.

    Raises:
        ValueError: ``num_targets`` not a positive int; a CP group reaching outside ``dp_group``.

    Example::

        dp = dist.group.WORLD
        n = global_num_targets(mbs, dp_group=dp)
        local = run_microbatches(model, mbs, num_targets=n, dp_group=dp)
        allreduce_gradients(model, dp_group=dp)
        loss = allreduce_sum(local, group=dp).item() / n
    """
    _check_count(num_targets)
    microbatches = list(microbatches)
    check_within((mb.group for mb in microbatches), check_dp_group(dp_group, "run_microbatches"), "run_microbatches")
    total = torch.zeros((), dtype=torch.float64)
    last = len(microbatches) - 1
    if _hooks.microbatches is not None:
        microbatches = _hooks.microbatches(microbatches, num_targets)
    for i, mb in enumerate(microbatches):
        if i == last and before_last is not None:
            before_last()
        with runtime_cp(mb.group, local_cp_size=mb.cp, comm=mb.comm):  # the planned variant (None: p2p)
            out = forward(model, mb)
            loss_sum = loss_fn(out, mb.labels)
        if backward:
            (loss_sum / num_targets).backward()  # ring-attention backward uses the scope captured in forward
        total = total.to(loss_sum.device) + loss_sum.detach().to(torch.float64)  # stays on device: no sync
    return total


def _grad_tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a forward's output (tensor, mapping or sequence of them) that require grad."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _grad_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _grad_tensors(v)]
    return []


def _run_empty(module: Any, forward: Forward, device: torch.device) -> None:
    """Forward the empty microbatch and backpropagate zeros: every parameter gets a zero gradient contribution."""
    mb = empty_microbatch(device=device)
    with runtime_cp(None, local_cp_size=1):
        out = forward(module, mb)
    tensors = _grad_tensors(out)
    if not tensors:
        raise RuntimeError(
            f"run_step: the forward of the empty microbatch returned no tensor that requires grad "
            f"({type(out).__name__}); the gradient sync needs one backward on every rank"
        )
    torch.autograd.backward(tensors, [torch.zeros_like(t) for t in tensors])


@dataclass(frozen=True)
class StepResult:
    """What :func:`run_step` returns on every rank.

    Attributes:
        loss_sum: this rank's summed (un-normalised) loss, a float64 scalar on the model's device (no host sync).
        num_targets: real targets of the global batch (the loss's denominator).
        num_microbatches: real microbatches this rank ran (an empty one is not counted).
        dp_group: the data-parallel group of the step (``None``: this rank alone).

    Example::

        result = run_step(model, mbs, dp_group=dist.group.WORLD)
        result.global_loss()          # collective over result.dp_group
    """

    loss_sum: torch.Tensor
    num_targets: int
    num_microbatches: int
    dp_group: Group

    def global_loss(self) -> float:
        """The global per-token loss; collective over ``dp_group`` (every rank calls it), one host sync."""
        return float(allreduce_sum(self.loss_sum, group=self.dp_group).item()) / self.num_targets


def _step_sync(model: torch.nn.Module, dp_group: Group, sync: Optional[GradientSync]) -> GradientSync:
    """``sync`` checked against ``model`` and ``dp_group`` (the same members), or the model's default one."""
    dp_group = check_dp_group(dp_group, "run_step")
    if sync is None:
        return gradient_sync(model, dp_group=dp_group)
    if sync.model is not model:
        raise ValueError(f"run_step: sync was built for {sync.model.__class__.__name__} object "
                         f"{id(sync.model):#x}, not for the model passed ({id(model):#x})")
    if sync.dp_group is not dp_group and sorted(group_ranks(sync.dp_group)) != sorted(group_ranks(dp_group)):
        raise ValueError(f"run_step: sync reduces over the ranks {group_ranks(sync.dp_group)} but dp_group has ranks "
                         f"{group_ranks(dp_group)}; build the sync with the step's dp_group")
    return sync


def run_step(
    model: torch.nn.Module,
    microbatches: Iterable[LocalMicrobatch],
    *,
    dp_group: Group,
    sync: Optional[GradientSync] = None,
    num_targets: Optional[int] = None,
    forward: Forward = _default_forward,
    loss_fn: LossFn = token_loss_sum,
) -> StepResult:
    """One training step's forward and backward of every microbatch of this rank, gradients synchronised once.

    Collective over the data-parallel group ``dp_group`` (``dist.group.WORLD`` for the world): every rank calls it,
    with its own microbatches — any number, **none included**. ``sync`` (default
    :func:`~cpscope.train.gradient_sync` of ``model`` over ``dp_group``, built per call: pass one built once to
    skip the checks) decides how: a plain module's gradients are summed after the last backward,
    ``DistributedDataParallel``'s forward and reducer are bypassed and its gradients summed once, FSDP2 modules are
    unsharded once and reduce-scatter once, in one CP1 backward at the end — the last microbatch when it is CP1,
    else an added :func:`~cpscope.train._prepare.empty_microbatch` (see :mod:`cpscope.train._sync`). Afterwards every
    parameter's gradient (sharded under FSDP2) is the gradient of the global per-token mean loss — the
    single-process gradient of the whole global batch. Call the optimizer next.

    ``forward(module, mb)`` runs under ``runtime_cp(mb.group)`` and receives ``sync.module`` (for DDP its inner
    ``.module``) and, under FSDP2, possibly the empty microbatch; ``loss_fn(output, labels)`` returns the **sum** of
    the per-token losses. ``num_targets`` defaults to :func:`global_num_targets` over ``dp_group`` (one all-reduce).

    Raises:
        ValueError: ``sync`` was built for another model or another group; ``num_targets`` not positive; a CP group
            outside ``dp_group``; what :func:`~cpscope.train.gradient_sync` refuses.
        cpscope.RanksDisagreeError: the ranks of a CP group ran different attention calls in this step (read at
            its end, before the optimizer step; :func:`cpscope.verify_agreement`).

    Example::

        dp = dist.group.WORLD
        sync = gradient_sync(ddp_model, dp_group=dp)                  # once
        for step in range(steps):
            mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups, device=device)
            result = run_step(ddp_model, mbs, dp_group=dp, sync=sync)
            optimizer.step(); optimizer.zero_grad()
            print(result.global_loss())
    """
    mbs = list(microbatches)
    sync = _step_sync(model, dp_group, sync)
    check_within((mb.group for mb in mbs), sync.dp_group, "run_step")  # before any collective of the step
    if num_targets is None:
        num_targets = global_num_targets(mbs, dp_group=sync.dp_group, device=sync.device)
    _check_count(num_targets)
    total = torch.zeros((), dtype=torch.float64, device=sync.device)
    # A sync inside a backward (FSDP2's reduce-scatters) must not interleave with a ring: a rank waiting in a
    # reduce-scatter would stall a CP peer still exchanging keys and values with it in that microbatch's backward.
    # So it rides on the last microbatch only when that is CP1, else on an extra empty (CP1) microbatch.
    inline = bool(mbs) and (not sync.needs_backward or mbs[-1].cp == 1)
    sync.begin_step()
    try:
        # one call for all microbatches (what a per-step observer such as the sentinel sees as the step)
        if mbs:
            total = total + run_microbatches(sync.module, mbs, num_targets=num_targets, dp_group=sync.dp_group,
                                             forward=forward, loss_fn=loss_fn,
                                             before_last=sync.before_last_microbatch if inline else None)
        if not inline:
            sync.before_last_microbatch()
            if sync.needs_backward:
                _run_empty(sync.module, forward, sync.device)
    except BaseException:
        sync.abort_step()
        raise
    sync.end_step()
    verify_agreement()  # the step boundary: attention calls whose agreement was checked on the device (no host read)
    return StepResult(loss_sum=total, num_targets=num_targets, num_microbatches=len(mbs), dp_group=sync.dp_group)
