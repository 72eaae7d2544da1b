"""Zigzag (dual-chunk) sharding of sequences across a CP group.

A sequence of length ``L`` (divisible by ``2·cp``) is cut into ``2·cp`` equal *chunks*; CP rank ``r`` holds chunk
``r`` followed by chunk ``2·cp−1−r``, which balances causal-attention work across ranks. In ``thd`` every document
listed in the (global) ``cu_seqlens`` is cut this way on its own, and the local tensor is the concatenation,
document by document, of each document's local part.

* :func:`zigzag_indices` — the full-tensor token indices a rank holds (pure index math, cached).
* :func:`zigzag_positions` (also named :func:`zigzag_position_ids`) — the global positions of the local tokens
  (restarting at 0 per document).
* :func:`zigzag_shard` / :func:`zigzag_unshard` — cut a full tensor / gather it back (collective, differentiable).
* :func:`pad_packed_batch` / :func:`pad_to_cp_multiple` — pad documents / sequences so they divide by ``2·cp``.

Example::

    with cpscope.runtime_cp(groups[2]):
        x_local = cpscope.zigzag_shard(x, seq_dim=1)            # [b, s/2, h, d]
        pos = cpscope.zigzag_position_ids(x.shape[1])           # [s/2] global positions
        x_full = cpscope.zigzag_unshard(x_local, seq_dim=1)     # == x on every rank
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _hooks
from ._checks import (
    check_divisible_seq,
    check_int,
    check_local_thd_len,
    check_seq_dim,
)
from ._pack import Pack, cu_seqlens_list, dense_pack, pack_for
from .scope import UNSET, CPScope, resolve_scope

__all__ = [
    "zigzag_indices",
    "zigzag_position_ids",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_unshard",
    "pad_packed_batch",
    "PaddedPackedBatch",
    "pad_to_cp_multiple",
    "real_offsets",
]

SeqlenOrCu = Union[int, torch.Tensor, Sequence[int]]


# ----------------------------------------------------------------------------------------------------------------
# Index math (pure, no process group; cached per pack, see cpscope._pack)


def _pack(seqlen_or_cu_seqlens: SeqlenOrCu, cp: int, rank: int) -> Pack:
    """The validated :class:`~cpscope._pack.Pack` of one sequence length or of global offsets (cached)."""
    if isinstance(seqlen_or_cu_seqlens, bool):
        raise ValueError(f"expected a sequence length or cu_seqlens, got {seqlen_or_cu_seqlens!r}")
    if isinstance(seqlen_or_cu_seqlens, numbers.Integral):
        seqlen = check_int(seqlen_or_cu_seqlens, "sequence length", low=0)
        check_divisible_seq(seqlen, cp)
        return dense_pack(seqlen, cp, rank)
    return pack_for(seqlen_or_cu_seqlens, cp, rank)


def _cp_rank(cp: Optional[int], rank: Optional[int], group: Any) -> tuple[int, int]:
    """``(cp, rank)``: both given explicitly (any integers), or neither — then the active scope's (or ``group=``)."""
    if cp is None and rank is None:
        scope = resolve_scope(group)
        return scope.size, scope.rank
    if cp is None or rank is None:
        raise ValueError(f"pass both cp and rank (got cp={cp!r}, rank={rank!r}), or neither for the active scope")
    if group is not UNSET:
        raise ValueError(f"pass either cp and rank (got cp={cp!r}, rank={rank!r}) or group=, not both")
    cp = check_int(cp, "cp", low=1)
    rank = check_int(rank, "rank", low=0)
    if rank >= cp:
        raise ValueError(f"rank must be an int in [0, cp={cp}), got {rank}")
    return cp, rank


def _device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@torch.compiler.disable  # host-side index math, cached: opaque to torch.compile (no per-cp recompiles)
def zigzag_indices(
    seqlen_or_cu_seqlens: SeqlenOrCu, cp: Optional[int] = None, rank: Optional[int] = None,
    device: Optional[Union[torch.device, str]] = None, *, group: Any = UNSET,
) -> torch.Tensor:
    """Indices, in the full (unsharded) tensor, of the tokens CP rank ``rank`` of ``cp`` holds, in local order.

    ``seqlen_or_cu_seqlens`` is either one sequence length (``bshd`` / ``sbhd``) or the global ``cu_seqlens`` of a
    packed ``thd`` batch (each document is cut on its own). ``cp`` and ``rank`` are given together (any integers),
    or neither: then they are the active scope's (or ``group=``'s). Returns a new int64 tensor (yours to change;
    the index math behind it is cached per pack). ``cp == 1`` gives ``arange(total)``.

    Raises:
        ValueError: a length not divisible by ``2·cp``; malformed ``cu_seqlens``; ``rank`` out of range.

    Example::

        >>> zigzag_indices(8, cp=2, rank=0)
        tensor([0, 1, 6, 7])
        >>> zigzag_indices([0, 4, 12], cp=2, rank=1)
        tensor([ 1,  2,  6,  7,  8,  9])
    """
    cp, rank = _cp_rank(cp, rank, group)
    return _pack(seqlen_or_cu_seqlens, cp, rank).indices(_device(device)).clone()


@torch.compiler.disable
def zigzag_positions(
    seqlen_or_cu_seqlens: SeqlenOrCu, cp: Optional[int] = None, rank: Optional[int] = None,
    device: Optional[Union[torch.device, str]] = None, *, group: Any = UNSET,
) -> torch.Tensor:
    """Global positions (restarting at 0 in every document) of the tokens CP rank ``rank`` of ``cp`` holds.

    ``cp`` and ``rank`` as in :func:`zigzag_indices`: both, or neither for the active scope (or ``group=``).
    Under CP1 this is ``arange(seqlen)`` (or the per-document aranges). Returns a new int64 tensor ``[n_local]``.
    ``zigzag_position_ids`` is this very function (the name reads well without ``cp`` / ``rank``).

    Example::

        >>> zigzag_positions([0, 4, 12], cp=2, rank=1)
        tensor([1, 2, 2, 3, 4, 5])
        with cpscope.runtime_cp(groups[2]):        # rank 1 of 2
            cpscope.zigzag_position_ids(8)          # tensor([2, 3, 4, 5])
    """
    cp, rank = _cp_rank(cp, rank, group)
    return _pack(seqlen_or_cu_seqlens, cp, rank).positions(_device(device)).clone()


zigzag_position_ids = zigzag_positions


# ----------------------------------------------------------------------------------------------------------------
# Shard / unshard


def zigzag_shard(
    x: torch.Tensor, *, seq_dim: int, cu_seqlens: Optional[SeqlenOrCu] = None, group: Any = UNSET,
    cu_seqlens_padded: Optional[SeqlenOrCu] = None,
) -> torch.Tensor:
    """This rank's zigzag part of the full tensor ``x`` (per document when ``cu_seqlens`` is given).

    ``bshd`` uses ``seq_dim=1``, ``sbhd`` and ``thd`` ``seq_dim=0``. No communication; differentiable (the gradient
    of the full tensor is zero outside this rank's tokens). Under CP1 ``x`` itself is returned. With
    ``cu_seqlens_padded`` (TE's convention) the layout is ``cu_seqlens_padded`` and ``cu_seqlens`` the real offsets
    (checked to fit); sharding follows the layout.

    Raises:
        ValueError: ``seq_dim`` out of range; the sequence (or a document) not divisible by ``2·cp``;
            ``cu_seqlens[-1]`` differs from ``x.shape[seq_dim]``; malformed ``cu_seqlens``.

    Example::

        with cpscope.runtime_cp(groups[2]):
            q_local = cpscope.zigzag_shard(q, seq_dim=1)                          # bshd
            t_local = cpscope.zigzag_shard(t, seq_dim=0, cu_seqlens=cu_seqlens)   # thd, global cu_seqlens
    """
    scope = resolve_scope(group)
    seq_dim = check_seq_dim(x, seq_dim)
    cp, rank = scope.size, scope.rank
    n = x.shape[seq_dim]
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("zigzag_shard: cu_seqlens_padded needs cu_seqlens (the real offsets) beside it")
        if cp == 1:
            return x
        check_divisible_seq(n, cp)
        c = n // (2 * cp)
        # [.., 2cp*c, ..] -> chunks r and 2cp-1-r
        out = torch.cat([x.narrow(seq_dim, rank * c, c), x.narrow(seq_dim, (2 * cp - 1 - rank) * c, c)], seq_dim)
        if _hooks.shard is not None:
            _hooks.shard(scope, out)
        return out
    pack = pack_for(cu_seqlens, cp, rank, cu_seqlens_padded=cu_seqlens_padded)
    if pack.total != n:
        raise ValueError(
            f"zigzag_shard: x has {n} tokens along seq_dim={seq_dim} (shape {tuple(x.shape)}) but "
            f"cu_seqlens[-1]={pack.total}; zigzag_shard takes the full (unsharded) tensor and global cu_seqlens"
        )
    if cp == 1:  # CP1 moves nothing (the offsets were still checked)
        return x
    out = x.index_select(seq_dim, pack.indices(x.device))
    if _hooks.shard is not None:
        _hooks.shard(scope, out)
    return out


class _ZigzagUnshard(torch.autograd.Function):
    """All-gather the local zigzag parts and undo the permutation; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seq_dim: int, pack: Pack, scope: CPScope) -> torch.Tensor:
        ctx.seq_dim, ctx.pack = seq_dim, pack  # the pack and the scope resolved in forward; backward reads neither
        xc = x.contiguous()
        parts = [torch.empty_like(xc) for _ in range(scope.size)]
        dist.all_gather(parts, xc, group=scope.group)
        gathered = torch.cat(parts, seq_dim)  # rank-major: [rank 0's local, rank 1's local, ...]
        return gathered.index_select(seq_dim, pack.inverse(x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        return grad.index_select(ctx.seq_dim, ctx.pack.indices(grad.device)), None, None, None


def zigzag_unshard(
    x: torch.Tensor, *, seq_dim: int, cu_seqlens: Optional[SeqlenOrCu] = None, group: Any = UNSET,
    cu_seqlens_padded: Optional[SeqlenOrCu] = None,
) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: gather every rank's local part and restore the original token order.

    **Collective** over the CP group (every member must call it). Differentiable: the backward returns this rank's
    slice of the full gradient (each rank is assumed to compute the same loss from the full tensor; no reduction
    is done). The group is resolved once here and kept for backward. Under CP1 ``x`` itself is returned.
    ``cu_seqlens_padded`` as in :func:`zigzag_shard`.

    Raises:
        ValueError: ``seq_dim`` out of range; an odd local length; local ``thd`` length ≠ ``cu_seqlens[-1]/cp``;
            a document not divisible by ``2·cp``; malformed ``cu_seqlens`` — all before any communication.

    Example::

        with cpscope.runtime_cp(groups[2]):
            out_full = cpscope.zigzag_unshard(out_local, seq_dim=1)    # [b, s, h, d] on every rank
    """
    scope = resolve_scope(group)
    seq_dim = check_seq_dim(x, seq_dim)
    cp = scope.size
    n = x.shape[seq_dim]
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("zigzag_unshard: cu_seqlens_padded needs cu_seqlens (the real offsets) beside it")
        if cp == 1:
            return x
        if n % 2:
            raise ValueError(
                f"zigzag_unshard: the local length must be even (two zigzag chunks), got {n} along seq_dim={seq_dim} "
                f"(shape {tuple(x.shape)}) with CP size {cp}"
            )
        pack = dense_pack(n * cp, cp, scope.rank)
    else:
        pack = pack_for(cu_seqlens, cp, scope.rank, cu_seqlens_padded=cu_seqlens_padded)
        check_local_thd_len(n, [0, pack.total], cp, name="zigzag_unshard input")
    if cp == 1:
        return x
    return _ZigzagUnshard.apply(x, seq_dim, pack, scope)


# ----------------------------------------------------------------------------------------------------------------
# Padding


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
