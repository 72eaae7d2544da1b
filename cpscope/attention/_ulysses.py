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

The same autograd function runs the hierarchical variant (:mod:`cpscope.attention._hierarchical`): the exchange
then spans an inner group and the attention in the middle is the zigzag ring across the outer groups.

Example::

    with cpscope.runtime_cp(groups[4], comm="a2a"):       # 16 q heads, 4 k/v heads: 4 and 1 per rank
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .._pack import pack_for
from .._tensor_cache import lru
from ..scope import CPScope
from ..sharding import zigzag_indices
from ._exchange import GroupCollectives
from ._halo import halo_backward, halo_forward
from ._halo_plan import HaloPlan, halo_plan_for
from ._layout import Packed
from ._merge import sink_terms
from ._mods import Mods
from ._ring import ring_backward, ring_forward
from ._ring_plan import RingPlan

__all__ = ["A2APlan", "UlyssesPlan", "a2a_attention", "check_heads", "replicate_kv", "seq_to_heads", "heads_to_seq"]


def check_heads(heads: int, kv_heads: int, n: int, *, variant: str, cp: int, replicate: bool = False) -> None:
    """``ValueError`` unless the heads shard over the all-to-all size ``n``; names what would work.

    ``replicate``: k/v heads are replicated as needed (:func:`replicate_kv`), so only the q heads must divide by
    ``n``; otherwise (an outside implementation, e.g. TE's) both head counts must.
    """
    if heads % n == 0 and (replicate or kv_heads % n == 0):
        return
    g = heads if replicate else math.gcd(heads, kv_heads)
    sizes = [d for d in range(1, g + 1) if g % d == 0]
    what = "CP size" if variant == "a2a" else "inner (all-to-all) size"
    need = f"q heads ({heads}) must divide by it (k/v heads, {kv_heads}, are replicated as needed)" if replicate \
        else f"q heads ({heads}) and k/v heads ({kv_heads}) must both divide by it"
    raise ValueError(
        f"comm={variant!r} shards heads over the {what} {n}: {need} (CP size {cp}); {what}s that would work for "
        f"these heads: {sizes}. Or use comm='all_gather' (cheap with few k/v heads) or comm='p2p', which take any "
        f"head count"
    )


def replicate_kv(k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v with each head repeated ``n / gcd(h_kv, n)`` times (differentiably: the copies' gradients sum back), so
    that their heads divide by the all-to-all size ``n``; unchanged when they already do.

    Each q head keeps its k/v head: with ``g = h / h_kv`` q heads per k/v head and ``r`` copies, the copies of k/v
    head ``j`` serve q heads ``j*g .. (j+1)*g - 1`` in ``r`` groups of ``g / r`` (``r`` divides ``g`` when ``n``
    divides ``h``). Example: MQA (1 k/v head) over 4 ranks: 4 copies, one per rank.
    """
    h_kv = k.shape[-2]
    r = n // math.gcd(h_kv, n)
    if r == 1:
        return k, v
    return k.repeat_interleave(r, dim=-2), v.repeat_interleave(r, dim=-2)


# ----------------------------------------------------------------------------------------------------------------
# Sequence <-> heads: one all-to-all plus one copy on each side (the zigzag permutation is undone (redone) by one
# ``index_select`` of the received (sent) rows)


@lru(maxsize=64)  # device tensors: cpscope.clear_caches() drops them
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
    """``[t, h_i, d_i]`` zigzag shards (all heads) -> ``[T, h_i/n, d_i]`` natural order, this rank's heads; one
    all-to-all (the tensors may differ in head dim: each row travels as its heads' values, flattened).

    Heads are split in ``n`` contiguous groups: rank ``j`` gets heads ``j*h_i/n ..`` of every tensor (for GQA the q
    heads of group ``j`` use exactly the k/v heads of group ``j``). The returned tensors are contiguous.
    """
    n, t = ex.n, ex.local
    feats = [(x.shape[1] // n) * x.shape[2] for x in xs]  # values per row and destination, per tensor
    send = xs[0].new_empty((n, t, sum(feats)))  # [dest, t, values of dest's heads (all tensors)]
    off = 0
    for x, f in zip(xs, feats):
        send[:, :, off:off + f].copy_(x.reshape(t, n, f).transpose(0, 1))
        off += f
    recv = coll.all_to_all(send.view(n * t, -1)).wait()  # [src * t, values], rank-major zigzag shards
    out, off = [], 0
    for x, f in zip(xs, feats):
        out.append(recv[:, off:off + f].index_select(0, ex.inv).view(-1, x.shape[1] // n, x.shape[2]))
        off += f
    return out


def heads_to_seq(xs: Sequence[torch.Tensor], ex: A2APlan, coll: Any) -> list[torch.Tensor]:
    """Inverse of :func:`seq_to_heads`: ``[T, h_i/n, d_i]`` natural, this rank's heads -> ``[t, h_i, d_i]`` zigzag."""
    n, t = ex.n, ex.local
    joined = torch.cat([x.reshape(x.shape[0], -1) for x in xs], dim=1) if len(xs) > 1 else \
        xs[0].reshape(xs[0].shape[0], -1)
    send = joined.index_select(0, ex.perm)  # [dest * t, values]: each destination's zigzag rows
    recv = coll.all_to_all(send).wait().view(n, t, -1)  # [src (= head group), t, values]
    out, off = [], 0
    for x in xs:
        f = x.shape[1] * x.shape[2]
        out.append(recv[:, :, off:off + f].view(n, t, x.shape[1], x.shape[2]).transpose(0, 1)
                   .reshape(t, n * x.shape[1], x.shape[2]))
        off += f
    return out


def _sinks_grad_home(dout_h: torch.Tensor, out_h: torch.Tensor, lse: torch.Tensor, sinks_h: torch.Tensor,
                     ex: A2APlan, coll: Any) -> torch.Tensor:
    """``[h]``: the sinks' gradient from this rank's own rows. Each rank has its heads' row terms (natural order);
    summed per owner rank, one small all-to-all brings every rank its rows' sums for all heads."""
    terms = sink_terms(dout_h, out_h, lse, sinks_h)
    terms = terms.reshape(-1, terms.shape[-1])  # [T, h/n], natural order
    per_owner = terms.index_select(0, ex.perm).view(ex.n, ex.local, -1).sum(1)  # [n owners, h/n]
    return coll.all_to_all(per_owner).wait().reshape(-1)  # [n head groups * h/n]


# ----------------------------------------------------------------------------------------------------------------
# The variant


class UlyssesPlan:
    """Static facts of one all-to-all call: the exchange over the inner ranks and the attention in the middle.

    ``inner``/``outer``: ``(rank, size)`` in the all-to-all group and across the outer groups (Ulysses: the CP
    group and ``(0, 1)``). The middle is a :class:`RingPlan` of the outer size (one local kernel when it is 1, the
    window then applied by the kernel: whole sequences), or — a window across outer ranks — the halo plan of the
    outer ring's pack (:mod:`cpscope.attention._halo`). ``mods``: the call's features (its window as it restricts
    the call's sequences), handed whole to the middle plan; :func:`run` gives its sinks to the autograd Function
    (the middle attention takes this rank's heads of them, :meth:`sinks`).
    """

    def __init__(self, *, causal: bool, scale: float, how: Packed, inner: tuple[int, int], outer: tuple[int, int],
                 device: torch.device, mods: Mods = Mods()) -> None:
        (i_rank, i_size), (o_rank, o_size) = inner, outer
        cu = how.cu
        self.mods = mods
        self.ex = A2APlan(tuple(x // o_size for x in cu), n=i_size, rank=i_rank, device=device)
        self.rows = how.rows  # dense batch rows (the middle then uses the dense kernels), None for thd
        self.halo: Optional[HaloPlan] = None
        if mods.window is not None and o_size > 1:
            self.rows = None  # the halo exchange works on the packed rows
            self.halo = halo_plan_for(pack_for(tuple(cu), o_size, o_rank), device, causal=causal, scale=scale,
                                      mods=mods)
        elif self.rows is not None:
            self.seq = cu[1] // o_size  # each row's tokens after the exchange
            self.ring = RingPlan(varlen=False, causal=causal, scale=scale, rank=o_rank, size=o_size,
                                 local_len=self.seq, mods=mods)
        else:
            self.ring = RingPlan(varlen=True, causal=causal, scale=scale, rank=o_rank, size=o_size, cu=cu,
                                 device=device, mods=mods)

    def middle(self, x: torch.Tensor) -> torch.Tensor:
        """Exchanged ``[T, h', d]`` as the middle attention takes it (dense: ``[rows, seq, h', d]``, a view)."""
        return x if self.rows is None else x.view(self.rows, self.seq, *x.shape[1:])

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.rows is None else x.reshape(-1, *x.shape[2:])

    def sinks(self, sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's heads' sinks."""
        if sinks is None:
            return None
        w = sinks.shape[0] // self.ex.n
        return sinks[self.ex.rank * w:(self.ex.rank + 1) * w]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, outer: Optional[dist.ProcessGroup],
               sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The middle's forward: ``(out, lse)``."""
        if self.halo is not None:
            return halo_forward(q, k, v, self.halo, outer, sinks)
        return ring_forward(q, k, v, self.ring, outer, sinks)

    def attend_backward(self, dout: torch.Tensor, saved: Sequence[torch.Tensor],
                        outer: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.halo is not None:
            return halo_backward(dout, *saved, self.halo, outer)
        return ring_backward(dout, *saved, self.ring, outer)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan, coll: Any,
            outer: Optional[dist.ProcessGroup],
            sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(out, saved)``: the local output rows and what :func:`backward` needs."""
    qh, kh, vh = (plan.middle(x) for x in seq_to_heads([q, k, v], plan.ex, coll))
    out_h, lse = plan.attend(qh, kh, vh, outer, plan.sinks(sinks))
    (out,) = heads_to_seq([plan.flat(out_h)], plan.ex, coll)
    return out, (qh, kh, vh, out_h, lse)


def backward(dout: torch.Tensor, saved: tuple[torch.Tensor, ...], plan: UlyssesPlan, coll: Any,
             outer: Optional[dist.ProcessGroup], sinks: Optional[torch.Tensor] = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(dq, dk, dv, dsinks)`` of the local rows, in the inputs' dtypes (``dsinks`` ``None`` without sinks)."""
    qh, kh, vh, out_h, lse = saved
    (dh,) = seq_to_heads([dout], plan.ex, coll)
    dh = plan.middle(dh)
    dq, dk, dv = plan.attend_backward(dh, saved, outer)
    dq, dk, dv = heads_to_seq([plan.flat(dq.to(qh.dtype)), plan.flat(dk), plan.flat(dv)], plan.ex, coll)
    ds = None
    if sinks is not None:
        ds = _sinks_grad_home(dh, out_h, lse, plan.sinks(sinks), plan.ex, coll).to(sinks.dtype)
    return dq, dk, dv, ds


class _A2AAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                plan: UlyssesPlan, coll: Any, outer: Optional[dist.ProcessGroup]) -> torch.Tensor:
        sk = None if sinks is None else sinks.detach()
        out, saved = forward(q.detach(), k.detach(), v.detach(), plan, coll, outer, sk)
        ctx.save_for_backward(*saved, sk)
        ctx.plan, ctx.coll, ctx.outer = plan, coll, outer  # resolved in forward; backward never reads the ContextVar
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        *saved, sinks = ctx.saved_tensors
        dq, dk, dv, ds = backward(dout.contiguous(), tuple(saved), ctx.plan, ctx.coll, ctx.outer, sinks)
        return dq, dk, dv, ds if ctx.needs_input_grad[3] else None, None, None, None


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan, coll: Any,
        outer: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The differentiable exchange + middle attention + exchange (shared with the hierarchical variant); k/v heads
    are replicated first where they do not divide by the all-to-all size (:func:`replicate_kv`). The plan's sinks
    (``plan.mods.sinks``) get the gradient of this rank's rows."""
    k, v = replicate_kv(k, v, plan.ex.n)
    return _A2AAttention.apply(q, k, v, plan.mods.sinks, plan, coll, outer)


@torch.compiler.disable  # collectives and a custom Function: always eager
def a2a_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, how: Packed, scope: CPScope, causal: bool, scale: float,
    mods: Mods = Mods(),
) -> torch.Tensor:
    """Ulysses attention on validated packed ``[t, h, d]`` tensors (heads already checked with :func:`check_heads`;
    ``mods``: the call's features).

    Use :func:`cpscope.context_parallel_attention` with ``comm="a2a"`` rather than calling this directly.
    """
    plan = UlyssesPlan(causal=causal, scale=scale, how=how, inner=(scope.rank, scope.size), outer=(0, 1),
                       device=q.device, mods=mods)
    return run(q, k, v, plan, GroupCollectives(scope.group, scope.size, scope.rank), None)
