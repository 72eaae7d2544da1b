"""What a windowed call derives from a pack: the blocks a window leaves, and the K/V rows each rank needs from whom.

With ``window=(left, right)`` the query at position ``i`` of a document sees keys ``i - left .. i + right``
(``causal``: up to ``i``). In the zigzag layout rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of every document (``c``
tokens each); a window shorter than a chunk leaves it needing only the last ``left`` keys of the chunk before each of
its chunks (the *halo*: from rank ``r - 1`` for chunk ``r``, from rank ``r + 1`` for chunk ``2cp-1-r``; nothing
before chunk 0; with ``right > 0``, non-causal, the first ``right`` keys of the chunk after each). Everything else
the ring would compute is masked out and is neither computed nor sent.

The plan is derived per document from the interval arithmetic of the band, without per-token loops: for each
query chunk ``x`` of a rank and each key chunk ``y`` of the document it keeps the keys some query of ``x`` sees,
then the queries that see one of those keys — a *piece*, ``nq`` contiguous queries against ``nk`` contiguous keys
whose mask is the block kernel's aligned window ``(left + D, right - D)`` with ``D`` the distance between the ends
of the two ranges (a side that reaches past the piece becomes ``-1``). Real lengths cap both ranges, so padding
is never computed or sent; documents shorter than the window simply keep whole chunks. Pieces with the same
source rank, chunk halves and window form one varlen block (:class:`HaloBlock`, one kernel call). A source's
needed rows — the union of its pieces' key ranges — travel compacted, in order (:attr:`HaloGeometry.sends`,
:attr:`HaloGeometry.recv_rows`).

:class:`HaloGeometry` is built once per (pack, device, window, causal) and cached on the pack; :class:`HaloPlan`
adds one call's scale and softcap. Its counters (:meth:`HaloGeometry.counters`) say what one pass sends and
computes on this rank.

Example::

    plan = halo_plan_for(pack, q.device, causal=True, scale=d ** -0.5, mods=Mods(window=Band(255, 0)))
    plan.geo.counters()          # {'rows_sent': ..., 'rows_received': ..., 'blocks': ..., 'pieces': ..., ...}
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from .._pack import Pack
from ._kernels import Varlen, Window
from ._mods import Band, Mods
from ._merge import rows_add_

__all__ = ["effective_window", "Rows", "HaloBlock", "HaloGeometry", "HaloPlan", "halo_plan_for"]

_INF = 1 << 60  # an unbounded side in the interval arithmetic


def effective_window(window: Window, causal: bool, longest: int) -> Window:
    """The window as it restricts documents of at most ``longest`` tokens: a side reaching past every document is
    unbounded (``-1``), the right side is 0 under ``causal``; ``None`` when nothing is left to restrict.

    Example::

        effective_window((4096, 0), True, 2048)    # None: every document is shorter than the window
        effective_window((255, 7), True, 8192)     # (255, 0)
    """
    return Band.effective(window, causal, longest)


class Rows(NamedTuple):
    """Rows along dim 0 (``[t, ...]`` tensors; lse ``[h, t]`` along its last dim): the contiguous range ``start ..
    start + length - 1``, or the listed ``index`` (distinct, ascending) when it is not ``None``."""

    start: int
    length: int
    index: Optional[torch.Tensor]

    @staticmethod
    def of(starts: torch.Tensor, lens: torch.Tensor, device: torch.device) -> "Rows":
        """The rows of the ranges ``[starts[i], starts[i] + lens[i])`` (ascending, disjoint), concatenated."""
        n = int(lens.sum())
        if starts.numel() == 1 or bool((starts[1:] == starts[:-1] + lens[:-1]).all()):
            return Rows(int(starts[0]), n, None)
        cum = torch.cumsum(lens, 0) - lens
        idx = torch.repeat_interleave(starts - cum, lens, output_size=n) + torch.arange(n)
        return Rows(int(starts[0]), n, idx.to(device))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(0, self.start, self.length) if self.index is None else x.index_select(0, self.index)

    def take_lse(self, lse: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return lse.narrow(-1, self.start, self.length)
        return lse.index_select(-1, self.index)

    def spec(self) -> Union[tuple[int, int], torch.Tensor]:
        """The rows as :func:`~cpscope.attention._merge.merge_rows_` takes them."""
        return (self.start, self.length) if self.index is None else self.index

    def add_(self, acc: torch.Tensor, val: torch.Tensor) -> None:
        if self.index is None:
            acc.narrow(0, self.start, self.length).add_(val)
        else:
            rows_add_(acc, self.index, val)


@dataclass(frozen=True, eq=False)
class HaloBlock:
    """One kernel call: this rank's ``q`` rows against rows of source ``src``'s K/V, as one varlen block.

    ``k``: rows of the source's buffer as it arrives (the compacted halo; the local K/V for ``src == rank``);
    ``k_local``: the same keys as rows of the source's local K/V. ``causal`` / ``window``: the block kernel's mask.
    ``pieces``: (document, query chunk, key chunk) pairs inside; ``area``: its rectangles' (query, key) pairs (what a
    kernel without masked-tile skipping computes); ``pairs``: the unmasked ones among them.
    """

    src: int
    q: Rows
    k: Rows
    k_local: Rows
    varlen: Varlen
    causal: bool
    window: Window
    pieces: int
    area: int
    shapes: tuple[torch.Tensor, torch.Tensor]  # the pieces' nq, nk (host)

    @property
    def pairs(self) -> int:
        """The unmasked (query, key) pairs of the block (computed when asked: counters, not the hot path)."""
        lw, rw = self.window if self.window is not None else (-1, -1)
        return _visible_pairs(*self.shapes, lw, 0 if self.causal else rw)


def _visible_pairs(nq: torch.Tensor, nk: torch.Tensor, lw: int, rw: int) -> int:
    """Unmasked (query, key) pairs of pieces ``nq x nk`` under the aligned window ``(lw, rw)`` (-1: unbounded)."""
    rows = torch.repeat_interleave(torch.arange(nq.numel()), nq)
    i = torch.arange(rows.numel()) - (torch.cumsum(nq, 0) - nq)[rows]
    diag, n = i + (nk - nq)[rows], nk[rows]
    lo = torch.zeros_like(n) if lw == -1 else (diag - lw).clamp(min=0)
    hi = n if rw == -1 else torch.minimum(diag + rw + 1, n)
    return int((hi - lo).clamp(min=0).sum())


class _Docs:
    """Per-document arrays of a pack (int64, host): layout / real lengths, chunk length, local offset."""

    def __init__(self, pack: Pack) -> None:
        cu = torch.tensor(pack.cu, dtype=torch.long)
        self.n = cu[1:] - cu[:-1]
        self.m = torch.tensor(pack.real_lens, dtype=torch.long)
        self.c = self.n // (2 * pack.cp)
        self.off = cu[:-1] // pack.cp
        self.local = pack.total // pack.cp


def _pieces(d: _Docs, cp: int, t: int, x_back: bool, y: int, left: int, right: int) -> dict[str, torch.Tensor]:
    """Rank ``t``'s pieces of query chunk ``x`` (its front or back chunk) against key chunk ``y``, per document;
    only documents where the piece is not empty. Keys: local rows of ``y``'s owner."""
    x = 2 * cp - 1 - t if x_back else t
    q_lo, k_lo = x * d.c, y * d.c
    q_hi, k_hi = torch.minimum(q_lo + d.c, d.m), torch.minimum(k_lo + d.c, d.m)  # real tokens only
    k0, k1 = torch.maximum(k_lo, q_lo - left), torch.minimum(k_hi, q_hi + right)  # keys some query sees
    q0, q1 = torch.maximum(q_lo, k0 - right), torch.minimum(q_hi, k1 + left)  # queries seeing one of them
    keep = (k1 > k0) & (q1 > q0)
    q0, q1, k0, k1, q_lo, k_lo, c, off = (a[keep] for a in (q0, q1, k0, k1, q_lo, k_lo, d.c, d.off))
    nq, nk, ends = q1 - q0, k1 - k0, k1 - q1
    lw = torch.full_like(nq, -1) if left >= _INF else left + ends
    rw = torch.full_like(nq, -1) if right >= _INF else right - ends
    lw, rw = torch.where(lw >= nk - 1, -1, lw), torch.where(rw >= nq - 1, -1, rw)
    return {"q": off + (c if x_back else 0) + q0 - q_lo, "k": off + (c if y >= cp else 0) + k0 - k_lo,
            "nq": nq, "nk": nk, "lw": lw, "rw": rw}


def _owner(y: int, cp: int) -> int:
    return y if y < cp else 2 * cp - 1 - y


def _needed(d: _Docs, cp: int, t: int, s: int, left: int, right: int) -> torch.Tensor:
    """``[local]`` bool over source ``s``'s local rows: the rows rank ``t``'s pieces read."""
    delta = torch.zeros(d.local + 1, dtype=torch.long)
    for x_back, y in itertools.product((False, True), (s, 2 * cp - 1 - s)):
        p = _pieces(d, cp, t, x_back, y, left, right)
        delta.index_add_(0, p["k"], torch.ones_like(p["k"]))
        delta.index_add_(0, p["k"] + p["nk"], -torch.ones_like(p["k"]))
    return torch.cumsum(delta, 0)[:-1] > 0


class HaloGeometry:
    """What a windowed call derives from one pack on one device, for this rank (built once, cached on the pack).

    Attributes:
        blocks: per source rank (this rank first), the :class:`HaloBlock` s this rank computes.
        sends: ``{dest: index}`` — local rows of K/V this rank sends to ``dest`` (ascending).
        recv_rows: ``{src: n}`` — rows this rank receives from ``src`` (compacted, in ``src``'s row order).
        pad_rows: local padding rows (``None`` without padding): no block covers them.

    Example::

        geo = pack.memo(("halo", device, (255, 0), True), lambda: HaloGeometry(pack, device, (255, 0), True))
    """

    def __init__(self, pack: Pack, device: torch.device, window: tuple[int, int], causal: bool) -> None:
        cp, r = pack.cp, pack.rank
        self.cp, self.rank, self.window, self.causal = cp, r, window, causal
        left = _INF if window[0] == -1 else window[0]
        right = 0 if causal else (_INF if window[1] == -1 else window[1])
        d = _Docs(pack)
        self.local = d.local
        # a bound on what any rank receives (each query chunk reads at most left + right rows beyond itself): when it
        # is within a rank's own rows, every round is posted at once (the same decision on every rank)
        reach = torch.minimum(torch.full_like(d.n, min(left, _INF) + min(right, _INF)) * 2, d.n - 2 * d.c)
        self.all_at_once = int(reach.sum()) <= d.local
        self.sends: dict[int, torch.Tensor] = {}
        self.recv_rows: dict[int, int] = {}
        compact: dict[int, torch.Tensor] = {}
        for s in range(cp):
            if s == r:
                continue
            mine = torch.nonzero(_needed(d, cp, s, r, left, right)).flatten()  # what s reads of my rows
            if mine.numel():
                self.sends[s] = mine.to(device)
            need = _needed(d, cp, r, s, left, right)
            if bool(need.any()):
                self.recv_rows[s] = int(need.sum())
                compact[s] = torch.cumsum(need.long(), 0) - 1  # buffer row of each needed row of s
        self.blocks: dict[int, list[HaloBlock]] = {}
        for y in [r, 2 * cp - 1 - r] + [y for y in range(2 * cp) if _owner(y, cp) != r]:  # local keys first
            for x_back in (False, True):
                p = _pieces(d, cp, r, x_back, y, left, right)
                self._add_blocks(p, _owner(y, cp), compact.get(_owner(y, cp)), device)
        self.pad_rows = pack.pad_rows(device)

    def _add_blocks(self, p: dict[str, torch.Tensor], src: int, compact: Optional[torch.Tensor],
                    device: torch.device) -> None:
        """Group one (query chunk, key chunk) pair's pieces by their window into blocks of source ``src``."""
        if p["nq"].numel() == 0:
            return
        pairs = torch.stack([p["lw"], p["rw"]], 1)
        for lw, rw in torch.unique(pairs, dim=0).tolist():
            sel = (pairs[:, 0] == lw) & (pairs[:, 1] == rw)
            qs, ks, nq, nk = (p[key][sel] for key in ("q", "k", "nq", "nk"))
            k_local = Rows.of(ks, nk, device)
            k = k_local if compact is None else Rows.of(compact[ks], nk, device)
            cu_q, cu_k = (0, *itertools.accumulate(nq.tolist())), (0, *itertools.accumulate(nk.tolist()))
            vl = Varlen(torch.tensor(cu_q, dtype=torch.int32, device=device),
                        torch.tensor(cu_k, dtype=torch.int32, device=device), int(nq.max()), int(nk.max()), cu_q, cu_k)
            causal = rw == 0
            window = None if lw == -1 and rw in (-1, 0) else (lw, 0 if causal else rw)
            self.blocks.setdefault(src, []).append(HaloBlock(src, Rows.of(qs, nq, device), k, k_local, vl, causal,
                                                             window, int(nq.numel()), int((nq * nk).sum()),
                                                             (nq, nk)))

    def rounds(self) -> list[tuple[int, Optional[int], Optional[int]]]:
        """``(distance, src, dest)`` of the exchange rounds this rank takes part in: at distance ``i`` it receives
        from ``rank - i`` and sends to ``rank + i`` (``None``: nothing that way)."""
        out = []
        for i in range(1, self.cp):
            src, dest = (self.rank - i) % self.cp, (self.rank + i) % self.cp
            src, dest = (src if src in self.recv_rows else None), (dest if dest in self.sends else None)
            if src is not None or dest is not None:
                out.append((i, src, dest))
        return out

    def counters(self) -> dict[str, int]:
        """What one pass sends and computes on this rank: K/V rows sent and received, kernel calls (``blocks``),
        (document, query chunk, key chunk) ``pieces``, the blocks' (query, key) rectangles (``area``) and the
        unmasked pairs in them (``pairs``)."""
        blocks = [b for bs in self.blocks.values() for b in bs]
        return {"rows_sent": sum(int(x.numel()) for x in self.sends.values()),
                "rows_received": sum(self.recv_rows.values()), "blocks": len(blocks),
                "pieces": sum(b.pieces for b in blocks), "area": sum(b.area for b in blocks),
                "pairs": sum(b.pairs for b in blocks)}


class HaloPlan:
    """One windowed call: the pack's :class:`HaloGeometry` plus the call's scale and features (``mods``: its
    ``softcap`` is what the block kernels read, its ``sinks`` what :func:`~cpscope.attention._halo.halo_attention`
    hands to the autograd Function; the window is the geometry's)."""

    def __init__(self, geo: HaloGeometry, *, scale: float, mods: Mods) -> None:
        self.geo, self.scale, self.mods, self.softcap = geo, scale, mods, mods.softcap
        self.rank, self.size, self.causal = geo.rank, geo.cp, geo.causal


def halo_plan_for(pack: Pack, device: torch.device, *, causal: bool, scale: float, mods: Mods) -> HaloPlan:
    """The windowed plan of a pack for a call's features (``mods.window`` as it restricts the pack's documents; its
    :class:`HaloGeometry` cached on the pack per device, window, causality)."""
    window = mods.window
    assert window is not None, "a halo plan needs a window"
    geo = pack.memo(("halo", device, window, causal), lambda: HaloGeometry(pack, device, window, causal))
    return HaloPlan(geo, scale=scale, mods=mods)
