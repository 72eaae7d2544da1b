"""Before the first hybrid-CP step: can this transformers model run under CP without mixing documents?

Three checks, all local (no collective of cpscope's; an FSDP2 model's own all-gathers run on every rank alike):

1. the model's layers (``config.layer_types``, where the model has them) are attention layers, layers without a
   token mixer (MLP / MoE blocks), or linear-attention, state-space and short-convolution layers that
   :func:`cpscope.integrations.hf.enable_runtime_cp` bound to the scope (one bound mixer per such layer); an unbound
   one would run its recurrence on each rank's zigzag chunks alone;
2. ``attn_implementation="cpscope"`` is set (:func:`use_cpscope_attention` sets it) and **every** attention layer
   (``layer_types``' attention and hybrid entries, else every decoder layer) really runs through it — a layer that
   bypasses transformers' ``AttentionInterface`` would run its own attention on zigzag shards;
3. a probe: a packed row of two documents, at CP1, must give the second document the logits it gets alone. Any
   token mixing across the boundary (a layer outside the interface, a custom mask, a cumulative op) shows here.

Example::

    use_cpscope_attention(model)              # ValueError if the model cannot switch
    check_model_for_cp(model)                 # ValueError naming what mixes documents
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from transformers import AttentionInterface

from ...scope import runtime_cp
from ._bound_layers import MIXINS
from ._mixers import MIXER_LAYER_TYPES
from ._recompute import ATTN_IMPLEMENTATION

__all__ = ["use_cpscope_attention", "check_model_for_cp", "base_model", "call_model"]

logger = logging.getLogger(__name__)

# Layer kinds that are attention (what cpscope shards); "hybrid" layers (Falcon-H1) run attention and a mixer.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
_BOTH_LAYER_TYPES = ("hybrid", "hybrid_sliding")
# Layer kinds without a token mixer (Nemotron-H's MLP / MoE blocks; MLP kinds of ``ALLOWED_MLP_LAYER_TYPES``).
_NO_MIXER_LAYER_TYPES = ("mlp", "moe", "dense", "sparse")
_PROBE_LENGTHS = (6, 10)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / accelerate / PEFT wrappers (what holds ``config``)."""
    inner = model
    for _ in range(8):
        if hasattr(inner, "get_base_model") and callable(inner.get_base_model):
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "module", None), torch.nn.Module) and not hasattr(inner, "config"):
            inner = inner.module
        else:
            break
    return inner


def use_cpscope_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (unwrapped as needed) to ``attn_implementation="cpscope"``; ``ValueError`` if it cannot.

    Example::

        use_cpscope_attention(model)     # the same weights; attention through cpscope (plain attention at CP1)
    """
    inner = base_model(model)
    config = getattr(inner, "config", None)
    if config is None:
        raise ValueError(f"hybrid CP needs a transformers model (with a config); got {type(inner).__name__}")
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        before = getattr(config, "_attn_implementation", None)
        setter = getattr(inner, "set_attn_implementation", None)
        if callable(setter):
            setter(ATTN_IMPLEMENTATION)
        if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"{type(inner).__name__} cannot switch its attention to attn_implementation="
                f"{ATTN_IMPLEMENTATION!r} (it stays {getattr(config, '_attn_implementation', None)!r}): its "
                f"attention does not go through transformers' AttentionInterface, so it cannot run under CP"
            )
        logger.info("hybrid CP: %s switched from attn_implementation=%r to %r", type(inner).__name__, before,
                    ATTN_IMPLEMENTATION)


def _bound_mixers(model: torch.nn.Module) -> int:
    """How many modules of ``model`` ``enable_runtime_cp`` bound as token mixers (their class swapped)."""
    return sum(1 for m in model.modules() if isinstance(m, MIXINS))


def _check_layer_types(config: Any, model: torch.nn.Module) -> Optional[int]:
    """Refuse layer kinds that would mix tokens unbound; the number of attention layers ``layer_types`` names."""
    layer_types = [str(t) for t in (getattr(config, "layer_types", None) or ())]
    if not layer_types:
        return None
    known = _ATTENTION_LAYER_TYPES + _BOTH_LAYER_TYPES + _NO_MIXER_LAYER_TYPES + MIXER_LAYER_TYPES
    other = sorted({t for t in layer_types if t not in known})
    if other:
        raise ValueError(
            f"{type(config).__name__} has layers of type {other}: cpscope does not know how they mix tokens "
            f"(attention, linear-attention, state-space and short-convolution layers it knows), so this model "
            f"cannot run under CP"
        )
    mixing = [t for t in layer_types if t in MIXER_LAYER_TYPES]
    bound = _bound_mixers(model)
    if len(mixing) > bound:
        raise ValueError(
            f"{type(config).__name__} has {len(mixing)} layers of type {sorted(set(mixing))} (linear-attention, "
            f"state-space or short-convolution layers: they mix tokens outside attention) but only {bound} token "
            f"mixers bound to the CP scope; call cpscope.integrations.hf.enable_runtime_cp(model) (the hybrid-CP "
            f"trainer does) so that they run under CP"
        )
    return sum(1 for t in layer_types if t in _ATTENTION_LAYER_TYPES + _BOTH_LAYER_TYPES)


def call_model(module: Callable[..., Any], input_ids: torch.Tensor, position_ids: torch.Tensor,
               cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """One packed forward of local tokens ``[T]`` with global document offsets; returns the logits ``[T, vocab]``."""
    out = module(input_ids=input_ids[None], position_ids=position_ids[None], cu_seq_lens_q=cu_seqlens,
                 cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[0]


def _probe(module: Callable[..., Any], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Logits of the second probe document packed after the first, and alone; the attention modules called."""
    gen = torch.Generator().manual_seed(1234)
    a, b = _PROBE_LENGTHS
    ids = torch.randint(0, vocab, (a + b,), generator=gen).to(device)
    packed_pos = torch.cat([torch.arange(a), torch.arange(b)]).to(device)
    called: list = []
    original = AttentionInterface._global_mapping[ATTN_IMPLEMENTATION]

    def counting(attn_module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        called.append(attn_module)
        return original(attn_module, *args, **kwargs)

    AttentionInterface.register(ATTN_IMPLEMENTATION, counting)
    try:
        packed = call_model(module, ids, packed_pos, torch.tensor([0, a, a + b], dtype=torch.int32), b)[a:]
        n_packed = len({id(m) for m in called})
        alone = call_model(module, ids[a:], packed_pos[a:], torch.tensor([0, b], dtype=torch.int32), b)
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, original)
    return packed, alone, called[:n_packed] if n_packed else []


def check_model_for_cp(model: torch.nn.Module, *, forward_module: Optional[Callable[..., Any]] = None) -> None:
    """Refuse a model whose forward would mix documents (or skip cpscope's attention) under CP; see the module.

    ``forward_module`` is what the training step calls (e.g. a DDP's ``.module``); default ``model``. Runs in
    eval mode without gradients (dropout off), then restores the training mode.

    Example::

        check_model_for_cp(model)     # ValueError: "layer 3 of 4 ran no cpscope attention ..."
    """
    inner = base_model(model)
    config = inner.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    attention_layers = _check_layer_types(text, inner)
    module = forward_module if forward_module is not None else model
    try:
        device = next(p.device for p in inner.parameters())
    except StopIteration:
        device = torch.device("cpu")
    training = [(m, m.training) for m in inner.modules()]
    inner.eval()
    try:
        with torch.no_grad(), runtime_cp(None):
            packed, alone, called = _probe(module, int(text.vocab_size), device)
    finally:
        for m, mode in training:
            m.training = mode
    total = getattr(text, "num_hidden_layers", None)
    layers = attention_layers if attention_layers is not None else total
    what = "layers" if layers == total else "attention layers"
    n_called = len({id(m) for m in called})
    if layers is not None and n_called < int(layers):
        raise ValueError(
            f"{type(inner).__name__}: only {n_called} of its {layers} {what} ran attention through "
            f"attn_implementation={ATTN_IMPLEMENTATION!r}; the others attend (or mix tokens) their own way, which "
            f"cannot run under CP"
        )
    scale = float(alone.abs().max().clamp(min=1e-6))
    diff = float((packed.float() - alone.float()).abs().max()) / scale
    tol = 1e-3 if alone.dtype in (torch.float32, torch.float64) else 5e-2
    if not diff <= tol:
        raise ValueError(
            f"{type(inner).__name__} mixes documents: in a packed row of two documents ({_PROBE_LENGTHS[0]} and "
            f"{_PROBE_LENGTHS[1]} tokens, CP1) the second one's logits differ from its logits alone by "
            f"{diff:.3g} (relative, tolerance {tol:g}); something outside cpscope's document-masked attention "
            f"attends or mixes across documents, so CP would be wrong"
        )
