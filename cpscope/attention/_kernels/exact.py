"""The exact block math: tiled scores in fp32 (fp64 for fp64 inputs), on any device — the CPU kernel and the last
route of every kind of CUDA block (:mod:`.router`).

Every mask a block has (documents, causal, a window, all relative to each sequence's bottom-right-aligned diagonal)
gives each query row one contiguous interval of visible keys, ``lo[i] <= j < hi[i]`` in packed key indices,
nondecreasing in ``i``. The kernels therefore compute scores only over tiles of query rows against the key range
their rows can see: a banded (windowed) block costs O(rows x window), not O(rows x keys), and no tile exceeds
``TILE_BUDGET`` score elements. Layouts and the mask convention are :func:`cpscope.attention._kernels.block_forward`'s.

Example::

    out, lse = forward(q, k, v, 0.125, True, None, window=(255, 0))          # dense [b, s, h, d]
    dq, dk, dv = backward(dout, q, k, v, out, lse, 0.125, True, None, window=(255, 0))
"""
from __future__ import annotations

from typing import Optional

import torch

from .block import Varlen, Window, acc_dtype

__all__ = ["forward", "backward", "key_bounds", "TILE_BUDGET"]

TILE_BUDGET = 1 << 22  # score elements ([batch, heads, rows, keys]) of one CPU tile


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    g = heads // x.shape[-2]
    return x if g == 1 else x.repeat_interleave(g, dim=-2)


def _reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    h = dx.shape[-2]
    if h == kv_heads:
        return dx
    return dx.unflatten(-2, (kv_heads, h // kv_heads)).sum(-2)


def key_bounds(t_q: int, t_k: int, causal: bool, vl: Optional[Varlen], window: Window,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``, ``[t_q]`` int64: query row ``i`` sees keys ``lo[i] <= j < hi[i]`` (packed key indices).

    Query ``i`` of a sequence of ``n_q`` queries sees key ``j`` of its ``n_k`` keys iff
    ``-left <= j - (i + n_k - n_q) <= right`` (``-1``: unbounded; ``right`` is 0 when causal).
    """
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if vl is None:
        i = torch.arange(t_q, device=device)
        start, n_k = torch.zeros_like(i), torch.full_like(i, t_k)
        diag = i + (t_k - t_q)  # the key on each query's aligned diagonal
    else:
        cu_q, cu_k = vl.cu_q.to(device=device, dtype=torch.long), vl.cu_k.to(device=device, dtype=torch.long)
        lq = cu_q[1:] - cu_q[:-1]
        seq = torch.repeat_interleave(torch.arange(lq.numel(), device=device), lq, output_size=t_q)
        n_k = (cu_k[1:] - cu_k[:-1])[seq]
        start = cu_k[:-1][seq]
        diag = torch.arange(t_q, device=device) - cu_q[:-1][seq] + n_k - lq[seq]
    zero = torch.zeros_like(n_k)
    lo = zero if left == -1 else torch.minimum(torch.maximum(diag - left, zero), n_k)
    hi = n_k if right == -1 else torch.minimum(torch.maximum(diag + right + 1, zero), n_k)
    return start + lo, start + hi


def _tiles(lo: torch.Tensor, hi: torch.Tensor, per_pair: int) -> list[tuple[int, int, int, int]]:
    """``(i0, i1, k0, k1)``: query rows ``[i0, i1)`` against keys ``[k0, k1)``, at most ``TILE_BUDGET`` score
    elements each (``per_pair`` elements per (row, key) pair: batch x heads), at least one row each.

    A tile's key range stays within twice its first row's span (at least 128 keys), so the pairs computed stay
    within a small factor of the visible ones: O(rows x window) for a band."""
    lo_l, hi_l = lo.tolist(), hi.tolist()
    n, cap = len(lo_l), max(1, TILE_BUDGET // max(1, per_pair))
    tiles, i0 = [], 0
    while i0 < n:
        reach = max(2 * (hi_l[i0] - lo_l[i0]), 128)
        a, b = i0 + 1, n  # the largest i1 whose tile fits (bisection: both bounds grow with i1)
        while a < b:
            mid = (a + b + 1) // 2
            width = hi_l[mid - 1] - lo_l[i0]
            if (mid - i0) * width <= cap and width <= reach:
                a = mid
            else:
                b = mid - 1
        tiles.append((i0, a, lo_l[i0], max(lo_l[i0], hi_l[a - 1])))
        i0 = a
    return tiles


def _batched(x: torch.Tensor, vl: Optional[Varlen]) -> torch.Tensor:
    return x.unsqueeze(0) if vl is not None else x


class _Tile:
    """One tile's scores: ``s`` (masked, capped) ``[b, h, rows, keys]`` and the capped scores' ``tanh`` (softcap)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k0: int, scale: float,
                 softcap: Optional[float], dt: torch.dtype) -> None:
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(dt), k.to(dt)) * scale
        self.tanh = None
        if softcap is not None:
            self.tanh = torch.tanh(s / softcap)
            s = self.tanh * softcap
        j = torch.arange(k0, k0 + k.shape[1], device=q.device)
        self.mask = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])  # [rows, keys]
        self.s = s.masked_fill(~self.mask, float("-inf"))

    def probs(self, lse: torch.Tensor) -> torch.Tensor:  # lse [b, h, rows]; -inf rows (nothing visible) give 0
        return torch.exp(self.s - torch.where(lse == float("-inf"), 0.0, lse).unsqueeze(-1))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, vl: Optional[Varlen],
            window: Window = None, softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block by the tiled exact math (any device; fp32 scores, fp64 for fp64 inputs)."""
    dt, h = acc_dtype(q.dtype), q.shape[-2]
    qb, kb, vb = _batched(q, vl), _batched(k, vl), _batched(v, vl)
    b, t_q = qb.shape[0], qb.shape[1]
    lo, hi = key_bounds(t_q, kb.shape[1], causal, vl, window, q.device)
    out = torch.zeros((*qb.shape[:-1], vb.shape[-1]), dtype=dt, device=q.device)
    lse = torch.full((b, h, t_q), float("-inf"), dtype=dt, device=q.device)
    for i0, i1, k0, k1 in _tiles(lo, hi, b * h):
        if k1 == k0:
            continue  # every row of the tile sees nothing: out 0, lse -inf
        tile = _Tile(qb[:, i0:i1], _expand_kv(kb[:, k0:k1], h), lo[i0:i1], hi[i0:i1], k0, scale, softcap, dt)
        lt = torch.logsumexp(tile.s, dim=-1)  # [b, h, rows]
        out[:, i0:i1] = torch.einsum("bhqk,bkhd->bqhd", tile.probs(lt), _expand_kv(vb[:, k0:k1], h).to(dt))
        lse[:, :, i0:i1] = lt
    out = out.to(q.dtype)
    return (out[0], lse[0]) if vl is not None else (out, lse)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float, causal: bool, vl: Optional[Varlen], window: Window = None,
             softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the merged ``out`` / ``lse`` of its queries, by the tiled exact math."""
    dt, h, h_kv = acc_dtype(q.dtype), q.shape[-2], k.shape[-2]
    qb, kb, vb = _batched(q, vl), _batched(k, vl), _batched(v, vl)
    dob, ob = _batched(dout, vl).to(dt), _batched(out, vl).to(dt)
    lseb = (lse.unsqueeze(0) if vl is not None else lse).to(dt)  # [b, h, s_q]
    b, t_q = qb.shape[0], qb.shape[1]
    lo, hi = key_bounds(t_q, kb.shape[1], causal, vl, window, q.device)
    dq = torch.zeros(qb.shape, dtype=dt, device=q.device)
    dk, dv = torch.zeros(kb.shape, dtype=dt, device=q.device), torch.zeros(vb.shape, dtype=dt, device=q.device)
    delta = (dob * ob).sum(-1).transpose(1, 2)  # [b, h, q]
    for i0, i1, k0, k1 in _tiles(lo, hi, b * h):
        if k1 == k0:
            continue
        kt, vt = _expand_kv(kb[:, k0:k1], h).to(dt), _expand_kv(vb[:, k0:k1], h).to(dt)
        qt, dot = qb[:, i0:i1].to(dt), dob[:, i0:i1]
        tile = _Tile(qt, kt, lo[i0:i1], hi[i0:i1], k0, scale, softcap, dt)
        p = tile.probs(lseb[:, :, i0:i1])  # [b, h, q, k]
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", dot, vt) - delta[:, :, i0:i1].unsqueeze(-1))
        if tile.tanh is not None:  # d(softcap * tanh(s / softcap)) / ds = 1 - tanh^2
            ds = ds * (1 - tile.tanh * tile.tanh)
        dq[:, i0:i1] = torch.einsum("bhqk,bkhd->bqhd", ds, kt) * scale
        dk[:, k0:k1] += _reduce_kv(torch.einsum("bhqk,bqhd->bkhd", ds, qt) * scale, h_kv)
        dv[:, k0:k1] += _reduce_kv(torch.einsum("bhqk,bqhd->bkhd", p, dot), h_kv)
    if vl is not None:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
