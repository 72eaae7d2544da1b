"""The documents of a Hugging Face training batch, the world's batch, and this rank's hybrid-CP microbatches.

A flattened (padding-free) batch — TRL's ``SFTTrainer(packing=True)`` / ``padding_free=True``, transformers'
``DataCollatorWithFlattening`` — is one row ``[1, T]`` of documents back to back whose ``position_ids`` restart at
every document. :func:`batch_documents` cuts it into documents and makes every token's next-token target **the way
transformers' causal-LM loss does without CP**: ``shift_labels`` when the batch has them, else ``labels`` shifted
by one over the whole row (``ignore_index`` at the end). The collators put ``ignore_index`` at the first label of
every document, so no target crosses a boundary; either way the targets are the trainer's own.

:func:`gather_documents` all-gathers every rank's documents (the step's global batch: token ids and targets only,
16 bytes a token), after one small all-gather of a status word: a batch refused on one rank raises on **every**
rank instead of leaving the others waiting. :func:`local_microbatches` packs, pads (each document to a multiple of
``2·cp``) and zigzag-shards this rank's planned microbatches.

Example::

    docs = batch_documents(inputs)                                  # ValueError for batches without boundaries
    world = gather_documents(docs, group=None, device="cpu")        # collective: every rank's documents
    plan = plan_hybrid([len(d) for d in world.input_ids], n_ranks=4, capacity=4096)
    mbs = local_microbatches(plan, world, groups, rank=dist.get_rank())
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ...train import IGNORE_INDEX, LocalMicrobatch, pad_and_shard, planned_group
from ..._variants import check_comm

__all__ = ["Documents", "batch_documents", "concat_documents", "document_offsets", "gather_documents",
           "local_microbatches"]

# Keys of a flattened batch that carry no per-token data cpscope must cut (offsets, lengths, flags).
_META_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "num_items_in_batch", "use_cache",
              "return_loss", "seq_lengths")
# Per-token keys cpscope consumes; ``seq_idx`` (document index per token, for linear-attention kernels) is dropped:
# the layers enable_runtime_cp binds read the packed documents from cu_seq_lens.
_TOKEN_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "seq_idx")


@dataclass(frozen=True)
class Documents:
    """Documents of one batch (or of the world's batch): each a ``[n]`` int64 tensor of ids and one of targets.

    ``targets[d][i]`` is the next-token target of token ``i`` of document ``d`` (``ignore_index`` where none);
    ``position_start`` is where every document's ``position_ids`` start (0 for causal LMs).
    """

    input_ids: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    position_start: int = 0

    @property
    def lengths(self) -> list[int]:
        """Token count of every document."""
        return [int(d.numel()) for d in self.input_ids]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def num_targets(self, ignore_index: int = IGNORE_INDEX) -> int:
        """Real (non-ignored) targets over all documents."""
        return sum(int((t != ignore_index).sum()) for t in self.targets)


def document_offsets(position_ids: torch.Tensor) -> list[int]:
    """Document offsets of one row of ``position_ids``: a document starts wherever the step is not +1.

    Example::

        >>> document_offsets(torch.tensor([[0, 1, 2, 0, 1]]))
        [0, 3, 5]
    """
    pid = position_ids.reshape(-1)
    if pid.numel() == 0:
        return [0]
    starts = (torch.nonzero(pid[1:] - pid[:-1] != 1).flatten() + 1).tolist()
    return [0] + starts + [int(pid.numel())]


def _refuse(why: str) -> ValueError:
    return ValueError(
        f"hybrid CP needs flattened batches with document boundaries (one row of documents, position_ids "
        f"restarting at every document: TRL's SFTTrainer(packing=True) or padding_free=True, transformers' "
        f"DataCollatorWithFlattening); {why}"
    )


def _check_keys(batch: Mapping[str, Any], total: int) -> None:
    for name, value in batch.items():
        if name in _TOKEN_KEYS or name in _META_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == (1, total):
            raise _refuse(f"the batch has a per-token tensor {name!r} of shape {tuple(value.shape)} that cpscope "
                          f"does not know how to shard (it cuts {_TOKEN_KEYS[:4]})")


def _row(batch: Mapping[str, Any], name: str, total: int) -> Optional[torch.Tensor]:
    value = batch.get(name)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() not in (1, 2) or value.shape[-1] != total or (
            value.dim() == 2 and value.shape[0] != 1):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise _refuse(f"{name!r} has shape {shape}, expected [1, {total}] like input_ids")
    return value.reshape(-1)


def _check_offsets(batch: Mapping[str, Any], cu: list[int]) -> None:
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        given = batch.get(name)
        if given is None:
            continue
        given = [int(x) for x in torch.as_tensor(given).reshape(-1).tolist()]
        if given != cu:
            raise _refuse(f"{name}={given[:8]}{'...' if len(given) > 8 else ''} disagrees with the documents of "
                          f"position_ids {cu[:8]}{'...' if len(cu) > 8 else ''}")


def batch_documents(batch: Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX) -> Documents:
    """Cut a flattened training batch into its documents, with the targets transformers' loss would use.

    Raises:
        ValueError: no ``input_ids`` / ``labels`` / ``position_ids``; more than one row; a padding mask; a
            document whose positions do not start where the others do; ``cu_seq_lens`` that disagree with
            ``position_ids``; an unknown per-token tensor.

    Example::

        docs = batch_documents({"input_ids": ids, "labels": ids, "position_ids": pos})   # [1, T] each
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise _refuse(f"the batch has no input_ids tensor (keys {sorted(batch)})")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise _refuse(f"input_ids have shape {tuple(ids.shape)}: a padded batch of rows, not one flattened row")
    total = int(ids.shape[1])
    _check_keys(batch, total)
    mask = _row(batch, "attention_mask", total)
    if mask is not None and bool((mask == 0).any()):
        raise _refuse(f"the attention_mask has {int((mask == 0).sum())} padding zeros")
    pos = _row(batch, "position_ids", total)
    if pos is None:
        raise _refuse("the batch has no position_ids, so its document boundaries are unknown")
    labels, shift = _row(batch, "labels", total), _row(batch, "shift_labels", total)
    if labels is None and shift is None:
        raise _refuse("the batch has no labels")
    cu = document_offsets(pos)
    _check_offsets(batch, cu)
    starts = pos[torch.tensor(cu[:-1], dtype=torch.long, device=pos.device)] if total else pos[:0]
    start = int(starts[0]) if total else 0
    if bool((starts != start).any()):
        bad = int(torch.nonzero(starts != start)[0])
        raise _refuse(f"document {bad} starts at position {int(starts[bad])}, the first at {start}; every "
                      f"document's position_ids must restart at the same value")
    if shift is None:  # ForCausalLMLoss: pad with ignore_index at the end, then shift by one over the whole row
        shift = torch.full_like(labels, ignore_index)
        shift[:-1] = labels[1:]
    ids = ids.reshape(-1).to(torch.long)
    shift = shift.to(torch.long)
    spans = list(zip(cu[:-1], cu[1:]))
    return Documents(tuple(ids[a:b] for a, b in spans), tuple(shift[a:b] for a, b in spans), start)


def _all_gather(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def gather_documents(
    local: Union[Documents, BaseException], *, group: Optional[dist.ProcessGroup] = None,
    device: Union[torch.device, str] = "cpu",
) -> list[Documents]:
    """Every rank's :class:`Documents` (in rank order of ``group``, default the world); collective.

    ``local`` may be the exception that refused this rank's batch: every rank then raises — this one its own
    error, the others a ``ValueError`` naming the ranks that refused — after the same one small all-gather.

    Example::

        world = gather_documents(batch_documents(inputs))
    """
    if not dist.is_initialized():
        if isinstance(local, BaseException):
            raise local
        return [local]
    failed = isinstance(local, BaseException)
    meta = torch.tensor([int(failed), 0 if failed else len(local.input_ids), 0 if failed else local.num_tokens,
                         0 if failed else local.position_start], dtype=torch.long, device=device)
    metas = torch.stack(_all_gather(meta, group)).cpu()
    if bool(metas[:, 0].any()):
        if failed:
            raise local
        bad = torch.nonzero(metas[:, 0]).flatten().tolist()
        raise ValueError(f"hybrid CP: the batch of rank(s) {bad} was refused (see the error on those ranks); no "
                         f"step was run")
    max_docs, max_tokens = int(metas[:, 1].max()), int(metas[:, 2].max())
    lengths = torch.zeros(max_docs, dtype=torch.long, device=device)
    lengths[: len(local.input_ids)] = torch.tensor(local.lengths, dtype=torch.long)
    tokens = torch.zeros(2, max_tokens, dtype=torch.long, device=device)  # [ids; targets]
    if local.input_ids:
        tokens[0, : local.num_tokens] = torch.cat(local.input_ids).to(device)
        tokens[1, : local.num_tokens] = torch.cat(local.targets).to(device)
    all_lengths, all_tokens = _all_gather(lengths, group), _all_gather(tokens, group)
    out = []
    for r in range(metas.shape[0]):
        lens = all_lengths[r][: int(metas[r, 1])].cpu().tolist()
        row = all_tokens[r][:, : int(metas[r, 2])]
        ids, tgt = row[0].split(lens), row[1].split(lens)
        out.append(Documents(tuple(ids), tuple(tgt), int(metas[r, 3])))
    return out


def local_microbatches(
    planned: Sequence[Any], docs: Documents, groups: Mapping[int, Optional[dist.ProcessGroup]], *,
    pad_id: int = 0, ignore_index: int = IGNORE_INDEX, device: Optional[Union[torch.device, str]] = None,
) -> list[LocalMicrobatch]:
    """This rank's planned microbatches (``plan.microbatches_for_rank(rank)``) of the world's ``docs``: packed,
    every document padded to ``2·cp`` (``pad_id`` / ``ignore_index``) and zigzag-sharded for its group.

    Example::

        mbs = local_microbatches(plan.microbatches_for_rank(rank), world_docs, groups)
    """
    out = []
    for mb in planned:
        group = planned_group(mb, groups)
        ids = torch.cat([docs.input_ids[i] for i in mb.seqs])
        targets = torch.cat([docs.targets[i] for i in mb.seqs])
        lens = torch.tensor([0] + [docs.input_ids[i].numel() for i in mb.seqs], dtype=torch.long)
        cu = torch.cumsum(lens, 0).to(torch.int32)
        ids_l, tgt_l, cu_p = pad_and_shard(ids, targets, cu, cp=mb.cp, group=group, pad_id=pad_id,
                                           ignore_index=ignore_index, device=device)
        out.append(LocalMicrobatch(
            cp=mb.cp, group=group, input_ids=ids_l, labels=tgt_l, cu_seqlens=cu_p,
            max_seqlen=int((cu_p[1:] - cu_p[:-1]).max()), num_targets=int((tgt_l != ignore_index).sum()),
            seqs=tuple(int(s) for s in mb.seqs), cu_seqlens_real=cu, comm=check_comm(getattr(mb, "comm", None)),
        ))
    return out


def concat_documents(parts: Sequence[Documents]) -> Documents:
    """The documents of several batches, in order (the world's batch from :func:`gather_documents`)."""
    starts = {p.position_start for p in parts if p.input_ids}
    if len(starts) > 1:
        raise ValueError(f"hybrid CP: the ranks' batches start their documents' position_ids at different values "
                         f"{sorted(starts)}")
    return Documents(tuple(d for p in parts for d in p.input_ids), tuple(t for p in parts for t in p.targets),
                     starts.pop() if starts else 0)
