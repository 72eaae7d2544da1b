"""``enable_runtime_cp(model)``: bind every token-mixing layer of a transformers model to the active CP scope.

Attention follows the scope through ``attn_implementation="cpscope"``; hybrid decoders also have layers whose state
runs along the sequence — gated DeltaNet (Qwen3.5, Qwen3-Next), Kimi Delta Attention (Kimi Linear), Mamba2
(Nemotron-H, Bamba, Granite 4 hybrids, Falcon-H1) and LFM2's short convolutions. :func:`enable_runtime_cp` switches
the model to ``"cpscope"`` attention and swaps each such layer's class for one whose forward runs the layer's
convolution and recurrence through cpscope's CP-aware core (:mod:`cpscope.integrations.hf._bound_layers`), so under
any CP size — and with CP1 / CP2 / CP4 microbatches in one job — the model gives its CP1 logits, loss and gradients,
packed documents isolated. A token mixer it cannot bind raises ``ValueError`` naming it; :func:`disable_runtime_cp`
undoes the binding.

A token mixer is recognised by its depthwise ``nn.Conv1d`` (every one of these layers has one: the short
convolution before the recurrence); their number is checked against the config's ``layer_types``.

Example::

    import cpscope, cpscope.integrations.hf as cphf
    model = AutoModelForCausalLM.from_config(Qwen3NextConfig(...))
    bound = cphf.enable_runtime_cp(model)     # ['model.layers.0.linear_attn', ..., 'model.layers.3.self_attn', ...]
    with cpscope.runtime_cp(groups[2]):
        loss = model(**cphf.shard_batch({"input_ids": ids, "labels": ids})).loss
"""
from __future__ import annotations

import logging

from torch import nn

from .._swap import original_class, swap_class, unswap
from ._bound_layers import MIXINS
from ._mixers import BOUND_ATTRIBUTE, MIXER_LAYER_TYPES
from ._model_check import base_model, use_cpscope_attention

__all__ = ["disable_runtime_cp", "enable_runtime_cp", "token_mixers"]

logger = logging.getLogger(__name__)


def _is_token_mixer(module: nn.Module) -> bool:
    """A layer that owns a depthwise 1-D convolution along the sequence (the short conv of every hybrid mixer)."""
    return any(isinstance(c, nn.Conv1d) and c.groups > 1 and c.groups == c.in_channels == c.out_channels
               for c in module.children())


def token_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every layer of ``model`` that mixes tokens outside attention.

    Example::

        [name for name, _ in token_mixers(qwen3_next)]   # ['model.layers.0.linear_attn', 'model.layers.1...']
    """
    return [(name, m) for name, m in base_model(model).named_modules() if _is_token_mixer(m)]


def _expected_mixers(config: object) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return sum(1 for t in (getattr(text, "layer_types", None) or ()) if str(t) in MIXER_LAYER_TYPES)


def enable_runtime_cp(model: nn.Module) -> list[str]:
    """Bind every token-mixing layer of ``model`` (unwrapped from DDP / FSDP / PEFT) to the active CP scope.

    Switches the model to ``attn_implementation="cpscope"`` and swaps the class of each linear-attention,
    state-space or short-convolution layer for its CP-aware version (parameters and ``state_dict`` unchanged).
    Idempotent. Returns the qualified names of the layers bound: the token mixers and the attention layers.

    Raises:
        ValueError: a token-mixing layer no binding fits (named); fewer token mixers than the config's
            ``layer_types`` announce; a model whose attention cannot switch to ``"cpscope"``.

    Example::

        bound = enable_runtime_cp(model)          # then shard batches with shard_batch under runtime_cp(...)
    """
    inner = base_model(model)
    mixers = token_mixers(inner)
    plan = []
    for name, module in mixers:
        mixin = next((m for m in MIXINS if m._cpscope_binds(module)), None)
        if mixin is None:
            raise ValueError(
                f"enable_runtime_cp: {name} ({original_class(module).__name__}) mixes tokens along the sequence "
                f"(a depthwise convolution) but is none of the layers cpscope can bind (gated DeltaNet, Kimi Delta "
                f"Attention, Mamba2, LFM2 short convolution); this model cannot run under CP"
            )
        plan.append((name, module, mixin))
    expected = _expected_mixers(inner.config)
    if len(mixers) < expected:
        raise ValueError(
            f"enable_runtime_cp: {type(inner).__name__}'s config announces {expected} linear-attention / "
            f"state-space / convolution layers but only {len(mixers)} token-mixing modules were found "
            f"({[n for n, _ in mixers]}); cpscope cannot tell how the others mix tokens"
        )
    use_cpscope_attention(inner)
    for name, module, mixin in plan:  # bind only once everything is known to bind
        swap_class(module, mixin)
    mixer_ids = {id(m) for _, m in mixers}
    attention = []
    for name, module in inner.named_modules():
        if id(module) in mixer_ids or getattr(module, "config", None) is None:
            continue
        module.__dict__[BOUND_ATTRIBUTE] = True  # the attention function checks it (mixers.refuse_unbound_mixers)
        if "Attention" in type(module).__name__:
            attention.append(name)
    bound = sorted([n for n, _ in mixers] + attention)
    logger.info("enable_runtime_cp: %s bound %d token mixers and %d attention layers", type(inner).__name__,
                len(mixers), len(attention))
    return bound


def disable_runtime_cp(model: nn.Module) -> list[str]:
    """Undo :func:`enable_runtime_cp`: the mixers' own classes again; returns the names of the modules restored.

    The model keeps ``attn_implementation="cpscope"`` (plain attention at CP1); under CP > 1 it is then refused again.
    """
    inner = base_model(model)
    restored = []
    for name, module in inner.named_modules():
        if module.__dict__.pop(BOUND_ATTRIBUTE, None):
            restored.append(name)
        if type(module).__dict__.get("_cpscope_mixin") in MIXINS and unswap(module):
            restored.append(name)
    return sorted(set(restored))
