"""The hybrid-CP microbatch loop: pack, pad, shard and bind per microbatch; normalise the loss globally.

One training step of hybrid CP, on every rank::

    plan = plan_hybrid(lengths, n_ranks=world, capacity=cap)            # same plan on every rank
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)   # pack → pad → shard
    n_targets = global_num_targets(mbs)                                 # real targets of the WHOLE batch
    loss_sum = run_microbatches(model, mbs, num_targets=n_targets)      # forward/backward, each in its scope
    allreduce_gradients(model)                                          # SUM over the world
    optimizer.step()

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

Example::

    groups = cpscope.new_cp_groups([1, 2, 4])
    for mb in prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups):
        with cpscope.runtime_cp(mb.group):
            logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)
            loss = token_loss_sum(logits, mb.labels) / n_targets
        loss.backward()
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _sentinel
from .._checks import cu_seqlens_list
from ..groups import group_ranks
from ..scope import runtime_cp, scope_for
from ..sharding import pad_packed_batch, zigzag_shard

__all__ = [
    "IGNORE_INDEX",
    "MicrobatchSpec",
    "LocalMicrobatch",
    "next_token_labels",
    "pack_documents",
    "prepare_microbatch",
    "prepare_microbatches",
    "global_num_targets",
    "token_loss_sum",
    "run_microbatches",
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
    """

    cp: int
    group: Optional[dist.ProcessGroup]
    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_targets: int
    seqs: tuple[int, ...]


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
    padded = pad_packed_batch(ids, labels, cu_seqlens=cu, cp=cp, pad_value=(pad_id, ignore_index))
    ids_p, labels_p = padded.tensors  # [T_padded] each
    cu_p = padded.cu_seqlens_padded
    ids_l = zigzag_shard(ids_p, seq_dim=0, cu_seqlens=cu_p, group=group)  # [T_padded / cp]
    labels_l = zigzag_shard(labels_p, seq_dim=0, cu_seqlens=cu_p, group=group)
    if device is not None:  # cu_seqlens stay on the host: cpscope reads them there (no device sync per layer)
        ids_l, labels_l = ids_l.to(device), labels_l.to(device)
    max_seqlen = int((cu_p[1:] - cu_p[:-1]).max())
    return LocalMicrobatch(
        cp=cp, group=group, input_ids=ids_l, labels=labels_l, cu_seqlens=cu_p, max_seqlen=max_seqlen,
        num_targets=int((labels_l != ignore_index).sum()), seqs=tuple(int(s) for s in seqs),
    )


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
        if mb.cp not in groups:
            raise ValueError(f"the plan uses CP size {mb.cp} but groups only has sizes {sorted(groups)}")
        group = groups[mb.cp]
        planned_ranks = [int(r) for r in mb.ranks]
        if ranks is not None:
            planned_ranks = [int(ranks[r]) for r in planned_ranks]
        actual = group_ranks(group)
        if actual != planned_ranks:
            raise ValueError(
                f"microbatch of documents {tuple(mb.seqs)} is planned on global ranks {planned_ranks} at CP "
                f"{mb.cp}, but this rank's group of that size has ranks {actual}; build groups with "
                f"new_cp_groups over the same ranks the plan was made for"
            )
        out.append(
            prepare_microbatch(
                [docs[i] for i in mb.seqs], cp=mb.cp, group=group, seqs=mb.seqs, pad_id=pad_id,
                ignore_index=ignore_index, device=device,
            )
        )
    return out


def allreduce_sum(value: Union[int, float, torch.Tensor], *, group: Optional[dist.ProcessGroup] = None,
                  device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """Sum a scalar (or tensor) over ``group`` (default: the world); float64 for floats, int64 for ints.

    Note: here, as in ``torch.distributed``, ``group=None`` means the **world**, not CP1 — to reduce over a
    microbatch's CP group, skip the call when ``mb.group is None``.

    ``device`` must suit the backend (a CUDA device for NCCL). Without ``torch.distributed`` it returns the value.
    """
    t = torch.as_tensor(value).detach().clone()
    t = t.to(torch.int64 if not t.is_floating_point() else torch.float64)
    if device is not None:
        t = t.to(device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


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
) -> torch.Tensor:
    """Forward (and backward) every microbatch in order, each under ``runtime_cp(mb.group)``.

    The loss backpropagated for a microbatch is ``loss_fn(output, labels) / num_targets`` where ``loss_fn``
    returns the **sum** of per-token losses over the local real targets and ``num_targets`` is the global count
    (:func:`global_num_targets`). Gradients accumulate in ``.grad``; call :func:`allreduce_gradients` afterwards.

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
    if _sentinel.ACTIVE is not None: microbatches = _sentinel.ACTIVE.watch_loop(microbatches, num_targets)  # noqa: E701
    for mb in microbatches:
        with runtime_cp(mb.group, local_cp_size=mb.cp):
            out = forward(model, mb)
            loss_sum = loss_fn(out, mb.labels)
        if backward:
            (loss_sum / num_targets).backward()  # ring-attention backward uses the scope captured in forward
        total = total.to(loss_sum.device) + loss_sum.detach().to(torch.float64)  # stays on device: no sync
    return total


def allreduce_gradients(
    model_or_params: Union[torch.nn.Module, Iterable[torch.nn.Parameter]],
    *,
    group: Optional[dist.ProcessGroup] = None,
    average: bool = False,
) -> None:
    """Sum (or average) the gradients of every parameter over ``group`` (default: the world), in place.

    With :func:`run_microbatches`' normalisation the **sum** is the gradient of the global per-token loss; use
    ``average=True`` only with a loss normalised per rank. A parameter without ``.grad`` (no local token reached
    it) takes part as zeros, so every rank issues the same collectives. Gradients are flattened into one buffer
    per (device, dtype) — one ``all_reduce`` each. Without ``torch.distributed`` it does nothing.
    """
    params = list(model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params)
    params = [p for p in params if p.requires_grad]
    if not dist.is_initialized():
        return
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    world = dist.get_world_size(group)
    for (_device, _dtype), ps in sorted(buckets.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if average:
            flat /= world
        offset = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
