"""MoE layers under runtime CP: the router's auxiliary losses and token counts use the microbatch's CP group.

megatron-core 0.19.2's ``TopKRouter`` keeps the groups of its build (``pg_collection``) and reads them in every
forward:

``tp_cp_group``
    ``aux_loss`` and ``seq_aux_loss`` all-reduce ``tokens_per_expert`` over it and take the token count as local
    tokens × its size (``moe_utils.get_tokens_per_expert_and_token_count``); the z-loss divides its coefficient by
    its size; ``calculate_per_token_loss`` scales by it; quantile balancing gathers logits over it. With a model
    built with CP1 running a CP2 microbatch it has size 1: the load-balancing loss is computed on each rank's half
    of the sequence (a different loss) and the z-loss counts twice.
``tp_dp_cp_group``
    ``global_aux_loss`` all-reduces ``tokens_per_expert`` over it (every microbatch running at the same forward
    index across the job) and takes the token count as local tokens × its size, which assumes equal token counts
    on all ranks — not so when ranks run different CP sizes.

:class:`MoELayerMixin` (on every ``TransformerLayer`` whose ``mlp`` is a ``MoELayer``) binds, for the call of its
MLP, the router's ``cp_group`` to the microbatch's CP group and its ``tp_cp_group`` to the microbatch's ``[tp, cp]``
group: with tensor parallelism of 1 that *is* the CP group; CP1 is the router's own ``tp`` group; with TP > 1 it is
the group :func:`cpscope.groups.new_tp_cp_groups` made up front for that CP group (looked up with
:func:`~cpscope.groups.lookup_tp_cp`; missing, or a CP group that holds two ranks of one TP group, is a
``ValueError``). It keeps ``tp_dp_cp_group`` (the whole DP×CP domain, which holds every CP group of the job; checked). The scope comes
from the ``packed_seq_params`` carrier (:mod:`._carrier`), so Megatron's full-layer recompute binds the same groups
in backward. It also hands the router a padding mask — the zigzag padding tokens of ``thd`` microbatches
(``cu_seqlens_q`` vs ``cu_seqlens_q_padded``; with sequence parallelism this TP rank's contiguous part of them),
none elsewhere — so token counts come from the all-reduced counts
(exact whatever each rank holds) and padding never enters the statistics, and weights each rank's z-loss by its
share of the microbatch's real tokens. No group is created in forward; nothing is left on the modules after a call.

Aux-loss-free balancing (``moe_router_enable_expert_bias``, as in DeepSeek-V3): each rank adds the tokens it routed
(padding excluded) to the router's ``local_tokens_per_expert``; Megatron's step end (``finalize_model_grads``)
all-reduces them over ``tp_dp_cp`` — every CP group of the job lies inside it — so the bias update sees every token
of the global batch once, as without CP. megatron-core 0.19.2's own ``_apply_expert_bias`` masks the ``[T, E]``
routing map with the ``[T]`` padding mask (a shape error whenever a mask is given); for the call of its MLP the
router counts with :func:`_count_expert_tokens` instead (the same count, the mask broadcast per token).

``global_aux_loss`` all-reduces over the whole DP×CP domain in every forward, as under Megatron's own data
parallelism: every rank must run the same number of MoE forwards per step (one per microbatch). cpscope's planner
does not promise that (ranks may run different numbers of microbatches, some none); give such plans equal counts
per rank (Megatron's ``BalancedCPScheduler`` groups do) or the all-reduce waits for a rank that never comes.

Megatron's metrics tracker keeps one reduction group per metric (the last one recorded); after each call it is set
back to the router's own group, so every rank reduces the logged values over the same groups at report time.

Refused (``ValueError`` from :func:`moe_refusals`): expert parallelism > 1 (its lockstep all-to-alls are not
checked here), an ``expert_tensor_parallel_size`` other than the TP size, ``recompute_modules`` with ``"moe"`` (its recompute in
backward would not see the bound groups), quantile balancing.

Example::

    enable_runtime_cp(moe_model)   # a GPTModel with num_moe_experts, built with CP1: routers follow each microbatch
"""
from __future__ import annotations

import copy
import functools
import weakref
from typing import Any, Optional

import torch

from ..._pack import cu_seqlens_list
from ...groups import group_ranks, lookup_tp_cp
from ...scope import CPScope
from ...sharding import zigzag_indices
from ._carrier import consumer_scope

__all__ = ["MoELayerMixin", "check_cp_beside_tp", "check_routers", "is_moe_layer", "moe_refusals"]

_PAD_ATTR = "_cpscope_moe_padding"
_COUNT_ATTR = "_apply_expert_bias"  # TopKRouter's method that counts the tokens routed per expert
_TP_CP_METRICS = ("load_balancing_loss", "seq_load_balancing_loss")
# CP groups already checked to lie inside a router's tp_dp_cp group (by the latter's id)
_CHECKED: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()
# CP groups already checked to hold one rank per TP group (by the TP group's ranks)
_TP_CHECKED: "weakref.WeakKeyDictionary[Any, set[tuple[int, ...]]]" = weakref.WeakKeyDictionary()


def is_moe_layer(module: Any) -> bool:
    """Whether ``module`` is a megatron ``TransformerLayer`` whose MLP is a ``MoELayer`` (with a router)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return isinstance(module, TransformerLayer) and isinstance(getattr(module, "mlp", None), MoELayer)


def moe_refusals(config: Any) -> list[str]:
    """What :func:`enable_runtime_cp` cannot cover in an MoE model built with ``config`` (empty: supported)."""
    if not getattr(config, "num_moe_experts", None):
        return []
    out = []
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp
    if ep != 1:
        out.append(f"expert_model_parallel_size={ep} with num_moe_experts (runtime CP binds MoE routers with expert "
                   "parallelism of 1 only)")
    if etp != tp:
        out.append(f"expert_tensor_parallel_size={etp} with tensor_model_parallel_size={tp} (runtime CP binds MoE "
                   "routers whose experts are split as the dense layers are)")
    modules = getattr(config, "recompute_modules", None) or []
    if getattr(config, "recompute_granularity", None) == "selective" and "moe" in modules:
        out.append("recompute_modules with 'moe' (the MoE recompute in backward would not see the microbatch's "
                   "groups; use recompute_granularity='full')")
    routing = getattr(config, "moe_router_load_balancing_type", None)
    if routing == "quantile_balancing" or (isinstance(routing, list) and "quantile_balancing" in routing):
        out.append("moe_router_load_balancing_type='quantile_balancing'")
    return out


class MoELayerMixin:
    """A ``TransformerLayer`` with an MoE MLP whose router runs with the microbatch's groups (module docstring)."""

    def _forward_mlp(self, hidden_states: torch.Tensor, inference_context: Any = None,
                     padding_mask: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> Any:
        scope = consumer_scope(packed_seq_params)  # the carried scope: forward and full-layer recompute alike
        router = self.mlp.router  # type: ignore[attr-defined]
        static = (router.tp_cp_group, router.cp_group, router.config)  # what the router was built with
        tp_cp = _tp_cp_group(router, scope)
        padding, z_scale = _padding_mask(packed_seq_params, scope, hidden_states, padding_mask, router.tp_group,
                                         1 if tp_cp is None else tp_cp.size())
        router.tp_cp_group, router.cp_group = tp_cp, (scope.group if scope.size > 1 else static[1])
        if z_scale != 1.0 and router.config.moe_z_loss_coeff:
            router.config = copy.copy(router.config)  # the router's own, for this call
            router.config.moe_z_loss_coeff = static[2].moe_z_loss_coeff * z_scale
        if getattr(router, "enable_expert_bias", False):  # for this call: megatron's own count fails on a mask
            router.__dict__[_COUNT_ATTR] = functools.partial(_count_expert_tokens, router)
        try:
            return super()._forward_mlp(  # type: ignore[misc]
                hidden_states, inference_context, padding_mask=padding, packed_seq_params=packed_seq_params)
        finally:
            router.tp_cp_group, router.cp_group, router.config = static
            router.__dict__.pop(_COUNT_ATTR, None)
            _restore_metric_groups(static[0])


def _count_expert_tokens(router: Any, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> None:
    """``TopKRouter._apply_expert_bias`` with the ``[T]`` padding mask (True = padding) broadcast over the
    ``[T, E]`` routing map: adds the real tokens routed to each expert to ``local_tokens_per_expert``, in training
    forwards only (``torch.is_grad_enabled()``, as Megatron: not in evaluation, nor twice with recompute)."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1).to(torch.bool)
            router.local_tokens_per_expert += routing_map.sum(dim=0)


def check_routers(routers: list, scope: CPScope) -> None:
    """At the entry forward, before any collective: the ``[tp, cp]`` group every MoE router of the model will bind
    for ``scope`` exists (made up front) and lies inside its ``tp_dp_cp`` group — else the ``ValueError`` that the
    first MoE layer would raise after the layers before it ran their collectives. Lookups only (no collective)."""
    for router in routers[:1]:  # every router of one model has the same tp and tp_dp_cp groups
        _tp_cp_group(router, scope)


def _tp_cp_group(router: Any, scope: CPScope) -> Any:
    """The ``[tp, cp]`` group of this microbatch: CP1, the router's ``tp`` group; TP1, the CP group; else the one
    :func:`cpscope.groups.new_tp_cp_groups` made for this CP group (looked up, never created here)."""
    tp = router.tp_group
    if scope.size == 1:
        return tp
    tp_ranks = tuple(group_ranks(tp))
    if len(tp_ranks) == 1:
        tp_cp = scope.group
    else:
        check_cp_beside_tp(scope.group, tp_ranks)
        tp_cp = lookup_tp_cp(scope.group, tp_ranks=tp_ranks)
        if tp_cp is None:
            raise ValueError(
                f"MoE router under runtime CP with TP{len(tp_ranks)}: no [tp, cp] group for the CP group "
                f"{group_ranks(scope.group)} and the TP group {list(tp_ranks)}; create them up front on every rank "
                "with cpscope.groups.new_tp_cp_groups(sizes, tp_size=...)"
            )
    domain = router.tp_dp_cp_group
    checked = _CHECKED.setdefault(tp_cp, set())
    if id(domain) not in checked:
        members = group_ranks(tp_cp)
        if not set(members) <= set(group_ranks(domain)):
            raise ValueError(
                f"MoE router under runtime CP: the microbatch's [tp, cp] group {members} is not inside the model's "
                f"tp_dp_cp group {group_ranks(domain)[:16]}: build the CP groups over the model's DP×CP ranks "
                "(cpscope.new_cp_groups(sizes, ranks=...), cpscope.groups.new_tp_cp_groups(..., ranks=...))"
            )
        checked.add(id(domain))
    return tp_cp


def check_cp_beside_tp(group: Any, tp_ranks: tuple[int, ...]) -> None:
    """``ValueError`` unless the CP group holds one rank of each TP group — of this rank's own, this rank alone —
    as the groups of :func:`cpscope.groups.new_tp_cp_groups` do (checked once per CP and TP group; no collective)."""
    checked = _TP_CHECKED.setdefault(group, set())
    if tp_ranks in checked:
        return
    members = group_ranks(group)
    shared = sorted(set(members) & set(tp_ranks) - {torch.distributed.get_rank()})
    if shared:
        raise ValueError(
            f"runtime CP beside tensor parallelism: the microbatch's CP group {members} holds ranks {shared} of "
            f"this rank's TP group {list(tp_ranks)}; a CP group must hold one rank of each TP group (the same TP "
            "rank): build the groups with cpscope.groups.new_tp_cp_groups(sizes, tp_size=...) and bind their .cp"
        )
    checked.add(tp_ranks)


def _padding_mask(psp: Any, scope: CPScope, hidden: torch.Tensor, given: Optional[torch.Tensor], tp: Any,
                  tp_cp_size: int) -> tuple[torch.Tensor, float]:
    """``[b, s]`` True where the router must not count a token — this rank's zigzag padding in ``thd`` (its
    sequence-parallel part with TP, cached on the per-forward carrier), OR-ed with a mask the caller gave — and the
    z-loss coefficient's factor.

    Megatron's z-loss is each rank's mean over its own tokens times ``coeff / |tp_cp|``, which is the microbatch's
    mean only when every rank of the ``[tp, cp]`` group holds as many real tokens; zigzag padding breaks that. The
    factor ``|tp_cp| · n_rank / n_microbatch`` makes each rank's share its tokens' sum over the microbatch's real
    tokens (``thd``, where the offsets give the count; 1 elsewhere)."""
    s, b = hidden.shape[0], hidden.shape[1]
    if psp is None or getattr(psp, "qkv_format", None) != "thd":
        mask = torch.zeros(b, s, dtype=torch.bool, device=hidden.device)
        return (mask if given is None else given.to(torch.bool).view(b, s)), 1.0
    cached = getattr(psp, _PAD_ATTR, None)
    if cached is None:
        is_pad, total = _thd_padding(psp, scope)
        cached = (is_pad.to(hidden.device), total)
        setattr(psp, _PAD_ATTR, cached)
    mask, total = cached
    parts = tp.size() if tp is not None else 1
    if mask.numel() == s * b * parts and parts > 1:  # sequence parallel: this TP rank's contiguous part
        start = tp.rank() * s * b
        mask = mask[start:start + s * b]
    elif mask.numel() != s * b:
        raise ValueError(f"MoE router under runtime CP: {s * b} local tokens, but the microbatch's offsets give "
                         f"{mask.numel()} for CP{scope.size}")
    mask = mask.view(b, s)
    if given is not None:  # a caller's own mask as well: counts stay exact, the z-loss keeps Megatron's weighting
        return mask | given.to(torch.bool).view(b, s), 1.0
    return mask, tp_cp_size * int((~mask).sum()) / total


def _thd_padding(psp: Any, scope: CPScope) -> tuple[torch.Tensor, int]:
    """This rank's zigzag tokens that are padding, and the microbatch's real token count."""
    real = cu_seqlens_list(psp.cu_seqlens_q, "cu_seqlens_q")
    padded_cu = getattr(psp, "cu_seqlens_q_padded", None)
    layout = real if padded_cu is None else cu_seqlens_list(padded_cu, "cu_seqlens_q_padded")
    is_pad = torch.ones(layout[-1], dtype=torch.bool)
    for start, a, b in zip(layout[:-1], real[:-1], real[1:]):
        is_pad[start:start + (b - a)] = False  # each document's real tokens lead its padded slot
    return is_pad[zigzag_indices(layout, scope.size, scope.rank)], real[-1]


def _restore_metric_groups(tp_cp: Any) -> None:
    """Megatron's tracker keeps the last reduction group per metric: set back to the router's own one."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    metrics = get_moe_metrics_tracker().metrics
    for name in _TP_CP_METRICS:
        entry = metrics.get(name)
        if entry is not None:
            entry.reduce_group = tp_cp
