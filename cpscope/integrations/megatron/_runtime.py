""":func:`enable_runtime_cp`: a megatron-core model built with a static CP size follows the group of each microbatch.

What it changes, in place (each module keeps its parameters and ``state_dict`` keys; classes are swapped for
subclasses, as FSDP2's ``fully_shard`` does, with :mod:`cpscope.integrations._swap`; :func:`disable_runtime_cp`
undoes everything):

entry
    The outermost modules whose ``forward`` takes ``packed_seq_params`` (``GPTModel``; or a bare ``TransformerBlock``
    / ``TransformerLayer``). Each forward resolves the microbatch's scope **once**: the one ``packed_seq_params``
    names (``cp_group`` / ``local_cp_size``, both CP1 conventions), else the enclosing one (the innermost
    :func:`cpscope.runtime_cp`, else the build-time group). It validates the batch against that scope
    (``ValueError`` before any collective), binds it for the forward and passes a per-forward copy of
    ``packed_seq_params`` that carries it to every layer (see :mod:`._carrier`).
RoPE
    ``RotaryEmbedding`` (table and per-rank rows) and every ``Attention`` (the group its RoPE gets): :mod:`._rope`.
core attention
    Megatron's local ``DotProductAttention`` → cpscope's ring (:class:`RingCoreAttention`); ``TEDotProductAttention``
    → bound per call to the scope, with :func:`cpscope.cp_stream`, restored after (:class:`TEAttentionMixin`).

Every other reader of ``pg_collection.cp`` in megatron-core 0.19.2 (audited with ``grep -rn "pg_collection.cp\\|
get_context_parallel_group\\|cp_group"``) either only runs at build time or in inference / CUDA-graph capture, or
would compute with the static group under runtime CP. MoE routers (aux losses, z-loss and token counts over the
``tp_cp`` / ``tp_dp_cp`` groups) follow the microbatch (:mod:`._moe`), and so do multi-token prediction's rolls
and its loss normalisation (:mod:`._mtp`). The others are refused by :func:`enable_runtime_cp` with a
``ValueError`` naming the option: multi-latent attention and YaRN / mRoPE (their own CP RoPE paths), Mamba /
gated-delta-net mixers (CUDA-only kernels: :mod:`._mixers` says why), CUDA graphs (static ``seq_length //
context_parallel_size`` inputs), and the options :func:`._moe.moe_refusals` and :func:`._mtp.mtp_refusals` name.
Inference (``inference_context``) is refused at forward.

Example::

    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size, max_len, position_embedding_type="rope")
    enable_runtime_cp(model)                                  # built with CP1
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m,
                          cp_group=groups[2], local_cp_size=2)
    logits = model(tokens_local, None, None, packed_seq_params=psp)   # CP2 in RoPE and attention
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, NamedTuple, Optional

from torch import nn

from ..._checks import check_divisible_seq, check_local_thd_len
from ..._pack import cu_seqlens_list
from ...groups import group_ranks
from ...scope import CPScope, build_time_cp_group, scope_for
from ._carrier import consumer_scope, with_scope
from ._core_attention import RingCoreAttention, TEAttentionMixin, is_causal
from ._mixers import LINEAR_MIXER_REFUSALS
from ._moe import MoELayerMixin, check_cp_beside_tp, check_routers, is_moe_layer, moe_refusals
from ._mtp import MTPModelMixin, is_mtp_model, mtp_refusals
from ._packed_seq_params import read_packed_seq_params
from ._rope import AttentionRopeMixin, RotaryTableMixin
from ._version import check_megatron_core
from .._swap import ForwardSignature, original_class, swap_class, unswap_all

__all__ = ["enable_runtime_cp", "disable_runtime_cp"]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Entry


class EntryMixin(ForwardSignature):
    """The entry forward: resolve the microbatch's scope once, validate, bind it and carry it down."""

    _cpscope_static: CPScope  # the model's static (build-time) CP scope, from its pg_collection.cp
    _cpscope_recompute: bool
    _cpscope_rotary: list  # the RotaryTableMixin modules below this entry
    _cpscope_tp: Optional[tuple[int, ...]]  # the global ranks of the model's TP group (None: TP1)
    _cpscope_routers: list  # the MoE routers below this entry

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = self._cpscope_signature.bind(*args, **kwargs)
        arguments = call.arguments
        psp = arguments.get("packed_seq_params")
        for name in ("inference_context", "inference_params"):
            if arguments.get(name) is not None:
                raise ValueError(f"{name} is given: inference is not supported under cpscope's runtime CP")
        self._cpscope_check_build_time()
        scope = consumer_scope(psp)  # named by packed_seq_params, else the enclosing scope — read once, here
        if self._cpscope_tp is not None and scope.size > 1:
            check_cp_beside_tp(scope.group, self._cpscope_tp)
            check_routers(self._cpscope_routers, scope)  # the [tp, cp] groups: refused here, before any collective
        if psp is None:
            if self._cpscope_recompute and self.training:  # type: ignore[attr-defined]
                raise ValueError(
                    "Megatron activation recompute (recompute_granularity="
                    f"{self.config.recompute_granularity!r}) under cpscope's runtime CP needs packed_seq_params: "  # type: ignore[attr-defined]
                    "it carries the microbatch's CP scope into the recompute during backward. Pass "
                    "packed_seq_params (e.g. cpscope.integrations.megatron.MegatronMicrobatch.packed_seq_params()) or "
                    "turn Megatron's recompute off and checkpoint with cpscope.checkpoint"
                )
            _check_dense(arguments, scope)
        else:
            _check_packed(psp, arguments, scope)
            arguments["packed_seq_params"] = with_scope(psp, scope)
        _, first = _first_tensor(arguments, "input_ids", "decoder_input", "hidden_states")
        if first is not None:
            for rotary in self._cpscope_rotary:  # a placement hint (no scope): build RoPE tables where the model runs
                rotary.__dict__["_cpscope_device"] = first.device
        with scope.bind():
            return super().forward(*call.args, **call.kwargs)  # type: ignore[misc]

    def _cpscope_check_build_time(self) -> None:
        built = scope_for(build_time_cp_group())
        static = self._cpscope_static
        if built.size != static.size or (static.size > 1 and built.group is not static.group):
            raise ValueError(
                f"this model was built with static CP{static.size} (its pg_collection.cp) but cpscope's build-time "
                f"group is CP{built.size}: outside every runtime_cp scope the model must run its own static group. "
                "Call cpscope.set_build_time_cp_group(model.pg_collection.cp) after building it"
            )


def _first_tensor(arguments: dict[str, Any], *names: str) -> Any:
    for name in names:
        value = arguments.get(name)
        if value is not None:
            return name, value
    return None, None


def _check_packed(psp: Any, arguments: dict[str, Any], scope: CPScope) -> None:
    """``thd``: offsets against ``2·cp``, local token count, ``max_seqlen`` — ``ValueError`` before any collective."""
    fmt = getattr(psp, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={fmt!r}: cpscope's Megatron adapter runs packed batches as 'thd'")
    info = read_packed_seq_params(psp, enclosing=scope)  # layout offsets vs 2*cp of the scope that runs
    if info.cu_seqlens is None:
        raise ValueError("packed_seq_params.qkv_format='thd' needs cu_seqlens_q (global document offsets)")
    layout = cu_seqlens_list(info.cu_seqlens, "cu_seqlens_q_padded")
    if psp.cu_seqlens_q_padded is not None and psp.cu_seqlens_q is not None:
        real = cu_seqlens_list(psp.cu_seqlens_q, "cu_seqlens_q")
        bad = [i for i, (a, b, c, d) in enumerate(zip(real[:-1], real[1:], layout[:-1], layout[1:])) if b - a > d - c]
        if len(real) != len(layout) or bad:
            raise ValueError(
                f"packed_seq_params: cu_seqlens_q {real} and cu_seqlens_q_padded {layout} must list the same "
                f"documents, each real length at most its padded length (documents {bad[:5]} are longer)"
            )
    longest = max((b - a for a, b in zip(layout[:-1], layout[1:])), default=0)
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(psp, name, None)
        if value is None or int(value) < longest:
            raise ValueError(
                f"packed_seq_params.{name}={value!r}: must be set and at least the longest (padded) document, "
                f"{longest} (Megatron sizes the RoPE table from it)"
            )
    name, t = _first_tensor(arguments, "input_ids", "decoder_input", "hidden_states")
    if t is not None:
        local = t.shape[1] if name == "input_ids" else t.shape[0]  # input_ids [1, t]; hidden [t, 1, h]
        other = t.shape[0] if name == "input_ids" else t.shape[1]
        if other != 1:
            raise ValueError(f"packed (thd) batches have batch size 1; {name} has shape {tuple(t.shape)}")
        check_local_thd_len(local, layout, scope.size, name)


def _check_dense(arguments: dict[str, Any], scope: CPScope) -> None:
    if scope.size == 1:
        return
    name, t = _first_tensor(arguments, "input_ids", "decoder_input", "hidden_states")
    if t is not None:
        local = t.shape[1] if name == "input_ids" else t.shape[0]  # input_ids [b, s]; hidden [s, b, h]
        check_divisible_seq(local * scope.size, scope.size, f"sequence length (local {local} x cp {scope.size})")


# ----------------------------------------------------------------------------------------------------------------
# enable / disable


def _refusals(config: Any, modules: list[nn.Module]) -> list[str]:
    """Options whose CP consumers would keep the static group under runtime CP (see the module docstring)."""
    out = []
    out += mtp_refusals(config)  # MTP rolls follow the scope (._mtp); what they cannot is refused there
    out += moe_refusals(config)  # MoE routers follow the scope (._moe); what they cannot is refused there
    if getattr(config, "multi_latent_attention", False):  # local spec: 0.19.2's DotProductAttention takes no
        out.append("multi_latent_attention=True (MLA's own CP RoPE path; megatron-core 0.19.2's local spec cannot "
                   "build MLA (its DotProductAttention takes no k_channels / v_channels), so it is not verified)")
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none") or getattr(config, "enable_cuda_graph", False):
        out.append(f"cuda_graph_impl={getattr(config, 'cuda_graph_impl', None)!r} (graphs capture static CP shapes)")
    names = {type(m).__name__ for m in modules}
    for cls in ("YarnRotaryEmbedding", "MultimodalRotaryEmbedding", "MultiLatentAttention"):
        if cls in names:
            out.append(f"{cls} modules (their own CP paths read the static group)")
    out += [LINEAR_MIXER_REFUSALS[cls] for cls in LINEAR_MIXER_REFUSALS if cls in names]
    return out


def _local_refusals(config: Any, cores: list[nn.Module]) -> list[str]:
    """What the ring cannot take over from the local spec's ``DotProductAttention`` modules ``cores``."""
    out = []
    if getattr(config, "attention_dropout", 0.0):
        out.append(f"attention_dropout={config.attention_dropout} (cpscope's ring attention has no dropout: build "
                   "with attention_dropout=0.0)")
    window = getattr(config, "window_size", None)
    causal = [c for c in cores if getattr(getattr(c, "scale_mask_softmax", None), "window_size", None) is not None
              and is_causal(c.attn_mask_type)]
    if window is not None and causal and int(window[1]) != 0:
        out.append(  # local: the window replaces the causal mask; TE (and the ring) apply both
            f"window_size={tuple(window)} with a causal mask (Megatron's local attention then drops the causal mask, "
            "TE keeps it; use window_size=(left, 0))")
    return out


def _tp_ranks(model: nn.Module) -> Optional[tuple[int, ...]]:
    """The global ranks of the model's tensor-parallel group (its ``pg_collection.tp``), ``None`` for TP1."""
    tp = getattr(getattr(model, "pg_collection", None), "tp", None)
    if tp is None or tp.size() == 1:
        return None
    return tuple(group_ranks(tp))


def _static_scope(model: nn.Module) -> CPScope:
    pgs = getattr(model, "pg_collection", None)
    cp = getattr(pgs, "cp", None) if pgs is not None else None
    return scope_for(cp)


def enable_runtime_cp(model: nn.Module) -> list[str]:
    """Make a megatron-core model follow the CP group bound per microbatch in every CP consumer it has, in place.

    After the call, each forward of ``model`` runs with the scope the microbatch names — ``packed_seq_params.
    cp_group`` / ``local_cp_size`` (``None`` and a size-1 group both mean CP1) — or, when it names none, the enclosing
    :func:`cpscope.runtime_cp` (else the build-time group, which must be the model's own static group). RoPE (fused
    and unfused, table and application), core attention (cpscope's ring for the local spec, TE bound per call with
    a lazily created CP stream) and the per-rank RoPE rows all use it; whatever the modules were built with is
    restored after every call, also on exceptions, so a CP1 microbatch after a CP2 one is CP1. The scope is read once
    per forward and carried on ``packed_seq_params``, so Megatron's own activation recompute
    (``recompute_granularity``) recomputes with it; without ``packed_seq_params`` recompute is refused.

    Calling it again is a no-op for converted modules; :func:`disable_runtime_cp` undoes it. Parameters and
    ``state_dict`` keys are unchanged (save ``state_dict``, not the module object). Do not run one model
    concurrently in two threads with different scopes (the per-call bindings live on its modules).

    Args:
        model: a megatron-core module (``GPTModel``, ``TransformerBlock``, ``TransformerLayer``, or a wrapper whose
            submodules are those).

    Returns:
        The qualified names of the modules converted.

    Raises:
        ImportError: megatron-core is not installed.
        RuntimeError: an unsupported megatron-core release (:data:`SUPPORTED_MEGATRON_CORE`).
        ValueError: the model uses an option whose CP consumers cannot follow a runtime group (MLA, YaRN /
            mRoPE, Mamba / linear attention, CUDA graphs, MoE with expert parallelism or MoE recompute, MTP with
            ``calculate_per_token_loss``;
            with the local spec also attention dropout and a causal window reaching right), or no module of it
            takes ``packed_seq_params``.

    Example::

        enable_runtime_cp(model)                              # built with CP1 (or any static CP)
        for mb in microbatches:                               # each names its group, or runs inside runtime_cp
            loss = loss_fn(model(mb.tokens, None, None, packed_seq_params=mb.psp), mb.labels)
            loss.backward()                                   # no scope needed here
    """
    classes = _megatron_classes()
    modules = dict(model.named_modules())
    config = _check_supported(modules, classes)
    entries = _entries(model)
    if not entries:
        raise ValueError(
            f"enable_runtime_cp: no module of {type(model).__name__} takes packed_seq_params in forward "
            "(expected a megatron-core GPTModel, TransformerBlock or TransformerLayer)"
        )
    for _, module in entries:
        recompute = getattr(getattr(module, "config", None), "recompute_granularity", None) is not None
        swap_class(module, _entry_mixin(module), _cpscope_static=_static_scope(module), _cpscope_recompute=recompute,
                   _cpscope_tp=_tp_ranks(module))
    names = [name for name, _ in entries] + _convert_consumers(modules, config, classes)
    for _, entry in entries:
        entry.__dict__["_cpscope_rotary"] = [m for m in entry.modules() if isinstance(m, RotaryTableMixin)]
        entry.__dict__["_cpscope_routers"] = [m.mlp.router for m in entry.modules() if is_moe_layer(m)]
    logger.debug("enable_runtime_cp: converted %d modules", len(names))
    return sorted(set(names))


def _entry_mixin(module: nn.Module) -> tuple[type, ...]:
    """The entry's mixins: the entry, and the consumer binding the entry module itself needs — a bare MoE
    ``TransformerLayer``'s router, a ``GPTModel``'s multi-token prediction rolls (:mod:`._mtp`) — chosen once:
    swapping an entry again would drop its state."""
    if is_mtp_model(module):
        return (EntryMixin, MTPModelMixin)
    return (EntryMixin, MoELayerMixin) if is_moe_layer(module) else (EntryMixin,)


class _Classes(NamedTuple):
    """The megatron-core classes whose modules :func:`enable_runtime_cp` converts."""

    rotary: type  # RotaryEmbedding
    attention: type  # Attention (self-attention's base)
    local_core: type  # the local spec's DotProductAttention
    te_core: Optional[type]  # TEDotProductAttention, where TransformerEngine is installed


def _megatron_classes() -> _Classes:
    check_megatron_core()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    te_cls: Optional[type] = None
    try:  # TE-spec models only exist where TransformerEngine is installed
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention

        te_cls = TEDotProductAttention if HAVE_TE else None
    except ImportError:  # pragma: no cover - depends on the installation
        te_cls = None
    return _Classes(RotaryEmbedding, Attention, DotProductAttention, te_cls)


def _check_supported(modules: dict[str, nn.Module], classes: _Classes) -> Any:
    """The model's config; ``ValueError`` listing every option whose CP consumers cannot follow a runtime group."""
    configs = [m.config for m in modules.values() if getattr(m, "config", None) is not None]
    config = configs[0] if configs else None
    bad = _refusals(config, list(modules.values())) if config is not None else []
    cores = [m for m in modules.values() if type(m) is classes.local_core]
    if cores and config is not None:
        bad += _local_refusals(config, cores)
    if bad:
        raise ValueError("enable_runtime_cp: not supported with runtime CP: " + "; ".join(bad))
    return config


def _convert_consumers(modules: dict[str, nn.Module], config: Any, classes: _Classes) -> list[str]:
    """Swap every CP consumer below the entries (RoPE table, attention, TE core attention); the names converted."""
    names: list[str] = []
    for name, module in modules.items():
        base = original_class(module)
        if base is classes.rotary:  # YaRN / multimodal subclasses are refused by _refusals
            static_cp = int(getattr(config, "context_parallel_size", 1) or 1)
            swap_class(module, RotaryTableMixin, _cpscope_config_cp_size=static_cp)
        elif issubclass(base, classes.attention):
            swap_class(module, AttentionRopeMixin)
            core = getattr(module, "core_attention", None)
            if type(core) is classes.local_core:
                module.core_attention = core = RingCoreAttention.replacing(core)
            if isinstance(core, RingCoreAttention):  # replaced now or by an earlier call
                names.append(f"{name}.core_attention" if name else "core_attention")
        elif classes.te_core is not None and issubclass(base, classes.te_core):
            swap_class(module, TEAttentionMixin)
        elif is_mtp_model(module):  # its MTP rolls follow the microbatch (._mtp; an entry already has them)
            if not isinstance(module, MTPModelMixin):
                swap_class(module, MTPModelMixin)
        elif is_moe_layer(module):  # its router's groups follow the microbatch (an entry layer has them already)
            if not isinstance(module, MoELayerMixin):
                swap_class(module, MoELayerMixin)
        else:
            continue
        names.append(name)
    return names


def _entries(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose forward takes ``packed_seq_params`` (and that are not attention modules)."""
    from megatron.core.transformer.attention import Attention

    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p, _ in out if p) or (out and out[0][0] == ""):
            continue
        base = original_class(module)
        if issubclass(base, (Attention,)) or isinstance(module, (RingCoreAttention,)):
            continue
        forward = getattr(base, "forward", None)
        try:
            params = inspect.signature(forward).parameters if forward is not None else {}
        except (TypeError, ValueError):
            params = {}
        if "packed_seq_params" in params and hasattr(module, "config"):
            out.append((name, module))
    return out


def disable_runtime_cp(model: nn.Module) -> list[str]:
    """Undo :func:`enable_runtime_cp`: original classes and core-attention modules; returns the names restored.

    Example::

        enable_runtime_cp(model)
        ...
        disable_runtime_cp(model)     # Megatron's own CP handling (the static group) again
    """
    names = []
    for name, module in list(model.named_modules()):
        core = getattr(module, "core_attention", None)
        if isinstance(core, RingCoreAttention) and core.original() is not None:
            module.core_attention = core.original()
            names.append(f"{name}.core_attention" if name else "core_attention")
    return sorted(set(names + unswap_all(model)))
