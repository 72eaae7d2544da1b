"""flash-linear-attention's Triton chunk functions behind :mod:`cpscope.linear._kernels`' interface (optional;
imported only when called).

The interface is fla's own (``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_simple_gla``: same keywords), so
these adapters only pick the function and drop the torch path's ``chunk_size``. fla's facts that the callers rely
on (0.6.0): ``initial_state`` receives a gradient (``dh0``) and ``output_final_state`` a differentiable final state
(fp32; ``chunk_kda`` requires an fp32 ``initial_state``); ``cu_seqlens`` needs one packed row (``B == 1``) and one
initial state per piece; ``cu_seqlens_cpu`` spares the device-to-host copy of the offsets; outputs come back in
``q``'s dtype.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Optional

import torch

__all__ = ["available", "usable", "delta_rule", "simple_gla"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether flash-linear-attention (``fla``) is installed (checked once, without importing it)."""
    return importlib.util.find_spec("fla") is not None


def usable(x: torch.Tensor) -> bool:
    """Whether the fla kernels take this input: CUDA, a 16/32-bit float, fla installed."""
    return x.is_cuda and x.dtype in _DTYPES and available()


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_kda`` for a per-channel gate (``g [B, T, HV, K]``), else ``chunk_gated_delta_rule``."""
    if g.dim() == 4:
        from fla.ops.kda import chunk_kda

        return chunk_kda(q, k, v, g, beta, **kwargs)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


def simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
               chunk_size: Optional[int] = None, **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_simple_gla`` (its own chunk size: ``chunk_size`` is the torch path's knob and is not passed)."""
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla(q, k, v, g, **kwargs)
