"""``gated_delta_rule``: gated DeltaNet (Qwen3.5, Qwen3-Next) and Kimi Delta Attention under the active CP scope.

Per head, with the state ``S [K, V]`` starting at zero at every document start::

    S_t = (I − β_t k_t k_tᵀ) diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ          o_t = S_tᵀ (scale · q_t)

``g_t`` is a scalar per head (GDN) or a ``[K]`` vector (KDA's per-channel gate); ``q`` / ``k`` are L2-normalised
first when ``use_qk_l2norm=True``. The maths of flash-linear-attention's ``chunk_gated_delta_rule`` / ``chunk_kda``
and of transformers' ``torch_chunk_gated_delta_rule``.

Under CP each local piece is run once with the value columns widened by ``K`` identity columns: from the initial
state ``[0 | I]`` the run leaves ``[b | A]`` (its summary, :mod:`cpscope.linear.summaries`) and outputs
``[o⁰ | Aₜᵀ q]``; after the exchange the output from the true incoming state ``S_in`` is ``o⁰ + (Aₜᵀ q)ᵀ S_in``.
One pass over the tokens, one all-gather of the summaries.

Example::

    with cpscope.runtime_cp(groups[2]):
        q, k, v, g, beta = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v, g, beta))
        o = cpscope.linear.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)    # [B, T/cp, H, V]
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..scope import UNSET, CPScope, resolve_scope
from . import _fla, summaries
from .delta_chunk import chunk_delta_rule, l2norm
from .pieces import Pieces, pieces_of_input, run_pieces

__all__ = ["gated_delta_rule"]

_WHERE = "gated_delta_rule"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           scale: Optional[float]) -> float:
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{_WHERE}: {name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"{_WHERE}: q and k must both be [B, T, H, K], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
        raise ValueError(
            f"{_WHERE}: v must be [B={B}, T={T}, HV, V] with HV a multiple of the q/k heads H={H}, got "
            f"{tuple(v.shape)}"
        )
    HV = v.shape[2]
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"{_WHERE}: beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if tuple(g.shape) not in ((B, T, HV), (B, T, HV, K)):
        raise ValueError(
            f"{_WHERE}: g must be [B, T, HV] = {(B, T, HV)} (one gate per head) or [B, T, HV, K] = {(B, T, HV, K)} "
            f"(per-channel gate), got {tuple(g.shape)}"
        )
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{_WHERE}: scale must be a finite number > 0, got {scale!r}")
    return float(scale)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, cu_seqlens: Optional[Any] = None, group: Any = UNSET,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """The gated delta rule over this rank's local zigzag shard, equal to the matching rows of the full recurrence.

    Args:
        q, k: ``[B, T, H, K]`` local queries and keys (this rank's zigzag shard: ``T`` = global length / cp).
        v: ``[B, T, HV, V]``; ``HV`` a multiple of ``H`` (each q/k head serves ``HV / H`` consecutive value heads).
        g: the log-decay (``≤ 0``): ``[B, T, HV]`` (GDN: one gate per head) or ``[B, T, HV, K]`` (KDA: per channel).
        beta: ``[B, T, HV]``, the delta rule's write strength.
        scale: the query scale, default ``K ** -0.5``.
        cu_seqlens: **global** document offsets (int32, as everywhere in cpscope) of a packed row (``B == 1``);
            each document starts from a zero state. ``None``: each of the ``B`` rows is one sequence.
        group: the CP group (``None`` = CP1); default the active scope (read once, in forward).
        use_qk_l2norm: L2-normalise ``q`` and ``k`` over ``K`` first (eps 1e-6, in fp32), as the models do.

    Returns:
        ``o [B, T, HV, V]`` in ``v``'s dtype. Computed in fp32 (fp64 for fp64 inputs); the chunk summaries are
        exchanged in that precision. Differentiable in ``q, k, v, g, beta``.

    Raises:
        ValueError: mismatched shapes, a bad ``scale``, a local length that does not match ``cu_seqlens`` and the CP
            size, a document length not divisible by ``2·cp`` — before any collective runs.

    Example::

        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, group=groups[4])
    """
    scale = _check(q, k, v, g, beta, scale)
    scope = resolve_scope(group)
    B, T, H, K = q.shape
    pieces = pieces_of_input(B, T, cu_seqlens, scope, where=_WHERE, name="q")
    HV, V = v.shape[2], v.shape[3]
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    if _fla.usable(q, pieces.lens):
        o = _run_fla(flat, pieces, scope, scale, use_qk_l2norm)
    else:
        o = _run_torch(flat, pieces, scope, scale, use_qk_l2norm)
    return o.reshape(B, T, HV, V).to(v.dtype)


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _local_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                 s0: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_delta_rule` on ``[n, L, H, ..]`` runs (tokens first in, tokens first out)."""
    t = [x.movedim(1, 2) for x in (q, k, v, g, beta)]  # [n, H, L, ..]
    o, s = chunk_delta_rule(*t, s0=s0)
    return o.movedim(2, 1), s


def _augment(v: torch.Tensor, K: int, n_pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[v | 0]`` with ``K`` more value columns and the initial states ``[0 | I]`` (``[pieces, H, K, V + K]``)."""
    H, V = v.shape[1], v.shape[2]
    v_aug = torch.cat([v, v.new_zeros(v.shape[0], H, K)], -1)
    eye = torch.eye(K, dtype=v.dtype, device=v.device).expand(n_pieces, H, K, K)
    s0 = torch.cat([v.new_zeros(n_pieces, H, K, V), eye], -1)
    return v_aug, s0


def _finish(o_aug: torch.Tensor, final: torch.Tensor, pieces: Pieces, scope: CPScope, V: int) -> torch.Tensor:
    """From the widened run's outputs and final states: exchange the summaries, add each piece's incoming part."""
    b, A = final[..., :V], final[..., V:]  # [pieces, H, K, V], [pieces, H, K, K]
    s_in = summaries.incoming_states(A, b, pieces, scope)  # [pieces, H, K, V]
    lens = torch.tensor(pieces.lens, device=o_aug.device)
    s_tok = s_in.repeat_interleave(lens, dim=0, output_size=o_aug.shape[0])  # [tokens, H, K, V]
    qa = o_aug[..., V:].to(s_tok.dtype)  # [tokens, H, K]: (A_t^T q_t)
    return o_aug[..., :V].to(s_tok.dtype) + (qa.unsqueeze(-2) @ s_tok).squeeze(-2)


def _prepare(flat: list[torch.Tensor], dtype: torch.dtype, scale: float, l2: bool) -> list[torch.Tensor]:
    q, k, v, g, beta = (t.to(dtype) for t in flat)
    if v.shape[1] != q.shape[1]:  # grouped values: each q/k head serves HV / H consecutive value heads
        q, k = (t.repeat_interleave(v.shape[1] // q.shape[1], dim=1) for t in (q, k))
    if l2:
        q, k = l2norm(q), l2norm(k)
    return [q * scale, k, v, g, beta]


def _run_torch(flat: list[torch.Tensor], pieces: Pieces, scope: CPScope, scale: float, l2: bool) -> torch.Tensor:
    q, k, v, g, beta = _prepare(flat, _compute_dtype(*flat), scale, l2)
    if pieces.cp == 1:
        return run_pieces(pieces, _local_torch, [q, k, v, g, beta])[0]
    K, V = k.shape[-1], v.shape[-1]
    v_aug, s0 = _augment(v, K, len(pieces.lens))
    o_aug, final = run_pieces(pieces, _local_torch, [q, k, v_aug, g, beta], s0)
    return _finish(o_aug, final, pieces, scope, V)


def _run_fla(flat: list[torch.Tensor], pieces: Pieces, scope: CPScope, scale: float, l2: bool) -> torch.Tensor:
    q, k, v, g, beta = flat
    cu = pieces.local_cu(q.device)
    if pieces.cp == 1:
        return _fla.delta_rule(q, k, v, g, beta, scale, cu, None, l2)[0]
    K, V = k.shape[-1], v.shape[-1]
    v_aug, s0 = _augment(v, K, len(pieces.lens))
    o_aug, final = _fla.delta_rule(q, k, v_aug, g, beta, scale, cu, s0.float(), l2)
    return _finish(o_aug, final.float(), pieces, scope, V)
