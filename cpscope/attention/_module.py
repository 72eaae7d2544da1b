"""``ContextParallelAttention``: an ``nn.Module`` around :func:`cpscope.context_parallel_attention`.

Which group it uses, per forward call:

1. a :func:`cpscope.runtime_cp` scope bound around the call wins (hybrid CP: one group per microbatch);
2. otherwise the **build-time** scope captured when the module was constructed (static CP — the build-time group
   in force at ``__init__``, see :func:`cpscope.build_time_cp`), even if the process-wide build-time group has
   changed since. A *runtime* binding active at construction (lazy init, meta-device materialisation, a rebuild
   inside the training loop's ``runtime_cp``) is never captured: it belongs to that microbatch only.

Under ``torch.compile`` a call is one eager island (``torch.compiler.disable``: one graph break): the scope read,
validation and the whole attention run eagerly, and only tensors cross into the compiled graphs, so a compiled
model guards on no group, CP size or offsets. :meth:`ContextParallelAttention.active_scope` is the scope read alone,
excluded from compilation the same way, for wrappers that trace around it.

Example::

    with cpscope.build_time_cp(groups[2]):
        attn = ContextParallelAttention(causal=True)        # captures CP2 as its default
    out = attn(q, k, v)                                      # CP2
    with cpscope.runtime_cp(None):
        out = attn(q_full, k_full, v_full)                   # CP1 for this call
    out = attn(q, k, v, comm="all_gather")                   # another variant for this call
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .._checks import check_qkv_format
from .._variants import check_comm
from ..scope import CPScope, build_time_scope, runtime_scope_or
from ._inputs import check_softcap, check_window
from ._api import attention_with_scope

__all__ = ["ContextParallelAttention"]


class ContextParallelAttention(nn.Module):
    """Ring attention over the runtime CP scope, else the build-time scope captured at construction.

    Args:
        qkv_format: ``"bshd"``, ``"sbhd"`` or ``"thd"``.
        causal: causal mask.
        softmax_scale: default ``1 / sqrt(d)``.
        comm: communication variant (see :func:`cpscope.context_parallel_attention`); ``None``: the scope's. A
            call's own ``comm=`` overrides it.
        window: ``(left, right)`` sliding window of every call (``-1``: unbounded side); ``None``: none.
        softcap: tanh soft-capping of the scaled scores (finite > 0); ``None``: none.

    Raises:
        ValueError: an unknown ``qkv_format`` or ``comm``, a bad ``window`` or ``softcap``.

    Example::

        attn = ContextParallelAttention(qkv_format="thd", causal=True)
        with cpscope.runtime_cp(groups[2]):
            out = attn(q, k, v, cu_seqlens=cu)     # local zigzag [t_local, h, d]; cu: global offsets
        swa = ContextParallelAttention(window=(127, 0))   # gpt-oss's sliding layers; sinks per call
        out = swa(q, k, v, sinks=layer_sinks)
    """

    def __init__(self, *, qkv_format: str = "bshd", causal: bool = True, softmax_scale: Optional[float] = None,
                 comm: Optional[str] = None, window: Optional[tuple[int, int]] = None,
                 softcap: Optional[float] = None) -> None:
        super().__init__()
        self.qkv_format = check_qkv_format(qkv_format)
        self.causal, self.softmax_scale = causal, softmax_scale
        self.comm = check_comm(comm)
        self.window, self.softcap = check_window(window), check_softcap(softcap)
        self._build_scope: CPScope = build_time_scope()  # never the runtime binding active now

    @property
    def build_scope(self) -> CPScope:
        """The scope captured at construction (used when no runtime scope is bound)."""
        return self._build_scope

    @torch.compiler.disable
    def active_scope(self) -> CPScope:
        """The scope for this call: the bound runtime scope if any, else the build-time scope.

        A checked read (:func:`cpscope.set_backward_read_check`): inside a backward recompute that did not re-enter
        the forward's scope it raises :class:`cpscope.ScopeReadInBackwardError`, also when nothing is bound.
        """
        return runtime_scope_or(self._build_scope)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: Optional[Any] = None,
        max_seqlen: Optional[int] = None, cu_seqlens_padded: Optional[Any] = None, comm: Optional[str] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Attention over the scope of this call (:meth:`active_scope`), resolved once here.

        Args:
            q: local zigzag shard in the module's ``qkv_format``: ``[b, s, h, d]``, ``[s, b, h, d]`` or ``[t, h, d]``.
            k, v: same layout, ``h_kv`` heads with ``h % h_kv == 0``.
            cu_seqlens: **global** offsets (int32, from 0): ``thd``'s documents (the real ones when
                ``cu_seqlens_padded`` is given); ``bshd`` / ``sbhd``: optional real lengths of the rows.
            max_seqlen: optional; checked to be at least the longest global sequence / document.
            cu_seqlens_padded: ``thd`` only: the layout offsets of padded documents (TransformerEngine's
                convention, see :func:`cpscope.context_parallel_attention`).
            comm: this call's communication variant; ``None``: the module's (else the scope's).
            sinks: ``[h]`` attention sinks of this call (one logit per q head; see
                :func:`cpscope.context_parallel_attention`).

        Returns:
            This rank's rows of full attention, same shape and dtype as ``q``.

        Raises:
            ValueError: inconsistent inputs, before any collective runs (see
                :func:`cpscope.context_parallel_attention`).
        """
        if torch.compiler.is_compiling():  # one eager island (one graph break): scope read and the whole call
            return _forward_island(self, q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                   cu_seqlens_padded=cu_seqlens_padded, comm=comm, sinks=sinks)
        return self._forward(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                             cu_seqlens_padded=cu_seqlens_padded, comm=comm, sinks=sinks)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: Optional[Any],
                 max_seqlen: Optional[int], cu_seqlens_padded: Optional[Any], comm: Optional[str],
                 sinks: Optional[torch.Tensor]) -> torch.Tensor:
        scope = runtime_scope_or(self._build_scope)  # what active_scope() reads, without its compile wrapper
        return attention_with_scope(
            q, k, v, scope, qkv_format=self.qkv_format, causal=self.causal, cu_seqlens=cu_seqlens,
            cu_seqlens_padded=cu_seqlens_padded, max_seqlen=max_seqlen, softmax_scale=self.softmax_scale,
            comm=self.comm if comm is None else comm, window=self.window, sinks=sinks, softcap=self.softcap,
        )

    def extra_repr(self) -> str:
        extra = "".join(f", {name}={value!r}" for name, value in
                        (("comm", self.comm), ("window", self.window), ("softcap", self.softcap)) if value is not None)
        return f"qkv_format={self.qkv_format!r}, causal={self.causal}{extra}, build_scope={self._build_scope!r}"


_forward_island = torch.compiler.disable(ContextParallelAttention._forward)
