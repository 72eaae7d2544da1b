"""Validation of :func:`cpscope.context_parallel_attention` inputs (``ValueError`` before any collective/kernel)."""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch

from .._checks import check_divisible_seq, check_local_thd_len, check_qkv_format
from .._pack import Pack

__all__ = ["check_attention_inputs", "check_softmax_scale", "check_thd_pack", "check_dense_max_seqlen", "check_window",
           "check_softcap", "check_sinks"]

# Every floating dtype some block kernel takes (the router sends each to the fastest that does: fp16 / bf16 to
# cuDNN or flash, fp32 to aten's memory-efficient kernels or the exact math, fp64 to the exact math).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qkv_format: str, cp: int,
) -> None:
    """Check q/k/v against each other, the layout and the CP size (shapes, dtypes, devices, heads); O(1)."""
    check_qkv_format(qkv_format)
    ndim = 3 if qkv_format == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"qkv_format={qkv_format!r} needs {ndim}-D q/k/v, got {name} of shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:  # v's head dim may differ (multi-latent attention)
        raise ValueError(
            f"v must have k's heads and {'tokens' if qkv_format == 'thd' else 'batch and sequence'} (its head dim may "
            f"differ), got k {tuple(k.shape)} and v {tuple(v.shape)} ({qkv_format}: k/v heads {k.shape[-2]} vs "
            f"{v.shape[-2]})"
        )
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in every dimension but heads ({qkv_format})"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    h, h_kv = q.shape[-2], k.shape[-2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({h_kv}) for grouped-query attention")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported on {q.device.type} (supported: {_DTYPES})")
    if qkv_format != "thd":
        seq = q.shape[1] if qkv_format == "bshd" else q.shape[0]
        check_divisible_seq(seq * cp, cp)


def check_softmax_scale(softmax_scale: Any, head_dim: int) -> float:
    """The softmax scale to use: ``1/sqrt(head_dim)`` by default; a given one must be a finite number > 0."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, torch.Tensor) and softmax_scale.numel() == 1 and not softmax_scale.is_cuda:
        softmax_scale = softmax_scale.item()
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) or \
            not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0 (or None for 1/sqrt(d)), got {softmax_scale!r}")
    return float(softmax_scale)


def check_thd_pack(q: torch.Tensor, pack: Pack, max_seqlen: Optional[int], name: str = "cu_seqlens") -> None:
    """The local ``thd`` length and ``max_seqlen`` against an already validated pack (O(1))."""
    check_local_thd_len(q.shape[0], [0, pack.total], pack.cp, name="q")
    if max_seqlen is not None and max_seqlen < pack.longest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is shorter than the longest document ({pack.longest}) in {name}"
        )


def check_dense_max_seqlen(max_seqlen: Optional[int], global_len: int) -> None:
    if max_seqlen is not None and max_seqlen < global_len:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the global sequence length {global_len}")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_window(window: Any) -> Optional[tuple[int, int]]:
    """``window`` as a ``(left, right)`` tuple of ints ``>= -1`` (``-1``: unbounded), or ``None``.

    Example::

        check_window((4095, 0))    # (4095, 0)
        check_window((-2, 0))      # ValueError: window=(-2, 0): ... below -1
    """
    if window is None:
        return None
    if isinstance(window, torch.Tensor):
        window = window.tolist()
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2 \
            or not all(_is_int(x) for x in window):
        raise ValueError(f"window must be a pair (left, right) of ints (-1: unbounded) or None, got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window=({left}, {right}): a side below -1 (use -1 for an unbounded side)")
    return left, right


def check_softcap(softcap: Any) -> Optional[float]:
    """``softcap`` as a float: ``None``, or a finite number ``> 0``."""
    if softcap is None:
        return None
    if isinstance(softcap, torch.Tensor) and softcap.numel() == 1 and not softcap.is_cuda:
        softcap = softcap.item()
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or \
            softcap <= 0:
        raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap!r}")
    return float(softcap)


def check_sinks(sinks: Any, heads: int, device: torch.device) -> Optional[torch.Tensor]:
    """``sinks``: ``None`` or a floating-point tensor of shape ``[heads]`` (the q heads) on the inputs' device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a torch.Tensor of shape [{heads}] (one logit per q head), got "
                         f"{type(sinks).__name__}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape [{heads}] (one logit per q head), got {tuple(sinks.shape)}")
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on the inputs' device {device}, got {sinks.device}")
    return sinks
