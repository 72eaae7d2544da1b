"""The gated delta rule on one batch of equal-length runs, in torch: chunked (UT transform), differentiable.

Per head, with the state ``S [K, V]``, the log-decay ``g_t`` (a scalar, GDN, or a ``[K]`` vector, KDA),
``D_t = diag(exp g_t)`` and the query already scaled::

    S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ          o_t = S_tᵀ q_t

Inside a chunk of ``C`` tokens with cumulative log-decay ``G_t`` (``Γ_t = diag(exp G_t)``), the corrections
``u_t = β_t (v_t − S_{t−1}ᵀ D_t k_t)`` solve the unit lower-triangular system ``(I + M) u = β v − β (Γ k) S₀``
with ``M_ts = β_t k_tᵀ diag(exp(G_t − G_s)) k_s`` (``s < t``); then ``o_t = S₀ᵀ Γ_t q_t + Σ_{s≤t} (q_tᵀ
diag(exp(G_t − G_s)) k_s) u_s`` and ``S_C = Γ_C S₀ + Σ_s diag(exp(G_C − G_s)) k_s u_sᵀ``. Only differences
``G_t − G_s ≤ 0`` are exponentiated (no ``exp(−G)``), so long chunks with strong decay stay finite.

Example::

    o, s = chunk_delta_rule(q, k, v, g, beta, s0)      # q, k [N, H, L, K], v [N, H, L, V]; s0, s [N, H, K, V]
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["chunk_delta_rule", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dimension (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _pairwise(G: torch.Tensor, per_channel: bool, diagonal: int) -> torch.Tensor:
    """``exp(G_t − G_s)`` for ``s ≤ t − diagonal`` (0 elsewhere): ``[.., C, C]`` or ``[.., C, C, K]``."""
    C = G.shape[-2] if per_channel else G.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(-diagonal)
    if per_channel:
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [.., t, s, K]
        return diff.masked_fill(~keep[..., None], float("-inf")).exp()
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)  # [.., t, s]
    return diff.masked_fill(~keep, float("-inf")).exp()


def _weighted(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """``[.., t, s] = a_tᵀ diag(decay_ts) b_s``."""
    if per_channel:
        return torch.einsum("...tk,...sk,...tsk->...ts", a, b, decay)
    return (a @ b.transpose(-1, -2)) * decay


def chunk_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    s0: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the gated delta rule over ``N`` runs of ``L`` tokens each from the states ``s0``.

    Args:
        q, k: ``[N, H, L, K]`` (``q`` already scaled, both already normalised if wanted); v: ``[N, H, L, V]``.
        g: the log-decay, ``[N, H, L]`` (scalar gate) or ``[N, H, L, K]`` (per-channel gate).
        beta: ``[N, H, L]``.
        s0: ``[N, H, K, V]`` initial states, ``None`` for zeros.
        chunk_size: tokens per chunk (default 64 for a scalar gate, 16 for a per-channel one).

    All inputs share one floating dtype (the caller picks fp32 or fp64). Returns ``(o [N, H, L, V], s [N, H, K, V])``.
    """
    N, H, L, K = k.shape
    V = v.shape[-1]
    per_channel = g.dim() == 4
    C = chunk_size or (16 if per_channel else 64)
    state = s0 if s0 is not None else v.new_zeros(N, H, K, V)
    if L == 0:
        return v.new_zeros(N, H, 0, V), state
    pad = (-L) % C  # padded tokens: q = k = 0, beta = 0, g = 0 — the state passes them unchanged
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta = F.pad(beta, (0, pad))
        g = F.pad(g, (0, 0, 0, pad)) if per_channel else F.pad(g, (0, pad))
    n = (L + pad) // C
    q, k, v = (t.reshape(N, H, n, C, t.shape[-1]) for t in (q, k, v))
    beta = beta.reshape(N, H, n, C, 1)
    G = g.reshape(N, H, n, C, K).cumsum(-2) if per_channel else g.reshape(N, H, n, C).cumsum(-1)
    G_col = G if per_channel else G.unsqueeze(-1)  # broadcastable against [.., C, K]
    G_last = G_col[..., -1:, :]  # [.., 1, K] or [.., 1, 1]

    M = _weighted(beta * k, k, _pairwise(G, per_channel, 1), per_channel)
    P = _weighted(q, k, _pairwise(G, per_channel, 0), per_channel)
    T = M + torch.eye(C, dtype=M.dtype, device=M.device)
    w_v = torch.linalg.solve_triangular(T, beta * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(T, beta * k * G_col.exp(), upper=False, unitriangular=True)
    q_g = q * G_col.exp()
    k_end = k * (G_last - G_col).exp()
    decay_end = G_last.exp().transpose(-1, -2)  # [.., K, 1] or [.., 1, 1]: scales the rows of S

    outs = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ state  # [N, H, C, V]
        outs.append(q_g[:, :, i] @ state + P[:, :, i] @ u)
        state = decay_end[:, :, i] * state + k_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(N, H, n * C, V)[:, :, :L]
    return o, state
