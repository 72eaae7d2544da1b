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
import logging
import re
from typing import Any, Optional

import torch

__all__ = ["available", "usable", "gated_backward_refusal", "delta_rule", "simple_gla"]

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether flash-linear-attention (``fla``) is installed (checked once, without importing it)."""
    return importlib.util.find_spec("fla") is not None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


@functools.lru_cache(maxsize=None)
def gated_backward_refusal(capability: tuple[int, int], triton_version: str, tilelang: bool) -> Optional[str]:
    """Why fla cannot run a *gated* chunk backward here (``None`` when it can).

    fla 0.6.0 refuses ``chunk_bwd_dqkwg`` with a gate — the backward of ``chunk_gated_delta_rule`` (GDN's scalar gate)
    and of ``chunk_simple_gla`` (Mamba2) — on Hopper (sm 9.0) with Triton >= 3.4.0 and < 3.7.1 unless its tilelang
    backend is installed (fla issue #640: that Triton gives wrong results there). It raises only in the backward,
    after the forward ran; cpscope picks its torch path up front instead. ``chunk_kda`` does not use that kernel.

    Example::

        gated_backward_refusal((9, 0), "3.6.0", False)   # -> "fla's gated chunk backward ... Triton 3.6.0 ..."
        gated_backward_refusal((10, 0), "3.6.0", False)  # -> None
    """
    if capability != (9, 0) or tilelang:
        return None
    v = _version(triton_version)
    if (3, 4, 0) <= v < (3, 7, 1):
        return (f"fla's gated chunk backward (chunk_bwd_dqkwg) is refused by fla on Hopper with Triton "
                f"{triton_version} (needs >= 3.7.1 or tilelang; fla issue #640)")
    return None


def _refusal_here(x: torch.Tensor) -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    reason = gated_backward_refusal(torch.cuda.get_device_capability(x.device), triton.__version__,
                                    importlib.util.find_spec("tilelang") is not None)
    if reason is not None and reason not in _LOGGED:
        _LOGGED.add(reason)
        log.warning("%s: GDN and Mamba2 layers that need gradients run on cpscope's torch chunk path", reason)
    return reason


_LOGGED: set[str] = set()


def usable(x: torch.Tensor, *, gated_backward: bool = False) -> bool:
    """Whether the fla kernels take this input: CUDA, a 16/32-bit float, fla installed; with ``gated_backward``
    (a GDN / Mamba2 call whose backward will run), also that fla's gated backward runs on this GPU and Triton
    (:func:`gated_backward_refusal`)."""
    if not (x.is_cuda and x.dtype in _DTYPES and available()):
        return False
    return not gated_backward or _refusal_here(x) is None


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
