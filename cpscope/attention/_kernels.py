"""Which CUDA kernel runs a block that has a window, a softcap, or a v head dim other than q/k's.

:func:`cpscope.attention.blocks.block_forward` keeps plain blocks on its own routes (cuDNN through aten for dense
blocks, :mod:`~cpscope.attention._cudnn_thd` for packed ones) and hands the others here:

1. **cuDNN** (the default where the cuDNN frontend is importable, cuDNN >= 9.6, sm90+): dense blocks on
   :mod:`~cpscope.attention._cudnn_graphs`, packed blocks on :mod:`~cpscope.attention._cudnn_thd`, both with the
   band (tiles outside the window skipped), the softcap as a score modifier, any head dims.
2. **flash-attention-2** (aten's bundled kernels, ``window_size_left/right``), when cuDNN is off or missing and there
   is no softcap: the same band convention (bottom-right aligned). FA2 needs one head dim for q, k and v, so a
   smaller one is zero-padded (exact: zero columns add nothing to ``q . k`` nor to ``out``, whose extra columns are
   cut off); its ``lse`` of +inf for rows that see no key becomes -inf.
3. **exact math** (``exact``: the CPU block, which runs on any device) for a softcap without cuDNN.

Only the kinds of block whose cuDNN graphs matched a float64 reference on an H200 (cuDNN 9.19) go to cuDNN
(:func:`on_cudnn`): a dense block that runs as one kernel (a band whose right bound, relative to its top-left
diagonal, is 0 or unbounded), and a packed block without a softcap, or with one beside a left-bounded window over
equal query and key offsets. The others — dense bands split in two kernels (a halo longer than the causal side, a
two-sided window) and the remaining packed softcap blocks — failed that parity check there, so they take the next
route (flash-attention-2, or the exact math with a softcap): slower, never wrong.

A graph that cuDNN refuses to build (:class:`~cpscope.attention._cudnn_thd.GraphUnsupported`: raised before any
kernel runs) sends that kind of block to the next route for the rest of the process, with one warning;
:func:`fallbacks` lists what fell back and why (the GPU tests assert it stays empty for what they expect on cuDNN).

Example::

    out, lse = forward(q, k, v, 0.125, True, None, (4095, 0), None, cudnn=True, exact=blocks._cpu_forward)
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from . import _cudnn_graphs, _cudnn_mods, _cudnn_thd

__all__ = ["forward", "backward", "route", "fallbacks", "on_cudnn"]

log = logging.getLogger(__name__)
_aten = torch.ops.aten
_REFUSED: dict[tuple, str] = {}  # kind of block -> why cuDNN refused it (see the module docstring)


def fallbacks() -> dict[tuple, str]:
    """The kinds of block that cuDNN refused in this process, with the reason (a copy)."""
    return dict(_REFUSED)


def _kind(direction: str, q, k, v, causal, vl, window, softcap) -> tuple:
    band = _cudnn_mods.band_of(causal, window)
    return (direction, vl is None, band is not None, band is not None and band.left != -1,
            band is not None and band.right not in (-1, 0), softcap is not None, q.dtype, q.shape[-1], v.shape[-1],
            q.shape[-2], k.shape[-2], q.device)


def _refused(kind: tuple, err: Exception) -> None:
    _REFUSED[kind] = str(err)[:500]
    log.warning("cuDNN refused a %s block (%s); this kind of block runs on the next route from now on", kind[0], err)


def on_cudnn(n_q: int, n_k: int, causal: bool, vl: Any, window: Any, softcap: Optional[float]) -> bool:
    """Whether this kind of block may run on cuDNN (see the module docstring): ``n_q`` / ``n_k`` are a dense
    block's lengths (ignored when ``vl``, the packed description, is given)."""
    if vl is None:
        return len(_cudnn_graphs.pieces(n_q, n_k, causal, window)) <= 1
    if softcap is None:
        return True
    band = _cudnn_mods.band_of(causal, window)
    same = vl.cu_q is vl.cu_k or (vl.cu_q_host is not None and vl.cu_q_host == vl.cu_k_host)
    return band is not None and band.left != -1 and same


def route(q: torch.Tensor, softcap: Optional[float], cudnn: bool) -> str:
    """``"cudnn"``, ``"flash"`` or ``"exact"`` for a block on ``q``'s device (see the module docstring)."""
    if cudnn and _cudnn_thd.available(q.device):
        return "cudnn"
    return "flash" if softcap is None else "exact"


def _flash_window(causal: bool, window: Any) -> tuple[bool, int, int]:
    band = _cudnn_mods.band_of(causal, window)
    left, right = (band.left, band.right) if band is not None else (-1, -1)
    return causal, left, right


def _padded(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


def _flash_forward(q, k, v, scale, causal, vl, window):
    d = max(q.shape[-1], v.shape[-1])
    qp, kp, vp = _padded(q, d), _padded(k, d), _padded(v, d)
    causal, left, right = _flash_window(causal, window)
    if vl is None:
        args = (None, None, q.shape[1], k.shape[1])
    else:
        args = (vl.cu_q, vl.cu_k, vl.max_q, vl.max_k)
    out, lse, _rng, _unused, _dbg = _aten._flash_attention_forward(
        qp, kp, vp, *args, 0.0, causal, False, scale=scale, window_size_left=left, window_size_right=right)
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))  # FA2 marks rows with no key +inf
    return out[..., : v.shape[-1]], lse


def _flash_backward(dout, q, k, v, out, lse, scale, causal, vl, window):
    d = max(q.shape[-1], v.shape[-1])
    qp, kp, vp, op, dop = (_padded(x, d) for x in (q, k, v, out, dout))
    causal, left, right = _flash_window(causal, window)
    if vl is None:
        args = (None, None, q.shape[1], k.shape[1])
    else:
        args = (vl.cu_q, vl.cu_k, vl.max_q, vl.max_k)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    lse = lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()  # FA2's mark of a row with no key
    dq, dk, dv = _aten._flash_attention_backward(
        dop, qp, kp, vp, op, lse, *args, 0.0, causal, rng, unused, scale=scale, window_size_left=left,
        window_size_right=right)
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, vl: Any,
            window: Optional[tuple[int, int]], softcap: Optional[float], *, cudnn: bool,
            exact: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block (dense ``[b, s, h, d]`` or packed ``[t, h, d]`` with ``vl``), as
    :func:`~cpscope.attention.blocks.block_forward` returns them."""
    how, kind = route(q, softcap, cudnn), _kind("forward", q, k, v, causal, vl, window, softcap)
    if how == "cudnn" and kind not in _REFUSED and on_cudnn(q.shape[1], k.shape[1], causal, vl, window, softcap):
        try:
            if vl is None:
                return _cudnn_graphs.forward(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap)
            return _cudnn_thd.forward(q, k, v, vl, scale=scale, causal=causal, window=window, softcap=softcap)
        except _cudnn_thd.GraphUnsupported as e:
            _refused(kind, e)
    if how == "cudnn":
        how = route(q, softcap, False)
    if how == "flash":
        return _flash_forward(q, k, v, scale, causal, vl, window)
    return exact(q, k, v, scale, causal, vl, window=window, softcap=softcap)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float, causal: bool, vl: Any, window: Optional[tuple[int, int]],
             softcap: Optional[float], *, cudnn: bool, exact: Callable
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the merged ``out`` and ``lse`` of its queries."""
    how, kind = route(q, softcap, cudnn), _kind("backward", q, k, v, causal, vl, window, softcap)
    if how == "cudnn" and kind not in _REFUSED and on_cudnn(q.shape[1], k.shape[1], causal, vl, window, softcap):
        try:
            if vl is None:
                return _cudnn_graphs.backward(dout, q, k, v, out, lse, scale=scale, causal=causal, window=window,
                                              softcap=softcap)
            return _cudnn_thd.backward(dout, q, k, v, out, lse, vl, scale=scale, causal=causal, window=window,
                                       softcap=softcap)
        except _cudnn_thd.GraphUnsupported as e:
            _refused(kind, e)
    if how == "cudnn":
        how = route(q, softcap, False)
    if how == "flash":
        return _flash_backward(dout, q, k, v, out, lse, scale, causal, vl, window)
    return exact(dout, q, k, v, out, lse, scale, causal, vl, window=window, softcap=softcap)
