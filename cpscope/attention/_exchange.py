"""Pieces shared by the collective variants (all-gather, all-to-all, hierarchical): the packed form, zigzag
permutations, the sequence <-> heads all-to-all, and the asynchronous collectives they run.

**Packed form.** Every variant works on ``[t, h, d]`` tensors holding whole zigzag-sharded sequences one after the
other, described by *global* offsets ``cu`` (``thd``: the documents; ``bshd``: ``b`` rows of global length ``S``, so
``cu = (0, S, 2S, ...)`` and ``q.reshape(b * s, h, d)`` is a view). :func:`packed` / :func:`unpacked` convert.

**Collectives.** :class:`GroupCollectives` posts ``all_gather`` / ``reduce_scatter`` / ``all_to_all`` asynchronously
(NCCL runs them on its own stream; ``wait()`` orders the compute stream after them, no host sync on CUDA) and
returns a :class:`Pending`. The variants only talk to this small interface, so a test harness can run them over an
in-process stand-in (``tests/attention/_virtual.py``: several virtual ranks on one device, one thread each).

**Sequence <-> heads.** :func:`seq_to_heads` turns this rank's zigzag tokens of all heads into all tokens (natural
order, per sequence) of this rank's ``1/n`` of the heads; :func:`heads_to_seq` is its inverse. Each is one
all-to-all plus one copy on each side: the zigzag permutation is undone (redone) by one ``index_select`` of the
received (sent) rows.

Example::

    coll = GroupCollectives(scope.group, scope.size, scope.rank)
    ex = A2APlan(cu, n=scope.size, rank=scope.rank, device=q.device)
    qh, kh, vh = seq_to_heads([q, k, v], ex, coll)       # [T, h/n, d] each, natural token order
    (out,) = heads_to_seq([out_h], ex, coll)             # back to [t, h, d], zigzag
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..sharding import zigzag_indices

__all__ = [
    "Pending",
    "GroupCollectives",
    "Packed",
    "packed",
    "unpacked",
    "A2APlan",
    "seq_to_heads",
    "heads_to_seq",
    "acc_dtype",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the merges and of dQ: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------------------
# Collectives

# torch >= 2.13 names them *_single (the *_tensor names warn there); older torch has only the *_tensor names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """One posted collective: :meth:`wait` waits for it (once) and returns its result tensor."""

    __slots__ = ("_work", "_result")

    def __init__(self, work: Any, result: torch.Tensor) -> None:
        self._work, self._result = work, result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


class GroupCollectives:
    """The collectives of the variants over one ``torch.distributed`` group, each posted asynchronously.

    ``size`` / ``rank`` are the group's (resolved once by the caller, kept on the autograd ``ctx``). Tensors are
    split and joined along dim 0, rank-major. Every rank of the group must post the same collectives in the same
    order.

    Example::

        coll = GroupCollectives(group, 2, rank)
        p = coll.all_gather(k_half)          # posted now
        ...compute...
        k_all = p.wait()                     # [2 * n, ...]
    """

    def __init__(self, group: Optional[dist.ProcessGroup], size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def all_gather(self, x: torch.Tensor) -> Pending:
        """``[n, ...]`` from every rank -> ``[size * n, ...]`` (rank ``j``'s rows at ``j*n``)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        return Pending(_ALL_GATHER(out, x, group=self.group, async_op=True), out)

    def reduce_scatter(self, x: torch.Tensor) -> Pending:
        """``[size * n, ...]`` from every rank -> the sum over ranks of rows ``rank*n .. rank*n+n-1``."""
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        return Pending(_REDUCE_SCATTER(out, x, group=self.group, async_op=True), out)

    def all_to_all(self, x: torch.Tensor) -> Pending:
        """``[size * n, ...]``: rows ``j*n ..`` go to rank ``j``; the result's rows ``j*n ..`` came from rank ``j``."""
        x = x.contiguous()
        out = torch.empty_like(x)
        return Pending(dist.all_to_all_single(out, x, group=self.group, async_op=True), out)


# ----------------------------------------------------------------------------------------------------------------
# Packed form


@dataclass(frozen=True)
class Packed:
    """How a layout was packed: ``fmt``, ``rows`` (dense batch rows; None for thd) and the packed ``cu``."""

    fmt: str
    rows: Optional[int]
    cu: tuple[int, ...]


def packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qkv_format: str, cu: Optional[tuple[int, ...]], cp: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Packed]:
    """q/k/v of any layout as packed ``[t, h, d]`` (views for contiguous ``bshd`` / ``thd``; ``sbhd`` is copied).

    ``cu`` is the validated global ``cu_seqlens`` for ``thd`` (else ignored); ``cp`` the CP size the local tensors
    are sharded over.
    """
    if qkv_format == "thd":
        assert cu is not None
        return q, k, v, Packed("thd", None, tuple(cu))
    if qkv_format == "sbhd":  # [s, b, h, d] -> [b, s, h, d]
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    b, s = q.shape[:2]
    g = s * cp  # global length of every row
    flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
    return flat[0], flat[1], flat[2], Packed(qkv_format, b, tuple(range(0, b * g + 1, g)))


def unpacked(out: torch.Tensor, how: Packed) -> torch.Tensor:
    """Inverse of :func:`packed` for the output: ``[t, h, d]`` back to the caller's layout."""
    if how.rows is None:
        return out
    x = out.view(how.rows, out.shape[0] // how.rows, *out.shape[1:])
    return x.transpose(0, 1).contiguous() if how.fmt == "sbhd" else x


# ----------------------------------------------------------------------------------------------------------------
# Zigzag permutation of an all-to-all


@functools.lru_cache(maxsize=64)
def _permutation(cu: tuple[int, ...], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inv)``: ``perm[i]`` is where row ``i`` of the rank-major concatenation of the ``n`` zigzag shards
    sits in natural order; ``natural = rank_major[inv]`` and ``rank_major = natural[perm]``."""
    perm = torch.cat([zigzag_indices(list(cu), n, r) for r in range(n)])
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return perm.to(device), inv.to(device)


class A2APlan:
    """The facts of one sequence <-> heads exchange over ``n`` ranks (this one ``rank``).

    ``cu`` are the offsets of the sequences the ``n`` ranks share: each sequence of ``cu`` is zigzag-sharded over
    the ``n`` ranks (chunks ``r`` and ``2n-1-r``). For Ulysses that is the global ``cu`` and ``n = cp``; inside the
    hierarchical variant it is the outer-local offsets ``cu // outer`` and ``n`` the inner size.
    """

    def __init__(self, cu: tuple[int, ...], *, n: int, rank: int, device: torch.device) -> None:
        self.cu, self.n, self.rank = cu, n, rank
        self.total = cu[-1]  # tokens after seq_to_heads (all n ranks' tokens)
        self.local = cu[-1] // n  # tokens before
        self.perm, self.inv = _permutation(cu, n, device)

    def split_heads(self, heads: int, what: str = "heads") -> int:
        if heads % self.n:
            raise ValueError(f"{what}={heads} do not divide by the all-to-all size {self.n}")
        return heads // self.n


def seq_to_heads(xs: Sequence[torch.Tensor], ex: A2APlan, coll: Any) -> list[torch.Tensor]:
    """``[t, h_i, d]`` zigzag shards (all heads) -> ``[T, h_i/n, d]`` natural order, this rank's heads; one all-to-all.

    Heads are split in ``n`` contiguous groups: rank ``j`` gets heads ``j*h_i/n ..`` of every tensor (for GQA the q
    heads of group ``j`` use exactly the k/v heads of group ``j``). The returned tensors are contiguous.
    """
    n, t = ex.n, ex.local
    widths = [x.shape[1] // n for x in xs]
    d = xs[0].shape[-1]
    send = xs[0].new_empty((n, t, sum(widths), d))  # [dest, t, heads of dest (all tensors), d]
    off = 0
    for x, w in zip(xs, widths):
        send[:, :, off:off + w].copy_(x.view(t, n, w, d).transpose(0, 1))
        off += w
    recv = coll.all_to_all(send.view(n * t, -1, d)).wait()  # [src * t, w_total, d], rank-major zigzag shards
    out, off = [], 0
    for w in widths:
        out.append(recv[:, off:off + w].index_select(0, ex.inv))  # natural order
        off += w
    return out


def heads_to_seq(xs: Sequence[torch.Tensor], ex: A2APlan, coll: Any) -> list[torch.Tensor]:
    """Inverse of :func:`seq_to_heads`: ``[T, h_i/n, d]`` natural, this rank's heads -> ``[t, h_i, d]`` zigzag."""
    n, t = ex.n, ex.local
    widths = [x.shape[1] for x in xs]
    d = xs[0].shape[-1]
    joined = xs[0] if len(xs) == 1 else torch.cat(list(xs), dim=1)
    send = joined.index_select(0, ex.perm)  # [dest * t, w_total, d]: each destination's zigzag rows
    recv = coll.all_to_all(send).wait().view(n, t, -1, d)  # [src (= head group), t, w_total, d]
    out, off = [], 0
    for w in widths:
        out.append(recv[:, :, off:off + w].transpose(0, 1).reshape(t, n * w, d))
        off += w
    return out
