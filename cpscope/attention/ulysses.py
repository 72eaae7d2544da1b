"""All-to-all (Ulysses) CP attention: sequence-sharded -> head-sharded, full attention, back.

One all-to-all (:func:`seq_to_heads`) turns this rank's zigzag tokens of all heads into **all** tokens of ``h/cp``
q heads and ``h_kv/cp`` k/v heads, in natural order per sequence (the zigzag permutation is undone as part of the
exchange); attention runs locally over whole sequences (document-masked in ``thd``, causal or not: one kernel
call); one all-to-all (:func:`heads_to_seq`) brings the output rows home in zigzag order. Backward:
dO travels like the inputs, the kernel's dQ/dK/dV travel back like the output. The head-sharded q/k/v/out and the
log-sum-exp are kept for backward (the same memory as the local ones), so backward runs two all-to-alls, not four.

Load balance is by heads, so it is perfect whatever the document lengths; the cost per rank and direction is
``(cp-1)/cp`` of the local q, k, v and out — independent of ``cp``, unlike the ring's K/V traffic. Both head counts
must divide by ``cp`` (checked before any collective, with the CP sizes and variants that would work).

The same autograd function runs the hierarchical variant (:mod:`cpscope.attention.hierarchical`): the exchange
then spans an inner group and the attention in the middle is the zigzag ring across the outer groups.

Example::

    with cpscope.runtime_cp(groups[4], comm="a2a"):       # 16 q heads, 4 k/v heads: 4 and 1 per rank
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..scope import CPScope
from ..sharding import zigzag_indices
from .comm import GroupCollectives
from .layout import Packed
from .ring import ring_backward, ring_forward
from .ring_plan import RingPlan

__all__ = ["A2APlan", "UlyssesPlan", "a2a_attention", "check_heads", "seq_to_heads", "heads_to_seq"]


def check_heads(heads: int, kv_heads: int, n: int, *, variant: str, cp: int) -> None:
    """``ValueError`` unless both head counts divide by the all-to-all size ``n``; names what would work."""
    if heads % n == 0 and kv_heads % n == 0:
        return
    g = math.gcd(heads, kv_heads)
    sizes = [d for d in range(1, g + 1) if g % d == 0]
    what = "CP size" if variant == "a2a" else "inner (all-to-all) size"
    raise ValueError(
        f"comm={variant!r} shards heads over the {what} {n}: q heads ({heads}) and k/v heads ({kv_heads}) must both "
        f"divide by it (CP size {cp}); {what}s that would work for these heads: {sizes}. Or use comm='all_gather' "
        f"(cheap with few k/v heads) or comm='p2p', which take any head count"
    )


# ----------------------------------------------------------------------------------------------------------------
# Sequence <-> heads: one all-to-all plus one copy on each side (the zigzag permutation is undone (redone) by one
# ``index_select`` of the received (sent) rows)


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


# ----------------------------------------------------------------------------------------------------------------
# The variant


class UlyssesPlan:
    """Static facts of one all-to-all call: the exchange over the inner ranks and the attention in the middle.

    ``inner``/``outer``: ``(rank, size)`` in the all-to-all group and across the outer groups (Ulysses: the CP
    group and ``(0, 1)``). The middle is a :class:`RingPlan` of the outer size: one local kernel when it is 1.
    """

    def __init__(self, *, causal: bool, scale: float, how: Packed, inner: tuple[int, int], outer: tuple[int, int],
                 device: torch.device) -> None:
        (i_rank, i_size), (o_rank, o_size) = inner, outer
        cu = how.cu
        self.ex = A2APlan(tuple(x // o_size for x in cu), n=i_size, rank=i_rank, device=device)
        self.rows = how.rows  # dense batch rows (the middle then uses the dense kernels), None for thd
        if self.rows is not None:
            self.seq = cu[1] // o_size  # each row's tokens after the exchange
            self.ring = RingPlan(varlen=False, causal=causal, scale=scale, rank=o_rank, size=o_size,
                                 local_len=self.seq)
        else:
            self.ring = RingPlan(varlen=True, causal=causal, scale=scale, rank=o_rank, size=o_size, cu=cu,
                                 device=device)

    def middle(self, x: torch.Tensor) -> torch.Tensor:
        """Exchanged ``[T, h', d]`` as the middle attention takes it (dense: ``[rows, seq, h', d]``, a view)."""
        return x if self.rows is None else x.view(self.rows, self.seq, *x.shape[1:])

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.rows is None else x.reshape(-1, *x.shape[2:])


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan, coll: Any,
            outer: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(out, saved)``: the local output rows and what :func:`backward` needs."""
    qh, kh, vh = (plan.middle(x) for x in seq_to_heads([q, k, v], plan.ex, coll))
    out_h, lse = ring_forward(qh, kh, vh, plan.ring, outer)
    (out,) = heads_to_seq([plan.flat(out_h)], plan.ex, coll)
    return out, (qh, kh, vh, out_h, lse)


def backward(dout: torch.Tensor, saved: tuple[torch.Tensor, ...], plan: UlyssesPlan, coll: Any,
             outer: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the local rows, in the inputs' dtypes."""
    qh, kh, vh, out_h, lse = saved
    (dh,) = seq_to_heads([dout], plan.ex, coll)
    dq, dk, dv = ring_backward(plan.middle(dh), qh, kh, vh, out_h, lse, plan.ring, outer)
    dq, dk, dv = heads_to_seq([plan.flat(dq.to(qh.dtype)), plan.flat(dk), plan.flat(dv)], plan.ex, coll)
    return dq, dk, dv


class _A2AAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan, coll: Any,
                outer: Optional[dist.ProcessGroup]) -> torch.Tensor:
        out, saved = forward(q.detach(), k.detach(), v.detach(), plan, coll, outer)
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.coll, ctx.outer = plan, coll, outer  # resolved in forward; backward never reads the ContextVar
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        dq, dk, dv = backward(dout.contiguous(), ctx.saved_tensors, ctx.plan, ctx.coll, ctx.outer)
        return dq, dk, dv, None, None, None


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan, coll: Any,
        outer: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The differentiable exchange + middle attention + exchange (shared with the hierarchical variant)."""
    return _A2AAttention.apply(q, k, v, plan, coll, outer)


@torch.compiler.disable  # collectives and a custom Function: always eager
def a2a_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, how: Packed, scope: CPScope, causal: bool, scale: float
) -> torch.Tensor:
    """Ulysses attention on validated packed ``[t, h, d]`` tensors (heads already checked with :func:`check_heads`).

    Use :func:`cpscope.context_parallel_attention` with ``comm="a2a"`` rather than calling this directly.
    """
    plan = UlyssesPlan(causal=causal, scale=scale, how=how, inner=(scope.rank, scope.size), outer=(0, 1),
                       device=q.device)
    return run(q, k, v, plan, GroupCollectives(scope.group, scope.size, scope.rank), None)
