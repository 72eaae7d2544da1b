"""Which transformers layers mix tokens outside attention, and the refusal of a model that runs them unbound under CP.

Hybrid decoders (Qwen3.5 and Qwen3-Next: gated DeltaNet; Kimi Linear: Kimi Delta Attention; Nemotron-H, Bamba,
Granite 4 hybrids and Falcon-H1: Mamba2; LFM2: short convolutions) interleave attention with layers whose recurrent
state or convolution window runs along the sequence. Under CP every rank holds zigzag chunks of the sequence, so such
a layer, unless it is bound to the scope (:func:`cpscope.integrations.hf.enable_runtime_cp`), would run its
recurrence over non-contiguous tokens from a zero state on every rank: wrong numbers, no error.

transformers names every decoder layer's kind in ``config.layer_types`` (one vocabulary,
``transformers.configuration_utils.ALLOWED_LAYER_TYPES``): :data:`MIXER_LAYER_TYPES` are those that mix tokens
outside attention. :func:`refuse_unbound_mixers` is called by the ``"cpscope"`` attention function — which every
rank reaches, at the model's first attention layer, before any collective of cpscope's — and raises the same
``ValueError`` on every rank when the model runs under CP > 1 with such layers and was not bound. The verdict is
computed once per config object.

Example::

    mixer_layer_types(Qwen3NextConfig())     # ['linear_attention']
    mixer_layer_types(LlamaConfig())         # []
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn

from ..._tensor_cache import register_clear

__all__ = ["BOUND_ATTRIBUTE", "MIXER_LAYER_TYPES", "is_bound", "mixer_layer_types", "refuse_unbound_mixers"]

# ``config.layer_types`` entries whose layers mix tokens outside attention (transformers 5 names them so; the last
# four are legacy names some configs still carry).
MIXER_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2", "recurrent", "rwkv")
# Set on every attention module that :func:`enable_runtime_cp` bound (its model's mixers are bound too).
BOUND_ATTRIBUTE = "_cpscope_runtime_bound"

_VERDICTS: dict[int, tuple[weakref.ref, list[str]]] = {}


@register_clear  # cpscope.clear_caches() drops the remembered verdicts (recomputed from the config on next use)
def _forget_verdicts() -> None:
    _VERDICTS.clear()


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def mixer_layer_types(config: Any) -> list[str]:
    """The sorted distinct layer kinds of ``config`` (its text config) that mix tokens outside attention."""
    layer_types = getattr(_text_config(config), "layer_types", None) or ()
    return sorted({str(t) for t in layer_types if str(t) in MIXER_LAYER_TYPES})


def _cached_mixer_types(config: Any) -> list[str]:
    """:func:`mixer_layer_types` remembered per config object (the attention function runs once per layer)."""
    hit = _VERDICTS.get(id(config))
    if hit is not None and hit[0]() is config:
        return hit[1]
    kinds = mixer_layer_types(config)
    try:
        ident = id(config)
        ref = weakref.ref(config, lambda r, ident=ident: _VERDICTS.pop(ident, None))
    except TypeError:  # no weak references: not remembered
        return kinds
    _VERDICTS[ident] = (ref, kinds)
    return kinds


def is_bound(module: nn.Module) -> bool:
    """Whether ``module`` was bound to the scope by ``enable_runtime_cp``."""
    return bool(module.__dict__.get(BOUND_ATTRIBUTE, False))


def refuse_unbound_mixers(module: Any, cp_size: int, config: Optional[Any] = None) -> None:
    """``ValueError`` if ``module`` (an attention layer) belongs to a model with unbound token mixers and
    ``cp_size > 1``; nothing otherwise. Deterministic (config and module only): every rank raises alike.

    Example::

        refuse_unbound_mixers(attn_layer, cp_size=2)   # ValueError for a Qwen3-Next not bound by enable_runtime_cp
    """
    if cp_size <= 1 or (isinstance(module, nn.Module) and is_bound(module)):
        return
    config = config if config is not None else getattr(module, "config", None)
    if config is None:
        return
    kinds = _cached_mixer_types(config)
    if kinds:
        raise ValueError(
            f"{type(config).__name__} has {kinds} layers (linear-attention, state-space or short-convolution layers "
            f"whose state runs along the sequence) that are not bound to the CP scope: under CP{cp_size} they would "
            f"run on each rank's zigzag chunks alone and give wrong results. Call "
            f"cpscope.integrations.hf.enable_runtime_cp(model) once before training (it binds every token-mixing "
            f"layer), instead of only setting attn_implementation='cpscope'"
        )
