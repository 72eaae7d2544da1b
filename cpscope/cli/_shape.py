"""The planner's cost model and the memory per rank, estimated from a model shape and a GPU (no measurement).

:func:`analytic_cost` turns a :class:`ModelShape` and a :class:`Hardware` into the coefficients of
:class:`~cpscope.hybrid.CostModel` (seconds per rank, forward + backward of the whole model):

* ``attn`` — causal attention FLOPs ``Lp²/2 · 4·heads·head_dim`` per **attention** layer forward, backward 2.5×
  forward, at ``attn_efficiency`` of the GPU's dense bf16 peak;
* ``linear`` — ``6 · matmul parameters`` FLOPs per token (projections, MLP, LM head), plus, per linear-time layer
  (``linear_layers``: linear attention, state-space, short convolution), its chunked recurrence
  ``2·heads·head_dim·(2·C + 3·head_dim)`` FLOPs per token forward (chunk ``C`` = 64: the intra-chunk products and
  the state read, update and correction), backward 2.5× forward, at ``linear_efficiency``;
* ``comm`` — the ring's K/V bytes per token received (``2·kv_heads·head_dim`` elements per attention layer
  forward, three times that forward + backward), over NVLink inside a node and the network across nodes, times
  ``exposed_comm`` (the part not hidden behind the attention); linear-time layers send no per-token traffic;
* ``latency`` — ``ring_step_ms`` per attention layer and ring step, ``exchange_ms`` per linear-time layer and peer
  (its state-summary exchange), forward + backward: kernel launches, handshakes, merges.

A hybrid model's attention layers are ``attention_layers`` (default ``layers − linear_layers``; Falcon-H1's blocks
hold both); :meth:`ModelShape.from_hf_config` reads all of it from a transformers config.

Where a CP group spans nodes (``cp > gpus_per_node``) the network's bandwidth prices its traffic
(:class:`NodeAwareCost`). :func:`memory_per_rank` adds the model states and the activations of the largest
microbatch a rank runs. Every number here is an assumption the ``plan`` command prints; ``--calibration`` replaces
the time model by a measured one.

Example::

    >>> shape = PRESETS["llama3-8b"]
    >>> cost = analytic_cost(shape, HARDWARE["h100"], gpus_per_node=8)
    >>> round(shape.params() / 1e9, 2), cost.comm_inter > cost.comm
    (8.03, True)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

import numpy as np

from ..hybrid import CostModel, padded_length
from ..hybrid import LayerMix

__all__ = ["HARDWARE", "PRESETS", "Assumptions", "Hardware", "ModelShape", "NodeAwareCost", "analytic_cost",
           "memory_per_rank"]

GB = 1e9
GIB = 2**30
_ELEM = {"bfloat16": 2, "float16": 2, "float32": 4}
LINEAR_CHUNK = 64  # the chunk of the chunked linear-time recurrences (flash-linear-attention's, Mamba2's SSD)


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: ``layers`` blocks of a token mixer (attention: ``heads`` × ``head_dim``, ``kv_heads`` k/v
    heads) and an MLP (``ffn_hidden``; ``"swiglu"``: three matrices, ``"gelu"``: two), an embedding and an untied LM
    head. In a hybrid model ``linear_layers`` of the blocks mix tokens in linear time instead (linear attention,
    state space, short convolution; priced with the attention's heads and head dim) and ``attention_layers``
    (default ``layers − linear_layers``) attend.

    Example::

        ModelShape(48, 2048, 16, 2, 256, 5632, 151936, linear_layers=36)     # three linear per attention layer
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    mlp: str = "swiglu"
    dtype: str = "bfloat16"
    linear_layers: int = 0
    attention_layers: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model shape: {name} must be an int ≥ 1, got {value!r}")
        for name in ("linear_layers", "attention_layers"):
            value = getattr(self, name)
            if value is None and name == "attention_layers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= self.layers:
                raise ValueError(f"model shape: {name} must be an int in [0, layers={self.layers}], got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model shape: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"model shape: mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        if self.dtype not in _ELEM:
            raise ValueError(f"model shape: dtype must be one of {sorted(_ELEM)}, got {self.dtype!r}")

    def layer_mix(self) -> LayerMix:
        """The attention and linear-time layer counts of this shape."""
        attention = self.layers - self.linear_layers if self.attention_layers is None else self.attention_layers
        return LayerMix(attention=attention, linear=self.linear_layers, layers=self.layers)

    @classmethod
    def from_hf_config(cls, config: Any, *, dtype: str = "bfloat16") -> "ModelShape":
        """The shape of a transformers decoder config (the object or its ``config.json`` as a dict).

        Reads ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
        ``head_dim`` and ``vocab_size``; the MLP width is ``intermediate_size``, or for MoE models the active
        experts' (``num_experts_per_tok × moe_intermediate_size``, plus a shared expert's); the layer counts come
        from :meth:`cpscope.hybrid.LayerMix.from_config`.

        Raises:
            ValueError: a field missing or not a positive int (named).

        Example::

            ModelShape.from_hf_config(json.load(open("config.json")))    # Qwen3-Next: linear_layers=36 of 48
        """
        text = config.get("text_config", config) if isinstance(config, Mapping) else config
        if not isinstance(text, Mapping):
            getter = getattr(text, "get_text_config", None)
            text = getter() if callable(getter) else text

        def get(name: str, default: Any = None) -> Any:
            value = text.get(name, default) if isinstance(text, Mapping) else getattr(text, name, default)
            return default if value is None else value

        def need(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"transformers config: {name} must be an int ≥ 1, got {value!r}")
            return value

        layers, hidden = need("num_hidden_layers", get("num_hidden_layers")), need("hidden_size", get("hidden_size"))
        heads = need("num_attention_heads", get("num_attention_heads"))
        kv_heads = need("num_key_value_heads", get("num_key_value_heads", heads))
        head_dim = need("head_dim", get("head_dim", hidden // heads))
        experts, moe_width = get("num_experts_per_tok"), get("moe_intermediate_size")
        if isinstance(experts, int) and isinstance(moe_width, int) and experts > 0 and moe_width > 0:
            ffn = experts * moe_width + int(get("shared_expert_intermediate_size", 0) or 0)
        else:
            ffn = get("intermediate_size")
        mix = LayerMix.from_config(text)
        return cls(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   ffn_hidden=need("intermediate_size", ffn), vocab=need("vocab_size", get("vocab_size")), dtype=dtype,
                   linear_layers=mix.linear, attention_layers=mix.attention)

    def layer_matmul_params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return attn + (3 if self.mlp == "swiglu" else 2) * self.hidden * self.ffn_hidden

    def params(self) -> int:
        """Every parameter: blocks (with two norms each), the embedding, the final norm and the LM head."""
        return self.layers * (self.layer_matmul_params() + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden

    def activation_bytes_per_token(self) -> int:
        """Bytes one layer keeps for backward per token: the norms' inputs and outputs, q/k/v, the attention output,
        the MLP's inputs and hidden activations (flash attention: no score matrix)."""
        h, d = self.hidden, self.head_dim
        mlp = (3 if self.mlp == "swiglu" else 2) * self.ffn_hidden
        return _ELEM[self.dtype] * (4 * h + (2 * self.heads + 2 * self.kv_heads) * d + mlp)


@dataclass(frozen=True)
class Hardware:
    """One GPU's dense bf16 peak (FLOP/s), memory (bytes), NVLink and network bandwidth per GPU (bytes/s)."""

    name: str
    peak_flops: float
    memory: float
    nvlink: float
    network: float


HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 80 * GB, 450 * GB, 50 * GB),
    "h200": Hardware("H200 SXM", 989e12, 141 * GB, 450 * GB, 50 * GB),
    "a100": Hardware("A100 SXM", 312e12, 80 * GB, 300 * GB, 25 * GB),
    "b200": Hardware("B200", 2250e12, 180 * GB, 900 * GB, 50 * GB),
}

PRESETS = {
    # the GPT of the 2×H200 measurement (benchmarks/_hybrid_gpu.py: examples/gpt.py, 8 layers, hidden 2048)
    "bench-gpt": ModelShape(8, 2048, 16, 16, 128, 8192, 32768, mlp="gelu"),
    "llama3-8b": ModelShape(32, 4096, 32, 8, 128, 14336, 128256),
    "llama3-70b": ModelShape(80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelShape(28, 3584, 28, 4, 128, 18944, 152064),
}


@dataclass(frozen=True)
class Assumptions:
    """What the analytic time and memory model assumes (each a ``plan`` flag)."""

    attn_efficiency: float = 0.4  # of the dense peak, causal flash attention forward + backward
    linear_efficiency: float = 0.4  # of the dense peak, the matmuls (model FLOPs utilisation)
    exposed_comm: float = 0.2  # part of the ring's K/V transfer not hidden behind attention
    ring_step_ms: float = 3.3  # fixed ms per layer and ring step, forward + backward (cpscope's ring, 2×H200)
    state_bytes_per_param: float = 18.0  # bf16 weights 2 + fp32 grads 4 + Adam fp32 master, m, v 12
    logit_bytes: float = 6.0  # per token and vocabulary entry: bf16 logits + fp32 loss / gradient
    recompute: bool = False  # full activation checkpointing: a layer input per layer + one layer's activations
    exchange_ms: float = 0.5  # fixed ms per linear-time layer and CP peer, forward + backward (summary exchange;
    #                           an assumption, not a measurement)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "recompute" and not (isinstance(value, (int, float)) and value >= 0 and np.isfinite(value)):
                raise ValueError(f"assumption {name} must be a finite number ≥ 0, got {value!r}")
        for name in ("attn_efficiency", "linear_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class NodeAwareCost(CostModel):
    """:class:`~cpscope.hybrid.CostModel` whose exposed ring traffic costs ``comm`` per token inside a node
    and ``comm_inter`` once a CP group spans nodes (``cp > gpus_per_node``)."""

    comm_inter: float = 0.0
    gpus_per_node: int = 8

    _RING_FIELDS = ("comm", "comm_inter")

    def padded_seq_cost(self, padded: Any, cp: Any) -> np.ndarray:
        cp_arr = np.asarray(cp, dtype=np.float64)
        lp = np.asarray(padded, dtype=np.float64)
        comm = np.where(cp_arr > self.gpus_per_node, self.comm_inter, self.comm)
        return lp * (self.attn * lp + self.linear + comm * (cp_arr - 1.0)) / cp_arr

    def seq_cost(self, lengths: Any, cp: Any) -> np.ndarray:
        return self.padded_seq_cost(padded_length(lengths, cp), cp)


def analytic_cost(shape: ModelShape, hw: Hardware, *, gpus_per_node: int,
                  assume: Assumptions = Assumptions()) -> NodeAwareCost:
    """The planner's cost model of ``shape`` on ``hw`` under ``assume`` (see the module docstring)."""
    mix = shape.layer_mix()
    attn_flops = 0.5 * 4 * shape.heads * shape.head_dim * 3.5 * mix.attention  # per Lp², causal, fwd + bwd
    linear_flops = 6.0 * (shape.layers * shape.layer_matmul_params() + shape.vocab * shape.hidden)
    recurrence = 2.0 * shape.heads * shape.head_dim * (2 * LINEAR_CHUNK + 3 * shape.head_dim) * 3.5  # fwd + bwd
    linear_flops += recurrence * mix.linear
    kv_bytes = 3 * 2 * shape.kv_heads * shape.head_dim * _ELEM[shape.dtype] * mix.attention  # per token received
    return NodeAwareCost(
        attn=attn_flops / (hw.peak_flops * assume.attn_efficiency),
        linear=linear_flops / (hw.peak_flops * assume.linear_efficiency),
        comm=assume.exposed_comm * kv_bytes / hw.nvlink,
        latency=(assume.ring_step_ms * mix.attention + assume.exchange_ms * mix.linear) * 1e-3,
        comm_inter=assume.exposed_comm * kv_bytes / hw.network,
        gpus_per_node=gpus_per_node,
    )


def memory_per_rank(shape: ModelShape, tokens_per_rank: int, assume: Assumptions = Assumptions()) -> dict[str, float]:
    """Bytes one rank holds at its largest microbatch (``tokens_per_rank`` local tokens): model states,
    activations kept for backward, logits.

    Example::

        >>> m = memory_per_rank(PRESETS["llama3-8b"], 16384)
        >>> round(m["total"] / 2**30, 1), round(m["states"] / 2**30, 1)
        (214.4, 134.6)
    """
    per_layer = shape.activation_bytes_per_token() * tokens_per_rank
    if assume.recompute:
        acts = 2 * shape.hidden * _ELEM[shape.dtype] * tokens_per_rank * shape.layers + per_layer
    else:
        acts = per_layer * shape.layers
    logits = assume.logit_bytes * shape.vocab * tokens_per_rank
    states = assume.state_bytes_per_param * shape.params()
    return {"states": float(states), "activations": float(acts), "logits": float(logits),
            "total": float(states + acts + logits)}
