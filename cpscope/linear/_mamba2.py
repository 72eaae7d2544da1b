"""``mamba2_scan``: Mamba2's selective scan (SSD) under the active CP scope (Nemotron-H, Bamba, Granite 4, Falcon-H1).

Per head ``h`` (group ``g = h // (H / G)``), with the state ``s [P, N]`` starting at zero at every document start::

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)        (softplus only when dt_softplus)
    s_t  = exp(dt_t A) s_{t−1} + dt_t x_t B_tᵀ                y_t = s_t C_t + D x_t

— transformers' Mamba2 / Bamba ``torch_forward`` and mamba_ssm's ``mamba_chunk_scan_combined`` (``z=None``; the
clamp is applied as transformers does; the default limits clamp nothing after a softplus and are skipped).

The transition over a piece is a scalar per head, ``exp(Σ dt·A)``, so a piece's summary is that scalar and its final
state from zero; after the one all-gather (:mod:`cpscope.linear._summaries`) the incoming state ``s_in`` adds
``exp(Σ_{≤t} dt·A) s_in C_t`` to each output row. The local scan is flash-linear-attention's ``chunk_simple_gla``
where it runs (fla 0.6.0 has no SSD kernel; SSD with a scalar decay per head is simple GLA), else cpscope's torch
chunk code (:mod:`cpscope.linear._kernels`). The phases — :func:`prepare`, :func:`local_scan`, :func:`piece_decays`,
(the exchange), :func:`read_states`, :func:`finish` — are public so that every rank can be run in one process.

Example::

    with cpscope.runtime_cp(groups[4]):
        y = cpscope.linear.mamba2_scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu)   # [1, T/4, H, P]
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..scope import UNSET, resolve_scope
from . import _kernels as kernels, _summaries as summaries
from ._pieces import Runs, run_pieces, runs_of_input

__all__ = ["mamba2_scan", "prepare", "local_scan", "piece_decays", "read_states", "finish"]

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
        ``y [B, T, H, P]`` in ``x``'s dtype. On CUDA with flash-linear-attention installed the scan runs on its
        ``chunk_simple_gla`` Triton kernel (SSD is simple GLA with ``q = C``, ``k = B``, ``v = dt·x``,
        ``g = dt·A``) in ``x``'s dtype; otherwise on the torch chunk code in fp32 (fp64 for fp64 inputs). ``dt``,
        the summaries and their exchange are fp32 (fp64). Differentiable in ``x, dt, A, B, C, D, dt_bias``.

    Raises:
        ValueError: mismatched shapes, a bad ``dt_limit``, a local length that does not match ``cu_seqlens`` and the
            CP size, a document length not divisible by ``2·cp`` — before any collective runs.

    Example::

        y = mamba2_scan(x, dt, -torch.exp(A_log), B, C, D=D, dt_bias=dt_bias, group=groups[2])
    """
    _check(x, dt, A, B, C, D, dt_bias, dt_limit, chunk_size)
    scope = resolve_scope(group)
    runs = runs_of_input(x.shape[0], x.shape[1], cu_seqlens, scope, x.device, where=_WHERE, name="x")
    kern = kernels.pick(x, runs, gated_backward=kernels.needs_grad(x, dt, A, B, C, D, dt_bias))
    a, xdt, Bh, Ch = prepare(kern, x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    y, b = local_scan(kern, runs, a, xdt, Bh, Ch, chunk_size)
    if runs.pieces.cp > 1:
        s_in = summaries.incoming_states(piece_decays(a, runs), b, runs.pieces, scope)  # the one collective
        y = y + read_states(a, Ch, s_in, runs)
    return finish(y, x, D)


def prepare(kern: kernels.Kernels, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            C: torch.Tensor, dt_bias: Optional[torch.Tensor], dt_softplus: bool, dt_limit: Any
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's inputs: ``a = dt·A [B, T, H]`` (fp32 / fp64), ``x·dt [B, T, H, P]`` and ``B``, ``C`` expanded to
    the heads ``[B, T, H, N]`` (in the model's dtype for the Triton kernels, fp32 / fp64 for the torch ones)."""
    sd = _state_dtype(x, dt, A, B, C)
    io = sd if kern.upcast else x.dtype
    dt = dt.to(sd)
    if dt_bias is not None:
        dt = dt + dt_bias.to(sd)
    if dt_softplus:
        dt = F.softplus(dt)
    low, high = float(dt_limit[0]), float(dt_limit[1])
    if not (dt_softplus and low <= 0.0 and high == math.inf):  # softplus is >= 0: the default limits clamp nothing
        dt = dt.clamp(min=low, max=high)
    a = dt * A.to(sd)
    xdt = (x.to(sd) * dt[..., None]).to(io)
    rep = x.shape[2] // B.shape[2]
    Bh, Ch = (t.to(io).repeat_interleave(rep, dim=2, output_size=x.shape[2]) for t in (B, C))  # groups -> heads
    return a, xdt, Bh, Ch


def local_scan(kern: kernels.Kernels, runs: Runs, a: torch.Tensor, xdt: torch.Tensor, Bh: torch.Tensor,
               Ch: torch.Tensor, chunk_size: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The scan of every local run from a zero state: ``(y [B, T, H, P], b [pieces, H, P, N] or None)`` (``b``, the
    runs' final states, only under CP), both fp32 / fp64."""
    sd = a.dtype
    y, final = kern.simple_gla(*(runs.shape(t) for t in (Ch, Bh, xdt, a)), scale=1.0, initial_state=None,
                               output_final_state=runs.pieces.cp > 1, cu_seqlens=runs.cu, cu_seqlens_cpu=runs.cu_cpu,
                               chunk_size=chunk_size)  # the kernel's default state layout: the direct call's speed
    return y.reshape(xdt.shape).to(sd), (None if final is None else final.transpose(-1, -2).to(sd))  # [.., P, N]


def _totals(a: torch.Tensor, *, s0: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return a[:, :, :0], a.sum(1)  # [n, H]: the log-decay over each run


def piece_decays(a: torch.Tensor, runs: Runs) -> torch.Tensor:
    """``[pieces, H]``: each local piece's transition ``exp(Σ dt·A)`` (its summary's ``A``)."""
    return run_pieces(runs.pieces, _totals, [a.reshape(-1, a.shape[-1])])[1].exp()


def _read_run(a: torch.Tensor, C: torch.Tensor, *, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(Σ_{≤t} a) · s_in C_t`` on ``[n, L, ..]`` runs from their incoming states ``s0 [n, H, P, N]``."""
    read = torch.einsum("nlhk,nhpk->nlhp", C.to(s0.dtype), s0)
    return read * a.cumsum(1).exp()[..., None], s0[:, :0]


def read_states(a: torch.Tensor, Ch: torch.Tensor, s_in: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Each token's read of its piece's incoming state ``s_in [pieces, H, P, N]``: ``[B, T, H, P]``."""
    flat = [a.reshape(-1, a.shape[-1]), Ch.reshape(-1, *Ch.shape[2:])]
    return run_pieces(runs.pieces, _read_run, flat, s_in)[0].reshape(*a.shape, s_in.shape[-2])


def finish(y: torch.Tensor, x: torch.Tensor, D: Optional[torch.Tensor]) -> torch.Tensor:
    """``y + D x`` in ``y``'s precision, returned in ``x``'s dtype."""
    if D is not None:
        y = y + x.to(y.dtype) * (D.to(y.dtype)[:, None] if D.dim() == 1 else D.to(y.dtype))
    return y.to(x.dtype)


def _state_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32
