"""From a plan to this rank's tensors: pack, label, pad and shard each planned microbatch (no communication).

Three microbatch types, one per layer of the API — each means one thing:

==================================  ===============================================================================
:class:`cpscope.hybrid.Microbatch`  **planned**: which documents one block of ``cp`` ranks runs together, at which
                                    CP size and communication variant. Plain data, the same on every rank, no
                                    tensor (the planner's output, ``plan.microbatches_for_rank(rank)``).
:class:`LocalMicrobatch`            **this rank's part** of one planned microbatch: its local zigzag token ids and
                                    next-token targets, the CP group to bind and the global offsets (made here).
:class:`cpscope.MicrobatchScope`    **only the CP scope** of a microbatch, carried from its forward to its backward
                                    through a pipeline schedule (1F1B); no data.
==================================  ===============================================================================

:func:`prepare_microbatches` turns this rank's planned microbatches into :class:`LocalMicrobatch` es, checking
each planned block of ranks against the group it is given (:func:`planned_group`). Each one, spelled out:

pack
    The documents are concatenated into one ``thd`` stream with global ``cu_seqlens``. The next-token labels are
    made **here, on the whole document, before sharding**: ``labels[i] = ids[i + 1]`` inside a document, and the
    last token of every document gets ``ignore_index`` (its target is not in the document). Sharding afterwards
    keeps every pair (token, its target) together even when ``i`` and ``i + 1`` land on different ranks.
pad
    :func:`cpscope.sharding.pad_packed_batch` pads every document to a multiple of ``2·cp`` (zigzag cuts it into
    ``2·cp`` chunks); padding tokens get ``pad_id`` as input and ``ignore_index`` as label. Padding sits at the
    *end* of each document, so causal attention never lets a real token see it.
shard
    :func:`cpscope.zigzag_shard` (``thd``, per document) keeps this rank's part of ids and labels.

Example::

    groups = cpscope.new_cp_groups([1, 2, 4])
    plan = plan_hybrid(lengths, n_ranks=world, capacity=4096)
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)   # list[LocalMicrobatch]
    mbs[0].input_ids, mbs[0].labels, mbs[0].group, mbs[0].cu_seqlens
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .._pack import cu_seqlens_list
from .._variants import check_comm
from ..groups import group_ranks
from ..hybrid import Microbatch
from ..scope import scope_for
from ..sharding import pad_packed_batch, zigzag_shard

__all__ = [
    "IGNORE_INDEX",
    "LocalMicrobatch",
    "next_token_labels",
    "pack_documents",
    "pad_and_shard",
    "prepare_microbatch",
    "planned_group",
    "prepare_microbatches",
    "empty_microbatch",
]

IGNORE_INDEX = -100
Device = Optional[Union[torch.device, str]]


@dataclass(frozen=True)
class LocalMicrobatch:
    """This rank's part of one planned microbatch: local zigzag tokens and targets, the group and the offsets.

    Made by :func:`prepare_microbatch` / :func:`prepare_microbatches` from a planned
    :class:`cpscope.hybrid.Microbatch` (module docstring: which type is which).

    Attributes:
        cp: the CP size; ``group`` the CP group (``None`` for CP1) to bind with ``runtime_cp``.
        input_ids: ``[T / cp]`` int64 local token ids (zigzag, document by document).
        labels: ``[T / cp]`` int64 local next-token targets; ``ignore_index`` at padding and document ends.
        cu_seqlens: ``[docs + 1]`` int32 **global** offsets of the padded documents — the layout the tensors are
            in, what RoPE and causal attention take — on the CPU: cpscope reads offsets on the host and keeps
            cached device copies for its kernels.
        max_seqlen: the longest padded document (global).
        num_targets: real (non-ignored) targets on this rank.
        seqs: indices of the documents in the global batch, in packing order.
        cu_seqlens_real: ``[docs + 1]`` int32 global offsets of the real (unpadded) documents. A causal model needs
            only ``cu_seqlens`` (padding follows every real token of its document); attention without a causal
            mask takes both — ``cu_seqlens=mb.cu_seqlens_real, cu_seqlens_padded=mb.cu_seqlens`` — so padding is
            masked.
        comm: the attention communication variant planned for this microbatch (``None``: the default, ``"p2p"``);
            :func:`cpscope.train.run_microbatches` binds it with the group.

    Example::

        mb = prepare_microbatch([doc_a, doc_b], cp=2, group=groups[2])
        mb.input_ids.shape        # (padded tokens / 2,)
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
    """Concatenate 1-D token tensors into a packed ``[T]`` stream; returns ``(ids, cu_seqlens int32)``.

    Example::

        >>> ids, cu = pack_documents([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        >>> ids.tolist(), cu.tolist()
        ([1, 2, 3, 4, 5], [0, 3, 5])
    """
    if not docs:
        raise ValueError("pack_documents: a microbatch needs at least one document, got none")
    bad = [(i, tuple(d.shape)) for i, d in enumerate(docs) if d.dim() != 1 or d.numel() == 0]
    if bad:
        raise ValueError(f"pack_documents: documents must be non-empty 1-D token tensors; got (index, shape) {bad[:5]}")
    lens = torch.tensor([0] + [d.numel() for d in docs], dtype=torch.long)
    return torch.cat(list(docs)), torch.cumsum(lens, 0).to(torch.int32)


def pad_and_shard(
    ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor, *, cp: int,
    group: Optional[dist.ProcessGroup], pad_id: int = 0, ignore_index: int = IGNORE_INDEX, device: Device = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad each document of a packed ``[T]`` pair (tokens, targets) to ``2·cp`` and keep this rank's zigzag part.

    Returns ``(ids_local, labels_local, cu_seqlens_padded)``: padding gets ``pad_id`` / ``ignore_index``; the
    offsets stay on the host (cpscope reads them there; no device sync per layer), the tokens move to ``device``.

    Example::

        ids_l, labels_l, cu_p = pad_and_shard(ids, labels, cu_seqlens, cp=2, group=groups[2])
    """
    padded = pad_packed_batch(ids, labels, cu_seqlens=cu_seqlens, cp=cp, pad_value=(pad_id, ignore_index))
    ids_p, labels_p = padded.tensors  # [T_padded] each
    cu_p = padded.cu_seqlens_padded
    ids_l = zigzag_shard(ids_p, seq_dim=0, cu_seqlens=cu_p, group=group)  # [T_padded / cp]
    labels_l = zigzag_shard(labels_p, seq_dim=0, cu_seqlens=cu_p, group=group)
    if device is not None:
        ids_l, labels_l = ids_l.to(device), labels_l.to(device)
    return ids_l, labels_l, cu_p


def prepare_microbatch(
    docs: Sequence[torch.Tensor],
    *,
    cp: int,
    group: Optional[dist.ProcessGroup],
    seqs: Sequence[int] = (),
    comm: Optional[str] = None,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    device: Device = None,
) -> LocalMicrobatch:
    """Pack ``docs``, make next-token labels, pad each document to ``2·cp``, and keep this rank's zigzag part.

    No communication. ``group`` must be this rank's CP group of size ``cp`` (``None`` for CP1); ``comm`` the
    planned communication variant (checked here).

    Raises:
        ValueError: ``cp`` contradicts ``group`` (or this rank is not in it); empty or non-1-D documents; an
            unknown ``comm``.

    Example::

        mb = prepare_microbatch([doc_a, doc_b], cp=2, group=groups[2])
        with cpscope.runtime_cp(mb.group):
            logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)
    """
    scope_for(group, local_cp_size=cp)  # ValueError if cp and group disagree, or this rank is not a member
    comm = check_comm(comm)
    ids, cu = pack_documents(docs)
    labels = next_token_labels(ids, cu, ignore_index)
    ids_l, labels_l, cu_p = pad_and_shard(ids, labels, cu, cp=cp, group=group, pad_id=pad_id,
                                          ignore_index=ignore_index, device=device)
    return LocalMicrobatch(
        cp=cp, group=group, input_ids=ids_l, labels=labels_l, cu_seqlens=cu_p,
        max_seqlen=int((cu_p[1:] - cu_p[:-1]).max()), num_targets=int((labels_l != ignore_index).sum()),
        seqs=tuple(int(s) for s in seqs), cu_seqlens_real=cu, comm=comm,
    )


def planned_group(
    mb: Microbatch, groups: Mapping[int, Optional[dist.ProcessGroup]], *, ranks: Optional[Sequence[int]] = None,
) -> Optional[dist.ProcessGroup]:
    """This rank's group for planned microbatch ``mb`` from ``groups`` (:func:`cpscope.new_cp_groups` over ``ranks``,
    default the world), checked against the planned ranks: a plan that does not match the groups fails here with a
    ``ValueError`` instead of hanging in a collective. Membership is compared, not order: a group's CP ranks ascend
    with the global ranks (torch's order, which ``cp_rank()`` and the shards follow), whatever the order of ``ranks``
    inside a block.

    ``mb`` is a :class:`cpscope.hybrid.Microbatch` (or any object with its ``cp``, ``seqs`` and ``ranks``).

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
    planned: Iterable[Microbatch],
    docs: Sequence[Any],
    groups: Mapping[int, Optional[dist.ProcessGroup]],
    *,
    ranks: Optional[Sequence[int]] = None,
    device: Device = None,
    build: Callable[..., LocalMicrobatch] = prepare_microbatch,
    **options: Any,
) -> list[LocalMicrobatch]:
    """This rank's :class:`LocalMicrobatch` for each of its planned :class:`cpscope.hybrid.Microbatch` es, in order.

    ``planned`` is this rank's ordered list (``plan.microbatches_for_rank(rank)``); ``docs[i]`` is document ``i``
    of the global batch; ``groups`` comes from :func:`cpscope.new_cp_groups` over ``ranks`` (default the world).
    Each group's members are checked against the microbatch's planned ranks (:func:`planned_group`), so a plan
    that does not match the groups fails here with a ``ValueError`` instead of hanging in a collective.

    Each one is ``build(documents, cp=, group=, seqs=, comm=, device=, **options)`` — by default
    :func:`prepare_microbatch` (``options``: ``pad_id``, ``ignore_index``); an adapter passes its own builder (a
    subclass of :class:`LocalMicrobatch` with what its model needs besides).

    Example::

        mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups, device="cuda")
    """
    out = []
    for mb in planned:
        group = planned_group(mb, groups, ranks=ranks)
        out.append(build([docs[i] for i in mb.seqs], cp=mb.cp, group=group, seqs=mb.seqs,
                         comm=getattr(mb, "comm", None), device=device, **options))
    return out


def empty_microbatch(*, device: Device = None, pad_id: int = 0, ignore_index: int = IGNORE_INDEX) -> LocalMicrobatch:
    """A microbatch with no target: one CP1 document of 2 padding tokens, every label ``ignore_index``.

    :func:`cpscope.train.run_step` runs it when the gradient sync happens inside a backward (FSDP2) and this
    rank's last microbatch is not CP1 (or it has none): its forward and a backward of **zero** output gradients let
    FSDP reduce-scatter after every ring of the step, without changing any gradient. A custom ``forward`` must
    accept it (``mb.num_targets == 0``, ``mb.seqs == ()``).

    Example::

        mb = empty_microbatch(device="cuda")
        logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)   # [2, vocab]
    """
    ids = torch.full((2,), pad_id, dtype=torch.long, device=device)
    labels = torch.full((2,), ignore_index, dtype=torch.long, device=device)
    cu = torch.tensor([0, 2], dtype=torch.int32)  # host, like every LocalMicrobatch
    return LocalMicrobatch(cp=1, group=None, input_ids=ids, labels=labels, cu_seqlens=cu, max_seqlen=2,
                           num_targets=0, seqs=())
