"""All-to-all (Ulysses) CP attention: sequence-sharded -> head-sharded, full attention, back.

One all-to-all turns this rank's zigzag tokens of all heads into **all** tokens of ``h/cp`` q heads and ``h_kv/cp``
k/v heads, in natural order per sequence (the zigzag permutation is undone as part of the exchange, see
:func:`cpscope.attention._exchange.seq_to_heads`); attention runs locally over whole sequences (document-masked in
``thd``, causal or not: one kernel call); one all-to-all brings the output rows home in zigzag order. Backward:
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

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..scope import CPScope
from ._exchange import A2APlan, GroupCollectives, Packed, heads_to_seq, seq_to_heads
from .ring import RingPlan
from .ring import _backward as ring_backward
from .ring import _forward as ring_forward

__all__ = ["A2APlan", "UlyssesPlan", "a2a_attention", "check_heads"]


def check_heads(heads: int, kv_heads: int, n: int, *, variant: str, cp: int) -> None:
    """``ValueError`` unless both head counts divide by the all-to-all size ``n``; names what would work."""
    if heads % n == 0 and kv_heads % n == 0:
        return
    import math

    g = math.gcd(heads, kv_heads)
    sizes = [d for d in range(1, g + 1) if g % d == 0]
    what = "CP size" if variant == "a2a" else "inner (all-to-all) size"
    raise ValueError(
        f"comm={variant!r} shards heads over the {what} {n}: q heads ({heads}) and k/v heads ({kv_heads}) must both "
        f"divide by it (CP size {cp}); {what}s that would work for these heads: {sizes}. Or use comm='all_gather' "
        f"(cheap with few k/v heads) or comm='p2p', which take any head count"
    )


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
