"""Which of a model's layers attend (quadratic time in the document length) and which mix tokens in linear time.

Hybrid decoders interleave attention with linear-attention, state-space and short-convolution layers — gated
DeltaNet (Qwen3.5, Qwen3-Next: three per full-attention layer), Kimi Delta Attention (Kimi Linear), Mamba2
(Nemotron-H, Bamba, Granite 4 hybrids, Falcon-H1), LFM2's short convolutions. Per document of ``L`` tokens an
attention layer costs ``∝ L²`` and moves its keys and values around the CP ring (``∝ L``); the others cost
``∝ L`` and exchange a fixed-size state summary (chunk summaries, a convolution halo). :class:`LayerMix` counts the
two kinds; the planner's cost models use it (:meth:`cpscope.hybrid.CostModel.for_layer_mix`, the ``plan``
command's ``--linear-layers``).

:meth:`LayerMix.from_config` reads a transformers config — the object or its ``config.json`` as a dict, no
transformers import — from ``layer_types`` (transformers' own vocabulary), else ``layers_block_type``, else
``full_attention_interval`` (Qwen3-Next's original files), else ``attn_layer_indices`` (Bamba), else every layer
attends. A ``"hybrid"`` layer (Falcon-H1: attention and Mamba2 side by side) counts as both.

Example::

    >>> LayerMix.from_layer_types(["linear_attention"] * 3 + ["full_attention"])
    LayerMix(attention=1, linear=3, layers=4)
    >>> LayerMix.from_config({"num_hidden_layers": 48, "full_attention_interval": 4}).attention_fraction
    0.25
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["ATTENTION_LAYER_TYPES", "LINEAR_LAYER_TYPES", "NO_MIXER_LAYER_TYPES", "LayerMix"]

# ``layer_types`` entries (transformers 5 names; legacy names too) whose layers mix tokens in linear time.
LINEAR_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2", "recurrent", "rwkv")
# Entries whose layers attend (quadratic time); "hybrid" layers do both.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention", "window_attention",
                         "indexed_attention", "hybrid", "hybrid_sliding")
# Entries whose layers mix no tokens (Nemotron-H's MLP and MoE blocks, transformers' MLP kinds).
NO_MIXER_LAYER_TYPES = ("mlp", "moe", "dense", "sparse")


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def _text(config: Any) -> Any:
    if isinstance(config, Mapping):
        text = config.get("text_config")
        return text if isinstance(text, Mapping) else config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"LayerMix.{name} must be an int ≥ 0, got {value!r}")
    return value


@dataclass(frozen=True)
class LayerMix:
    """How many of a model's ``layers`` blocks attend and how many mix tokens in linear time.

    Attributes:
        attention: layers with attention (quadratic in the document length, K/V around the ring under CP).
        linear: linear-attention, state-space and short-convolution layers (linear in the document length).
        layers: blocks in all (``≥ max(attention, linear)``; a block may have neither — an MLP block — or both).

    Example::

        LayerMix(attention=12, linear=36, layers=48).attention_fraction     # 0.25 (Qwen3-Next-80B)
    """

    attention: int
    linear: int
    layers: int

    def __post_init__(self) -> None:
        for name in ("attention", "linear", "layers"):
            _count(getattr(self, name), name)
        if self.layers < 1 or self.layers < max(self.attention, self.linear):
            raise ValueError(f"LayerMix: layers={self.layers} must be ≥ 1 and ≥ attention={self.attention} and "
                             f"linear={self.linear}")

    @property
    def attention_fraction(self) -> float:
        """The share of the blocks that attend (1.0 for an attention-only decoder)."""
        return self.attention / self.layers

    @classmethod
    def from_layer_types(cls, layer_types: Iterable[str]) -> "LayerMix":
        """Count transformers' ``layer_types`` entries (see the module docstring); ``ValueError`` on unknown kinds.

        Example::

            LayerMix.from_layer_types(["conv", "full_attention", "conv"])    # LayerMix(attention=1, linear=2, ...)
        """
        kinds = [str(t) for t in layer_types]
        unknown = sorted({t for t in kinds if t not in ATTENTION_LAYER_TYPES + LINEAR_LAYER_TYPES
                          + NO_MIXER_LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer types {unknown} are none of attention {list(ATTENTION_LAYER_TYPES)}, "
                             f"linear-time {list(LINEAR_LAYER_TYPES)} or {list(NO_MIXER_LAYER_TYPES)}")
        return cls(attention=sum(t in ATTENTION_LAYER_TYPES for t in kinds),
                   linear=sum(t in LINEAR_LAYER_TYPES for t in kinds), layers=max(len(kinds), 1))

    @classmethod
    def from_config(cls, config: Any) -> "LayerMix":
        """The mix of a transformers config (object, or ``config.json`` as a dict); see the module docstring.

        Raises:
            ValueError: no ``num_hidden_layers`` nor layer list; unknown layer kinds; an interval or index out of range.

        Example::

            LayerMix.from_config(model.config)         # Qwen3_5TextConfig(...): attention=n/4, linear=3n/4
        """
        config = _text(config)
        for name in ("layer_types", "layers_block_type"):
            kinds = _get(config, name)
            if isinstance(kinds, (list, tuple)) and kinds:
                return cls.from_layer_types(kinds)
        layers = _get(config, "num_hidden_layers")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"the config has no layer_types and num_hidden_layers={layers!r}; cannot count its "
                             f"attention and linear-time layers")
        interval = _get(config, "full_attention_interval")
        if interval is not None:
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise ValueError(f"full_attention_interval must be an int ≥ 1, got {interval!r}")
            attention = layers // interval  # layer i attends when (i + 1) % interval == 0
            return cls(attention=attention, linear=layers - attention, layers=layers)
        indices = _get(config, "attn_layer_indices")
        if isinstance(indices, (list, tuple)):
            bad = [i for i in indices if not isinstance(i, int) or not 0 <= i < layers]
            if bad:
                raise ValueError(f"attn_layer_indices {bad} are outside the {layers} layers")
            attention = len(set(indices))
            return cls(attention=attention, linear=layers - attention, layers=layers)
        return cls(attention=layers, linear=0, layers=layers)
