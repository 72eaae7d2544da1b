"""Windowed CP attention over a :class:`~cpscope.attention._halo_plan.HaloPlan`: only the blocks and the K/V rows the
window leaves, computed and moved.

Forward: post the exchange of K/V, compute this rank's local blocks, then each source's blocks as its rows arrive,
merging every block into fp32 (fp64) accumulators through its log-sum-exp; sinks (if any) are merged last.
Backward (given the final ``out`` / ``lse``, the ring identity): K/V are exchanged again, each block's dQ is added
into dQ and its dK/dV into a buffer shaped like the rows that source sent, which goes straight back to it.

Two exchanges:

* ``"p2p"`` (:class:`HaloExchange`, the ``"p2p"`` variant): round ``i`` (``i = 1 .. cp-1``) sends to ``rank + i`` the
  rows of local K/V it needs and receives from ``rank - i`` the rows this rank needs, compacted; a round nobody
  needs is skipped. Every rank runs the rounds on one schedule — all posted at once when no rank receives more
  than its own number of rows (a short window: the halo of its neighbours), else one round ahead (at most one
  round's rows held) — so the sends and receives between any two ranks pair up in the same order in forward and
  backward. Per pass each rank sends exactly the rows its peers' blocks read: the halo lower bound.
* ``"gather"`` (:class:`GatherExchange`, the ``"all_gather"`` variant with a window): all K/V gathered, dK/dV
  reduce-scattered; the blocks read what they need of the gathered rows.

Example::

    plan = halo_plan_for(pack, q.device, causal=True, scale=d ** -0.5, mods=Mods(window=Band(255, 0)))
    out = halo_attention(q, k, v, plan=plan, group=scope.group, exchange="p2p")    # [t, h, d] local rows
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..groups import group_ranks
from ._kernels import acc_dtype, block_backward, block_forward
from ._exchange import GroupCollectives
from ._halo_plan import HaloBlock, HaloGeometry, HaloPlan, Rows
from ._merge import merge_rows_, merge_sinks_, sinks_grad

__all__ = ["HaloExchange", "GatherExchange", "halo_forward", "halo_backward", "halo_attention"]

Buffers = list[torch.Tensor]


class _Posted:
    """One batch of point-to-point sends / receives in flight; :meth:`wait` returns the receive buffers."""

    def __init__(self, group: Any, ranks: list[int], sends: Sequence[tuple[int, Buffers]],
                 recvs: Sequence[tuple[int, Buffers]]) -> None:
        ops = [dist.P2POp(dist.isend, t, ranks[peer], group) for peer, ts in sends for t in ts]
        ops += [dist.P2POp(dist.irecv, t, ranks[peer], group) for peer, ts in recvs for t in ts]
        self._reqs = dist.batch_isend_irecv(ops) if ops else []
        self._keep = [t for _, ts in sends for t in ts]  # alive until sent
        self.received = [ts for _, ts in recvs]

    def wait(self) -> list[Buffers]:
        for req in self._reqs:
            req.wait()
        self._reqs, self._keep = [], []
        return self.received


def _like(n: int, x: torch.Tensor) -> torch.Tensor:
    return torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)


class HaloExchange:
    """The ``"p2p"`` exchange of a windowed call: rounds of compacted halo rows (see the module docstring)."""

    def __init__(self, geo: HaloGeometry, group: Any) -> None:
        self.geo, self.group = geo, group
        self.ranks = group_ranks(group) if geo.cp > 1 else [0]
        self.ahead = geo.cp - 1 if geo.all_at_once else 1
        self._grads: list[tuple[int, _Posted]] = []

    def _peers(self, i: int) -> tuple[Optional[int], Optional[int]]:
        """Round ``i``'s ``(src, dest)``: whom this rank receives from / sends to (``None``: nothing that way)."""
        geo = self.geo
        src, dest = (geo.rank - i) % geo.cp, (geo.rank + i) % geo.cp
        return (src if src in geo.recv_rows else None), (dest if dest in geo.sends else None)

    def _post_kv(self, i: int, tensors: Buffers) -> _Posted:
        src, dest = self._peers(i)
        sends = [] if dest is None else [(dest, [t.index_select(0, self.geo.sends[dest]) for t in tensors])]
        recvs = [] if src is None else [(src, [_like(self.geo.recv_rows[src], t) for t in tensors])]
        return _Posted(self.group, self.ranks, sends, recvs)

    def kv(self, tensors: Buffers) -> Iterator[tuple[int, Optional[int], Buffers]]:
        """``(round, src, buffers)``: round 0 is this rank's own K/V; then every round ``1 .. cp-1`` in order (``src``
        ``None`` where this rank receives nothing), its rows arrived."""
        last = self.geo.cp - 1
        posted: dict[int, _Posted] = {}
        for i in range(1, min(self.ahead, last) + 1):
            posted[i] = self._post_kv(i, tensors)
        yield 0, self.geo.rank, tensors
        for i in range(1, last + 1):
            got = posted.pop(i).wait()
            if i + self.ahead <= last:  # the same schedule on every rank: pairs' sends and receives stay in order
                posted[i + self.ahead] = self._post_kv(i + self.ahead, tensors)
            src = self._peers(i)[0]
            yield i, src, (got[0] if src is not None else [])

    def keys(self, blk: HaloBlock) -> Rows:
        return blk.k

    def post_grads(self, i: int, grads: Buffers, like: Buffers) -> None:
        """Round ``i``'s dK/dV: back to its source (``grads``: the received rows' gradients), and the gradients of
        this rank's rows from the rank it sent them to (shaped after ``like``: k and v)."""
        src, dest = self._peers(i)
        sends = [] if src is None else [(src, [g.contiguous() for g in grads])]
        recvs = [] if dest is None else [(dest, [_like(self.geo.sends[dest].numel(), t) for t in like])]
        if sends or recvs:
            self._grads.append((dest, _Posted(self.group, self.ranks, sends, recvs)))

    def finish_grads(self, acc: Buffers) -> None:
        """Wait for every round's dK/dV and add the received ones into ``acc`` (this rank's dK, dV)."""
        for dest, posted in self._grads:
            got = posted.wait()
            if dest is not None:
                rows = Rows(0, 0, self.geo.sends[dest])
                for a, g in zip(acc, got[0]):
                    rows.add_(a, g)
        self._grads = []


class GatherExchange:
    """The ``"gather"`` exchange: every rank's K/V all-gathered, dK/dV reduce-scattered (``all_gather`` variant)."""

    def __init__(self, geo: HaloGeometry, group: Any) -> None:
        self.geo = geo
        self.coll = GroupCollectives(group, geo.cp, geo.rank)
        self._bufs: Optional[Buffers] = None

    def kv(self, tensors: Buffers) -> Iterator[tuple[int, Optional[int], Buffers]]:
        pending = [self.coll.all_gather(t.contiguous()) for t in tensors]
        yield 0, self.geo.rank, tensors
        full = [p.wait() for p in pending]
        n = self.geo.local
        for s in range(self.geo.cp):
            if s != self.geo.rank:
                yield s, s, [f.narrow(0, s * n, n) for f in full]

    def keys(self, blk: HaloBlock) -> Rows:
        return blk.k_local

    def post_grads(self, i: int, grads: Buffers, like: Buffers) -> None:
        if self._bufs is None:
            self._bufs = [x.new_zeros((self.geo.cp * x.shape[0], *x.shape[1:])) for x in like]
        n = self.geo.local
        for b, g in zip(self._bufs, grads):
            b.narrow(0, i * n, n).add_(g)

    def finish_grads(self, acc: Buffers) -> None:
        like = acc
        if self._bufs is None:  # no remote block on this rank: it still joins the reduce-scatter
            self._bufs = [x.new_zeros((self.geo.cp * x.shape[0], *x.shape[1:])) for x in like]
        for a, p in zip(acc, [self.coll.reduce_scatter(b) for b in self._bufs]):
            a.add_(p.wait())
        self._bufs = None


def _exchange(plan: HaloPlan, group: Any, kind: str) -> Any:
    return HaloExchange(plan.geo, group) if kind == "p2p" else GatherExchange(plan.geo, group)


def halo_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: HaloPlan, group: Any,
                 sinks: Optional[torch.Tensor] = None, exchange: str = "p2p") -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the local rows (``[t, h, d_v]`` in q's dtype, ``[h, t]`` in the accumulation dtype); sinks
    merged when given. ``q`` / ``k`` / ``v``: local ``[t, h, d]`` rows of the plan's pack."""
    dt = acc_dtype(q.dtype)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=dt, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dt, device=q.device)
    ex = _exchange(plan, group, exchange)
    for _, src, (kk, vv) in ((i, s, b) for i, s, b in ex.kv([k, v]) if s is not None):
        for blk in plan.geo.blocks.get(src, ()):
            rows = ex.keys(blk) if src != plan.rank else blk.k
            o, l = block_forward(blk.q.take(q), rows.take(kk), rows.take(vv), scale=plan.scale, causal=blk.causal,
                                 varlen=blk.varlen, window=blk.window, softcap=plan.softcap)
            merge_rows_(out, lse, o, l, rows=blk.q.spec())
    if sinks is not None:
        merge_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse


def halo_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, plan: HaloPlan, group: Any,
                  exchange: str = "p2p") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the local rows (dq in the accumulation dtype, dk/dv in k/v's) given the final out/lse."""
    dt = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk, dv = torch.zeros(k.shape, dtype=dt, device=k.device), torch.zeros(v.shape, dtype=dt, device=v.device)
    ex = _exchange(plan, group, exchange)
    for i, src, bufs in ex.kv([k, v]):
        if src is None:
            ex.post_grads(i, [], [k, v])  # this rank's rows may still come back from the rank it sent them to
            continue
        kk, vv = bufs
        gk, gv = (dk, dv) if src == plan.rank else (torch.zeros(kk.shape, dtype=dt, device=k.device),
                                                     torch.zeros(vv.shape, dtype=dt, device=v.device))
        for blk in plan.geo.blocks.get(src, ()):
            rows = ex.keys(blk) if src != plan.rank else blk.k
            g = block_backward(blk.q.take(dout), blk.q.take(q), rows.take(kk), rows.take(vv), blk.q.take(out),
                               blk.q.take_lse(lse), scale=plan.scale, causal=blk.causal, varlen=blk.varlen,
                               window=blk.window, softcap=plan.softcap)
            blk.q.add_(dq, g[0])
            rows.add_(gk, g[1])
            rows.add_(gv, g[2])
        if src != plan.rank:
            ex.post_grads(i, [gk.to(k.dtype), gv.to(v.dtype)], [k, v])
    ex.finish_grads([dk, dv])
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _HaloAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                plan: HaloPlan, group: Any, exchange: str) -> torch.Tensor:
        sk = None if sinks is None else sinks.detach()
        out, lse = halo_forward(q.detach(), k.detach(), v.detach(), plan, group, sk, exchange)
        ctx.save_for_backward(q, k, v, out, lse, sk)
        ctx.plan, ctx.group, ctx.exchange = plan, group, exchange  # resolved in forward: no ContextVar in backward
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = halo_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, ctx.plan, ctx.group,
                                   ctx.exchange)
        return dq.to(q.dtype), dk, dv, sinks_grad(dout, out, lse, sinks, ctx.needs_input_grad[3]), None, None, None


@torch.compiler.disable  # point-to-point collectives and a custom Function: always eager
def halo_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: HaloPlan, group: Any,
                   exchange: str = "p2p") -> torch.Tensor:
    """Differentiable windowed attention on validated local ``[t, h, d]`` rows of the plan's pack.

    ``exchange``: ``"p2p"`` (halo rows) or ``"gather"`` (everything gathered). The plan's sinks (``plan.mods``,
    ``[h]``) get the gradient of this rank's rows. Use :func:`cpscope.context_parallel_attention` with a ``window``
    rather than calling this directly.
    """
    return _HaloAttention.apply(q, k, v, plan.mods.sinks, plan, group, exchange)
