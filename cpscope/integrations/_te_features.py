"""Which of TransformerEngine's CP communication types run a module's attention features (TE 2.20.2).

TE's ``DotProductAttention`` takes the features itself — a sliding window (``window_size`` at construction or per
call), attention sinks (``softmax_type="off-by-one"`` / ``"learnable"``: its ``softmax_offset``) and multi-latent
head dims (``kv_channels=(k, v)``, or key / value tensors whose head dims differ) — and cpscope passes them through
unchanged. Under CP, TE 2.20.2 runs each only with some ``cp_comm_type``s (``attn_forward_func_with_cp`` asserts
them deep inside the forward, and ``get_attention_backend`` finds no backend for sinks outside ``a2a``):

=================================================  =============================
feature                                            CP comm types that run it
=================================================  =============================
sliding window (anything but ``(-1, 0)`` /         ``"all_gather"``, ``"a2a"``
``(-1, -1)``)
sinks (``softmax_type`` other than ``vanilla``)    ``"a2a"``
MLA (k head dim != v head dim)                     ``"p2p"``, ``"a2a+p2p"``
=================================================  =============================

:func:`te_variant` picks the binding: a requested variant the features rule out raises ``ValueError`` naming the
ones that would run (before anything is bound or communicated); ``"auto"`` picks among those.

Example::

    cp_group, comm = te_variant(scope, "p2p", te_attn)   # te_attn has window_size=(127, 0): ValueError naming
                                                         # 'all_gather' and 'a2a'
"""
from __future__ import annotations

from typing import Any, Optional

from .._variants import A2A, ALL_GATHER, AUTO, HIERARCHICAL, P2P, VARIANTS, split_comm
from ..scope import CPScope

__all__ = ["te_features", "te_variant", "TE_FEATURE_VARIANTS"]

#: feature -> the CP comm types TE 2.20.2 runs it with (see the module docstring).
TE_FEATURE_VARIANTS: dict[str, tuple[str, ...]] = {
    "sliding window": (ALL_GATHER, A2A),
    "sinks": (A2A,),
    "multi-latent attention": (P2P, HIERARCHICAL),
}


def _head_dim(call: dict[str, Any], names: tuple[str, ...], module: Any, attribute: str) -> Optional[int]:
    for name in names:
        t = call.get(name)
        if t is not None and hasattr(t, "shape") and len(t.shape) >= 1:
            return int(t.shape[-1])
    value = getattr(module, attribute, None)
    return int(value) if isinstance(value, int) else None


def te_features(module: Any, call: Optional[dict[str, Any]] = None) -> dict[str, str]:
    """The features of this call that restrict TE's CP comm types: ``{feature: what shows it}``.

    ``call`` holds the forward's arguments (``window_size`` overrides the module's; key / value tensors give the
    head dims, else ``hidden_size_per_attention_head_k`` / ``_v``).

    Example::

        te_features(te_attn)   # {"sliding window": "window_size=(127, 0)"} for a windowed module
    """
    call = call or {}
    out: dict[str, str] = {}
    window = call.get("window_size")
    if window is None:
        window = getattr(module, "window_size", None)
    if window is not None and tuple(int(w) for w in window) not in ((-1, 0), (-1, -1)):
        out["sliding window"] = f"window_size={tuple(int(w) for w in window)}"
    softmax = getattr(module, "softmax_type", "vanilla")
    if softmax not in (None, "vanilla"):
        out["sinks"] = f"softmax_type={softmax!r}"
    dk = _head_dim(call, ("key_layer", "key"), module, "hidden_size_per_attention_head_k")
    dv = _head_dim(call, ("value_layer", "value"), module, "hidden_size_per_attention_head_v")
    if dk is not None and dv is not None and dk != dv:
        out["multi-latent attention"] = f"k head dim {dk} != v head dim {dv}"
    return out


def _allowed(features: dict[str, str]) -> list[str]:
    allowed = list(VARIANTS)
    for feature in features:
        allowed = [v for v in allowed if v in TE_FEATURE_VARIANTS[feature]]
    return allowed


def te_variant(scope: CPScope, comm: str, module: Any, call: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """TE's ``(cp_group, cp_comm_type)`` for a CP > 1 ``scope`` (as ``te_binding``), restricted to the comm types TE
    2.20.2 runs this module's features with; ``"auto"`` picks the first of them that the heads allow.

    Raises:
        ValueError: the requested variant cannot run the features (naming the variants that can, or saying that
            none can), or ``te_binding``'s own refusals (heads an all-to-all cannot shard).
    """
    from ..attention import te_binding  # "auto" resolved, "a2a+p2p[:N]" as TE's [a2a, p2p] groups

    features = te_features(module, call)
    if not features:
        return te_binding(scope, comm, module)
    allowed = _allowed(features)
    shown = "; ".join(f"{k} ({v})" for k, v in features.items())
    if not allowed:
        raise ValueError(f"TransformerEngine 2.20.2 runs no CP communication type with all of: {shown} "
                         f"({', '.join(f'{k}: {list(v)}' for k, v in TE_FEATURE_VARIANTS.items() if k in features)})")
    name = split_comm(comm)[0]
    if name != AUTO:
        if name not in allowed:
            raise ValueError(f"cp_comm_type={comm!r} under CP{scope.size}: TransformerEngine 2.20.2 runs {shown} "
                             f"only with cp_comm_type in {allowed}")
        return te_binding(scope, comm, module)
    first = te_binding(scope, AUTO, module)
    if first[1] in allowed:
        return first
    errors = []
    for candidate in allowed:  # e.g. "a2a" needs heads divisible by the CP size: then the next one
        try:
            return te_binding(scope, candidate, module)
        except ValueError as e:
            errors.append(f"{candidate}: {e}")
    raise ValueError(f"cp_comm_type='auto' under CP{scope.size}: TransformerEngine 2.20.2 runs {shown} only with "
                     f"{allowed}, and none fits this module: " + "; ".join(errors))
