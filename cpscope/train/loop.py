"""The hybrid-CP microbatch loop: pack, pad, shard and bind per microbatch; normalise the loss globally.

One training step of hybrid CP, on every rank::

    plan = plan_hybrid(lengths, n_ranks=world, capacity=cap)            # same plan on every rank
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)   # pack → pad → shard
    result = run_step(model, mbs)            # forward/backward each microbatch in its scope; gradients synced once
    optimizer.step(); optimizer.zero_grad()
    loss = result.global_loss()              # the global per-token loss (collective)

:func:`run_step` counts the real targets of the whole global batch (:func:`global_num_targets`), runs every
microbatch (:func:`run_microbatches`) and synchronises the gradients **once**, however many microbatches each rank
ran — none included — through the :class:`~cpscope.train.sync.GradientSync` that suits the model: a plain
module, ``DistributedDataParallel`` or FSDP2 (:mod:`cpscope.train.sync`). The pieces stay usable on their own for
a hand-written loop: ``run_microbatches`` then ``allreduce_gradients(model)`` is the plain-module step.

Each step, spelled out:

pack
    The documents of one microbatch are concatenated into one ``thd`` stream with global ``cu_seqlens``. The
    next-token labels are made **here, on the whole document, before sharding**: ``labels[i] = ids[i + 1]``
    inside a document, and the last token of every document gets ``ignore_index`` (its target is not in the
    document). Sharding afterwards keeps every pair (token, its target) together even when ``i`` and ``i + 1``
    land in different zigzag chunks or on different ranks.
pad
    :func:`cpscope.sharding.pad_packed_batch` pads every document to a multiple of ``2·cp`` (zigzag cuts it into
    ``2·cp`` chunks); padding tokens get ``pad_id`` as input and ``ignore_index`` as label. Padding sits at the
    *end* of each document, so causal attention never lets a real token see it.
shard
    :func:`cpscope.zigzag_shard` (``thd``, per document) keeps this rank's part of ids and labels.
bind
    ``with runtime_cp(group):`` around the forward; RoPE and attention read the group there. Backward runs
    outside the scope: cpscope's autograd functions use the scope they captured in forward.
loss normalisation
    Each rank's loss is ``Σ_local CE(token) / N``, where ``N`` is the number of real targets in the **global**
    batch (every microbatch of every rank). Every real target sits on exactly one rank, so the world-sum of the
    local losses is the global per-token mean, and — because ring attention sends the gradient of remote keys and
    values back to their owners — the world-sum of the parameter gradients (:func:`allreduce_gradients`) is the
    gradient of that mean: the single-rank gradient of the same global batch, whatever the CP sizes.

Example (the loop without :func:`run_step`, plain module)::

    groups = cpscope.new_cp_groups([1, 2, 4])
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
    n_targets = global_num_targets(mbs)
    for mb in mbs:
        with cpscope.runtime_cp(mb.group):
            logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)
            loss = token_loss_sum(logits, mb.labels) / n_targets
        loss.backward()
    allreduce_gradients(model)                                          # SUM over the world
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _hooks
from .._pack import cu_seqlens_list
from ..groups import group_ranks
from ..scope import check_comm, runtime_cp, scope_for
from ..sharding import pad_packed_batch, zigzag_shard
from .sync import GradientSync, allreduce_gradients, allreduce_sum, gradient_sync

__all__ = [
    "IGNORE_INDEX",
    "MicrobatchSpec",
    "LocalMicrobatch",
    "next_token_labels",
    "pack_documents",
    "prepare_microbatch",
    "prepare_microbatches",
    "planned_group",
    "pad_and_shard",
    "global_num_targets",
    "token_loss_sum",
    "run_microbatches",
    "run_step",
    "StepResult",
    "empty_microbatch",
    "allreduce_gradients",
    "allreduce_sum",
]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


class MicrobatchSpec(Protocol):
    """What the loop needs from a planned microbatch (:class:`cpscope.hybrid.Microbatch` has it)."""

    cp: int
    seqs: Sequence[int]

    @property
    def ranks(self) -> Iterable[int]: ...


@dataclass(frozen=True)
class LocalMicrobatch:
    """One microbatch as this rank runs it: its local zigzag tokens and targets, the group and the offsets.

    Attributes:
        cp: the CP size; ``group`` the CP group (``None`` for CP1) to bind with ``runtime_cp``.
        input_ids: ``[T / cp]`` int64 local token ids (zigzag, document by document).
        labels: ``[T / cp]`` int64 local next-token targets; ``ignore_index`` at padding and document ends.
        cu_seqlens: ``[docs + 1]`` int32 **global** offsets of the padded documents (what RoPE / attention take),
            on the CPU: cpscope reads offsets on the host and keeps cached device copies for its kernels.
        max_seqlen: the longest padded document (global).
        num_targets: real (non-ignored) targets on this rank.
        seqs: indices of the documents in the global batch, in packing order.
        cu_seqlens_real: ``[docs + 1]`` int32 global offsets of the real (unpadded) documents. A causal model needs
            only ``cu_seqlens`` (padding follows every real token of its document); attention without a causal
            mask takes both — ``cu_seqlens=mb.cu_seqlens_real, cu_seqlens_padded=mb.cu_seqlens`` — so padding is
            masked.
        comm: the attention communication variant planned for this microbatch (``None``: the default, ``"p2p"``);
            :func:`run_microbatches` binds it with the group.
    """

    cp: int
    group: Optional[dist.ProcessGroup]
    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_targets: int
    seqs: tuple[int, ...]
    cu_seqlens_real: Optional[torch.Tensor] = None
    comm: Optional[str] = None


def next_token_labels(
    input_ids: torch.Tensor, cu_seqlens: Union[torch.Tensor, Sequence[int]], ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token targets of a packed ``[T]`` stream, document by document (call it **before** sharding).

    ``labels[i] = input_ids[i + 1]`` when ``i + 1`` is in the same document, else ``ignore_index``.

    Example::

        >>> next_token_labels(torch.tensor([5, 6, 7, 8, 9]), [0, 3, 5]).tolist()
        [6, 7, -100, 9, -100]
    """
    cu = torch.tensor(cu_seqlens_list(cu_seqlens), dtype=torch.long)  # validated: ints, from 0, non-decreasing
    if input_ids.dim() != 1 or int(cu[-1]) != input_ids.shape[0]:
        raise ValueError(
            f"next_token_labels: input_ids must be a full packed [T] tensor with T = cu_seqlens[-1]; got shape "
            f"{tuple(input_ids.shape)} and cu_seqlens[-1]={int(cu[-1])}"
        )
    labels = torch.full_like(input_ids, ignore_index)
    labels[:-1] = input_ids[1:]
    ends = cu[1:][cu[1:] > cu[:-1]] - 1  # last token of every non-empty document
    labels[ends.to(labels.device)] = ignore_index
    return labels


def pack_documents(docs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate 1-D token tensors into a packed ``[T]`` stream; returns ``(ids, cu_seqlens int32)``."""
    if not docs:
        raise ValueError("pack_documents: a microbatch needs at least one document, got none")
    bad = [(i, tuple(d.shape)) for i, d in enumerate(docs) if d.dim() != 1 or d.numel() == 0]
    if bad:
        raise ValueError(f"pack_documents: documents must be non-empty 1-D token tensors; got (index, shape) {bad[:5]}")
    lens = torch.tensor([0] + [d.numel() for d in docs], dtype=torch.long)
    return torch.cat(list(docs)), torch.cumsum(lens, 0).to(torch.int32)


def prepare_microbatch(
    docs: Sequence[torch.Tensor],
    *,
    cp: int,
    group: Optional[dist.ProcessGroup],
    seqs: Sequence[int] = (),
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    device: Optional[Union[torch.device, str]] = None,
    comm: Optional[str] = None,
) -> LocalMicrobatch:
    """Pack ``docs``, make next-token labels, pad each document to ``2·cp``, and keep this rank's zigzag part.

    No communication. ``group`` must be this rank's CP group of size ``cp`` (``None`` for CP1).

    Raises:
        ValueError: ``cp`` contradicts ``group`` (or this rank is not in it); empty or non-1-D documents.

    Example::

        mb = prepare_microbatch([doc_a, doc_b], cp=2, group=groups[2])
        with cpscope.runtime_cp(mb.group):
            logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)
    """
    scope_for(group, local_cp_size=cp)  # ValueError if cp and group disagree, or this rank is not a member
    ids, cu = pack_documents(docs)
    labels = next_token_labels(ids, cu, ignore_index)
    ids_l, labels_l, cu_p = pad_and_shard(ids, labels, cu, cp=cp, group=group, pad_id=pad_id,
                                          ignore_index=ignore_index, device=device)
    return LocalMicrobatch(
        cp=cp, group=group, input_ids=ids_l, labels=labels_l, cu_seqlens=cu_p,
        max_seqlen=int((cu_p[1:] - cu_p[:-1]).max()), num_targets=int((labels_l != ignore_index).sum()),
        seqs=tuple(int(s) for s in seqs), cu_seqlens_real=cu, comm=check_comm(comm),
    )


def pad_and_shard(
    ids: torch.Tensor, labels: torch.Tensor, cu: torch.Tensor, *, cp: int, group: Optional[dist.ProcessGroup],
    pad_id: int = 0, ignore_index: int = IGNORE_INDEX, device: Optional[Union[torch.device, str]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad each document of a packed ``[T]`` pair (tokens, targets) to ``2·cp`` and keep this rank's zigzag part.

    Returns ``(ids_local, labels_local, cu_seqlens_padded)``: padding gets ``pad_id`` / ``ignore_index``; the
    offsets stay on the host (cpscope reads them there; no device sync per layer), the tokens move to ``device``.

    Example::

        ids_l, labels_l, cu_p = pad_and_shard(ids, labels, cu, cp=2, group=groups[2])
    """
    padded = pad_packed_batch(ids, labels, cu_seqlens=cu, cp=cp, pad_value=(pad_id, ignore_index))
    ids_p, labels_p = padded.tensors  # [T_padded] each
    cu_p = padded.cu_seqlens_padded
    ids_l = zigzag_shard(ids_p, seq_dim=0, cu_seqlens=cu_p, group=group)  # [T_padded / cp]
    labels_l = zigzag_shard(labels_p, seq_dim=0, cu_seqlens=cu_p, group=group)
    if device is not None:
        ids_l, labels_l = ids_l.to(device), labels_l.to(device)
    return ids_l, labels_l, cu_p


def planned_group(
    mb: MicrobatchSpec, groups: Mapping[int, Optional[dist.ProcessGroup]], *, ranks: Optional[Sequence[int]] = None,
) -> Optional[dist.ProcessGroup]:
    """This rank's group for planned microbatch ``mb`` from ``groups`` (:func:`cpscope.new_cp_groups` over ``ranks``,
    default the world), checked against the planned ranks: a plan that does not match the groups fails here with a
    ``ValueError`` instead of hanging in a collective. Membership is compared, not order: a group's CP ranks ascend
    with the global ranks (torch's order, which ``cp_rank()`` and the shards follow), whatever the order of ``ranks``
    inside a block.

    Example::

        group = planned_group(mb, cpscope.new_cp_groups([1, 2, 4]))
    """
    if mb.cp not in groups:
        raise ValueError(f"the plan uses CP size {mb.cp} but groups only has sizes {sorted(groups)}")
    group = groups[mb.cp]
    planned_ranks = [int(r) for r in mb.ranks]
    if ranks is not None:
        planned_ranks = [int(ranks[r]) for r in planned_ranks]
    actual = group_ranks(group)
    if sorted(actual) != sorted(planned_ranks):
        raise ValueError(
            f"microbatch of documents {tuple(mb.seqs)} is planned on global ranks {planned_ranks} at CP "
            f"{mb.cp}, but this rank's group of that size has ranks {actual}; build groups with "
            f"new_cp_groups over the same ranks the plan was made for"
        )
    return group


def prepare_microbatches(
    planned: Iterable[MicrobatchSpec],
    docs: Sequence[torch.Tensor],
    groups: Mapping[int, Optional[dist.ProcessGroup]],
    *,
    ranks: Optional[Sequence[int]] = None,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    device: Optional[Union[torch.device, str]] = None,
) -> list[LocalMicrobatch]:
    """:func:`prepare_microbatch` for each planned microbatch of this rank, with its group from ``groups``.

    ``planned`` is this rank's ordered list (``plan.microbatches_for_rank(rank)``); ``docs[i]`` is document ``i``
    of the global batch; ``groups`` comes from :func:`cpscope.new_cp_groups` over ``ranks`` (default the world).
    Each group's members are checked against the microbatch's planned ranks, so a plan that does not match the
    groups fails here with a ``ValueError`` instead of hanging in a collective.
    """
    out = []
    for mb in planned:
        group = planned_group(mb, groups, ranks=ranks)
        out.append(
            prepare_microbatch(
                [docs[i] for i in mb.seqs], cp=mb.cp, group=group, seqs=mb.seqs, pad_id=pad_id,
                ignore_index=ignore_index, device=device, comm=getattr(mb, "comm", None),
            )
        )
    return out


def global_num_targets(
    microbatches: Iterable[LocalMicrobatch], *, group: Optional[dist.ProcessGroup] = None,
    device: Optional[Union[torch.device, str]] = None,
) -> int:
    """Real targets of the **global** batch: this rank's local counts summed over ``group`` (default the world).

    Collective. Every real target sits on exactly one rank (zigzag splits documents; CP1 documents live on one
    rank), so the sum counts each once.
    """
    local = sum(mb.num_targets for mb in microbatches)
    n = int(allreduce_sum(local, group=group, device=device).item())
    if n <= 0:
        raise ValueError(f"the global batch has {n} real targets; every document needs at least 2 tokens")
    return n


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-ignored targets (computed in fp32 at least)."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(compute), labels, ignore_index=ignore_index, reduction="sum")


def _default_forward(model: Callable[..., torch.Tensor], mb: LocalMicrobatch) -> torch.Tensor:
    return model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)


def run_microbatches(
    model: Callable[..., torch.Tensor],
    microbatches: Iterable[LocalMicrobatch],
    *,
    num_targets: int,
    forward: Callable[[Any, LocalMicrobatch], torch.Tensor] = _default_forward,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
    backward: bool = True,
    before_last: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """Forward (and backward) every microbatch in order, each under ``runtime_cp(mb.group)``.

    The loss backpropagated for a microbatch is ``loss_fn(output, labels) / num_targets`` where ``loss_fn``
    returns the **sum** of per-token losses over the local real targets and ``num_targets`` is the global count
    (:func:`global_num_targets`). Gradients accumulate in ``.grad``; call :func:`allreduce_gradients` afterwards
    — or use :func:`run_step`, which does both and also drives DDP and FSDP2.

    ``before_last`` (used by :func:`run_step`) is called right before the last microbatch runs.

    Returns:
        This rank's summed (un-normalised) loss, a float64 scalar tensor on the loss's device (no host sync);
        ``allreduce_sum`` it and divide by ``num_targets`` for the global per-token loss.

    Example::

        n = global_num_targets(mbs)
        local = run_microbatches(model, mbs, num_targets=n)
        allreduce_gradients(model)
        loss = allreduce_sum(local).item() / n
    """
    if num_targets <= 0:
        raise ValueError(f"num_targets must be the (positive) number of real targets in the global batch, got {num_targets}")
    total = torch.zeros((), dtype=torch.float64)
    microbatches = list(microbatches)
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


def empty_microbatch(
    *, device: Optional[Union[torch.device, str]] = None, pad_id: int = 0, ignore_index: int = IGNORE_INDEX
) -> LocalMicrobatch:
    """A microbatch with no target: one CP1 document of 2 padding tokens, every label ``ignore_index``.

    :func:`run_step` runs it when the gradient sync happens inside a backward (FSDP2) and this rank's last
    microbatch is not CP1 (or it has none): its forward and a backward of **zero** output gradients let FSDP
    reduce-scatter after every ring of the step, without changing any gradient. A custom ``forward`` must accept it
    (``mb.num_targets == 0``, ``mb.seqs == ()``).

    Example::

        mb = empty_microbatch(device="cuda")
        logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)   # [2, vocab]
    """
    ids = torch.full((2,), pad_id, dtype=torch.long, device=device)
    labels = torch.full((2,), ignore_index, dtype=torch.long, device=device)
    cu = torch.tensor([0, 2], dtype=torch.int32)  # host, like every LocalMicrobatch
    return LocalMicrobatch(cp=1, group=None, input_ids=ids, labels=labels, cu_seqlens=cu, max_seqlen=2,
                           num_targets=0, seqs=())


def _grad_tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a forward's output (tensor, mapping or sequence of them) that require grad."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _grad_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _grad_tensors(v)]
    return []


def _run_empty(module: Any, forward: Callable[[Any, LocalMicrobatch], Any], device: torch.device) -> None:
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
        group: the data-parallel group (``None``: the world) of the sync.
    """

    loss_sum: torch.Tensor
    num_targets: int
    num_microbatches: int
    group: Optional[dist.ProcessGroup]

    def global_loss(self) -> float:
        """The global per-token loss; collective over ``group`` (every rank calls it), one host sync."""
        return float(allreduce_sum(self.loss_sum, group=self.group).item()) / self.num_targets


def run_step(
    model: torch.nn.Module,
    microbatches: Iterable[LocalMicrobatch],
    *,
    sync: Optional[GradientSync] = None,
    num_targets: Optional[int] = None,
    forward: Callable[[Any, LocalMicrobatch], torch.Tensor] = _default_forward,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
) -> StepResult:
    """One training step's forward and backward of every microbatch of this rank, gradients synchronised once.

    Collective over the data-parallel group: every rank calls it, with its own microbatches — any number,
    **none included**. ``sync`` (default :func:`~cpscope.train.sync.gradient_sync` of ``model``, built per call:
    pass one built once to skip the checks) decides how: a plain module's gradients are summed after the last
    backward, ``DistributedDataParallel``'s forward and reducer are bypassed and its gradients summed once,
    FSDP2 modules are unsharded once and reduce-scatter once, in one CP1 backward at the end — the last
    microbatch when it is CP1, else an added :func:`empty_microbatch` (see :mod:`cpscope.train.sync`). Afterwards
    every parameter's gradient (sharded under FSDP2) is the gradient of the global per-token mean loss — the
    single-process gradient of the whole global batch. Call the optimizer next.

    ``forward(module, mb)`` runs under ``runtime_cp(mb.group)`` and receives ``sync.module`` (for DDP its inner
    ``.module``) and, under FSDP2, possibly the empty microbatch; ``loss_fn(output, labels)`` returns the **sum** of
    the per-token losses. ``num_targets`` defaults to :func:`global_num_targets` over ``sync.group`` (one
    all-reduce).

    Raises:
        ValueError: ``sync`` was built for another model; ``num_targets`` not positive; what
            :func:`~cpscope.train.sync.gradient_sync` refuses.

    Example::

        sync = gradient_sync(ddp_model)                   # once
        for step in range(steps):
            mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups, device=device)
            result = run_step(ddp_model, mbs, sync=sync)
            optimizer.step(); optimizer.zero_grad()
            print(result.global_loss())
    """
    mbs = list(microbatches)
    if sync is None:
        sync = gradient_sync(model)
    elif sync.model is not model:
        raise ValueError(f"run_step: sync was built for {sync.model.__class__.__name__} object "
                         f"{id(sync.model):#x}, not for the model passed ({id(model):#x})")
    if num_targets is None:
        num_targets = global_num_targets(mbs, group=sync.group, device=sync.device)
    elif num_targets <= 0:
        raise ValueError(
            f"num_targets must be the (positive) number of real targets in the global batch, got {num_targets}")
    total = torch.zeros((), dtype=torch.float64, device=sync.device)
    # A sync inside a backward (FSDP2's reduce-scatters) must not interleave with a ring: a rank waiting in a
    # reduce-scatter would stall a CP peer still exchanging keys and values with it in that microbatch's backward.
    # So it rides on the last microbatch only when that is CP1, else on an extra empty (CP1) microbatch.
    inline = bool(mbs) and (not sync.needs_backward or mbs[-1].cp == 1)
    sync.begin_step()
    try:
        # one call for all microbatches (what a per-step observer such as the sentinel sees as the step)
        if mbs:
            total = total + run_microbatches(sync.module, mbs, num_targets=num_targets, forward=forward,
                                             loss_fn=loss_fn, before_last=sync.before_last_microbatch if inline
                                             else None)
        if not inline:
            sync.before_last_microbatch()
            if sync.needs_backward:
                _run_empty(sync.module, forward, sync.device)
    except BaseException:
        sync.abort_step()
        raise
    sync.end_step()
    return StepResult(loss_sum=total, num_targets=num_targets, num_microbatches=len(mbs), group=sync.group)
