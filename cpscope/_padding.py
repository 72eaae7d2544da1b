"""Padding to the zigzag's multiple: documents (``thd``) or sequences padded so that each divides by ``2·cp``, and
the offsets that tell real tokens from padding. Public through :mod:`cpscope.sharding`.

Example::

    b = pad_packed_batch(ids, cu_seqlens=[0, 5, 12], cp=2)      # documents padded to 8 and 8 tokens
    b.cu_seqlens_padded.tolist()                                  # [0, 8, 16]
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from ._checks import check_int, check_seq_dim
from ._pack import cu_seqlens_list
from .scope import UNSET, resolve_scope

__all__ = ["PaddedPackedBatch", "pad_packed_batch", "pad_to_cp_multiple", "real_offsets"]


def real_offsets(real_len: Union[int, Sequence[int]], batch: Optional[int] = None) -> torch.Tensor:
    """Offsets (int32, from 0) of the real tokens of ``batch`` rows padded at their end: what ``bshd`` / ``sbhd``
    attention takes as ``cu_seqlens`` to mask padding. ``real_len`` is one length for every row, or one per row.

    Example::

        real_offsets(5, 3)           # tensor([ 0,  5, 10, 15], dtype=torch.int32)
        real_offsets([5, 8, 0])      # tensor([ 0,  5, 13, 13], dtype=torch.int32)
    """
    if batch is not None:
        batch = check_int(batch, "batch", low=0)
    one = isinstance(real_len, numbers.Integral) and not isinstance(real_len, bool)
    lens = [real_len] * (batch if batch is not None else 1) if one else list(real_len)
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0 for n in lens):
        raise ValueError(f"real lengths must be non-negative ints, got {real_len!r}")
    lens = [int(n) for n in lens]
    if batch is not None and len(lens) != batch:
        raise ValueError(f"{len(lens)} real lengths for a batch of {batch} rows")
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


class PaddedPackedBatch(NamedTuple):
    """Result of :func:`pad_packed_batch`.

    Attributes:
        tensors: the padded tensors (same order as given), each ``[cu_seqlens_padded[-1], ...]``.
        cu_seqlens_padded: int32 global offsets of the padded documents (what sharding / RoPE / attention take).
        cu_seqlens: int32 global offsets of the real documents (TE's ``cu_seqlens`` next to ``cu_seqlens_padded``).
        real_mask: bool ``[cu_seqlens_padded[-1]]``, True at real tokens (for losses).
        real_index: int64 ``[cu_seqlens[-1]]``, where each real token sits in the padded batch.

    Example::

        b = cpscope.pad_packed_batch(ids, cu_seqlens=[0, 3, 8], cp=2)   # documents of 3 and 5 tokens
        b.cu_seqlens_padded                  # tensor([0, 4, 12], dtype=torch.int32): padded to multiples of 2*cp
        (ids_p,) = b.tensors                 # [12]; ids_p[b.real_index] == ids, b.real_mask marks the real tokens
    """

    tensors: tuple[torch.Tensor, ...]
    cu_seqlens_padded: torch.Tensor
    cu_seqlens: torch.Tensor
    real_mask: torch.Tensor
    real_index: torch.Tensor


def _resolve_cp(cp: Optional[int], group: Any) -> int:
    if cp is None:
        return resolve_scope(group).size
    cp = check_int(cp, "cp", low=1)
    if group is not UNSET and resolve_scope(group).size != cp:
        raise ValueError(f"cp={cp} contradicts group= of CP size {resolve_scope(group).size}; pass one of them")
    return cp


def pad_packed_batch(
    *tensors: torch.Tensor,
    cu_seqlens: Union[torch.Tensor, Sequence[int]],
    cp: Optional[int] = None,
    pad_value: Union[float, int, Sequence[Union[float, int]]] = 0,
    group: Any = UNSET,
) -> PaddedPackedBatch:
    """Pad every document of a packed ``thd`` batch to a multiple of ``2·cp`` tokens (padding at each end).

    ``tensors`` are full (unsharded) ``[T, ...]`` tensors with ``T = cu_seqlens[-1]`` (tokens, labels, q, ...);
    ``cp`` defaults to the size of the active group (or ``group=``). ``pad_value`` may be one value or one per
    tensor (e.g. ``(0, -100)`` for input ids and labels). Differentiable w.r.t. the inputs.

    Returns a :class:`PaddedPackedBatch`: the padded tensors, the **layout** offsets ``cu_seqlens_padded`` (what
    sharding, RoPE and attention index the tensors by) and the **real** offsets ``cu_seqlens``, plus a mask and an
    index of the real tokens. What to pass where:

    * sharding: ``zigzag_shard(x, seq_dim=0, cu_seqlens=b.cu_seqlens_padded)``;
    * attention: ``context_parallel_attention(..., cu_seqlens=b.cu_seqlens, cu_seqlens_padded=b.cu_seqlens_padded)``
      (TE's convention) — padding tokens are then masked: no query sees them, their output rows and gradients are
      zero. Passing only ``cu_seqlens=b.cu_seqlens_padded`` treats padding as part of each document: the same real
      rows under a causal mask (padding follows every real token of its document), **different** ones without one;
    * RoPE: either form (positions follow the layout; real tokens get the same positions);
    * losses: mask with ``b.real_mask`` or give padding an ignored label (``pad_value=(0, -100)``).

    Example::

        b = cpscope.pad_packed_batch(ids, labels, cu_seqlens=cu, cp=2, pad_value=(0, -100))
        ids_p, labels_p = b.tensors
        with cpscope.runtime_cp(groups[2]):
            ids_local = cpscope.zigzag_shard(ids_p, seq_dim=0, cu_seqlens=b.cu_seqlens_padded)
            ...
            out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", causal=False,
                                                     cu_seqlens=b.cu_seqlens, cu_seqlens_padded=b.cu_seqlens_padded)
    """
    cp = _resolve_cp(cp, group)
    cu = cu_seqlens_list(cu_seqlens)
    pads = list(pad_value) if isinstance(pad_value, (list, tuple)) else [pad_value] * len(tensors)
    if len(pads) != len(tensors):
        raise ValueError(f"pad_value has {len(pads)} entries for {len(tensors)} tensors")
    for i, t in enumerate(tensors):
        if t.dim() < 1 or t.shape[0] != cu[-1]:
            raise ValueError(
                f"pad_packed_batch: tensor {i} has shape {tuple(t.shape)} but cu_seqlens[-1]={cu[-1]}; "
                f"tensors must be full [T, ...] packed tensors with T = cu_seqlens[-1]"
            )
    mult = 2 * cp
    cu_t = torch.tensor(cu, dtype=torch.long)
    lens = cu_t[1:] - cu_t[:-1]
    plens = (lens + mult - 1) // mult * mult
    cu_p = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(plens, 0)])
    total_p = int(cu_p[-1])
    doc = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T] document of each real token
    real_index = torch.arange(cu[-1]) - cu_t[:-1][doc] + cu_p[:-1][doc]
    device = tensors[0].device if tensors else torch.device("cpu")
    real_index = real_index.to(device)
    real_mask = torch.zeros(total_p, dtype=torch.bool, device=device)
    real_mask[real_index] = True
    out = tuple(
        t.new_full((total_p, *t.shape[1:]), p).index_copy(0, real_index.to(t.device), t) for t, p in zip(tensors, pads)
    )
    cu_dev = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else device
    return PaddedPackedBatch(
        out, cu_p.to(torch.int32).to(cu_dev), cu_t.to(torch.int32).to(cu_dev), real_mask, real_index
    )


def pad_to_cp_multiple(
    x: torch.Tensor, *, seq_dim: int, cp: Optional[int] = None, pad_value: Union[float, int] = 0, group: Any = UNSET
) -> tuple[torch.Tensor, int]:
    """Pad ``x`` at the end of ``seq_dim`` to a multiple of ``2·cp`` (``bshd`` / ``sbhd``); returns ``(x, real_len)``.

    ``cp`` defaults to the size of the active group (or ``group=``). Returns ``x`` itself when no padding is needed.
    ``real_len`` is the length before padding. Under a causal mask the padding never reaches a real token; without
    one, tell attention the real lengths — ``cu_seqlens=real_offsets(real_len, batch)`` — so that padding keys are
    masked (output rows and gradients at padding are then zero).

    Example::

        ids, n = cpscope.pad_to_cp_multiple(ids, seq_dim=1, cp=4, pad_value=0)
        labels, _ = cpscope.pad_to_cp_multiple(labels, seq_dim=1, cp=4, pad_value=-100)
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=False,
                                                 cu_seqlens=cpscope.sharding.real_offsets(n, q.shape[0]))
    """
    cp = _resolve_cp(cp, group)
    seq_dim = check_seq_dim(x, seq_dim)
    n = x.shape[seq_dim]
    mult = 2 * cp
    target = -(-n // mult) * mult
    if target == n:
        return x, n
    shape = list(x.shape)
    shape[seq_dim] = target - n
    return torch.cat([x, x.new_full(shape, pad_value)], seq_dim), n
