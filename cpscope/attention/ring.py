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
causal mask every step is all Q against all K/V. Partial outputs are merged through their log-sum-exp in fp32, by
the fused row kernels of :mod:`cpscope.attention.merge` (which also replace ``index_add_`` in backward).

Backward runs its own ring: K/V travel as in forward; each remote step's dK/dV contribution joins a buffer that
travels with them in the inputs' dtype (fp32/fp64 inputs keep their precision; bf16 rounds once per hop, which for
CP2 adds nothing to the kernel's own rounding), and one more hop delivers it to its owner. The diagonal block's
dK/dV never travel; it is split in two pieces that hide the first K/V hop and the last dK/dV hop — by documents
when a varlen pack holds several (two contiguous token ranges of balanced causal work: zero-copy views), else by
heads.

Internally ``bshd`` is the *dense* form ``[b, s, h, d]`` (halves are views along ``s``) and ``thd`` the *varlen*
form ``[t, h, d]`` (halves are index gathers, one per document, computed without per-token loops; views when the
pack holds one sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .._pack import Pack
from .merge import merge_rows_, rows_add_
from .blocks import Varlen, block_backward, block_forward
from .comm import RingComm, is_dense

__all__ = ["RingGeometry", "RingPlan", "ring_attention"]


@dataclass(frozen=True)
class DiagPart:
    """One piece of the backward's diagonal block: a token range (varlen, by documents) and/or a head range."""

    rows: Optional[tuple[int, int]]  # [start, stop) of the local tokens (varlen); None: all
    hq: slice  # q heads
    hk: slice  # k/v heads
    varlen: Optional[Varlen]  # the piece's own varlen description (rebased offsets); None: dense

    def take(self, x: torch.Tensor, heads: slice) -> torch.Tensor:
        """The piece of a q- or k-like tensor (``heads`` = :attr:`hq` or :attr:`hk`); a view."""
        if self.rows is not None:
            x = x[self.rows[0]:self.rows[1]]
        return x if heads == slice(None) else x[..., heads, :]

    def take_lse(self, lse: torch.Tensor) -> torch.Tensor:  # [b, h, s] / [h, t]
        if self.rows is not None:
            lse = lse[..., self.rows[0]:self.rows[1]]
        return lse if self.hq == slice(None) else lse[..., self.hq, :]


_ALL = slice(None)


def _doc_split(cu: tuple[int, ...], cp: int, device: torch.device) -> Optional[tuple[DiagPart, DiagPart]]:
    """The diagonal block cut between two documents: two token ranges balancing ``sum(len_i**2)`` (the causal work),
    the longer range first. None when fewer than two documents hold local tokens.

    Computed once per pack (:class:`RingGeometry`).
    """
    lens = [(b - a) // cp for a, b in zip(cu[:-1], cu[1:])]  # local tokens per document
    cu_loc = [0]
    for n in lens:
        cu_loc.append(cu_loc[-1] + n)
    t, total = cu_loc[-1], sum(n * n for n in lens)
    best, acc = None, 0
    for j in range(1, len(lens)):
        acc += lens[j - 1] ** 2
        if 0 < cu_loc[j] < t and (best is None or abs(total - 2 * acc) < best[0]):
            best = (abs(total - 2 * acc), j)
    if best is None:
        return None
    j = best[1]

    def part(lo: int, hi: int) -> DiagPart:
        host = tuple(c - cu_loc[lo] for c in cu_loc[lo:hi + 1])
        cu_t = torch.tensor(host, dtype=torch.int32, device=device)
        m = max(lens[lo:hi])
        return DiagPart((cu_loc[lo], cu_loc[hi]), _ALL, _ALL, Varlen(cu_t, cu_t, m, m, host, host))

    first, second = part(0, j), part(j, len(lens))
    # the piece with fewer tokens runs second: backward's memory peak is there (dQ, the first piece's dK/dV and the
    # dK/dV in flight are alive), and the kernel's workspace grows with the piece's tokens
    return (first, second) if cu_loc[j] >= t - cu_loc[j] else (second, first)


class RingGeometry:
    """What the ring derives from one pack's offsets on one device, built once per pack and reused by every layer.

    Varlen (``thd``) only: the local / half-chunk offsets (device tensors with host copies), the front / back row
    indices, the per-step :class:`~cpscope.attention.blocks.Varlen` descriptions, the backward's document split, and
    — when the pack holds padding — the padding rows and, for attention without a causal mask, the real rows of
    every rank's K/V (which travel compacted: padding keys are never seen).

    Example::

        geo = pack.memo(("ring", q.device), lambda: RingGeometry(pack, q.device))
        plan = RingPlan(varlen=True, causal=True, scale=s, rank=pack.rank, size=pack.cp, geometry=geo)
    """

    def __init__(self, pack: Pack, device: torch.device) -> None:
        cu, cp, rank = pack.cu, pack.cp, pack.rank
        self.cp, self.rank = cp, rank
        cu_t = torch.tensor(cu, dtype=torch.long)
        cu_loc = (cu_t // cp).to(device, torch.int32)
        h_loc = tuple(x // cp for x in cu)
        m_loc = pack.longest // cp
        loc = Varlen(cu_loc, cu_loc, m_loc, m_loc, h_loc, h_loc)  # host offsets ride along (cuDNN: no sync)
        self.vl: dict[str, Varlen] = {"diag": loc, "full": loc}
        # Halves are slices along dim 0 when the pack holds ONE sequence (zero-copy), else index gathers/scatters.
        self.dim: Optional[int] = 0 if len(cu) == 2 else None
        self.c = cu[-1] // (2 * cp) if len(cu) == 2 else 0
        self.front = self.back = None
        self.doc_parts: Optional[tuple[DiagPart, DiagPart]] = None
        if cp > 1:
            half = cu_t // (2 * cp)  # per-document half-chunk offsets
            c = half[1:] - half[:-1]
            j = torch.arange(int(half[-1]))
            self.front = (j + torch.repeat_interleave(half[:-1], c)).to(device)  # local row of each front token
            self.back = (j + torch.repeat_interleave(half[1:], c)).to(device)  # local row of each back token
            cu_half = half.to(device, torch.int32)
            h_half = tuple(x // (2 * cp) for x in cu)
            m_half = pack.longest // (2 * cp)
            self.vl["kv_front"] = Varlen(cu_loc, cu_half, m_loc, m_half, h_loc, h_half)
            self.vl["q_back"] = Varlen(cu_half, cu_loc, m_half, m_loc, h_half, h_loc)
            self.doc_parts = _doc_split(cu, cp, device)
        self.pad_rows = pack.pad_rows(device)
        # Without a causal mask, real queries see every key of their document: padding keys must go. Each rank's
        # real keys of a document are a prefix of its part of it, so K/V are compacted to the real rows and every
        # source rank's compacted offsets describe the blocks. (With a causal mask padding keys are never visible to
        # real queries: they sit after every real token of their document.)
        self.keep: Optional[torch.Tensor] = None
        self.full_from: Optional[list[Varlen]] = None
        self.rows_from: Optional[list[int]] = None
        if pack.padded:
            self.keep = pack.real_rows(device)
            self.full_from, self.rows_from = [], []
            for src in range(cp):
                n = pack.real_local_lens(src)
                host = [0]
                for x in n:
                    host.append(host[-1] + x)
                cu_k = torch.tensor(host, dtype=torch.int32, device=device)
                self.full_from.append(Varlen(cu_loc, cu_k, m_loc, max(n, default=0), h_loc, tuple(host)))
                self.rows_from.append(host[-1])


def _geometry(cu: tuple[int, ...], cp: int, rank: int, device: torch.device) -> RingGeometry:
    """The geometry of offsets given as values (callers without a pack: the collective variants, tests), through the
    pack cache's bounded LRU — so repeated calls with the same offsets build it once."""
    from .._pack import pack_for

    pack = pack_for(cu, cp, rank)
    return pack.memo(("ring", device), lambda: RingGeometry(pack, device))


class RingPlan:
    """Static facts of one ring call: layout, causality, scale, and the per-step block shapes.

    Step kinds: ``"diag"`` (local block, causal), ``"full"`` (all Q vs all K/V, no mask), ``"kv_front"`` (all Q vs
    front half of K/V) and ``"q_back"`` (back half of Q vs all K/V). Varlen plans take their per-pack facts from a
    :class:`RingGeometry` (built here from ``cu`` when none is given); the plan itself is cheap.
    """

    def __init__(
        self, *, varlen: bool, causal: bool, scale: float, rank: int, size: int, cu: Optional[tuple[int, ...]] = None,
        local_len: int = 0, device: Optional[torch.device] = None, geometry: Optional[RingGeometry] = None,
    ) -> None:
        self.varlen, self.causal, self.scale, self.rank, self.size = varlen, causal, scale, rank, size
        # Halves are slices along `dim` (dense: dim 1; varlen holding ONE sequence: dim 0, zero-copy) or, for
        # several packed documents, index gathers/scatters (`dim` None).
        self.dim: Optional[int] = 1
        self.c = local_len // 2
        self.geo: Optional[RingGeometry] = None
        self.doc_parts: Optional[tuple[DiagPart, DiagPart]] = None
        self.pad_rows: Optional[torch.Tensor] = None
        self.compact = False  # K/V travel compacted to their real rows (padding, no causal mask)
        if varlen:
            if geometry is None:
                assert cu is not None and device is not None
                geometry = _geometry(tuple(cu), size, rank, device)
            geo = self.geo = geometry
            self.dim, self.c, self.front, self.back = geo.dim, geo.c, geo.front, geo.back
            self.doc_parts = geo.doc_parts
            self.pad_rows = geo.pad_rows
            self.compact = geo.keep is not None and not causal
            if self.compact:
                self.doc_parts = None  # the diagonal's K rows are compacted: cut it by heads

    def kind(self, step: int) -> str:
        if not self.causal:
            return "full"
        if step == 0:
            return "diag"
        src = (self.rank - step) % self.size
        return "kv_front" if src < self.rank else "q_back"

    def varlen_for(self, kind: str) -> Optional[Varlen]:
        """The varlen description of a block kind (unpadded plans; ``None`` for dense plans)."""
        return self.geo.vl[kind] if self.varlen else None

    def varlen_at(self, step: int) -> Optional[Varlen]:
        """The varlen description of the block at ``step`` (``None`` for dense plans)."""
        if not self.varlen:
            return None
        if self.compact:
            return self.geo.full_from[(self.rank - step) % self.size]
        return self.geo.vl[self.kind(step)]

    def send_kv(self, k: torch.Tensor) -> torch.Tensor:
        """This rank's K (or V) as it travels: all rows, or its real rows when compacted."""
        return k.index_select(0, self.geo.keep) if self.compact else k

    def recv_shape(self, src: int, like: torch.Tensor) -> Optional[torch.Size]:
        """Shape of a K-like buffer of source rank ``src`` (``None``: the same as ``like``)."""
        if not self.compact:
            return None
        return torch.Size((self.geo.rows_from[src % self.size],) + tuple(like.shape[1:]))

    def recv_shapes(self, src: int, like: list[torch.Tensor]) -> Optional[list[torch.Size]]:
        if not self.compact:
            return None
        return [self.recv_shape(src, t) for t in like]

    def expand_kv(self, dk: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A compacted dK (or dV) back on all local rows (zero at padding)."""
        if not self.compact:
            return dk
        return torch.zeros_like(like, dtype=dk.dtype).index_copy_(0, self.geo.keep, dk)

    def zero_pad_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (q-like, varlen) with its padding rows zeroed, in place; ``x`` unchanged without padding."""
        return x if self.pad_rows is None else x.index_fill_(0, self.pad_rows, 0)

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

    def diag_parts(self, h: int, h_kv: int) -> list[DiagPart]:
        """The backward's diagonal pieces: by documents (varlen, >= 2 documents), else by heads (``h_kv`` even), else
        one piece (CP1 too). Document pieces are contiguous token ranges: zero-copy views, no head-slice copies."""
        vl = self.varlen_at(0)
        if self.size == 1:
            return [DiagPart(None, _ALL, _ALL, vl)]
        if self.doc_parts is not None:
            return list(self.doc_parts)
        if h_kv % 2:
            return [DiagPart(None, _ALL, _ALL, vl)]
        return [DiagPart(None, slice(0, h // 2), slice(0, h_kv // 2), vl),
                DiagPart(None, slice(h // 2, h), slice(h_kv // 2, h_kv), vl)]

    def back_rows(self) -> Union[tuple[int, int], torch.Tensor]:
        """The q_back rows for :func:`merge_rows_`: ``(start, length)`` along the sequence, or the index tensor."""
        return self.back if self.dim is None else (self.c, self.c)

    def add_q_back(self, acc: torch.Tensor, val: torch.Tensor) -> None:
        if self.dim is None:
            rows_add_(acc, self.back, val)
        else:
            acc.narrow(self.dim, self.c, self.c).add_(val)

    def add_kv_front(self, acc: torch.Tensor, val: torch.Tensor) -> None:  # acc: one of dk / dv
        if self.dim is None:
            rows_add_(acc, self.front, val)
        else:
            acc.narrow(self.dim, 0, self.c).add_(val)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ring: returns ``(out, lse)``; ``out`` in q's dtype, ``lse`` in the accumulation dtype.

    Merges run in fp32 (fp64) through :func:`merge_rows_`. With CP2 there is exactly one merge, so the remote block
    merges straight into the diagonal block's output (q's dtype, rounded once): the same numbers as an fp32
    accumulator cast at the end, without the upcast and the cast. Larger rings keep an fp32 accumulator.
    """
    comm = RingComm(group, plan.rank, plan.size) if plan.size > 1 else None
    out_acc = lse_acc = None
    kc, vc = plan.send_kv(k), plan.send_kv(v)  # compacted to the real rows for padded packs without a causal mask
    for step in range(plan.size):
        if comm is not None and step + 1 < plan.size:
            # the next step's K/V travel while this step computes
            comm.send_recv([kc, vc], recv_shapes=plan.recv_shapes(plan.rank - step - 1, [kc, vc]))
        kind = plan.kind(step)
        vl = plan.varlen_at(step)
        if kind in ("diag", "full"):
            o, l = block_forward(q, kc, vc, scale=plan.scale, causal=kind == "diag", varlen=vl)
        elif kind == "kv_front":
            o, l = block_forward(q, plan.kv_front(kc), plan.kv_front(vc), scale=plan.scale, causal=False, varlen=vl)
        else:  # q_back
            o, l = block_forward(plan.q_back(q), kc, vc, scale=plan.scale, causal=False, varlen=vl)
        if plan.size == 1:  # CP1: one plain kernel call, nothing to merge
            return plan.zero_pad_rows(o), l
        if out_acc is None:  # step 0 always covers all of Q
            acc = _acc_dtype(q.dtype)
            out_acc, lse_acc = (o if plan.size == 2 else o.to(acc)), l.to(acc)
        else:
            merge_rows_(out_acc, lse_acc, o, l, rows=plan.back_rows() if kind == "q_back" else None)
        del o, l
        if comm is not None and step + 1 < plan.size:
            kc, vc = comm.wait()
    return plan.zero_pad_rows(out_acc.to(q.dtype)), lse_acc


def _backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    plan: RingPlan, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward ring: returns ``(dq, dk, dv)``; ``dq`` in the accumulation dtype, ``dk``/``dv`` in k/v's dtype.

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
    size, rank = plan.size, plan.rank
    if plan.pad_rows is not None:  # padding rows are no queries: no gradient flows from them
        dout = dout.index_fill(0, plan.pad_rows, 0)
    k_full, v_full = k, v
    if plan.compact:  # K/V travel compacted; a real query row without any real key has lse -inf: make p = 0 there
        k, v = plan.send_kv(k), plan.send_kv(v)
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    if size == 1:  # CP1: one plain kernel call
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=plan.scale, causal=plan.kind(0) == "diag",
                                    varlen=plan.varlen_at(0))
        return dq, plan.expand_kv(dk, k_full), plan.expand_kv(dv, v_full)
    kv_comm, dkv_comm = RingComm(group, rank, size), RingComm(group, rank, size)
    # dQ accumulates in fp32 (fp64) — except for CP2 where it is a sum of two kernel outputs that are already in
    # q's dtype, so adding them in q's dtype (computed in fp32, rounded once) loses nothing and saves memory.
    acc = q.dtype if size == 2 else _acc_dtype(q.dtype)
    causal0 = plan.kind(0) == "diag"
    parts = plan.diag_parts(q.shape[-2], k.shape[-2])
    dks: list[torch.Tensor] = []
    dvs: list[torch.Tensor] = []

    def diagonal(p: DiagPart) -> torch.Tensor:  # returns the piece's dQ; keeps its dK/dV
        g = block_backward(p.take(dout, p.hq), p.take(q, p.hq), p.take(k, p.hk), p.take(v, p.hk),
                           p.take(out, p.hq), p.take_lse(lse), scale=plan.scale, causal=causal0, varlen=p.varlen)
        dks.append(g[1].to(k.dtype))
        dvs.append(g[2].to(v.dtype))
        return g[0]

    def piece(x: torch.Tensor, p: DiagPart) -> torch.Tensor:  # p's rows/heads of a q-like tensor
        return p.take(x, p.hq)

    # Each exchange is posted BEFORE the kernel it overlaps: cuDNN's attention kernels are persistent (one CTA per
    # SM), so an exchange posted behind one gets no SM until it ends (H200, 16k: the K/V hop then started at the end
    # of the diagonal block, also on a high-priority NCCL stream). benchmarks/attention_notes.md §8.
    kv_comm.send_recv([k, v], recv_shapes=plan.recv_shapes(rank - 1, [k, v]))
    dq0: Optional[torch.Tensor] = diagonal(parts[0])
    dq: Optional[torch.Tensor] = None
    kept: Optional[torch.Tensor] = None  # CP2 q_back rank: the remote back-half dQ, added after the last piece
    recv_front = False
    for step in range(1, size):
        kc, vc = kv_comm.wait()
        if step + 1 < size:
            kv_comm.send_recv([kc, vc], recv_shapes=plan.recv_shapes(rank - step - 1, [kc, vc]))
        kind = plan.kind(step)
        vl = plan.varlen_at(step)
        if kind == "q_back":
            g = block_backward(plan.q_back(dout), plan.q_back(q), kc, vc, plan.q_back(out), plan.lse_back(lse),
                               scale=plan.scale, causal=False, varlen=vl)
        else:
            kk, vv = (plan.kv_front(kc), plan.kv_front(vc)) if kind == "kv_front" else (kc, vc)
            g = block_backward(dout, q, kk, vv, out, lse, scale=plan.scale, causal=False, varlen=vl)
        gq = g[0]
        if dq is not None:  # later steps of larger rings
            _add_remote(plan, dq, gq, kind)
        elif len(parts) == 1:  # the diagonal's dQ is complete: it becomes the accumulator
            dq = dq0 if dq0.dtype == acc else dq0.to(acc)
            _add_remote(plan, dq, gq, kind)
        elif kind != "q_back" and gq.dtype == acc:  # a full-size remote dQ becomes the accumulator
            dq = gq
            piece(dq, parts[0]).add_(dq0)
        elif size == 2 and kind == "q_back":
            # joined after the last piece. Memory: dq0 + the back half are one dQ for a head split; for a document
            # split up to half a dQ more, while the second piece has at most half the tokens (all heads: no larger
            # kernel workspace than a head half) and needs no head-slice copies — below the head split's peak
            kept = gq
        else:
            dq = torch.empty(q.shape, dtype=acc, device=q.device)
            piece(dq, parts[0]).copy_(dq0)
            piece(dq, parts[1]).zero_()
            _add_remote(plan, dq, gq, kind)
        if dq is not None:
            dq0 = None
        gk, gv, front = g[1].to(k.dtype), g[2].to(v.dtype), kind == "kv_front"
        del g, gq
        if step == 1:  # the kernel's own (front-shaped or full) output starts the buffer
            bk, bv = gk.contiguous(), gv.contiguous()
        else:
            rk, rv = dkv_comm.wait()
            bk, bv = _join(plan, rk, recv_front, gk, front), _join(plan, rv, recv_front, gv, front)
            front = front and recv_front
        del gk, gv
        # the previous rank's buffer for the next step (or, after the last step, our own dK/dV) has its shape
        recv_front = plan.sends_front(step, (rank - 1) % size)
        shape = plan.front_shape(kc) if recv_front else (plan.recv_shape(rank - 1 - step, kc) or kc.shape)
        assert front == plan.sends_front(step, rank)  # what the next rank expects from us
        dkv_comm.send_recv([bk, bv], recv_shapes=[shape, shape])  # after the last step: to the owner
        del bk, bv
    del kc, vc  # the received K/V are not needed by the second diagonal piece
    for part in parts[1:]:
        dq1 = diagonal(part)
        if dq is None:  # CP2 q_back rank: one concatenation builds dQ, then the back rows are added
            dq = _cat_parts(parts, [dq0, dq1])
            dq0 = None
            plan.add_q_back(dq, kept)
            kept = None
        else:
            piece(dq, part).add_(dq1)
        del dq1
    dk = _cat_parts(parts, dks)
    dks.clear()  # before the second cat: one k-sized pair of copies alive at a time
    dv = _cat_parts(parts, dvs)
    dvs.clear()
    rk, rv = dkv_comm.wait()
    if recv_front:
        plan.add_kv_front(dk, rk)
        plan.add_kv_front(dv, rv)
    else:
        dk.add_(rk)
        dv.add_(rv)
    return dq, plan.expand_kv(dk, k_full), plan.expand_kv(dv, v_full)


def _add_remote(plan: RingPlan, dq: torch.Tensor, gq: torch.Tensor, kind: str) -> None:
    """Add a remote step's dQ: the back rows for ``q_back``, all rows otherwise."""
    if kind == "q_back":
        plan.add_q_back(dq, gq)
    else:
        dq.add_(gq)


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
    :class:`~cpscope.attention.comm.RingComm`) and the kernels read their strides."""
    return t if is_dense(t) else t.contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group: Any
    ) -> torch.Tensor:
        k, v = _dense(k.detach()), _dense(v.detach())  # send buffers (no copy for dense views)
        out, lse = _forward(q.detach(), k, v, plan, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group = plan, group  # the scope resolved in forward; backward never reads the ContextVar
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(_dense(dout), q.detach(), k, v, out, lse, ctx.plan, ctx.group)
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
