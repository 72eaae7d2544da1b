"""``shard_batch``: a transformers batch cut to this rank's zigzag tokens, its labels shifted on the full sequence.

Private to :mod:`cpscope.integrations.hf`, which re-exports :func:`shard_batch` (its public home). This is the
input side of the adapter, run once per batch before the model: which keys are cut along the sequence, the packed
documents read from ``position_ids`` (a new document wherever the step is not +1), the labels shifted before the
cut (a rank's tokens are not contiguous afterwards), and the scope the batch was cut for, marked on it
(:mod:`cpscope.integrations.hf._batch_scope`) so that the attention function can refuse a model run under another.
The per-call side — what the attention function checks and runs for every layer — stays in the package
``__init__``.

Example::

    import cpscope.integrations.hf as cphf
    with cpscope.runtime_cp(groups[2]):
        local = cphf.shard_batch({"input_ids": ids, "labels": ids})   # input_ids, position_ids, shift_labels, ...
        loss = model(**local).loss
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..._checks import check_cu_seqlens, check_divisible_seq
from ...scope import UNSET as _UNSET, resolve_scope
from ...sharding import zigzag_shard
from . import _batch_scope as batch_scope
from ._inputs import check_mask

__all__ = ["shard_batch"]

# Keys shard_batch knows how to cut along the sequence (dim 1).
_SEQ_KEYS = ("input_ids", "inputs_embeds", "labels", "position_ids", "token_type_ids")


def _packed_cu_seqlens(position_ids: torch.Tensor) -> Optional[list[int]]:
    """Document offsets from one row of position ids (a new document wherever the step is not +1), or ``None``."""
    pid = position_ids.reshape(-1)
    starts = torch.nonzero(pid[1:] - pid[:-1] != 1).flatten() + 1
    if starts.numel() == 0:
        return None
    return [0] + starts.tolist() + [pid.numel()]


def shard_batch(
    batch: dict[str, Any], group: Any = _UNSET, *, ignore_index: int = -100
) -> dict[str, Any]:
    """Shard a transformers batch for the active CP group (or ``group=``); returns a new dict for ``model(**out)``.

    * ``input_ids`` / ``inputs_embeds`` / ``token_type_ids`` / ``position_ids`` ``[b, S, …]`` are cut to this rank's
      zigzag tokens (``S`` must divide by 2·cp). ``position_ids`` are created (``arange(S)``) when absent; they stay
      **global**, so the model's RoPE needs no change.
    * ``labels`` are shifted on the full sequence first: ``shift_labels[i] = labels[i + 1]`` and ``ignore_index`` at
      the last token of every row (and of every packed document), then sharded. The result holds ``shift_labels``
      (for transformers' loss, which then does not shift again), the sharded unshifted ``labels`` (transformers
      computes a loss only when ``labels`` is given) and ``num_items_in_batch`` (target tokens in the full batch,
      unless the batch already has one), making each rank's loss its share of the full-batch mean.
    * Packed rows (``position_ids`` restarting, ``b == 1``): each document is zigzag-sharded on its own and the
      result holds global ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32) and ``max_length_q`` / ``max_length_k``;
      every document length must divide by 2·cp (pad with ``cpscope.pad_packed_batch``).
    * ``use_cache=False`` is added unless the batch sets it (a KV cache of sharded tokens is meaningless).
    * An ``attention_mask`` of all ones is dropped; one with zeros raises. Other entries pass through unchanged,
      except unknown tensors shaped ``[b, S, …]``, which raise (cpscope would not know how to cut them).

    Raises:
        ValueError: padding in ``attention_mask``; ``S`` or a document not divisible by 2·cp; packed rows with
            ``b > 1``; an unknown per-token tensor; no ``input_ids`` / ``inputs_embeds``.

    Example::

        with cpscope.runtime_cp(groups[4]):
            out = model(**shard_batch({"input_ids": ids, "labels": ids}))
    """
    scope = resolve_scope(group)
    tokens = batch.get("input_ids")
    if tokens is None:
        tokens = batch.get("inputs_embeds")
    if tokens is None:
        raise ValueError(f"shard_batch needs input_ids or inputs_embeds, got keys {sorted(batch)}")
    b, seqlen = tokens.shape[0], tokens.shape[1]
    check_mask(batch.get("attention_mask"))
    for name, value in batch.items():
        if (
            name not in _SEQ_KEYS and name != "attention_mask" and isinstance(value, torch.Tensor)
            and value.dim() >= 2 and tuple(value.shape[:2]) == (b, seqlen)
        ):
            raise ValueError(
                f"shard_batch does not know how to shard {name!r} of shape {tuple(value.shape)}; it shards "
                f"{_SEQ_KEYS} along dim 1"
            )
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seqlen, device=tokens.device).unsqueeze(0).expand(b, seqlen)
    cu = _batch_offsets(position_ids, b, seqlen, scope.size)

    def cut(x: torch.Tensor) -> torch.Tensor:
        return zigzag_shard(x, seq_dim=1, cu_seqlens=cu, group=scope.group)

    out = {k: v for k, v in batch.items() if k not in _SEQ_KEYS and k != "attention_mask"}
    for name in ("input_ids", "inputs_embeds", "token_type_ids"):
        if batch.get(name) is not None:
            out[name] = cut(batch[name])
    rows = position_ids.reshape(-1, seqlen)
    out["position_ids"] = cut(rows.expand(b, seqlen) if rows.shape[0] == 1 else rows)
    labels = batch.get("labels")
    if labels is not None:
        shifted = _shifted_labels(labels, cu, ignore_index)
        out["labels"] = cut(labels)
        out["shift_labels"] = cut(shifted)
        if "num_items_in_batch" not in batch:
            out["num_items_in_batch"] = (shifted != ignore_index).sum()
    out.setdefault("use_cache", False)  # a KV cache has no meaning for sharded training sequences
    if cu is not None:
        cu_t = torch.tensor(cu, dtype=torch.int32, device=tokens.device)
        max_len = max(e - s for s, e in zip(cu[:-1], cu[1:]))
        out.update(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=max_len, max_length_k=max_len)
    batch_scope.mark(out, scope)  # the model must run under this scope (checked by the attention function)
    return out


def _batch_offsets(position_ids: torch.Tensor, b: int, seqlen: int, cp: int) -> Optional[list[int]]:
    """The global document offsets of a packed batch (``position_ids`` restarting), ``None`` for one sequence per
    row; checks the lengths against ``2·cp``."""
    if position_ids.shape[-1] != seqlen:
        raise ValueError(f"position_ids have {position_ids.shape[-1]} positions, the batch has {seqlen} tokens")
    position_ids = position_ids.reshape(-1, seqlen)
    cu: Optional[list[int]] = None
    if position_ids.shape[0] == 1 or bool((position_ids == position_ids[:1]).all()):
        cu = _packed_cu_seqlens(position_ids[0])
    else:
        bad = [i for i in range(position_ids.shape[0]) if _packed_cu_seqlens(position_ids[i]) is not None]
        if bad:
            raise ValueError(
                f"rows {bad} of position_ids restart (packed documents) in a batch of {b} rows; pack documents "
                "into a single row (batch size 1)"
            )
    if cu is not None and b != 1:
        raise ValueError(f"packed documents (position_ids restart) need batch size 1, got {b}; pack into one row")
    if cu is None:
        check_divisible_seq(seqlen, cp)
    else:
        check_cu_seqlens(cu, cp)
    return cu


def _shifted_labels(labels: torch.Tensor, cu: Optional[list[int]], ignore_index: int) -> torch.Tensor:
    """``labels[i + 1]`` at ``i`` on the full sequence, ``ignore_index`` at the last token of every row / document."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    if cu is not None:
        ends = torch.tensor(cu[1:], device=labels.device) - 1
        shifted[:, ends] = ignore_index  # the last token of a document predicts nothing
    return shifted
