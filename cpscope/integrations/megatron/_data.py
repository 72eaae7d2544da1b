"""Megatron's data side ↔ cpscope's hybrid loop: a Megatron ``thd`` batch into planned, sharded microbatches and back.

Megatron's packed batches (``get_batch`` after ``flatten_batch_for_packed_sequences``) are dicts of ``[1, T]``
tensors — ``tokens``, ``labels`` (already the next-token targets, as Megatron's datasets make them), ``loss_mask``,
``position_ids`` — plus ``cu_seqlens`` (``[1, n+1]`` int32, the real document offsets) and optionally
``cu_seqlens_padded`` (the layout offsets when documents were padded). This module moves them through cpscope:

1. :func:`documents_from_batch` — split one or more such batches into :class:`Document` s (tokens and their
   targets, with ``loss_mask == 0`` turned into ``ignore_index``; Megatron's own labels are kept, not re-derived);
2. :func:`cpscope.hybrid.plan_hybrid` over ``[len(d) for d in docs]`` (or :class:`~.scheduler.PlannerScheduler`
   where Megatron's ``BalancedCPScheduler`` sits);
3. :func:`prepare_megatron_microbatches` — pack each planned microbatch, pad every document to ``2·cp``, shard it
   per document in the zigzag layout (Megatron's ``get_batch_on_this_cp_rank`` per-document convention, TE's
   ``thd_get_partitioned_indices``) → :class:`MegatronMicrobatch`, a :class:`cpscope.train.LocalMicrobatch`;
4. :func:`cpscope.train.run_microbatches` with ``forward=megatron_forward`` — each microbatch under its group,
   the loss normalised by the global number of targets;
5. back to Megatron: :meth:`MegatronMicrobatch.packed_seq_params` (``cp_group`` / ``local_cp_size`` set, real and
   padded offsets) and :meth:`MegatronMicrobatch.megatron_batch` — the dict Megatron's ``forward_step`` consumes.

:func:`shard_batch` is cpscope's ``get_batch_on_this_cp_rank`` for an already packed batch (per-document zigzag, no
TransformerEngine needed).

Example::

    docs = documents_from_batch(megatron_batches)               # the global batch, on every rank
    plan = plan_hybrid([len(d) for d in docs], n_ranks=world, capacity=16384)
    mbs = prepare_megatron_microbatches(plan.microbatches_for_rank(rank), docs, groups)
    dp = dist.group.WORLD                                       # the data-parallel group, always named
    n = global_num_targets(mbs, dp_group=dp)
    run_microbatches(model, mbs, num_targets=n, dp_group=dp, forward=megatron_forward)
    allreduce_gradients(model, dp_group=dp)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..._pack import cu_seqlens_list
from ..._variants import check_comm
from ...hybrid import Microbatch
from ...train import IGNORE_INDEX, LocalMicrobatch, pad_and_shard, planned_group
from ...scope import UNSET as _UNSET, resolve_scope, scope_for
from ...sharding import zigzag_positions, zigzag_shard

__all__ = [
    "Document",
    "MegatronMicrobatch",
    "documents_from_batch",
    "prepare_megatron_microbatch",
    "prepare_megatron_microbatches",
    "megatron_forward",
    "shard_batch",
    "SEQUENCE_KEYS",
]

#: The per-token keys of a Megatron batch (sharded along the sequence; everything else is metadata).
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class Document:
    """One document of a Megatron batch: its tokens and their targets (``ignore_index`` where not trained on).

    Example::

        Document(tokens=torch.tensor([5, 6, 7]), labels=torch.tensor([6, 7, -100]))
    """

    tokens: torch.Tensor  # [L] int64
    labels: torch.Tensor  # [L] int64

    def __len__(self) -> int:
        return int(self.tokens.numel())


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 2 and t.shape[0] == 1:
        return t[0]
    if t.dim() != 1:
        raise ValueError(f"batch[{name!r}] must be [T] or [1, T] (a packed thd batch), got shape {tuple(t.shape)}")
    return t


def _offsets(batch: Mapping[str, Any], key: str) -> Optional[list[int]]:
    cu = batch.get(key)
    if cu is None:
        return None
    cu = cu_seqlens_list(_flat(torch.as_tensor(cu), key), key)
    while len(cu) > 2 and cu[-1] == cu[-2]:  # Megatron pads cu_seqlens rows with copies of the last offset
        cu.pop()
    return cu


def documents_from_batch(
    batches: Union[Mapping[str, Any], Iterable[Mapping[str, Any]]], *, ignore_index: int = IGNORE_INDEX
) -> list[Document]:
    """The documents of one Megatron packed batch, or of several (concatenated in order: a global batch).

    Each batch needs ``tokens``, ``labels``, ``cu_seqlens`` (real offsets); ``loss_mask`` (0/1) is optional;
    with ``cu_seqlens_padded`` the tokens are taken from the padded layout (each document's real prefix).
    Empty documents are skipped.

    Raises:
        ValueError: missing keys, shapes that disagree with the offsets, a ``loss_mask`` that is not 0/1.

    Example::

        >>> b = {"tokens": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[6, 7, 0, 9]]),
        ...      "loss_mask": torch.tensor([[1, 1, 0, 1]]), "cu_seqlens": torch.tensor([[0, 3, 4]])}
        >>> [d.labels.tolist() for d in documents_from_batch(b)]
        [[6, 7, -100], [9]]
    """
    if isinstance(batches, Mapping):
        batches = [batches]
    docs: list[Document] = []
    for bi, batch in enumerate(batches):
        missing = [k for k in ("tokens", "labels", "cu_seqlens") if batch.get(k) is None]
        if missing:
            raise ValueError(f"batch {bi}: missing {missing} (a Megatron packed thd batch has tokens, labels, cu_seqlens)")
        tokens, labels = _flat(batch["tokens"], "tokens"), _flat(batch["labels"], "labels")
        mask = batch.get("loss_mask")
        if mask is not None:
            mask = _flat(mask, "loss_mask")
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError(f"batch {bi}: loss_mask must be 0/1 (weights cannot be carried as ignored targets)")
            labels = torch.where(mask.bool(), labels, torch.full_like(labels, ignore_index))
        real = _offsets(batch, "cu_seqlens")
        layout = _offsets(batch, "cu_seqlens_padded") or real
        if len(layout) != len(real) or tokens.shape != labels.shape or tokens.shape[0] < layout[-1]:
            raise ValueError(
                f"batch {bi}: tokens {tuple(tokens.shape)} / labels {tuple(labels.shape)} disagree with cu_seqlens "
                f"{real} / cu_seqlens_padded {layout}"
            )
        for i in range(len(real) - 1):
            n, start = real[i + 1] - real[i], layout[i]
            if n > layout[i + 1] - start:
                raise ValueError(f"batch {bi}: document {i} has {n} real tokens but {layout[i + 1] - start} in the layout")
            if n > 0:
                docs.append(Document(tokens[start:start + n].long(), labels[start:start + n].long()))
    return docs


@dataclass(frozen=True)
class MegatronMicrobatch(LocalMicrobatch):
    """A :class:`cpscope.train.LocalMicrobatch` with what a Megatron forward needs besides it.

    Attributes (besides the base class's — ``cu_seqlens`` are the padded, layout offsets):
        cu_seqlens_real: ``[docs + 1]`` int32 global offsets of the real (unpadded) documents.
        position_ids: ``[T / cp]`` int64 global positions (restarting per document) of the local tokens.

    Example::

        from cpscope.integrations.megatron import megatron_forward, prepare_megatron_microbatches
        mbs = prepare_megatron_microbatches(plan.microbatches_for_rank(rank), docs, groups)
        mb = mbs[0]                                  # a MegatronMicrobatch
        logits = megatron_forward(gpt_model, mb)     # [T / mb.cp, vocab], run under mb.group
    """

    cu_seqlens_real: torch.Tensor = None  # type: ignore[assignment]
    position_ids: torch.Tensor = None  # type: ignore[assignment]

    def packed_seq_params(self, cls: Any = None) -> Any:
        """Megatron's ``PackedSeqParams`` for this microbatch: ``thd``, global real / padded offsets, ``max_seqlen``,
        ``cp_group`` and ``local_cp_size`` of this microbatch (``cls`` defaults to megatron-core's class).

        Offsets are on the tokens' device (what TE wants); cpscope copies them to the host once per microbatch.
        """
        if cls is None:
            from megatron.core.packed_seq_params import PackedSeqParams as cls  # noqa: N813
        dev = self.input_ids.device
        real, padded = self.cu_seqlens_real.to(dev), self.cu_seqlens.to(dev)
        return cls(
            qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded, max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
            cp_group=self.group, local_cp_size=self.cp,
        )

    def megatron_batch(self, cls: Any = None) -> dict[str, Any]:
        """The dict Megatron's ``forward_step`` takes (``get_batch`` after ``get_batch_on_this_cp_rank``):
        ``[1, T/cp]`` ``tokens``, ``labels`` (0 where ignored), ``loss_mask`` (float), ``position_ids``,
        ``attention_mask=None`` and ``packed_seq_params``."""
        keep = self.labels != IGNORE_INDEX
        return {
            "tokens": self.input_ids[None],
            "labels": torch.where(keep, self.labels, torch.zeros_like(self.labels))[None],
            "loss_mask": keep.float()[None],
            "position_ids": self.position_ids[None],
            "attention_mask": None,
            "packed_seq_params": self.packed_seq_params(cls),
        }


def prepare_megatron_microbatch(
    docs: Sequence[Document], *, cp: int, group: Optional[dist.ProcessGroup], seqs: Sequence[int] = (),
    pad_id: int = 0, ignore_index: int = IGNORE_INDEX, device: Optional[Union[torch.device, str]] = None,
    comm: Optional[str] = None,
) -> MegatronMicrobatch:
    """Pack ``docs`` (keeping their targets), pad each to a multiple of ``2·cp``, keep this rank's zigzag part.

    No communication. ``group`` must be this rank's CP group of size ``cp`` (``None`` for CP1); ``comm`` the
    planned communication variant (kept on the microbatch: ``run_microbatches`` binds it with the group, and the
    model's forward keeps it while ``packed_seq_params`` names the same group).

    Raises:
        ValueError: ``cp`` contradicts ``group``, no / empty documents, an unknown ``comm``.

    Example::

        mb = prepare_megatron_microbatch(docs[:2], cp=2, group=groups[2])
        logits = model(mb.input_ids[None], None, None, packed_seq_params=mb.packed_seq_params())
    """
    scope = scope_for(group, local_cp_size=cp)
    comm = check_comm(comm)
    if not docs or any(len(d) == 0 for d in docs):
        raise ValueError(f"a microbatch needs non-empty documents; got lengths {[len(d) for d in docs]}")
    ids = torch.cat([d.tokens for d in docs])
    labels = torch.cat([d.labels for d in docs])
    lens = torch.tensor([0] + [len(d) for d in docs], dtype=torch.long)
    cu = torch.cumsum(lens, 0).to(torch.int32)
    ids_l, labels_l, cu_p = pad_and_shard(ids, labels, cu, cp=cp, group=group, pad_id=pad_id,
                                          ignore_index=ignore_index, device=device)
    pos = zigzag_positions(cu_p, scope.size, scope.rank).clone()
    if device is not None:
        pos = pos.to(device)
    return MegatronMicrobatch(
        cp=cp, group=group, input_ids=ids_l, labels=labels_l, cu_seqlens=cu_p,
        max_seqlen=int((cu_p[1:] - cu_p[:-1]).max()), num_targets=int((labels_l != ignore_index).sum()),
        seqs=tuple(int(s) for s in seqs), cu_seqlens_real=cu, position_ids=pos, comm=comm,
    )


def prepare_megatron_microbatches(
    planned: Iterable[Microbatch],
    docs: Sequence[Document],
    groups: Mapping[int, Optional[dist.ProcessGroup]],
    *,
    ranks: Optional[Sequence[int]] = None,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    device: Optional[Union[torch.device, str]] = None,
) -> list[MegatronMicrobatch]:
    """:func:`prepare_megatron_microbatch` for each planned microbatch of this rank (``plan.microbatches_for_rank``).

    ``groups`` comes from :func:`cpscope.new_cp_groups` over ``ranks`` (default the world); each microbatch's planned
    ranks are checked against its group's members (``ValueError`` instead of a hang).

    Example::

        mbs = prepare_megatron_microbatches(plan.microbatches_for_rank(rank), docs, groups)
    """
    out = []
    for mb in planned:
        group = planned_group(mb, groups, ranks=ranks)
        out.append(prepare_megatron_microbatch(
            [docs[i] for i in mb.seqs], cp=mb.cp, group=group, seqs=mb.seqs, pad_id=pad_id,
            ignore_index=ignore_index, device=device, comm=getattr(mb, "comm", None),  # the planned variant
        ))
    return out


def megatron_forward(model: Any, mb: MegatronMicrobatch) -> torch.Tensor:
    """``forward=`` for :func:`cpscope.train.run_microbatches`: a megatron-core GPT model on ``mb``; logits
    ``[T/cp, V]``.

    The model should have :func:`~cpscope.integrations.megatron.enable_runtime_cp` applied; it runs with this
    microbatch's group (carried by ``packed_seq_params``).

    Example::

        from cpscope.integrations.megatron import enable_runtime_cp, megatron_forward, prepare_megatron_microbatches
        from cpscope.train._loop import run_microbatches
        enable_runtime_cp(gpt_model)
        mbs = prepare_megatron_microbatches(plan.microbatches_for_rank(rank), docs, groups)
        loss = run_microbatches(gpt_model, mbs, num_targets=n_targets, dp_group=dp_group, forward=megatron_forward)
    """
    batch = mb.megatron_batch()
    logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])
    return logits[0]  # [1, t, V] -> [t, V]


def shard_batch(batch: Mapping[str, Any], *, group: Any = _UNSET) -> dict[str, Any]:
    """cpscope's ``get_batch_on_this_cp_rank`` for a packed batch: per-document zigzag of the per-token keys.

    Shards :data:`SEQUENCE_KEYS` (``[1, T]`` or ``[T]``) by ``cu_seqlens_padded`` (else ``cu_seqlens``) for the
    active group (or ``group=``), as Megatron's per-document balancing (TE's ``thd_get_partitioned_indices``) does;
    metadata keys pass through unchanged. Every (padded) document must divide by ``2·cp``.

    Example::

        with cpscope.runtime_cp(groups[2]):
            local = shard_batch(batch)          # tokens [1, T/2], ...; cu_seqlens unchanged (global)
    """
    scope = resolve_scope(group)
    cu = _offsets(batch, "cu_seqlens_padded") or _offsets(batch, "cu_seqlens")
    if cu is None:
        raise ValueError("shard_batch: the batch has no cu_seqlens (a packed thd batch is expected)")
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        t = batch.get(key)
        if t is None:
            continue
        two_d = t.dim() == 2
        flat = _flat(t, key)
        local = zigzag_shard(flat, seq_dim=0, cu_seqlens=cu, group=scope.group)
        out[key] = local[None] if two_d else local
    return out
