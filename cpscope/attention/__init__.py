"""Context-parallel (ring) attention over the active CP group.

:func:`context_parallel_attention` takes this rank's **zigzag** shards of q/k/v (see ``cpscope.zigzag_shard``) and
returns this rank's rows of full attention over the whole sequences — document-masked in ``thd``, causal or not,
with grouped-query attention. Under CP1 (no group, or a size-1 group) it is plain local attention.

Kernels: exact math on CPU (fp32/fp64 scores); on CUDA (fp16/bf16) PyTorch's cuDNN attention for dense blocks
with equal q and k/v heads, its flash-attention kernels otherwise (GQA, ``thd``).

Example::

    with cpscope.runtime_cp(groups[2]):
        q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import _sentinel
from ..scope import _UNSET, CPScope, resolve_scope
from ._inputs import check_attention_inputs
from .module import ContextParallelAttention
from .ring import RingPlan, ring_attention

__all__ = ["context_parallel_attention", "attention_with_scope", "ContextParallelAttention"]

# How bshd/sbhd run: with the dense kernels (default; cuDNN attention on CUDA) or as packed varlen blocks (each
# batch row one zigzag-sharded "document"; flash varlen on CUDA). Private knob: tests cover both routes on CPU.
_DENSE_AS_VARLEN: bool = False


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    causal: bool = True,
    cu_seqlens: Optional[Any] = None,
    max_seqlen: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    group: Any = _UNSET,
) -> torch.Tensor:
    """Local rows of full attention for local zigzag q/k/v, over the active CP group (or ``group=``).

    Args:
        q: ``[b, s, h, d]`` (``bshd``), ``[s, b, h, d]`` (``sbhd``) or ``[t, h, d]`` (``thd``), local zigzag shard.
        k, v: same layout, ``h_kv`` heads with ``h % h_kv == 0``.
        qkv_format: ``"bshd"``, ``"sbhd"`` or ``"thd"``.
        causal: causal mask (within each document in ``thd``).
        cu_seqlens: ``thd`` only: **global** document offsets (int32, from 0); the local tensor holds
            ``cu_seqlens[-1] / cp`` tokens, every document zigzag-sharded on its own.
        max_seqlen: optional; checked to be at least the longest global sequence / document.
        softmax_scale: default ``1 / sqrt(d)``.
        group: explicit CP group (``None`` = CP1); default: the active scope.

    Returns:
        The local output, same shape and dtype as ``q``. q, k and v receive the gradients of their own rows.

    Raises:
        ValueError: inconsistent inputs (shapes, dtypes, devices, heads, lengths vs cp and cu_seqlens), before any
            collective runs.

    Example::

        with cpscope.runtime_cp(groups[2]):       # q/k/v: local zigzag shards, [t_local, h, d]; cu: global offsets
            out = context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)
        out = context_parallel_attention(q, k, v, qkv_format="bshd", group=None)   # CP1: plain local attention
    """
    scope = resolve_scope(group)
    return attention_with_scope(
        q, k, v, scope, qkv_format=qkv_format, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        softmax_scale=softmax_scale,
    )


def attention_with_scope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scope: CPScope,
    *,
    qkv_format: str = "bshd",
    causal: bool = True,
    cu_seqlens: Optional[Any] = None,
    max_seqlen: Optional[int] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`context_parallel_attention` with an already resolved :class:`~cpscope.CPScope` (no ContextVar read).

    For callers that resolved the scope once themselves (a module's forward, an adapter); arguments and result as
    :func:`context_parallel_attention`.

    Example::

        scope = cpscope.resolve_scope()            # once, in forward
        out = attention_with_scope(q, k, v, scope, qkv_format="bshd", causal=True)
    """
    if _sentinel.ACTIVE is not None and not _sentinel.busy(): return _sentinel.attention(attention_with_scope, locals())  # noqa
    cu = check_attention_inputs(
        q, k, v, qkv_format=qkv_format, cp=scope.size, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
    )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if qkv_format == "thd":
        plan = RingPlan(varlen=True, causal=causal, scale=scale, rank=scope.rank, size=scope.size, cu=cu,
                        device=q.device)
        return ring_attention(q, k, v, plan=plan, group=scope.group)
    if qkv_format == "sbhd":  # [s, b, h, d] -> [b, s, h, d] (one copy each); the result goes back to sbhd
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    if _DENSE_AS_VARLEN:  # [b, s, h, d] -> [b*s, h, d]: row i is a document of global length s*cp, zigzag-sharded
        b, s = q.shape[:2]
        g = s * scope.size
        plan = RingPlan(varlen=True, causal=causal, scale=scale, rank=scope.rank, size=scope.size,
                        cu=tuple(range(0, b * g + 1, g)), device=q.device)
        q2, k2, v2 = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
        out = ring_attention(q2, k2, v2, plan=plan, group=scope.group).view(b, s, *q.shape[2:])
    else:
        plan = RingPlan(varlen=False, causal=causal, scale=scale, rank=scope.rank, size=scope.size,
                        local_len=q.shape[1])
        out = ring_attention(q, k, v, plan=plan, group=scope.group)
    return out.transpose(0, 1).contiguous() if qkv_format == "sbhd" else out
