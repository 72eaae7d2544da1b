"""Validation of :func:`cpscope.context_parallel_attention` inputs (``ValueError`` before any collective/kernel)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._checks import check_cu_seqlens, check_divisible_seq, check_local_thd_len, check_qkv_format, cu_seqlens_list

__all__ = ["check_attention_inputs"]

_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qkv_format: str, cp: int, cu_seqlens: Any,
    max_seqlen: Optional[int],
) -> Optional[tuple[int, ...]]:
    """Check q/k/v against each other, the layout and the CP size; return ``cu_seqlens`` as a tuple (``thd``)."""
    check_qkv_format(qkv_format)
    ndim = 3 if qkv_format == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"qkv_format={qkv_format!r} needs {ndim}-D q/k/v, got {name} of shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in every dimension but heads ({qkv_format})"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    h, h_kv = q.shape[-2], k.shape[-2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({h_kv}) for grouped-query attention")
    allowed = _CUDA_DTYPES if q.is_cuda else _CPU_DTYPES
    if q.dtype not in allowed:
        raise ValueError(f"dtype {q.dtype} is not supported on {q.device.type} (supported: {allowed})")
    if qkv_format != "thd":
        if cu_seqlens is not None:
            raise ValueError(f"cu_seqlens is only meaningful with qkv_format='thd', got qkv_format={qkv_format!r}")
        seq = q.shape[1] if qkv_format == "bshd" else q.shape[0]
        check_divisible_seq(seq * cp, cp)
        if max_seqlen is not None and max_seqlen < seq * cp:
            raise ValueError(f"max_seqlen={max_seqlen} is shorter than the global sequence length {seq * cp}")
        return None
    if cu_seqlens is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens (global, int32, starting at 0)")
    cu = cu_seqlens_list(cu_seqlens)
    check_cu_seqlens(cu, cp)
    check_local_thd_len(q.shape[0], cu, cp, name="q")
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest document ({longest}) in cu_seqlens")
    return tuple(cu)
