"""The attention options transformers passes to an attention function, as cpscope's ``window`` / ``sinks`` /
``softcap``.

transformers' decoders pass their per-layer attention options as keyword arguments of the attention function:

* ``sliding_window=W`` (Mistral, Qwen2/3, Gemma 2/3, gpt-oss: ``None`` on the full-attention layers of models that
  alternate): in transformers' own masks (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``) and its
  flash-attention path (``window_size=(W - 1, W - 1)`` with ``causal``), query ``i`` sees key ``j`` when
  ``i - W < j <= i`` — cpscope's ``window=(W - 1, 0)``. A window at least as long as the longest sequence /
  document has no effect and is dropped (the full-attention plan is cheaper);
* ``softcap=c`` (Gemma 2's ``attn_logit_softcapping``): ``c * tanh(s / c)`` of the scaled scores, before masking —
  cpscope's ``softcap``;
* ``s_aux=sinks`` (gpt-oss: a ``[q heads]`` parameter): one extra logit per head in every softmax denominator, with
  no value (the eager code concatenates it to the scores and drops its column after the softmax) — cpscope's
  ``sinks``, differentiable.

Multi-latent attention (DeepSeek-V3: q/k head dim ``qk_nope + qk_rope``, v head dim ``v_head_dim``) needs no option:
the attention function receives v with its own head dim, unpadded, and cpscope's attention takes it as is.

Example::

    attention_options({"sliding_window": 4096, "softcap": 50.0}, causal=True, longest=8192)
    # {"window": (4095, 0), "sinks": kwargs.get("s_aux"), "softcap": 50.0}
"""
from __future__ import annotations

import numbers
from typing import Any, Optional

__all__ = ["attention_options", "longest_sequence"]


def longest_sequence(local_len: int, cp: int, cu_list: Optional[list[int]]) -> int:
    """The longest global sequence (``local_len · cp``) or packed document (from the global offsets ``cu_list``)."""
    if cu_list is None:
        return local_len * cp
    return max(b - a for a, b in zip(cu_list, cu_list[1:]))


def _window(sliding_window: Any, causal: bool, longest: int) -> Optional[tuple[int, int]]:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        raise ValueError(
            f'attn_implementation="cpscope" needs sliding_window to be None or an int >= 1 (query i sees keys '
            f"i - sliding_window < j <= i), got {sliding_window!r}"
        )
    if sliding_window >= longest:
        return None  # covers every sequence / document: no effect
    if not causal:
        raise ValueError(
            f'attn_implementation="cpscope" cannot honour sliding_window={sliding_window} without a causal mask '
            "(transformers' bidirectional sliding-window masks do not agree on the bound); pass "
            "context_parallel_attention(window=(left, right)) directly from a custom attention function"
        )
    return (int(sliding_window) - 1, 0)


def attention_options(kwargs: dict[str, Any], *, causal: bool, longest: int) -> dict[str, Any]:
    """``window`` / ``sinks`` / ``softcap`` for :func:`cpscope.context_parallel_attention` from transformers' kwargs.

    ``longest`` is the longest global sequence or packed document (a window covering it is dropped).

    Raises:
        ValueError: a ``sliding_window`` that is not an int ``>= 1``, or one shorter than ``longest`` without a
            causal mask. (``softcap`` and ``s_aux`` are checked by the attention itself: a finite number ``> 0``,
            a floating tensor of shape ``[q heads]``.)

    Example::

        attention_options({"s_aux": sinks}, causal=True, longest=64)   # {"window": None, "sinks": sinks, ...}
    """
    return {
        "window": _window(kwargs.get("sliding_window"), causal, longest),
        "sinks": kwargs.get("s_aux"),
        "softcap": kwargs.get("softcap"),
    }
