"""What the zigzag ring derives from a pack: the block each step computes and the Q rows / K/V rows it needs.

Layout. Each of the ``cp`` ranks holds, per sequence (per document in ``thd``), chunk ``r`` (the *front* half of its
local tokens) and chunk ``2cp-1-r`` (the *back* half). K and V travel around the ring, one hop per step; at step
``i`` rank ``r`` holds the K/V of source ``s = (r - i) mod cp``. For causal attention:

* step 0 (``s == r``): local Q against local K/V with the ordinary causal mask — the local order of the two chunks
  is increasing in global position, so local causality is global causality (kind ``"diag"``);
* ``s < r``: both local chunks (``r`` and ``2cp-1-r``) come after chunk ``s`` and before chunk ``2cp-1-s``: all
  local Q against the **front** half of the received K/V, no mask (``"kv_front"``);
* ``s > r``: chunk ``r`` precedes both received chunks (sees nothing); chunk ``2cp-1-r`` follows both: the **back**
  half of local Q against all received K/V, no mask (``"q_back"``).

Without a causal mask every step is all Q against all K/V (``"full"``). Every rank does the same work per step: the
zigzag load balance.

Everything the ring needs to know about a step is here, in one place: :meth:`RingPlan.step` gives a
:class:`RingStep` (source rank, kind, varlen description) and the plan's row helpers cut the step's Q rows, lse rows
and K/V rows out of local tensors (:meth:`RingPlan.q_rows`, :meth:`RingPlan.kv_rows`, ...), what travels
(:meth:`RingPlan.send_kv`, :meth:`RingPlan.recv_shapes`, the backward's dK/dV buffers: :meth:`RingPlan.sends_front`)
and the backward's diagonal pieces (:class:`DiagPart`).

Internally ``bshd`` is the *dense* form ``[b, s, h, d]`` (halves are views along ``s``) and ``thd`` the *varlen*
form ``[t, h, d]`` (halves are index gathers, one per document, computed without per-token loops; views when the
pack holds one sequence). Per-pack facts are a :class:`RingGeometry`, built once per (pack, device) and cached on
the pack; a :class:`RingPlan` (one call) is cheap.

Example::

    plan = plan_for_pack(pack, q.device, causal=True, scale=d ** -0.5)
    st = plan.step(1)                       # RingStep(index=1, src=..., kind='kv_front', varlen=...)
    kk = plan.kv_rows(k_received, st)       # the K rows this step's block reads
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from .._pack import Pack, pack_for
from ._kernels import Placeholders, Varlen
from ._mods import Mods
from ._merge import rows_add_

__all__ = ["DiagPart", "RingGeometry", "RingPlan", "RingStep", "plan_for_pack"]

_ALL = slice(None)


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
        return x if heads == _ALL else x[..., heads, :]

    def take_q(self, x: torch.Tensor) -> torch.Tensor:
        """The piece of a q-like tensor (q, out, dout, dq); a view."""
        return self.take(x, self.hq)

    def take_kv(self, x: torch.Tensor) -> torch.Tensor:
        """The piece of a k-like tensor (k, v, dk, dv); a view."""
        return self.take(x, self.hk)

    def take_lse(self, lse: torch.Tensor) -> torch.Tensor:  # [b, h, s] / [h, t]
        if self.rows is not None:
            lse = lse[..., self.rows[0]:self.rows[1]]
        return lse if self.hq == _ALL else lse[..., self.hq, :]


def _doc_split(cu: tuple[int, ...], cp: int, device: torch.device) -> Optional[tuple[DiagPart, DiagPart]]:
    """The diagonal block cut between two documents: two token ranges balancing ``sum(len_i**2)`` (the causal work),
    the longer range first. None when fewer than two documents hold local tokens.

    Computed once per pack (:class:`RingGeometry`).
    """
    lens = [(b - a) // cp for a, b in zip(cu[:-1], cu[1:])]  # local tokens per document
    cu_loc = [0, *itertools.accumulate(lens)]
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
    indices, the per-kind :class:`~cpscope.attention._kernels.block.Varlen` descriptions, the backward's document split, and
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
                host = (0, *itertools.accumulate(n))
                cu_k = torch.tensor(host, dtype=torch.int32, device=device)
                self.full_from.append(Varlen(cu_loc, cu_k, m_loc, max(n, default=0), h_loc, host))
                self.rows_from.append(host[-1])


def _geometry(pack: Pack, device: torch.device) -> RingGeometry:
    """The pack's geometry on ``device``, built once per (pack, device) and cached on the pack."""
    return pack.memo(("ring", device), lambda: RingGeometry(pack, device))


def plan_for_pack(pack: Pack, device: torch.device, *, causal: bool, scale: float, mods: Mods = Mods()) -> RingPlan:
    """The varlen ring plan of a pack (its :class:`RingGeometry` cached on the pack, per device)."""
    return RingPlan(varlen=True, causal=causal, scale=scale, rank=pack.rank, size=pack.cp,
                    geometry=_geometry(pack, device), mods=mods)


class RingStep(NamedTuple):
    """One step of the ring on this rank: the K/V it holds and the block it computes.

    ``src``: the rank whose K/V this rank holds at step ``index``; ``kind``: ``"diag"``, ``"full"``, ``"kv_front"``
    or ``"q_back"`` (see the module docstring); ``varlen``: the block's packed-sequence description (``None`` for
    dense plans). ``causal`` (the block is causally masked: the local diagonal), ``q_back`` (only the back half of
    the local queries take part) and ``kv_front`` (only the front half of the held K/V) follow from ``kind``; they
    are fields, not properties, because the ring reads them on its hot path.
    """

    index: int
    src: int
    kind: str
    varlen: Optional[Varlen]
    causal: bool
    q_back: bool
    kv_front: bool


class RingPlan:
    """Static facts of one ring call: layout, causality, scale, and the per-step blocks and rows.

    Step kinds: ``"diag"`` (local block, causal), ``"full"`` (all Q vs all K/V, no mask), ``"kv_front"`` (all Q vs
    front half of K/V) and ``"q_back"`` (back half of Q vs all K/V). Varlen plans take their per-pack facts from a
    :class:`RingGeometry` (built from ``cu`` when none is given); the plan itself is cheap.

    ``mods``: the call's score features (:class:`~cpscope.attention._mods.Mods`, its window already as it restricts
    the call's sequences); :func:`~cpscope.attention._ring.ring_attention` hands its ``sinks`` to the autograd
    Function, ``window`` / ``softcap`` are what the block kernels read. The softcap applies to every block; a window
    only to a plan of one rank (whole sequences: the block's aligned window is the global one) — a windowed call
    across ranks runs :mod:`cpscope.attention._halo` instead.
    """

    def __init__(
        self, *, varlen: bool, causal: bool, scale: float, rank: int, size: int, cu: Optional[tuple[int, ...]] = None,
        local_len: int = 0, device: Optional[torch.device] = None, geometry: Optional[RingGeometry] = None,
        mods: Mods = Mods(),
    ) -> None:
        if mods.window is not None and size > 1:
            raise RuntimeError(f"a ring of {size} ranks with window={mods.window}: windowed calls run the halo "
                               "exchange")
        self.varlen, self.causal, self.scale, self.rank, self.size = varlen, causal, scale, rank, size
        self.mods = mods
        self.window, self.softcap = mods.window, mods.softcap  # the block kernels' inputs, read on the hot path
        self.placeholders = Placeholders()  # what this call's dense forwards hand to its backward (kept on ctx)
        # Halves are slices along `dim` (dense: dim 1; varlen holding ONE sequence: dim 0, zero-copy) or, for
        # several packed documents, index gathers/scatters (`dim` None).
        self.dim: Optional[int] = 1
        self.c = local_len // 2
        self.geo: Optional[RingGeometry] = None
        self.doc_parts: Optional[tuple[DiagPart, DiagPart]] = None
        self.pad_rows: Optional[torch.Tensor] = None
        self.compact = False  # K/V travel compacted to their real rows (padding, no causal mask)
        if varlen:
            if geometry is None:  # offsets given as values: the pack cache's bounded LRU keeps the geometry
                assert cu is not None and device is not None
                geometry = _geometry(pack_for(tuple(cu), size, rank), device)
            geo = self.geo = geometry
            self.dim, self.c, self.front, self.back = geo.dim, geo.c, geo.front, geo.back
            self.doc_parts = geo.doc_parts
            self.pad_rows = geo.pad_rows
            self.compact = geo.keep is not None and not causal
            if self.compact:
                self.doc_parts = None  # the diagonal's K rows are compacted: cut it by heads

    # ---- the steps ---------------------------------------------------------------------------------------------

    def kind(self, step: int) -> str:
        if not self.causal:
            return "full"
        if step == 0:
            return "diag"
        src = (self.rank - step) % self.size
        return "kv_front" if src < self.rank else "q_back"

    def step(self, index: int) -> RingStep:
        """What step ``index`` holds and computes on this rank."""
        src, kind = (self.rank - index) % self.size, self.kind(index)
        if not self.varlen:
            vl = None
        elif self.compact:  # compacted K/V: every source's own real rows
            vl = self.geo.full_from[src]
        else:
            vl = self.geo.vl[kind]
        return RingStep(index, src, kind, vl, kind == "diag", kind == "q_back", kind == "kv_front")

    def varlen_for(self, kind: str) -> Optional[Varlen]:
        """The varlen description of a block kind (unpadded plans; ``None`` for dense plans)."""
        return self.geo.vl[kind] if self.varlen else None

    def varlen_at(self, step: int) -> Optional[Varlen]:
        """The varlen description of the block at ``step`` (``None`` for dense plans)."""
        return self.step(step).varlen

    # ---- the rows of a step's block ----------------------------------------------------------------------------

    def block_rows(self, st: RingStep, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v rows step ``st``'s block reads (``k`` / ``v``: the held K/V); one call on the hot path."""
        if st.q_back:
            return self.q_back(q), k, v
        if st.kv_front:
            return q, self.kv_front(k), self.kv_front(v)
        return q, k, v

    def q_rows(self, x: torch.Tensor, st: RingStep) -> torch.Tensor:
        """The rows of a q-like tensor (q, out, dout) that step ``st``'s block reads."""
        return self.q_back(x) if st.q_back else x

    def lse_rows(self, lse: torch.Tensor, st: RingStep) -> torch.Tensor:
        return self.lse_back(lse) if st.q_back else lse

    def kv_rows(self, x: torch.Tensor, st: RingStep) -> torch.Tensor:
        """The rows of a held k-like tensor (k, v) that step ``st``'s block reads."""
        return self.kv_front(x) if st.kv_front else x

    def out_rows(self, st: RingStep) -> Union[None, tuple[int, int], torch.Tensor]:
        """The accumulator rows step ``st``'s block covers, for :func:`~cpscope.attention._merge.merge_rows_`."""
        return self.back_rows() if st.q_back else None

    def add_q_rows(self, acc: torch.Tensor, val: torch.Tensor, st: RingStep) -> None:
        """Add a step's dQ ``val`` into the q-like accumulator ``acc`` (the rows the step covers)."""
        if st.q_back:
            self.add_q_back(acc, val)
        else:
            acc.add_(val)

    # rows of q-like tensors ([b, s, h, d] dense / [t, h, d] varlen) and of lse ([b, h, s] / [h, t])
    def q_back(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.back) if self.dim is None else x.narrow(self.dim, self.c, self.c)

    def lse_back(self, lse: torch.Tensor) -> torch.Tensor:
        return lse.index_select(-1, self.back) if self.dim is None else lse.narrow(-1, self.c, self.c).contiguous()

    def kv_front(self, x: torch.Tensor) -> torch.Tensor:  # front half of one k-like tensor
        return x.index_select(0, self.front) if self.dim is None else x.narrow(self.dim, 0, self.c)

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

    # ---- what travels ------------------------------------------------------------------------------------------

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

    # ---- the backward's diagonal block -------------------------------------------------------------------------

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
