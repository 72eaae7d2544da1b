"""All-gather CP attention: gather K/V once, attend this rank's zigzag rows, reduce-scatter dK/dV.

Rank ``r`` of ``cp`` holds chunks ``r`` (front half) and ``2cp-1-r`` (back half) of every sequence. K/V travel as two
all-gathers, **A** (every rank's front half: chunks ``0 .. cp-1``) and **B** (every rank's back half). With a causal
mask the local rows need:

* **local** — local Q against local K/V, causal (the local order is increasing in global position);
* **A[:r]** — all local Q against the front halves of ranks ``< r`` (chunks before chunk ``r``), no mask;
* **A[r+1:]**, **B[r+1:]** — the back-half Q against both halves of ranks ``> r`` (chunks ``r+1 .. 2cp-2-r``, all
  before chunk ``2cp-1-r``), no mask.

These are the blocks of the zigzag ring (:mod:`cpscope.attention._ring`) with all sources at once, so the kernels run
the same two shapes as there: causal blocks only with ``n_q == n_k`` and unmasked blocks otherwise. The key sets are
contiguous ranges of the gathered buffers (views) for one sequence; for several packed documents they are gathered
per document (one ``index_select``). Without a mask: all Q against all of A, then all of B.

Overlap (posted before the kernels they hide, as the ring does): forward posts both gathers, runs the local block
(hides A) and the A blocks (hide B; together at least ``cp + 1`` of the ``2cp`` units of causal work on every
rank). Backward gathers K/V again (memory stays at the local K/V between forward and backward), runs the first
piece of the local block (hides the gathers), the A blocks, posts the reduce-scatter of A's dK/dV (hidden by the B
block), the B block, posts B's reduce-scatter (hidden by the second piece of the local block).

Cost per rank and direction: ``(cp-1)/cp`` of the whole sequence's K/V (gather) and the same again for dK/dV
(reduce-scatter) — as the ring, but in 4 + 4 large collectives instead of ``2(cp-1)`` hops; cheap with few k/v
heads (GQA / MQA).

Example::

    out = context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu, comm="all_gather")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._pack import pack_for
from .._tensor_cache import lru
from ..scope import CPScope
from ._kernels import Varlen, acc_dtype, block_backward, block_forward
from ._exchange import GroupCollectives, Pending
from ._halo import halo_attention
from ._halo_plan import halo_plan_for
from ._layout import Packed
from ._merge import merge_rows_, merge_sinks_, sinks_grad
from ._mods import Mods
from ._ring_plan import DiagPart, RingPlan

__all__ = ["AllGatherPlan", "all_gather_attention"]


@dataclass(frozen=True)
class _Block:
    src: str  # "local" (local K/V, causal), "A" (gathered front halves) or "B" (gathered back halves)
    lo: int  # source ranks [lo, hi) of the gathered buffer
    hi: int
    back: bool  # the back-half Q rows only (else all local rows)


@lru(maxsize=128)  # device tensors: cpscope.clear_caches() drops them
def _keys_index(cu: tuple[int, ...], cp: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """Rows of a gathered half-buffer (``[cp * t_half]``, rank-major) holding ranks ``lo .. hi-1``'s halves,
    grouped by document (the varlen key order)."""
    half = torch.tensor(cu, dtype=torch.long) // (2 * cp)  # per-document offsets inside one rank's half
    c = half[1:] - half[:-1]
    per_doc = (hi - lo) * c
    doc = torch.repeat_interleave(torch.arange(c.numel()), per_doc)
    j = torch.arange(int(per_doc.sum())) - (torch.cumsum(per_doc, 0) - per_doc)[doc]
    cd = c[doc]
    return ((lo + j // cd) * int(half[-1]) + half[:-1][doc] + j % cd).to(device)


@lru(maxsize=128)
def _block_varlen(cu: tuple[int, ...], cp: int, q_halves: int, k_halves: int, device: torch.device) -> Varlen:
    """Per document: ``q_halves`` half-chunks of queries against ``k_halves`` half-chunks of keys."""
    half = [x // (2 * cp) for x in cu]
    m = max(b - a for a, b in zip(half[:-1], half[1:]))
    hq, hk = tuple(q_halves * x for x in half), tuple(k_halves * x for x in half)
    as_t = lambda h: torch.tensor(h, dtype=torch.int32, device=device)  # noqa: E731
    return Varlen(as_t(hq), as_t(hk), q_halves * m, k_halves * m, hq, hk)


class AllGatherPlan:
    """Static facts of one all-gather call: the zigzag rows (a :class:`RingPlan`), the blocks, the key sets.

    ``dense``: the packed tensors are one sequence handled as ``[1, t, h, d]`` with the dense kernels (``bshd`` /
    ``sbhd`` with one batch row); otherwise varlen ``[t, h, d]`` over ``cu``.
    """

    def __init__(self, *, causal: bool, scale: float, rank: int, size: int, cu: tuple[int, ...], dense: bool,
                 device: torch.device, mods: Mods = Mods()) -> None:
        self.causal, self.scale, self.rank, self.size, self.cu, self.dense = causal, scale, rank, size, cu, dense
        self.mods, self.softcap = mods, mods.softcap  # the call's features; the softcap is the block kernels' input
        self.ring = RingPlan(varlen=not dense, causal=causal, scale=scale, rank=rank, size=size,
                             cu=None if dense else cu, local_len=cu[-1] // size, device=device)
        r = rank
        if causal:
            blocks = [_Block("local", r, r + 1, False), _Block("A", 0, r, False), _Block("A", r + 1, size, True),
                      _Block("B", r + 1, size, True)]
        else:
            blocks = [_Block("A", 0, size, False), _Block("B", 0, size, False)]
        self.blocks = [b for b in blocks if b.hi > b.lo]

    @classmethod
    def of(cls, how: Packed, *, rank: int, size: int, causal: bool, scale: float, device: torch.device,
           mods: Mods = Mods()) -> "AllGatherPlan":
        """The plan for packed tensors (``how``): the dense kernels for one dense row, else varlen."""
        return cls(causal=causal, scale=scale, rank=rank, size=size, cu=how.cu, dense=how.rows == 1, device=device,
                   mods=mods)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[t, h, d]`` as this plan computes on it (``[1, t, h, d]`` when dense; a view)."""
        return x.unsqueeze(0) if self.dense else x

    def outer(self, x: torch.Tensor) -> torch.Tensor:
        return x[0] if self.dense else x

    # key sets of the gathered buffers: [cp, c, h, d] (dense) or [cp * t_half, h, d] (varlen)
    def keys(self, g: torch.Tensor, blk: _Block) -> torch.Tensor:
        rp = self.ring
        if rp.dim is None:  # several documents: gather each one's rows
            return g.index_select(0, _keys_index(self.cu, self.size, blk.lo, blk.hi, g.device))
        flat = g.view(1, -1, *g.shape[2:]) if self.dense else g
        return flat.narrow(rp.dim, blk.lo * rp.c, (blk.hi - blk.lo) * rp.c)

    def put_keys(self, buf: torch.Tensor, blk: _Block, val: torch.Tensor) -> None:
        """Inverse of :meth:`keys` for a gradient buffer shaped like the gathered one."""
        rp = self.ring
        if rp.dim is None:
            buf.index_copy_(0, _keys_index(self.cu, self.size, blk.lo, blk.hi, buf.device), val)
            return
        flat = buf.view(1, -1, *buf.shape[2:]) if self.dense else buf
        flat.narrow(rp.dim, blk.lo * rp.c, (blk.hi - blk.lo) * rp.c).copy_(val)

    def varlen(self, blk: _Block, device: torch.device) -> Optional[Varlen]:
        if self.dense:
            return None
        if blk.src == "local":
            return self.ring.varlen_for("diag")
        return _block_varlen(self.cu, self.size, 1 if blk.back else 2, blk.hi - blk.lo, device)

    def rows(self, x: torch.Tensor, blk: _Block) -> torch.Tensor:  # q-like rows of a block
        return self.ring.q_back(x) if blk.back else x

    def lse_rows(self, lse: torch.Tensor, blk: _Block) -> torch.Tensor:
        return self.ring.lse_back(lse) if blk.back else lse


def _post_gathers(k: torch.Tensor, v: torch.Tensor, plan: AllGatherPlan, coll: Any) -> dict[str, list[Pending]]:
    rp = plan.ring
    a = [coll.all_gather(rp.kv_front(k)), coll.all_gather(rp.kv_front(v))]
    b = [coll.all_gather(rp.q_back(k)), coll.all_gather(rp.q_back(v))]
    return {"A": a, "B": b}


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AllGatherPlan, coll: Any,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the local rows; ``out`` in q's dtype, ``lse`` in the accumulation dtype; sinks merged."""
    gathered = _post_gathers(k, v, plan, coll)  # before any kernel
    out = lse = None
    for j, blk in enumerate(plan.blocks):
        if blk.src == "local":
            kk, vv = k, v
        else:
            kk, vv = (plan.keys(p.wait(), blk) for p in gathered[blk.src])
        o, l = block_forward(plan.rows(q, blk), kk, vv, scale=plan.scale, causal=blk.src == "local",
                             varlen=plan.varlen(blk, q.device), softcap=plan.softcap,
                             placeholders=plan.ring.placeholders)
        if out is None:  # the first block covers all rows
            out, lse = o.to(acc_dtype(q.dtype)), l.to(acc_dtype(q.dtype))
        else:
            merge_rows_(out, lse, o, l, rows=plan.ring.back_rows() if blk.back else None)
        del o, l, kk, vv
        if blk.src != "local" and all(b.src != blk.src for b in plan.blocks[j + 1:]):
            for p in gathered.pop(blk.src):  # this source's gathered K/V are done with
                p.wait()
    for p in (p for ps in gathered.values() for p in ps):  # a source without blocks on this rank
        p.wait()
    if sinks is not None:
        merge_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse


def backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    plan: AllGatherPlan, coll: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: dq in the accumulation dtype, dk/dv in k/v's dtype."""
    rp = plan.ring
    gathered = _post_gathers(k, v, plan, coll)
    dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    local = [b for b in plan.blocks if b.src == "local"]
    parts = rp.diag_parts(q.shape[-2], k.shape[-2]) if local else []

    def local_piece(p: DiagPart) -> None:
        g = block_backward(p.take_q(dout), p.take_q(q), p.take_kv(k), p.take_kv(v), p.take_q(out), p.take_lse(lse),
                           scale=plan.scale, causal=True, varlen=p.varlen, softcap=plan.softcap,
                           placeholders=plan.ring.placeholders)
        p.take_q(dq).add_(g[0])
        p.take_kv(dk).copy_(g[1])
        p.take_kv(dv).copy_(g[2])

    if parts:
        local_piece(parts[0])  # hides the gathers
    grads: dict[str, list[torch.Tensor]] = {}
    scattered: dict[str, list[Pending]] = {}
    remote = [b for b in plan.blocks if b.src != "local"]
    for src in ("A", "B"):
        for blk in (b for b in remote if b.src == src):
            kg, vg = (p.wait() for p in gathered[src])
            g = block_backward(plan.rows(dout, blk), plan.rows(q, blk), plan.keys(kg, blk), plan.keys(vg, blk),
                               plan.rows(out, blk), plan.lse_rows(lse, blk), scale=plan.scale, causal=False,
                               varlen=plan.varlen(blk, q.device), softcap=plan.softcap,
                               placeholders=plan.ring.placeholders)
            if blk.back:
                rp.add_q_back(dq, g[0])
            else:
                dq.add_(g[0])
            if src not in grads:
                grads[src] = [kg.new_zeros(kg.shape), vg.new_zeros(vg.shape)]
            plan.put_keys(grads[src][0], blk, g[1].to(k.dtype))
            plan.put_keys(grads[src][1], blk, g[2].to(v.dtype))
            del g, kg, vg
        if src not in grads:  # no block of this rank sees that source: it still joins the reduce-scatter
            kg, vg = (p.wait() for p in gathered[src])
            grads[src] = [kg.new_zeros(kg.shape), vg.new_zeros(vg.shape)]
        for p in gathered.pop(src):  # its gathered K/V are done with
            p.wait()
        scattered[src] = [coll.reduce_scatter(x) for x in grads.pop(src)]  # before the next kernel
    for p in parts[1:]:
        local_piece(p)  # hides B's reduce-scatter
    (rak, rav), (rbk, rbv) = ([p.wait() for p in scattered[s]] for s in ("A", "B"))
    rp.add_kv_front(dk, rak)
    rp.add_kv_front(dv, rav)
    rp.add_q_back(dk, rbk)
    rp.add_q_back(dv, rbv)
    return dq, dk, dv


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                plan: AllGatherPlan, coll: Any) -> torch.Tensor:
        k, v = k.detach().contiguous(), v.detach().contiguous()
        sk = None if sinks is None else sinks.detach()
        out, lse = forward(q.detach(), k, v, plan, coll, sk)
        ctx.save_for_backward(q, k, v, out, lse, sk)
        ctx.plan, ctx.coll = plan, coll  # resolved in forward; backward never reads the ContextVar
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = backward(dout, q.detach(), k, v, out, lse, ctx.plan, ctx.coll)
        return dq.to(q.dtype), dk, dv, sinks_grad(dout, out, lse, sinks, ctx.needs_input_grad[3]), None, None


@torch.compiler.disable  # collectives and a custom Function: always eager
def all_gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, how: Packed, scope: CPScope, causal: bool, scale: float,
    mods: Mods = Mods(),
) -> torch.Tensor:
    """All-gather attention on validated packed ``[t, h, d]`` tensors (see :mod:`cpscope.attention._layout`).

    ``mods``: the call's features (its window as it restricts the call's sequences). With a window the gathered
    K/V feed the window's blocks only (:mod:`cpscope.attention._halo`, its ``"gather"`` exchange). Use
    :func:`cpscope.context_parallel_attention` with ``comm="all_gather"`` rather than calling this directly.
    """
    if mods.window is not None:
        hp = halo_plan_for(pack_for(tuple(how.cu), scope.size, scope.rank), q.device, causal=causal, scale=scale,
                           mods=mods)
        return halo_attention(q, k, v, plan=hp, group=scope.group, exchange="gather")
    plan = AllGatherPlan.of(how, rank=scope.rank, size=scope.size, causal=causal, scale=scale, device=q.device,
                            mods=mods)
    q, k, v = (plan.inner(x) for x in (q, k, v))
    out = _AllGatherAttention.apply(q, k, v, mods.sinks, plan, GroupCollectives(scope.group, scope.size, scope.rank))
    return plan.outer(out)
