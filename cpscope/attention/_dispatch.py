"""Which communication variant runs a call, and running it: the one place that knows all the variants.

Variants (``comm=``): ``"p2p"`` (the zigzag ring, the default), ``"all_gather"``, ``"a2a"`` (Ulysses), ``"a2a+p2p"``
(hierarchical; ``"a2a+p2p:N"`` names the inner size) and ``"auto"``. ``None`` means what the active scope carries
(``runtime_cp(group, comm=...)``), else ``"p2p"``. The variant is resolved once, in forward; each variant's autograd
function keeps what it needs on ``ctx``, so backward and recompute use the variant of their forward. Under CP1 every
variant is the same local attention and runs as such.

``"auto"`` asks :func:`choose_variant`, whose rule is replaceable: :func:`set_auto_chooser` installs a function of a
:class:`VariantQuery` (the hook for a fitted cost model). It must be deterministic — every rank of the group asks
it with the same query and must get the same answer. The default rule (:func:`default_rule`):

1. heads divide by ``cp`` (q and k/v): ``"a2a"`` — balanced by heads whatever the documents, and its traffic per
   rank does not grow with ``cp``;
2. else few k/v heads (``h >= 4 * h_kv``, GQA / MQA): ``"all_gather"`` — gathering K/V costs little;
3. else ``"p2p"``;

except that with a sliding window ``"p2p"`` wins when its halo exchange (:func:`cpscope.hybrid._comm_cost.halo_rows`:
a short window moves only its neighbours' halos) receives at most half of what the whole ring would, and no more
than the variant the rule would pick.

Example::

    with cpscope.runtime_cp(groups[4], comm="auto"):
        out = cpscope.context_parallel_attention(q, k, v)         # a2a for 32/8 heads, all_gather for 32/2
    cpscope.attention.set_auto_chooser(lambda query: "p2p")       # e.g. a calibrated cost model
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

from .._variants import A2A, ALL_GATHER, AUTO, HIERARCHICAL, P2P, VARIANTS, check_comm, split_comm
from ..scope import CPScope
from ._allgather import all_gather_attention
from ._hierarchical import check_inner_size, hierarchical_attention, hierarchical_groups
from ._layout import packed, unpacked
from ._mods import Mods
from ._ulysses import a2a_attention, check_heads

__all__ = ["VARIANTS", "VariantQuery", "Variant", "default_rule", "choose_variant", "set_auto_chooser",
           "resolve_variant", "run_variant", "te_binding"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class VariantQuery:
    """What ``"auto"`` knows about a call (the same on every rank of the group).

    ``heads`` / ``kv_heads``: q and k/v heads of the call (per tensor-parallel rank); ``seq_lens``: global lengths of
    the sequences (``thd``: the documents; dense: one per batch row; empty where unknown, e.g. when the TE adapter
    binds a module before its forward); ``window``: the call's ``(left, right)`` window, if any.
    """

    cp: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_format: str
    causal: bool
    seq_lens: tuple[int, ...] = ()
    dtype: Optional[torch.dtype] = None
    device_type: str = "cuda"
    window: Optional[tuple[int, int]] = None  # (left, right), -1 unbounded; None: no window


class Variant(NamedTuple):
    """A resolved choice: the variant's name and, for ``"a2a+p2p"``, the inner size."""

    name: str
    inner: Optional[int] = None


def default_rule(query: VariantQuery) -> str:
    """The documented rule of ``"auto"`` until a calibrated cost model replaces it (see the module docstring).

    Example::

        default_rule(VariantQuery(4, 32, 8, 128, "thd", True, (65536,)))                      # 'a2a'
        default_rule(VariantQuery(4, 32, 8, 128, "thd", True, (65536,), window=(255, 0)))     # 'p2p'
    """
    if query.cp == 1:
        return P2P
    if query.heads % query.cp == 0 and query.kv_heads % query.cp == 0:
        pick = A2A
    elif query.heads >= 4 * query.kv_heads:
        pick = ALL_GATHER
    else:
        return P2P
    if query.window is not None and query.seq_lens and sum(query.seq_lens):
        # imported here: the cost model uses numpy, which attention itself (and `import cpscope`) does not need
        from ..hybrid import halo_rows

        cp, h, g, total = query.cp, query.heads, query.kv_heads, sum(query.seq_lens)
        lens = [n for n in query.seq_lens if n > 0]
        halo = 2 * g * halo_rows(lens, cp, query.window, query.causal)  # head-rows one rank receives
        ring = 2 * g * total * (cp - 1) / cp
        other = 2 * (h + g) * total * (cp - 1) / cp**2 if pick == A2A else ring
        if halo <= min(other, ring / 2):
            return P2P
    return pick


_chooser: Callable[[VariantQuery], str] = default_rule


def set_auto_chooser(fn: Optional[Callable[[VariantQuery], str]]) -> Callable[[VariantQuery], str]:
    """Install the function ``"auto"`` asks (``None``: the default rule); returns the previous one.

    Process-wide configuration, like the build-time group: set it once at start-up on every rank. ``fn(query)``
    returns one of ``"p2p"``, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``, ``"a2a+p2p:N"`` and must be
    deterministic.

    Example::

        previous = set_auto_chooser(my_cost_model.best_variant)
    """
    global _chooser
    old, _chooser = _chooser, (default_rule if fn is None else fn)
    return old


def choose_variant(query: VariantQuery) -> str:
    """The variant ``"auto"`` picks for ``query`` (the installed chooser; default :func:`default_rule`)."""
    name = _chooser(query)
    try:
        check_comm(name)
    except ValueError as e:
        raise ValueError(f"the auto chooser {_chooser!r} returned {name!r}, not a variant: {e}") from None
    if name == AUTO:
        raise ValueError(f"the auto chooser {_chooser!r} returned 'auto'; it must name a variant")
    return name


def _query(q: torch.Tensor, k: torch.Tensor, *, scope: CPScope, qkv_format: str, causal: bool,
           cu: Optional[tuple[int, ...]], window: Optional[tuple[int, int]] = None) -> VariantQuery:
    if qkv_format == "thd":
        lens = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
    else:
        b, s = (q.shape[0], q.shape[1]) if qkv_format == "bshd" else (q.shape[1], q.shape[0])
        lens = (s * scope.size,) * b
    return VariantQuery(scope.size, q.shape[-2], k.shape[-2], q.shape[-1], qkv_format, causal, lens, q.dtype,
                        q.device.type, window)


def resolve_variant(comm: Optional[str], scope: CPScope, q: torch.Tensor, k: torch.Tensor, *, qkv_format: str,
                    causal: bool, cu: Optional[tuple[int, ...]], padded: bool = False,
                    window: Optional[tuple[int, int]] = None) -> Variant:
    """The variant of this call (after the shared input checks, before any collective).

    ``padded``: the call masks padding rows (real offsets that differ from the layout); without a causal mask only
    ``"p2p"`` masks them, so ``"auto"`` then falls back to it and another named variant raises.

    Raises:
        ValueError: an unknown ``comm``; a variant these heads / this CP size cannot run (with what would work); a
            variant other than ``"p2p"`` asked for padding without a causal mask.
    """
    asked = check_comm(comm) if comm is not None else (scope.comm or P2P)
    if scope.size == 1:  # every variant is the same local attention
        return Variant(P2P)
    spec = asked
    if spec == AUTO:
        spec = choose_variant(_query(q, k, scope=scope, qkv_format=qkv_format, causal=causal, cu=cu, window=window))
        logger.debug("comm='auto' chose %r (cp=%d, heads %d/%d, %s)", spec, scope.size, q.shape[-2], k.shape[-2],
                     qkv_format)
    name, inner = split_comm(spec)
    h, h_kv = q.shape[-2], k.shape[-2]
    if name == A2A:
        check_heads(h, h_kv, scope.size, variant=A2A, cp=scope.size, replicate=True)
    variant = Variant(name, check_inner_size(inner, scope.size, h, h_kv, replicate=True)) if name == HIERARCHICAL \
        else Variant(name)
    if name == HIERARCHICAL:
        hierarchical_groups(scope.group, variant.inner)  # made up front, or a ValueError saying so (before any kernel)
    if name != P2P and padded and not causal:
        if asked != AUTO:
            raise ValueError(
                f"comm={name!r} cannot mask padding without a causal mask (real offsets given that differ "
                "from the layout); use comm='p2p' (or 'auto') for this microbatch"
            )
        return Variant(P2P)
    return variant


def run_variant(variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scope: CPScope, *,
                qkv_format: str, causal: bool, cu: Optional[tuple[int, ...]], scale: float,
                mods: Mods = Mods()) -> torch.Tensor:
    """Run a collective variant (not ``"p2p"``, which the caller runs) on validated inputs of any layout.

    ``mods``: the call's features, its window as it restricts the call's sequences
    (:meth:`cpscope.attention._mods.Mods.within`)."""
    qp, kp, vp, how = packed(q, k, v, qkv_format=qkv_format, cu=cu, cp=scope.size)
    kw: dict[str, Any] = {"how": how, "scope": scope, "causal": causal, "scale": scale, "mods": mods}
    if variant.name == HIERARCHICAL:
        kw["inner"] = variant.inner
    out = _RUNNERS[variant.name](qp, kp, vp, **kw)
    return unpacked(out, how)


def _te_heads(module: Any) -> Optional[tuple[int, int]]:
    """(q heads, k/v heads) per tensor-parallel rank of a TE attention module, where it says."""
    h, g = getattr(module, "num_attention_heads", None), getattr(module, "num_gqa_groups", None)
    if not isinstance(h, int) or not isinstance(g, int):
        return None
    tp = getattr(module, "tp_size", 1) or 1
    return h // tp, g // tp


def te_binding(scope: CPScope, comm: str, module: Any) -> tuple[Any, str]:
    """TE's ``(cp_group, cp_comm_type)`` for a CP > 1 ``scope`` and a requested variant.

    ``"auto"`` is resolved from the module's heads (``num_attention_heads`` / ``num_gqa_groups`` per TP rank;
    ``"p2p"`` where it does not say), ``"a2a+p2p[:N]"`` becomes TE's pair ``[a2a_group, p2p_group]`` (the
    hierarchical groups of :mod:`cpscope.attention._hierarchical`, TE's numbering). Other names pass through.

    Raises:
        ValueError: an unknown variant; ``"a2a"`` / ``"a2a+p2p"`` with heads (or a CP size) they cannot shard.
    """
    name, inner = split_comm(check_comm(comm))
    heads = _te_heads(module)
    if name == AUTO:
        if heads is None:
            return scope.group, P2P
        hd = getattr(module, "hidden_size_per_attention_head_k", getattr(module, "hidden_size_per_attention_head", 0))
        query = VariantQuery(scope.size, heads[0], heads[1], int(hd or 0), str(getattr(module, "qkv_format", "")),
                             "causal" in str(getattr(module, "attn_mask_type", "causal")))
        name, inner = split_comm(choose_variant(query))
    if name == A2A and heads is not None:
        check_heads(heads[0], heads[1], scope.size, variant=A2A, cp=scope.size)
    if name != HIERARCHICAL:
        return scope.group, name
    if heads is None and inner is None:
        check_inner_size(None, scope.size, scope.size, scope.size)  # a CP size without proper divisors: its error
        raise ValueError(f"cp_comm_type='a2a+p2p' for a module whose heads cpscope cannot read: name the inner size, "
                         f"e.g. 'a2a+p2p:2' (CP size {scope.size})")
    h, h_kv = heads if heads is not None else (0, 0)  # unknown heads: TE checks them itself
    n = check_inner_size(inner, scope.size, h, h_kv)
    return list(hierarchical_groups(scope.group, n)), HIERARCHICAL


# name -> runner, looked up per call (a test may wrap one to see which variant ran)
_RUNNERS: dict[str, Callable[..., torch.Tensor]] = {
    ALL_GATHER: all_gather_attention, A2A: a2a_attention, HIERARCHICAL: hierarchical_attention,
}
assert set(_RUNNERS) | {P2P} == set(VARIANTS)  # every variant runs: the collective ones here, the ring in api
