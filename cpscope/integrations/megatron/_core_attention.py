"""Megatron's core attention under the microbatch's scope: cpscope's ring for the local spec, TE bound per call.

* **Local spec** — Megatron's ``DotProductAttention`` refuses CP (``context_parallel_size == 1`` asserted at build)
  and packed sequences (``packed_seq_params is None`` asserted in forward). :class:`RingCoreAttention` takes its
  place: the same call (``query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params``),
  ``sbhd`` ``[s, b, h, d]`` → ``[s, b, h·d]`` and ``thd`` ``[t, h, d]`` → ``[t, h·d]``, computed by
  :func:`cpscope.attention.attention_with_scope` with the carried scope (grouped-query attention natively, causal
  or not, document-masked in ``thd``), with the layer's sliding window (``window_size``, where
  ``window_attn_skip_freq`` makes it a window layer) and softmax offset (``softmax_type`` "off-by-one" /
  "learnable": one sink logit per head, the learnable one the same ``Parameter`` under the same key). It holds no
  other parameter, so the model's ``state_dict`` is unchanged.
* **TE spec** — :class:`TEAttentionMixin` replaces ``TEDotProductAttention.forward``: it binds the carried scope to
  the module with :func:`cpscope.integrations.te.bind_te_cp` (group, global ranks and :func:`cpscope.cp_stream`,
  created lazily — 0.19.2 creates its stream only when the static CP size is > 1) for the call and restores the
  build-time settings afterwards, also on exceptions. Megatron's own per-call re-binding from
  ``packed_seq_params.cp_group`` (which never restores, so a later microbatch that names no group kept CP2) is
  bypassed by handing it a copy without ``cp_group`` / ``local_cp_size``.

Padding (``cu_seqlens_q_padded``): :func:`attention_offsets` is the one place that decides which offsets the ring
gets: TE's pair (``cu_seqlens`` real + ``cu_seqlens_padded`` layout), so padding is masked with or without a
causal mask.

Example::

    attention.core_attention = RingCoreAttention.replacing(attention.core_attention)   # what enable_runtime_cp does
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from ...attention import attention_with_scope
from ...scope import CPScope
from .._swap import ForwardSignature
from ._carrier import consumer_scope

__all__ = ["RingCoreAttention", "TEAttentionMixin", "attention_offsets", "is_causal"]

# Megatron's AttnMaskType names (megatron.core.transformer.enums): which ones mean causal.
_CAUSAL = {"causal", "padding_causal", "causal_bottom_right"}
_FULL = {"no_mask", "padding"}


def is_causal(attn_mask_type: Any) -> bool:
    """Whether a Megatron ``AttnMaskType`` (or its name) asks for causal attention; ``arbitrary`` is refused."""
    name = getattr(attn_mask_type, "name", attn_mask_type)
    if name in _CAUSAL:
        return True
    if name in _FULL:
        return False
    raise ValueError(
        f"attn_mask_type={attn_mask_type!r}: cpscope's ring attention builds causal / document masks itself; "
        f"supported mask types are {sorted(_CAUSAL | _FULL)}"
    )


def attention_offsets(packed_seq_params: Any, *, causal: bool) -> dict[str, Any]:
    """The offsets keyword(s) for :func:`cpscope.attention.attention_with_scope` from a ``thd`` ``PackedSeqParams``.

    TE's convention, which Megatron follows: with ``cu_seqlens_q_padded`` set, ``{"cu_seqlens": cu_seqlens_q,
    "cu_seqlens_padded": cu_seqlens_q_padded}`` — the ring masks the padding (no query sees it, its rows and
    gradients are zero), with or without a causal mask; else ``{"cu_seqlens": cu_seqlens_q}``. ``causal`` is kept
    for callers; the offsets do not depend on it.
    """
    real = packed_seq_params.cu_seqlens_q
    padded = packed_seq_params.cu_seqlens_q_padded
    if padded is None or padded is real:
        return {"cu_seqlens": real}
    return {"cu_seqlens": real, "cu_seqlens_padded": padded}


class RingCoreAttention(nn.Module):
    """Megatron's core-attention call computed by cpscope's ring attention over the carried scope.

    Built from the module it replaces (:meth:`replacing`), it keeps that module's mask type, effective softmax
    scale and heads. Refuses (``ValueError``, before any communication) what the ring does not do: an explicit
    ``attention_mask`` tensor (the ring builds causal / document masks itself: build batches without one, e.g.
    ``create_attention_mask_in_dataloader=False``), ``attention_bias``, ``arbitrary`` masks.

    Example::

        attn.core_attention = RingCoreAttention.replacing(attn.core_attention)
        out = attn.core_attention(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
    """

    def __init__(self, attn_mask_type: Any, softmax_scale: float, layer_number: int = 1,
                 window: Optional[tuple[int, int]] = None, softmax_offset: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = float(softmax_scale)
        self.layer_number = layer_number
        self.window = None if window is None else (int(window[0]), int(window[1]))
        if isinstance(softmax_offset, nn.Parameter):  # softmax_type="learnable": the same parameter, the same key
            self.softmax_offset = softmax_offset
        else:  # "off-by-one": a fixed zero logit (a plain tensor, as in Megatron); "vanilla": None
            self.__dict__["softmax_offset"] = softmax_offset
        self.__dict__["_cpscope_replaced"] = None  # the original module (not a submodule: state_dict unchanged)

    @classmethod
    def replacing(cls, core: nn.Module) -> "RingCoreAttention":
        """A ring replacement for Megatron's local ``DotProductAttention`` ``core`` (kept for :meth:`original`):
        its mask type, scale, this layer's sliding window (``window_size`` where ``window_attn_skip_freq`` makes the
        layer a window layer) and its softmax offset (``softmax_type``: the sink logit of every head)."""
        scale = float(core.softmax_scale)
        if getattr(core.config, "apply_query_key_layer_scaling", False):
            scale *= max(1, core.layer_number)  # Megatron divides by the layer coefficient and the softmax multiplies
        window = getattr(getattr(core, "scale_mask_softmax", None), "window_size", None)
        new = cls(core.attn_mask_type, scale, getattr(core, "layer_number", 1), window=window,
                  softmax_offset=getattr(core, "softmax_offset", None))
        new.train(core.training)
        new.__dict__["_cpscope_replaced"] = core
        return new

    def original(self) -> Optional[nn.Module]:
        """The module this one replaced (restored by ``disable_runtime_cp``)."""
        return self.__dict__.get("_cpscope_replaced")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        **_unused: Any,
    ) -> torch.Tensor:
        scope = consumer_scope(packed_seq_params)
        causal = is_causal(self.attn_mask_type if attn_mask_type is None else attn_mask_type)
        if attention_mask is not None:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} given to cpscope's ring attention, which "
                "builds the causal / document mask itself; pass attention_mask=None (Megatron: "
                "create_attention_mask_in_dataloader=False)"
            )
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by cpscope's ring attention")
        return self._run(query, key, value, scope, causal, packed_seq_params)

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scope: CPScope, causal: bool,
             psp: Any) -> torch.Tensor:
        sinks = self.softmax_offset
        if sinks is not None and sinks.device != q.device:  # Megatron moves its offset to the scores' device too
            sinks = sinks.to(q.device)
        options = {"softmax_scale": self.softmax_scale, "window": self.window, "sinks": sinks}
        if psp is not None and getattr(psp, "qkv_format", None) == "thd":  # [t, h, d]
            out = attention_with_scope(
                q, k, v, scope, qkv_format="thd", causal=causal, max_seqlen=psp.max_seqlen_q,
                **attention_offsets(psp, causal=causal), **options,
            )
            return out.reshape(out.shape[0], -1)  # [t, h*d]
        out = attention_with_scope(q, k, v, scope, qkv_format="sbhd", causal=causal, **options)
        return out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, h*d]

    def extra_repr(self) -> str:
        return f"attn_mask_type={getattr(self.attn_mask_type, 'name', self.attn_mask_type)}, " \
               f"softmax_scale={self.softmax_scale:.6g}, window={self.window}"


class TEAttentionMixin(ForwardSignature):
    """``TEDotProductAttention.forward`` bound to the carried scope for the call (see the module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from ..te import bind_te_cp  # cpscope's TE glue: imports TransformerEngine only when it runs TE code

        call = self._cpscope_signature.bind(*args, **kwargs)
        psp = call.arguments.get("packed_seq_params")
        scope = consumer_scope(psp)
        if psp is not None:
            te_psp = copy.copy(psp)
            te_psp.cp_group = None  # Megatron's forward would re-bind from these and never restore
            te_psp.local_cp_size = None
            if scope.size > 1 and te_psp.qkv_format == "thd":
                if te_psp.cu_seqlens_q_padded is None:  # TE needs the layout offsets under CP
                    te_psp.cu_seqlens_q_padded = te_psp.cu_seqlens_q
                if te_psp.cu_seqlens_kv_padded is None:
                    te_psp.cu_seqlens_kv_padded = te_psp.cu_seqlens_kv
            call.arguments["packed_seq_params"] = te_psp
        query = call.arguments.get("query")
        device = query.device if isinstance(query, torch.Tensor) else None
        with bind_te_cp(self, scope, device=device, call=call.arguments):  # type: ignore[arg-type]
            return super().forward(*call.args, **call.kwargs)  # type: ignore[misc]
