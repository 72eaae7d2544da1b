"""The local kernels of the recurrences, behind one interface: flash-linear-attention's chunk functions' own.

A recurrence under CP needs from its kernel exactly what flash-linear-attention's public chunk functions give: run
``[rows, L, ...]`` equal runs, or one varlen row of pieces (``cu_seqlens``), each from an initial state, and return
the outputs and each run's final state, differentiably in everything (the initial state included). So the interface
**is** theirs, keyword for keyword:

* ``delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
  cu_seqlens_cpu)`` — ``chunk_gated_delta_rule`` (``g [.., HV]``) or ``chunk_kda`` (``g [.., HV, K]``);
  states ``[N, HV, K, V]``;
* ``simple_gla(q, k, v, g, *, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
  chunk_size)`` — ``chunk_simple_gla``, which is Mamba2's SSD with ``q = C``, ``k = B``, ``v = dt·x``,
  ``g = dt·A`` (states ``[N, H, N, P]``; ``[N, H, P, N]``, Mamba2's layout, with ``state_v_first``).

Two implementations: :data:`FLA` (the Triton kernels, :mod:`cpscope.linear._fla`; CUDA, 16/32-bit floats) and
:data:`TORCH` (the chunked torch code of :mod:`~cpscope.linear._delta_chunk` / :mod:`~cpscope.linear._ssd_chunk`, in
fp32 — fp64 for fp64 inputs — on any device). :func:`pick` chooses per call; everything around the kernel (the
summaries, the exchange, the read of the incoming states) is the same code for both, so the CPU tests of the torch
kernels test the code that runs around the Triton ones.

Example::

    kern = pick(q, runs)                             # FLA on CUDA with fla installed, else TORCH
    o, final = kern.delta_rule(q, k, v, g, beta, scale=0.1, initial_state=s0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, cu_seqlens=runs.cu, cu_seqlens_cpu=runs.cu_cpu)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from . import _fla
from ._delta_chunk import chunk_delta_rule, l2norm
from ._pieces import Runs, pieces_for, run_pieces
from ._ssd_chunk import chunk_ssd

__all__ = ["Kernels", "FLA", "TORCH", "pick", "torch_delta_rule", "torch_simple_gla"]


class Kernels(NamedTuple):
    """One implementation of the interface. ``upcast``: whether it computes in fp32 whatever its inputs (then the
    caller may hand it fp32 intermediates); ``False`` for the Triton kernels, which take the model's dtype."""

    name: str
    delta_rule: Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]
    simple_gla: Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]
    upcast: bool


def _compute_dtype(*ts: Optional[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _segments(cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor]) -> Sequence[int]:
    src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    return [int(x) for x in src.tolist()]


def _by_runs(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: list[torch.Tensor],
             s0: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             cu_seqlens_cpu: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` on ``[rows, L, ...]`` runs (no offsets) or on the pieces of one varlen row, equal lengths batched."""
    if cu_seqlens is None:
        return fn(*inputs, s0=s0)
    if inputs[0].shape[0] != 1:
        raise ValueError(f"with cu_seqlens the inputs must be one packed row, got batch size {inputs[0].shape[0]}")
    segs = pieces_for(_segments(cu_seqlens, cu_seqlens_cpu), 1, 0)
    out, final = run_pieces(segs, fn, [t[0] for t in inputs], s0)
    return out.unsqueeze(0), final


def torch_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_gated_delta_rule`` / ``chunk_kda``'s contract in torch: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``,
    ``g [B, T, HV]`` or ``[B, T, HV, K]``, ``beta [B, T, HV]``; returns ``(o [B, T, HV, V], final [N, HV, K, V] or
    None)``, both in the compute dtype (fp32, fp64 for fp64 inputs)."""
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if v.shape[2] != q.shape[2]:  # grouped values: each q/k head serves HV / H consecutive value heads
        rep = v.shape[2] // q.shape[2]
        q, k = (t.repeat_interleave(rep, dim=2, output_size=v.shape[2]) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (k.shape[-1] ** -0.5 if scale is None else scale)
    s0 = None if initial_state is None else initial_state.to(dtype)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
            s0: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        o, s = chunk_delta_rule(*(t.movedim(1, 2) for t in (q, k, v, g, beta)), s0=s0)  # [n, H, L, ..]
        return o.movedim(2, 1), s

    o, final = _by_runs(run, [q, k, v, g, beta], s0, cu_seqlens, cu_seqlens_cpu)
    return o, (final if output_final_state else None)


def torch_simple_gla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False, state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_simple_gla``'s contract in torch (scalar gate per head, ``q, k [B, T, H, K]``, ``v [B, T, H, V]``,
    ``g [B, T, H]``), from zero initial states; final states ``[N, H, K, V]`` (``[N, H, V, K]`` with
    ``state_v_first``). Outputs in the compute dtype."""
    if initial_state is not None:
        raise NotImplementedError("torch_simple_gla runs from zero initial states only")
    dtype = _compute_dtype(q, k, v, g)
    q, k, v, g = (t.to(dtype) for t in (q, k, v, g))
    q = q * (k.shape[-1] ** -0.5 if scale is None else scale)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, s0: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
        y, h, _ = chunk_ssd(v, g, k, q, chunk_size)  # h [n, H, V, K]
        return y, h

    o, final = _by_runs(run, [q, k, v, g], None, cu_seqlens, cu_seqlens_cpu)
    if not output_final_state:
        return o, None
    return o, (final if state_v_first else final.transpose(-1, -2))


FLA = Kernels("fla", _fla.delta_rule, _fla.simple_gla, upcast=False)
TORCH = Kernels("torch", torch_delta_rule, torch_simple_gla, upcast=True)


def pick(x: torch.Tensor, runs: Runs, *, gated_backward: bool = False) -> Kernels:
    """:data:`FLA` when flash-linear-attention takes ``x`` (CUDA, fp32 / bf16 / fp16, installed) and no run is empty,
    else :data:`TORCH`. ``gated_backward``: the call uses fla's gated chunk backward (GDN's scalar gate, Mamba2) and
    needs gradients; where fla refuses that backward (:func:`cpscope.linear._fla.gated_backward_refusal`) the call
    runs on :data:`TORCH` from the start rather than failing in its backward."""
    return FLA if not runs.has_empty and _fla.usable(x, gated_backward=gated_backward) else TORCH


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd will record a call on these tensors (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
