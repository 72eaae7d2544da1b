"""``mamba2_scan``: Mamba2's selective scan (SSD) under the active CP scope (Nemotron-H, Bamba, Granite 4, Falcon-H1).

Per head ``h`` (group ``g = h // (H / G)``), with the state ``s [P, N]`` starting at zero at every document start::

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)        (softplus only when dt_softplus)
    s_t  = exp(dt_t A) s_{t−1} + dt_t x_t B_tᵀ                y_t = s_t C_t + D x_t

— transformers' Mamba2 / Bamba ``torch_forward`` and mamba_ssm's ``mamba_chunk_scan_combined`` (``z=None``; the
clamp is applied always, as transformers does).

The transition over a piece is a scalar per head, ``exp(Σ dt·A)``, so a piece's summary is that scalar and its final
state from zero; after the one all-gather (:mod:`cpscope.linear.summaries`) the incoming state ``s_in`` adds
``exp(Σ_{≤t} dt·A) s_in C_t`` to each output row.

Example::

    with cpscope.runtime_cp(groups[4]):
        y = cpscope.linear.mamba2_scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu)   # [1, T/4, H, P]
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..scope import UNSET, CPScope, resolve_scope
from . import _fla, summaries
from .pieces import Pieces, pieces_of_input, run_pieces
from .ssd_chunk import chunk_ssd

__all__ = ["mamba2_scan"]

_WHERE = "mamba2_scan"


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], dt_limit: Any, chunk_size: Any) -> None:
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or not t.is_floating_point()):
            raise ValueError(f"{_WHERE}: {name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if x.dim() != 4:
        raise ValueError(f"{_WHERE}: x must be [B, T, H, P], got shape {tuple(x.shape)}")
    Bt, T, H, P = x.shape
    if tuple(dt.shape) != (Bt, T, H):
        raise ValueError(f"{_WHERE}: dt must be [B, T, H] = {(Bt, T, H)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (H,):
        raise ValueError(f"{_WHERE}: A must be [H] = {(H,)}, got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (Bt, T) or B.shape != C.shape or B.shape[2] == 0 or H % B.shape[2]:
        raise ValueError(
            f"{_WHERE}: B and C must both be [B={Bt}, T={T}, G, N] with the heads H={H} divisible by the groups G, "
            f"got B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        raise ValueError(f"{_WHERE}: D must be [H] = {(H,)} or [H, P] = {(H, P)}, got {tuple(D.shape)}")
    if dt_bias is not None and tuple(dt_bias.shape) != (H,):
        raise ValueError(f"{_WHERE}: dt_bias must be [H] = {(H,)}, got {tuple(dt_bias.shape)}")
    ok = isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in dt_limit)
    if not ok or dt_limit[0] > dt_limit[1]:
        raise ValueError(f"{_WHERE}: dt_limit must be a pair (low, high) of numbers with low <= high, got {dt_limit!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{_WHERE}: chunk_size must be a positive int or None, got {chunk_size!r}")


def mamba2_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
    D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")), chunk_size: Optional[int] = None,
    cu_seqlens: Optional[Any] = None, group: Any = UNSET,
) -> torch.Tensor:
    """Mamba2's scan over this rank's local zigzag shard, equal to the matching rows of the full scan.

    Args:
        x: ``[B, T, H, P]`` local inputs (this rank's zigzag shard: ``T`` = global length / cp).
        dt: ``[B, T, H]`` time steps before ``dt_bias`` / softplus.
        A: ``[H]`` (negative: ``-exp(A_log)``).
        B, C: ``[B, T, G, N]``; ``G`` groups, ``H`` divisible by ``G`` (head ``h`` uses group ``h // (H / G)``).
        D: ``[H]`` or ``[H, P]`` skip connection, or ``None``.
        dt_bias: ``[H]`` added to ``dt`` first, or ``None``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: ``(low, high)``: ``dt`` is clamped to it (after softplus).
        chunk_size: the torch path's chunk length (default 64); does not change the result beyond rounding.
        cu_seqlens: **global** document offsets (int32) of a packed row (``B == 1``); each document starts from a
            zero state. ``None``: each row is one sequence.
        group: the CP group (``None`` = CP1); default the active scope (read once, in forward).

    Returns:
        ``y [B, T, H, P]`` in ``x``'s dtype; computed in fp32 (fp64 for fp64 inputs), summaries in that precision.
        Differentiable in ``x, dt, A, B, C, D, dt_bias``.

    Raises:
        ValueError: mismatched shapes, a bad ``dt_limit``, a local length that does not match ``cu_seqlens`` and the
            CP size, a document length not divisible by ``2·cp`` — before any collective runs.

    Example::

        y = mamba2_scan(x, dt, -torch.exp(A_log), B, C, D=D, dt_bias=dt_bias, group=groups[2])
    """
    _check(x, dt, A, B, C, D, dt_bias, dt_limit, chunk_size)
    scope = resolve_scope(group)
    Bt, T, H, P = x.shape
    pieces = pieces_of_input(Bt, T, cu_seqlens, scope, where=_WHERE, name="x")
    dtype = torch.float64 if torch.float64 in (x.dtype, dt.dtype, A.dtype, B.dtype, C.dtype) else torch.float32
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))
    rep = H // B.shape[2]
    flat = lambda t: t.reshape(Bt * T, *t.shape[2:])  # noqa: E731
    xf = flat(x).to(dtype)
    a = flat(dt) * A.to(dtype)  # [tokens, H]
    xdt = xf * flat(dt)[..., None]
    Bf, Cf = (flat(t).to(dtype).repeat_interleave(rep, dim=1, output_size=H) for t in (B, C))
    if _fla.usable(x, pieces.lens):
        y = _run_fla(xdt.to(x.dtype), a, Bf.to(x.dtype), Cf.to(x.dtype), pieces, scope)
    else:
        y = _run_torch(xdt, a, Bf, Cf, pieces, scope, chunk_size)
    if D is not None:
        y = y + xf * (D.to(dtype)[:, None] if D.dim() == 1 else D.to(dtype))
    return y.reshape(Bt, T, H, P).to(x.dtype)


def _local_torch(x: torch.Tensor, a: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *, s0: Any,
                 chunk_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_ssd` on ``[n, L, ..]`` runs; the cumulative log-decay rides along as a last output column."""
    y, h, cum = chunk_ssd(x, a, B, C, chunk_size)
    return torch.cat([y, cum[..., None]], -1), h


def _with_incoming(y: torch.Tensor, cum: torch.Tensor, b: torch.Tensor, C: torch.Tensor, pieces: Pieces,
                   scope: CPScope) -> torch.Tensor:
    """Exchange the summaries ``(exp(total log-decay), b)`` and add each piece's read of its incoming state."""
    if pieces.cp == 1:
        return y
    lens = torch.tensor(pieces.lens, device=y.device)
    last = torch.cumsum(lens, 0) - 1  # the last row of each piece (pieces are never empty here: 2·cp | length)
    A_piece = cum.index_select(0, last.clamp(min=0)).exp() * (lens > 0)[:, None]  # [pieces, H]
    A_piece = A_piece + (lens == 0)[:, None].to(A_piece.dtype)  # an empty piece is the identity
    s_in = summaries.incoming_states(A_piece, b, pieces, scope)  # [pieces, H, P, N]
    s_tok = s_in.repeat_interleave(lens, dim=0, output_size=y.shape[0])  # [tokens, H, P, N]
    return y + torch.einsum("thn,thpn->thp", C, s_tok) * cum.exp()[..., None]


def _run_torch(xdt: torch.Tensor, a: torch.Tensor, B: torch.Tensor, C: torch.Tensor, pieces: Pieces,
               scope: CPScope, chunk_size: Optional[int]) -> torch.Tensor:
    fn = lambda *runs, s0: _local_torch(*runs, s0=s0, chunk_size=chunk_size)  # noqa: E731
    out, b = run_pieces(pieces, fn, [xdt, a, B, C])
    return _with_incoming(out[..., :-1], out[..., -1], b, C, pieces, scope)


def _cumsum_local(a: torch.Tensor, *, s0: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return a.cumsum(1), a.new_zeros(a.shape[0])


def _run_fla(xdt: torch.Tensor, a: torch.Tensor, B: torch.Tensor, C: torch.Tensor, pieces: Pieces,
             scope: CPScope) -> torch.Tensor:
    cu = pieces.local_cu(xdt.device)
    y, ht = _fla.simple_gla(C, B, xdt, a, cu, final=pieces.cp > 1)
    if pieces.cp == 1:
        return y.to(a.dtype)
    cum = run_pieces(pieces, _cumsum_local, [a])[0]  # [tokens, H]
    return _with_incoming(y.to(a.dtype), cum, ht.transpose(-1, -2).to(a.dtype), C.to(a.dtype), pieces, scope)
