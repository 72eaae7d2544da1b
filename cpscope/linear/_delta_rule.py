"""``gated_delta_rule``: gated DeltaNet (Qwen3.5, Qwen3-Next) and Kimi Delta Attention under the active CP scope.

Per head, with the state ``S [K, V]`` starting at zero at every document start::

    S_t = (I − β_t k_t k_tᵀ) diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ          o_t = S_tᵀ (scale · q_t)

``g_t`` is a scalar per head (GDN) or a ``[K]`` vector (KDA's per-channel gate); ``q`` / ``k`` are L2-normalised
first when ``use_qk_l2norm=True``. The maths of flash-linear-attention's ``chunk_gated_delta_rule`` / ``chunk_kda``
and of transformers' ``torch_chunk_gated_delta_rule``.

Under CP each local piece is run once with the value columns widened by ``K`` identity columns: from the initial
state ``[0 | I]`` the run leaves ``[b | A]`` (its summary, :mod:`cpscope.linear._summaries`) and outputs
``[o⁰ | Aₜᵀ q]``; after the exchange the output from the true incoming state ``S_in`` is ``o⁰ + (Aₜᵀ q)ᵀ S_in``.
One pass over the tokens, one all-gather of the summaries. Under CP1 the kernel is called once, directly. The
kernel is flash-linear-attention's where it runs, else cpscope's torch chunk code (:mod:`cpscope.linear._kernels`);
:func:`summarise` and :func:`read_incoming` are the local phases before and after the exchange.

Example::

    with cpscope.runtime_cp(groups[2]):
        q, k, v, g, beta = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v, g, beta))
        o = cpscope.linear.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)    # [B, T/cp, H, V]
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..scope import UNSET, resolve_scope
from . import _kernels as kernels, _summaries as summaries
from ._pieces import Runs, run_pieces, runs_of_input

__all__ = ["gated_delta_rule", "summarise", "read_incoming"]

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
        ``o [B, T, HV, V]`` in ``v``'s dtype. On CUDA with flash-linear-attention installed, computed by its Triton
        kernels (``chunk_gated_delta_rule`` / ``chunk_kda``) in the inputs' dtype with fp32 states; otherwise by
        the torch chunk code in fp32 (fp64 for fp64 inputs). The chunk summaries are exchanged in fp32 (fp64).
        Differentiable in ``q, k, v, g, beta``.

    Raises:
        ValueError: mismatched shapes, a bad ``scale``, a local length that does not match ``cu_seqlens`` and the CP
            size, a document length not divisible by ``2·cp`` — before any collective runs.

    Example::

        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, group=groups[4])
    """
    scale = _check(q, k, v, g, beta, scale)
    scope = resolve_scope(group)
    B, T = q.shape[:2]
    runs = runs_of_input(B, T, cu_seqlens, scope, q.device, where=_WHERE, name="q")
    kern = kernels.pick(q, runs, gated_backward=g.dim() == 3 and kernels.needs_grad(q, k, v, g, beta))
    if runs.pieces.cp == 1:  # no exchange: straight to the kernel
        o, _ = kern.delta_rule(*(runs.shape(t) for t in (q, k, v, g, beta)), scale=scale, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm,
                               cu_seqlens=runs.cu, cu_seqlens_cpu=runs.cu_cpu)
        return o if o.shape == v.shape and o.dtype == v.dtype else o.reshape(v.shape).to(v.dtype)
    o_aug, A, b = summarise(kern, runs, q, k, v, g, beta, scale, use_qk_l2norm)
    s_in = summaries.incoming_states(A, b, runs.pieces, scope)  # [pieces, HV, K, V]: the one collective
    return read_incoming(o_aug, s_in, runs, v.shape[-1]).reshape(v.shape).to(v.dtype)


def state_dtype(*ts: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32: the precision of the summaries and of the exchange."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def summarise(kern: kernels.Kernels, runs: Runs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float, l2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel pass over the local runs with the values widened by ``K`` identity columns.

    From the initial states ``[0 | I]`` every run leaves ``[b | A]`` (its summary) and outputs ``[o⁰ | Aₜᵀ q]``.
    Returns ``(o_aug [tokens, HV, V + K], A [pieces, HV, K, K], b [pieces, HV, K, V])``, the summaries in fp32 (fp64
    for fp64 inputs). Local: no collective.
    """
    K, (HV, V) = k.shape[-1], v.shape[2:]
    sd = state_dtype(q, k, v, g, beta)
    n = len(runs.pieces.lens)
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], -1)  # [B, T, HV, V + K]
    eye = torch.eye(K, dtype=sd, device=v.device).expand(n, HV, K, K)
    s0 = torch.cat([torch.zeros(n, HV, K, V, dtype=sd, device=v.device), eye], -1)  # [pieces, HV, K, V + K]
    o_aug, final = kern.delta_rule(*(runs.shape(t) for t in (q, k, v_aug, g, beta)), scale=scale, initial_state=s0,
                                   output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=runs.cu,
                                   cu_seqlens_cpu=runs.cu_cpu)
    final = final.to(sd)
    return o_aug.flatten(0, 1), final[..., V:], final[..., :V]


def _read_run(qa: torch.Tensor, *, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.einsum("nlhk,nhkv->nlhv", qa, s0), s0[:, :0]


def read_incoming(o_aug: torch.Tensor, s_in: torch.Tensor, runs: Runs, V: int) -> torch.Tensor:
    """The outputs from the true incoming states: ``o⁰ + (Aₜᵀ q)ᵀ S_in`` per piece (``[tokens, HV, V]``, fp32 / fp64).

    Pieces of one length are read in one batched product (no per-token copy of a state)."""
    qa = o_aug[..., V:].to(s_in.dtype)  # [tokens, HV, K]
    return o_aug[..., :V].to(s_in.dtype) + run_pieces(runs.pieces, _read_run, [qa], s_in)[0]
