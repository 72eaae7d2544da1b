"""Zigzag ring attention: the autograd Function (forward ring, backward ring); the scope lives on ``ctx``.

Layout. Each of the ``cp`` ranks holds, per sequence (per document in ``thd``), chunk ``r`` (the *front* half of its
local tokens) and chunk ``2cp-1-r`` (the *back* half). K and V travel around the ring, one hop per step; at step
``i`` rank ``r`` holds the K/V of source ``s = (r - i) mod cp``. For causal attention:

* step 0 (``s == r``): local Q against local K/V with the ordinary causal mask — the local order of the two chunks
  is increasing in global position, so local causality is global causality;
* ``s < r``: both local chunks (``r`` and ``2cp-1-r``) come after chunk ``s`` and before chunk ``2cp-1-s``: all
  local Q against the **front** half of the received K/V, no mask;
* ``s > r``: chunk ``r`` precedes both received chunks (sees nothing); chunk ``2cp-1-r`` follows both: the **back**
  half of local Q against all received K/V, no mask.

Every rank therefore does the same work per step (half a block after step 0): the zigzag load balance. Without a
causal mask every step is all Q against all K/V. Partial outputs are merged through their log-sum-exp in fp32.

Backward runs its own ring: K/V travel as in forward; each remote step's dK/dV contribution joins a buffer that
travels with them in the inputs' dtype (fp32/fp64 inputs keep their precision; bf16 rounds once per hop, which for
CP2 adds nothing to the kernel's own rounding), and one more hop delivers it to its owner. The diagonal block's
dK/dV never travel; it is split by heads so that its two halves hide the first K/V hop and the last dK/dV hop.

Internally ``bshd`` is the *dense* form ``[b, s, h, d]`` (halves are views along ``s``) and ``thd`` the *varlen*
form ``[t, h, d]`` (halves are index gathers, one per document, computed without per-token loops; views when the
pack holds one sequence).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from .blocks import Varlen, block_backward, block_forward
from .comm import RingComm
from .merge import merge_into, merged

__all__ = ["RingPlan", "ring_attention"]


@functools.lru_cache(maxsize=32)
def _varlen_tensors(cu: tuple[int, ...], cp: int, device: torch.device) -> tuple[Any, ...]:
    """(cu_local, cu_half, front_idx, back_idx) on ``device``; cached per (cu, cp, device)."""
    cu_t = torch.tensor(cu, dtype=torch.long)
    cu_loc = cu_t // cp
    if cp == 1:
        return (cu_loc.to(device, torch.int32), None, None, None)
    half = cu_t // (2 * cp)  # per-document half-chunk offsets
    c = half[1:] - half[:-1]  # [docs] chunk length of each document
    j = torch.arange(int(half[-1]))
    front = j + torch.repeat_interleave(half[:-1], c)  # local index of each front-chunk token
    back = j + torch.repeat_interleave(half[1:], c)  # local index of each back-chunk token
    return (cu_loc.to(device, torch.int32), half.to(device, torch.int32), front.to(device), back.to(device))


class RingPlan:
    """Static facts of one ring call: layout, causality, scale, and the per-step block shapes.

    Step kinds: ``"diag"`` (local block, causal), ``"full"`` (all Q vs all K/V, no mask), ``"kv_front"`` (all Q vs
    front half of K/V) and ``"q_back"`` (back half of Q vs all K/V).
    """

    def __init__(
        self, *, varlen: bool, causal: bool, scale: float, rank: int, size: int, cu: Optional[tuple[int, ...]] = None,
        local_len: int = 0, device: Optional[torch.device] = None,
    ) -> None:
        self.varlen, self.causal, self.scale, self.rank, self.size = varlen, causal, scale, rank, size
        # Halves are slices along `dim` (dense: dim 1; varlen holding ONE sequence: dim 0, zero-copy) or, for
        # several packed documents, index gathers/scatters (`dim` None).
        self.dim: Optional[int] = 1
        self.c = local_len // 2
        if varlen:
            assert cu is not None and device is not None
            cu_loc, cu_half, self.front, self.back = _varlen_tensors(cu, size, device)
            lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
            m_loc = max(lens) // size
            self.dim, self.c = (0, cu[-1] // (2 * size)) if len(cu) == 2 else (None, 0)
            self._vl = {"diag": Varlen(cu_loc, cu_loc, m_loc, m_loc), "full": Varlen(cu_loc, cu_loc, m_loc, m_loc)}
            if size > 1:
                m_half = max(lens) // (2 * size)
                self._vl["kv_front"] = Varlen(cu_loc, cu_half, m_loc, m_half)
                self._vl["q_back"] = Varlen(cu_half, cu_loc, m_half, m_loc)

    def kind(self, step: int) -> str:
        if not self.causal:
            return "full"
        if step == 0:
            return "diag"
        src = (self.rank - step) % self.size
        return "kv_front" if src < self.rank else "q_back"

    def varlen_for(self, kind: str) -> Optional[Varlen]:
        return self._vl[kind] if self.varlen else None

    # rows of q-like tensors ([b, s, h, d] dense / [t, h, d] varlen) and of lse ([b, h, s] / [h, t])
    def q_back(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.back) if self.dim is None else x.narrow(self.dim, self.c, self.c)

    def lse_back(self, lse: torch.Tensor) -> torch.Tensor:
        return lse.index_select(-1, self.back) if self.dim is None else lse.narrow(-1, self.c, self.c).contiguous()

    def kv_front(self, x: torch.Tensor) -> torch.Tensor:  # front half of one k-like tensor
        return x.index_select(0, self.front) if self.dim is None else x.narrow(self.dim, 0, self.c)

    def sends_front(self, step: int, sender: int) -> bool:
        """Whether the dK/dV buffer ``sender`` posts after backward step ``step`` holds only the K/V front half.

        It carries source ``s = (sender - step) mod cp``'s gradients, touched by ranks ``s+1 .. sender``; all of them
        had ``kv_front`` steps (front-only contributions) iff that run did not wrap past the last rank: ``s < sender``.
        """
        return self.causal and (sender - step) % self.size < sender

    def front_shape(self, x: torch.Tensor) -> torch.Size:
        """Shape of :meth:`kv_front` of a k-like tensor ``x``."""
        n = self.front.numel() if self.dim is None else self.c
        dim = 0 if self.dim is None else self.dim
        return x.shape[:dim] + (n,) + x.shape[dim + 1:]

    def head_parts(self, h: int, h_kv: int) -> list[tuple[slice, slice]]:
        """(q heads, k/v heads) of the backward's two diagonal pieces (one piece when not splittable or CP1)."""
        if self.size == 1 or h_kv % 2:
            return [(slice(None), slice(None))]
        return [(slice(0, h // 2), slice(0, h_kv // 2)), (slice(h // 2, h), slice(h_kv // 2, h_kv))]

    def add_q_back(self, acc: torch.Tensor, val: torch.Tensor) -> None:
        if self.dim is None:
            acc.index_add_(0, self.back, val.to(acc.dtype))
        else:
            acc.narrow(self.dim, self.c, self.c).add_(val)

    def add_kv_front(self, acc: torch.Tensor, val: torch.Tensor) -> None:  # acc: one of dk / dv
        if self.dim is None:
            acc.index_add_(0, self.front, val.to(acc.dtype))
        else:
            acc.narrow(self.dim, 0, self.c).add_(val)

    def merge_q_back(self, out_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
        if self.dim is not None:
            merge_into(out_acc.narrow(self.dim, self.c, self.c), lse_acc.narrow(-1, self.c, self.c), o, l)
            return
        o_new, l_new = merged(out_acc.index_select(0, self.back), lse_acc.index_select(-1, self.back), o, l)
        out_acc.index_copy_(0, self.back, o_new)
        lse_acc.index_copy_(-1, self.back, l_new)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ring: returns ``(out, lse)``; ``out`` in q's dtype, ``lse`` in the accumulation dtype."""
    comm = RingComm(group, plan.rank, plan.size) if plan.size > 1 else None
    out_acc = lse_acc = None
    kc, vc = k, v
    for step in range(plan.size):
        if comm is not None and step + 1 < plan.size:
            comm.send_recv([kc, vc])  # the next step's K/V travel while this step computes
        kind = plan.kind(step)
        vl = plan.varlen_for(kind)
        if kind in ("diag", "full"):
            o, l = block_forward(q, kc, vc, scale=plan.scale, causal=kind == "diag", varlen=vl)
        elif kind == "kv_front":
            o, l = block_forward(q, plan.kv_front(kc), plan.kv_front(vc), scale=plan.scale, causal=False, varlen=vl)
        else:  # q_back
            o, l = block_forward(plan.q_back(q), kc, vc, scale=plan.scale, causal=False, varlen=vl)
        if plan.size == 1:  # CP1: one plain kernel call, nothing to merge
            return o, l
        if out_acc is None:  # step 0 always covers all of Q
            out_acc, lse_acc = o.to(_acc_dtype(q.dtype)), l.to(_acc_dtype(q.dtype))
        elif kind == "q_back":
            plan.merge_q_back(out_acc, lse_acc, o, l)
        else:
            merge_into(out_acc, lse_acc, o, l)
        del o, l
        if comm is not None and step + 1 < plan.size:
            kc, vc = comm.wait()
    return out_acc.to(q.dtype), lse_acc


def _backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    plan: RingPlan, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward ring: returns ``(dq, dk, dv)``; ``dq`` in the accumulation dtype, ``dk``/``dv`` in k/v's dtype.

    Order: post the first K/V hop, compute the first head-half of the diagonal block (hiding that hop), then the
    remote steps; each remote step's dK/dV contribution joins a buffer that travels with the K/V (in the inputs'
    dtype) and, after the last step, one more hop delivers it to its owner while the second head-half of the
    diagonal block computes. The diagonal contributions never travel. A traveling buffer holds only the K/V front
    half while every rank that touched it had a ``kv_front`` step (see :meth:`RingPlan.sends_front`).
    Memory: the diagonal's dK/dV stay per head-half until one final concatenation, and the received K/V are
    dropped before the second diagonal half.
    """
    size, rank = plan.size, plan.rank
    if size == 1:  # CP1: one plain kernel call
        return block_backward(dout, q, k, v, out, lse, scale=plan.scale, causal=plan.kind(0) == "diag",
                              varlen=plan.varlen_for(plan.kind(0)))
    kv_comm, dkv_comm = RingComm(group, rank, size), RingComm(group, rank, size)
    # dQ accumulates in fp32 (fp64) — except for CP2 where it is a sum of two kernel outputs that are already in
    # q's dtype, so adding them in q's dtype (computed in fp32, rounded once) loses nothing and saves memory.
    dq = torch.zeros(q.shape, dtype=q.dtype if size == 2 else _acc_dtype(q.dtype), device=q.device)
    diag_kind = plan.kind(0)
    vl0 = plan.varlen_for(diag_kind)
    dks: list[torch.Tensor] = []
    dvs: list[torch.Tensor] = []

    def diagonal(hq: slice, hk: slice) -> None:
        g = block_backward(dout[..., hq, :], q[..., hq, :], k[..., hk, :], v[..., hk, :], out[..., hq, :],
                           lse[..., hq, :].contiguous(), scale=plan.scale, causal=diag_kind == "diag", varlen=vl0)
        dq[..., hq, :].add_(g[0])
        dks.append(g[1].to(k.dtype))
        dvs.append(g[2].to(v.dtype))

    parts = plan.head_parts(q.shape[-2], k.shape[-2])
    kv_comm.send_recv([k, v])
    diagonal(*parts[0])
    recv_front = False
    for step in range(1, size):
        kc, vc = kv_comm.wait()
        if step + 1 < size:
            kv_comm.send_recv([kc, vc])
        kind = plan.kind(step)
        vl = plan.varlen_for(kind)
        if kind == "q_back":
            g = block_backward(plan.q_back(dout), plan.q_back(q), kc, vc, plan.q_back(out), plan.lse_back(lse),
                               scale=plan.scale, causal=False, varlen=vl)
            plan.add_q_back(dq, g[0])
        else:
            kk, vv = (plan.kv_front(kc), plan.kv_front(vc)) if kind == "kv_front" else (kc, vc)
            g = block_backward(dout, q, kk, vv, out, lse, scale=plan.scale, causal=False, varlen=vl)
            dq.add_(g[0])
        gk, gv, front = g[1].to(k.dtype), g[2].to(v.dtype), kind == "kv_front"
        del g
        if step == 1:  # the kernel's own (front-shaped or full) output starts the buffer
            bk, bv = gk.contiguous(), gv.contiguous()
        else:
            rk, rv = dkv_comm.wait()
            bk, bv = _join(plan, rk, recv_front, gk, front, kc), _join(plan, rv, recv_front, gv, front, vc)
            front = front and recv_front
        del gk, gv
        # the previous rank's buffer for the next step (or, after the last step, our own dK/dV) has its shape
        recv_front = plan.sends_front(step, (rank - 1) % size)
        shape = plan.front_shape(kc) if recv_front else kc.shape
        assert front == plan.sends_front(step, rank)  # what the next rank expects from us
        dkv_comm.send_recv([bk, bv], recv_shapes=[shape, shape])  # after the last step: to the owner
        del bk, bv
    del kc, vc  # the received K/V are not needed by the second diagonal half
    for part in parts[1:]:
        diagonal(*part)
    dk = dks[0] if len(dks) == 1 else torch.cat(dks, dim=-2)
    dks.clear()  # before the second cat: one k-sized pair of copies alive at a time
    dv = dvs[0] if len(dvs) == 1 else torch.cat(dvs, dim=-2)
    dvs.clear()
    rk, rv = dkv_comm.wait()
    if recv_front:
        plan.add_kv_front(dk, rk)
        plan.add_kv_front(dv, rv)
    else:
        dk.add_(rk)
        dv.add_(rv)
    return dq, dk, dv


def _join(plan: RingPlan, recv: torch.Tensor, recv_front: bool, own: torch.Tensor, own_front: bool,
          like: torch.Tensor) -> torch.Tensor:
    """Received dK (or dV) buffer plus this step's contribution, each front-only or full; front-only iff both are."""
    if recv_front == own_front:
        return recv.add_(own)
    if own_front:  # full buffer, front-half contribution
        plan.add_kv_front(recv, own)
        return recv
    full = torch.zeros_like(like)  # front-only buffer meets a full contribution
    plan.add_kv_front(full, recv)
    return full.add_(own)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group: Any
    ) -> torch.Tensor:
        k, v = k.detach().contiguous(), v.detach().contiguous()  # contiguous send buffers
        out, lse = _forward(q.detach(), k, v, plan, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group = plan, group  # the scope resolved in forward; backward never reads the ContextVar
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q.detach(), k, v, out, lse, ctx.plan, ctx.group)
        return dq.to(q.dtype), dk, dv, None, None


@torch.compiler.disable  # point-to-point collectives and a custom Function: always eager
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: RingPlan, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """Differentiable zigzag ring attention on validated local tensors (dense ``[b, s, h, d]`` or varlen ``[t, h, d]``).

    ``plan`` carries rank/size of ``group`` (resolved once by the caller); ``group`` may be ``None`` only when
    ``plan.size == 1``. Use :func:`cpscope.context_parallel_attention` rather than calling this directly.
    """
    return _RingAttention.apply(q, k, v, plan, group)
