"""Zigzag (dual-chunk) sharding of sequences across a CP group.

A sequence of length ``L`` (divisible by ``2·cp``) is cut into ``2·cp`` equal *chunks*; CP rank ``r`` holds chunk
``r`` followed by chunk ``2·cp−1−r``, which balances causal-attention work across ranks. In ``thd`` every document
listed in the (global) ``cu_seqlens`` is cut this way on its own, and the local tensor is the concatenation,
document by document, of each document's local part.

* :func:`zigzag_indices` — the full-tensor token indices a rank holds (pure index math, cached).
* :func:`zigzag_positions` (also named :func:`zigzag_position_ids`) — the global positions of the local tokens
  (restarting at 0 per document).
* :func:`zigzag_shard` / :func:`zigzag_unshard` — cut a full tensor / gather it back (collective, differentiable).
* :func:`pad_packed_batch` / :func:`pad_to_cp_multiple` — pad documents / sequences so they divide by ``2·cp``
  (defined in :mod:`cpscope._padding`; this module is their public home).

Example::

    with cpscope.runtime_cp(groups[2]):
        x_local = cpscope.zigzag_shard(x, seq_dim=1)            # [b, s/2, h, d]
        pos = cpscope.zigzag_position_ids(x.shape[1])           # [s/2] global positions
        x_full = cpscope.zigzag_unshard(x_local, seq_dim=1)     # == x on every rank
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _hooks
from ._checks import (
    check_divisible_seq,
    check_int,
    check_local_thd_len,
    check_seq_dim,
)
from ._pack import Pack, dense_pack, pack_for
from ._padding import PaddedPackedBatch, pad_packed_batch, pad_to_cp_multiple, real_offsets
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
]  # real_offsets (the offsets of a padded pack's real tokens) stays importable

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
