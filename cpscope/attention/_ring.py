"""Zigzag ring attention: the autograd Function, the forward ring and the backward ring; the scope lives on ``ctx``.

Which block each step computes, and which Q and K/V rows it reads, is the ring's plan
(:mod:`cpscope.attention._ring_plan`); this module runs it. Partial outputs are merged through their log-sum-exp in
fp32, by the fused row kernels of :mod:`cpscope.attention._merge` (which also replace ``index_add_`` in backward).

Backward runs its own ring: K/V travel as in forward; each remote step's dK/dV contribution joins a buffer that
travels with them in the inputs' dtype (fp32/fp64 inputs keep their precision; bf16 rounds once per hop, which for
CP2 adds nothing to the kernel's own rounding), and one more hop delivers it to its owner. The diagonal block's
dK/dV never travel; it is split in two pieces that hide the first K/V hop and the last dK/dV hop — by documents
when a varlen pack holds several (two contiguous token ranges of balanced causal work: zero-copy views), else by
heads.

Entries: :func:`ring_attention` (differentiable, for :func:`cpscope.context_parallel_attention`), and
:func:`ring_forward` / :func:`ring_backward` (the two rings on plain tensors, for algorithms that run the ring
inside their own autograd function: the hierarchical variant).

Example::

    plan = plan_for_pack(pack, q.device, causal=True, scale=d ** -0.5)
    out = ring_attention(q, k, v, plan=plan, group=scope.group)          # differentiable
    out, lse = ring_forward(q, k, v, plan, scope.group)                  # the forward ring alone
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ._kernels import acc_dtype, block_backward, block_forward, run_whole
from ._exchange import RingComm, is_dense
from ._merge import merge_rows_, merge_sinks_, sinks_grad
from ._ring_plan import DiagPart, RingGeometry, RingPlan, RingStep

__all__ = ["RingGeometry", "RingPlan", "ring_attention", "ring_forward", "ring_backward"]


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group: Any,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ring: returns ``(out, lse)``; ``out`` in q's dtype, ``lse`` in the accumulation dtype; ``sinks``
    (``[h]``, optional) are merged into both (what :func:`ring_backward` then takes).

    ``k`` / ``v`` are the send buffers (dense: gap-free, see :class:`~cpscope.attention._exchange.RingComm`). Merges run
    in fp32 (fp64) through :func:`merge_rows_`. With CP2 there is exactly one merge, so the remote block merges
    straight into the diagonal block's output (q's dtype, rounded once): the same numbers as an fp32 accumulator
    cast at the end, without the upcast and the cast. Larger rings keep an fp32 accumulator.
    """
    comm = RingComm(group, plan.rank, plan.size) if plan.size > 1 else None
    out_acc = lse_acc = None
    kc, vc = plan.send_kv(k), plan.send_kv(v)  # compacted to the real rows for padded packs without a causal mask
    for step in range(plan.size):
        if comm is not None and step + 1 < plan.size:
            # the next step's K/V travel while this step computes
            comm.send_recv([kc, vc], recv_shapes=plan.recv_shapes(plan.rank - step - 1, [kc, vc]))
        st = plan.step(step)
        o, l = block_forward(*plan.block_rows(st, q, kc, vc), scale=plan.scale, causal=st.causal, varlen=st.varlen,
                             window=plan.window, softcap=plan.softcap, placeholders=plan.placeholders)
        if plan.size == 1:  # CP1: one plain kernel call, nothing to merge
            if sinks is not None:
                merge_sinks_(o, l, sinks)
            return plan.zero_pad_rows(o), l
        if out_acc is None:  # step 0 always covers all of Q
            acc = acc_dtype(q.dtype)
            out_acc, lse_acc = (o if plan.size == 2 else o.to(acc)), l.to(acc)
        else:
            merge_rows_(out_acc, lse_acc, o, l, rows=plan.out_rows(st))
        del o, l
        if comm is not None and step + 1 < plan.size:
            kc, vc = comm.wait()
    if sinks is not None:
        merge_sinks_(out_acc, lse_acc, sinks)
    return plan.zero_pad_rows(out_acc.to(q.dtype)), lse_acc


def ring_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    plan: RingPlan, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward ring: returns ``(dq, dk, dv)``; ``dq`` in the accumulation dtype, ``dk``/``dv`` in k/v's dtype.

    ``out`` / ``lse`` are the forward ring's (merged) results; see :class:`_BackwardRing` for the order of work.
    """
    return _BackwardRing(dout, q, k, v, out, lse, plan, group).run()


class _BackwardRing:
    """One backward ring on this rank.

    Order: post the first K/V hop, compute the first piece of the diagonal block (hiding that hop), then the remote
    steps; each remote step's dK/dV contribution joins a buffer that travels with the K/V (in the inputs' dtype)
    and, after the last step, one more hop delivers it to its owner while the second diagonal piece computes. The
    diagonal contributions never travel. A traveling buffer holds only the K/V front half while every rank that
    touched it had a ``kv_front`` step (see :meth:`RingPlan.sends_front`). The diagonal is cut by documents when the
    pack holds several (contiguous token ranges: no copies), else by heads (:meth:`RingPlan.diag_parts`).

    Memory: the diagonal's dK/dV stay per piece until one final concatenation, the received K/V are dropped before
    the second diagonal piece, and dQ is never held twice over: either one full accumulator, or (CP2, ``q_back``
    rank) the first piece's dQ plus the remote back-half dQ, joined at the end by one concatenation.
    """

    def __init__(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, plan: RingPlan, group: Any) -> None:
        if plan.pad_rows is not None:  # padding rows are no queries: no gradient flows from them
            dout = dout.index_fill(0, plan.pad_rows, 0)
        self.k_full, self.v_full = k, v
        if plan.compact:  # K/V travel compacted; a real query row without any real key has lse -inf: make p = 0 there
            k, v = plan.send_kv(k), plan.send_kv(v)
            lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        self.dout, self.q, self.k, self.v, self.out, self.lse = dout, q, k, v, out, lse
        self.plan, self.group = plan, group
        self.acc = q.dtype  # the dQ accumulator's dtype (set in run)
        self.parts: list[DiagPart] = []
        self.dks: list[torch.Tensor] = []  # the diagonal pieces' dK / dV
        self.dvs: list[torch.Tensor] = []
        self.dq: Optional[torch.Tensor] = None  # the dQ accumulator, once there is one
        self.dq0: Optional[torch.Tensor] = None  # the first diagonal piece's dQ until it joins the accumulator
        self.kept: Optional[torch.Tensor] = None  # CP2 q_back rank: the remote back-half dQ, added after the last piece
        self.recv_front = False  # whether the dK/dV buffer in flight to this rank holds the front half only
        self.dkv_comm: Optional[RingComm] = None

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        plan, rank, size = self.plan, self.plan.rank, self.plan.size
        if size == 1:  # CP1: one plain kernel call
            st = plan.step(0)
            dq, dk, dv = block_backward(self.dout, self.q, self.k, self.v, self.out, self.lse, scale=plan.scale,
                                        causal=st.causal, varlen=st.varlen, window=plan.window, softcap=plan.softcap,
                                        placeholders=plan.placeholders)
            return dq, plan.expand_kv(dk, self.k_full), plan.expand_kv(dv, self.v_full)
        kv_comm, self.dkv_comm = RingComm(self.group, rank, size), RingComm(self.group, rank, size)
        # dQ accumulates in fp32 (fp64) — except for CP2 where it is a sum of two kernel outputs that are already in
        # q's dtype, so adding them in q's dtype (computed in fp32, rounded once) loses nothing and saves memory.
        self.acc = self.q.dtype if size == 2 else acc_dtype(self.q.dtype)
        self.parts = plan.diag_parts(self.q.shape[-2], self.k.shape[-2])
        # Each exchange is posted BEFORE the kernel it overlaps: cuDNN's attention kernels are persistent (one CTA per
        # SM), so an exchange posted behind one gets no SM until it ends (the K/V hop then started at the end of the
        # diagonal block, also on a high-priority NCCL stream). docs/attention_kernels.md §8, §13.
        k, v = self.k, self.v
        kv_comm.send_recv([k, v], recv_shapes=plan.recv_shapes(rank - 1, [k, v]))
        self.dq0 = self._diagonal(self.parts[0])
        for step in range(1, size):
            kc, vc = kv_comm.wait()
            if step + 1 < size:
                kv_comm.send_recv([kc, vc], recv_shapes=plan.recv_shapes(rank - step - 1, [kc, vc]))
            self._remote(plan.step(step), kc, vc)
        del kc, vc  # the received K/V are not needed by the second diagonal piece
        for part in self.parts[1:]:
            self._add_diagonal_dq(part, self._diagonal(part))
        return self._finish()

    def _diagonal(self, p: DiagPart) -> torch.Tensor:
        """One piece of the diagonal block: returns the piece's dQ, keeps its dK/dV."""
        g = block_backward(p.take_q(self.dout), p.take_q(self.q), p.take_kv(self.k), p.take_kv(self.v),
                           p.take_q(self.out), p.take_lse(self.lse), scale=self.plan.scale, causal=self.plan.causal,
                           varlen=p.varlen, softcap=self.plan.softcap,
                           placeholders=self.plan.placeholders)
        self.dks.append(g[1].to(self.k.dtype))
        self.dvs.append(g[2].to(self.v.dtype))
        return g[0]

    def _remote(self, st: RingStep, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """A remote step: its block's gradients; its dK/dV join the traveling buffer, which is sent on."""
        plan, rank, size = self.plan, self.plan.rank, self.plan.size
        qq, kk, vv = plan.block_rows(st, self.q, kc, vc)
        g = block_backward(plan.q_rows(self.dout, st), qq, kk, vv, plan.q_rows(self.out, st),
                           plan.lse_rows(self.lse, st), scale=plan.scale, causal=st.causal, varlen=st.varlen,
                           softcap=plan.softcap, placeholders=plan.placeholders)
        del qq, kk, vv
        self._add_remote_dq(g[0], st)
        gk, gv, front = g[1].to(self.k.dtype), g[2].to(self.v.dtype), st.kv_front
        del g
        if st.index == 1:  # the kernel's own (front-shaped or full) output starts the buffer
            bk, bv = gk.contiguous(), gv.contiguous()
        else:
            rk, rv = self.dkv_comm.wait()
            bk, bv = _join(plan, rk, self.recv_front, gk, front), _join(plan, rv, self.recv_front, gv, front)
            front = front and self.recv_front
            del rk, rv
        del gk, gv
        # the previous rank's buffer for the next step (or, after the last step, our own dK/dV) has its shape
        self.recv_front = plan.sends_front(st.index, (rank - 1) % size)
        shapes = [plan.front_shape(x) if self.recv_front else (plan.recv_shape(rank - 1 - st.index, x) or x.shape)
                  for x in (kc, vc)]  # k and v may differ in head dim
        assert front == plan.sends_front(st.index, rank)  # what the next rank expects from us
        self.dkv_comm.send_recv([bk, bv], recv_shapes=shapes)  # after the last step: to the owner

    def _add_remote_dq(self, gq: torch.Tensor, st: RingStep) -> None:
        """Add a remote step's dQ, holding dQ once: the first remote dQ decides what becomes the accumulator."""
        plan, parts = self.plan, self.parts
        if self.dq is not None:  # later steps of larger rings
            plan.add_q_rows(self.dq, gq, st)
        elif len(parts) == 1:  # the diagonal's dQ is complete: it becomes the accumulator
            self.dq = self.dq0 if self.dq0.dtype == self.acc else self.dq0.to(self.acc)
            plan.add_q_rows(self.dq, gq, st)
        elif not st.q_back and gq.dtype == self.acc:  # a full-size remote dQ becomes the accumulator
            self.dq = gq
            parts[0].take_q(self.dq).add_(self.dq0)
        elif plan.size == 2 and st.q_back:
            # joined after the last piece. Memory: dq0 + the back half are one dQ for a head split; for a document
            # split up to half a dQ more, while the second piece has at most half the tokens (all heads: no larger
            # kernel workspace than a head half) and needs no head-slice copies — below the head split's peak
            self.kept = gq
        else:
            self.dq = torch.empty(self.q.shape, dtype=self.acc, device=self.q.device)
            parts[0].take_q(self.dq).copy_(self.dq0)
            parts[1].take_q(self.dq).zero_()
            plan.add_q_rows(self.dq, gq, st)
        if self.dq is not None:
            self.dq0 = None

    def _add_diagonal_dq(self, part: DiagPart, dq1: torch.Tensor) -> None:
        """Add a later diagonal piece's dQ."""
        if self.dq is None:  # CP2 q_back rank: one concatenation builds dQ, then the back rows are added
            self.dq = _cat_parts(self.parts, [self.dq0, dq1])
            self.dq0 = None
            self.plan.add_q_back(self.dq, self.kept)
            self.kept = None
        else:
            part.take_q(self.dq).add_(dq1)

    def _finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dK/dV: the diagonal pieces' joined, plus this rank's own buffer home from its trip around the ring."""
        plan = self.plan
        dk = _cat_parts(self.parts, self.dks)
        self.dks.clear()  # before the second cat: one k-sized pair of copies alive at a time
        dv = _cat_parts(self.parts, self.dvs)
        self.dvs.clear()
        rk, rv = self.dkv_comm.wait()
        if self.recv_front:
            plan.add_kv_front(dk, rk)
            plan.add_kv_front(dv, rv)
        else:
            dk.add_(rk)
            dv.add_(rv)
        return self.dq, plan.expand_kv(dk, self.k_full), plan.expand_kv(dv, self.v_full)


def _cat_parts(parts: list[DiagPart], xs: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from the diagonal pieces' results: by token order (document pieces) or head order."""
    if len(xs) == 1:
        return xs[0]
    if parts[0].rows is None:
        return torch.cat(xs, dim=-2)
    return torch.cat([x for _, x in sorted(zip(parts, xs), key=lambda px: px[0].rows[0])], dim=0)


def _join(plan: RingPlan, recv: torch.Tensor, recv_front: bool, own: torch.Tensor, own_front: bool) -> torch.Tensor:
    """Received dK (or dV) buffer plus this step's contribution, each front-only or full; front-only iff both are.

    The result is contiguous (it is sent on); ``own`` is this step's fresh kernel output and may be reused.
    """
    if recv_front == own_front:
        return recv.add_(own)
    if own_front:  # full buffer, front-half contribution
        plan.add_kv_front(recv, own)
        return recv
    own = own.contiguous()  # front-only buffer meets a full contribution: add it into the contribution
    plan.add_kv_front(own, recv)
    return own


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its elements fill one block of memory in some dimension order (e.g. the ``[b, s, h, d]``
    view of an ``sbhd`` tensor), else a contiguous copy: such tensors can be sent as they are (see
    :class:`~cpscope.attention._exchange.RingComm`) and the kernels read their strides."""
    return t if is_dense(t) else t.contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], plan: RingPlan,
        group: Any,
    ) -> torch.Tensor:
        k, v = _dense(k.detach()), _dense(v.detach())  # send buffers (no copy for dense views)
        sk = None if sinks is None else sinks.detach()
        out, lse = ring_forward(q.detach(), k, v, plan, group, sk)
        ctx.save_for_backward(q, k, v, out, lse, sk)
        ctx.plan, ctx.group = plan, group  # the scope resolved in forward; backward never reads the ContextVar
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = _dense(dout)
        dq, dk, dv = ring_backward(dout, q.detach(), k, v, out, lse, ctx.plan, ctx.group)
        return dq.to(q.dtype), dk, dv, sinks_grad(dout, out, lse, sinks, ctx.needs_input_grad[3]), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: RingPlan, group: Optional[dist.ProcessGroup],
) -> torch.Tensor:
    """Differentiable zigzag ring attention on validated local tensors (dense ``[b, s, h, d]`` or varlen ``[t, h, d]``).

    ``plan`` carries rank/size of ``group`` (resolved once by the caller) and the call's features (``plan.mods``);
    ``group`` may be ``None`` only when ``plan.size == 1``. The sinks (``plan.mods.sinks``, ``[h]``) get the
    gradient of this rank's rows. Use :func:`cpscope.context_parallel_attention` rather than calling this directly.
    """
    if torch.compiler.is_compiling():  # point-to-point collectives and a custom Function: always eager (an island)
        return _ring_attention_island(q, k, v, plan=plan, group=group)
    sinks = plan.mods.sinks
    if plan.size == 1 and plan.pad_rows is None and not plan.compact:
        # CP1 is one block: where the router picks a kernel with its own autograd (FlexAttention), run it as is
        st = plan.step(0)
        out = run_whole(q, k, v, scale=plan.scale, causal=st.causal, varlen=st.varlen, window=plan.window,
                        softcap=plan.softcap, sinks=sinks)
        if out is not None:
            return out
    return _RingAttention.apply(q, k, v, sinks, plan, group)


# Eager calls do not pass through the disable wrapper (a frame-callback swap per call: host time of every layer).
_ring_attention_island = torch.compiler.disable(ring_attention)
