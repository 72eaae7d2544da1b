"""flash-linear-attention's Triton kernels for the local part of a recurrence (optional; imported only when used).

Used on CUDA tensors (fp32 / bf16 / fp16) when ``fla`` imports; the torch path otherwise. The kernels run the local
pieces varlen (``cu_seqlens`` = the local piece offsets) from per-piece initial states and return per-piece final
states, which is all the summary exchange needs (:mod:`cpscope.linear.delta_rule`, :mod:`cpscope.linear.mamba2`).
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch

__all__ = ["available", "usable", "delta_rule", "simple_gla"]


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether flash-linear-attention (``fla``) is installed (checked once, without importing it)."""
    return importlib.util.find_spec("fla") is not None


def usable(x: torch.Tensor, lens: tuple[int, ...] = ()) -> bool:
    """Whether the fla kernels take this input: CUDA, a 16/32-bit float, fla installed, no empty piece."""
    return (x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and available()
            and all(n > 0 for n in lens))


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
               cu: torch.Tensor, s0: Optional[torch.Tensor], l2: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_gated_delta_rule`` (``g [N, HV]``) or ``chunk_kda`` (``g [N, HV, K]``) on flat ``[N, H, ..]`` inputs.

    Returns ``(o [N, HV, V], final [pieces, HV, K, V] or None)``; ``final`` only when ``s0`` is given.
    """
    kwargs = dict(scale=scale, initial_state=s0, output_final_state=s0 is not None, use_qk_l2norm_in_kernel=l2,
                  cu_seqlens=cu.long())
    args = [t.unsqueeze(0).contiguous() for t in (q, k, v, g, beta)]
    if g.dim() == 3:
        from fla.ops.kda import chunk_kda

        o, final = chunk_kda(*args, **kwargs)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, final = chunk_gated_delta_rule(*args, **kwargs)
    return o.squeeze(0), final


def simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, cu: torch.Tensor,
               final: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_simple_gla`` (scale 1, zero initial states) on flat ``[N, H, ..]`` inputs: Mamba2's SSD with
    ``q = C``, ``k = B``, ``v = dt·x``, ``g = dt·A``. Returns ``(o [N, H, P], final [pieces, H, N, P] or None)``."""
    from fla.ops.simple_gla import chunk_simple_gla

    args = [t.unsqueeze(0).contiguous() for t in (q, k, v, g)]
    o, ht = chunk_simple_gla(*args, scale=1.0, output_final_state=final, cu_seqlens=cu.long())
    return o.squeeze(0), ht
