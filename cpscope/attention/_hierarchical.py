"""Hierarchical (USP-style, TE's ``a2a+p2p``) CP attention: all-to-all inside inner groups, the zigzag ring across.

The CP group of size ``cp = inner * outer`` is seen as a grid: group rank ``g = o * inner + i`` is rank ``i`` of the
inner (all-to-all) group ``o`` — ``inner`` consecutive group ranks, e.g. the GPUs of one node — and rank ``o`` of the
outer group ``i`` (ranks ``i, i + inner, ...``); TE uses the same numbering (``cp_rank = inner * p2p_rank +
a2a_rank``).

Why no re-sharding is needed: rank ``g`` holds chunks ``g`` and ``2cp-1-g`` of every sequence. The inner group ``o``
together holds chunks ``o*inner .. (o+1)*inner - 1`` and their mirror images — exactly outer rank ``o``'s zigzag
shard for a ring of size ``outer`` (chunks ``o`` and ``2*outer-1-o`` of ``2*outer`` super-chunks). And inside that
shard, inner rank ``i`` holds sub-chunks ``i`` and ``2*inner-1-i``: the zigzag layout of the shard over ``inner``
ranks. So the Ulysses exchange over the inner group, with the outer-local offsets ``cu // outer``, delivers each rank
the outer ring's local layout for ``h/inner`` heads; the ring (:mod:`cpscope.attention._ring`) runs across the outer
group; the reverse exchange brings the rows home. One autograd function (:mod:`cpscope.attention._ulysses`) does all.

Groups: :func:`hierarchical_groups` returns ``(inner, outer)`` process groups for a CP group, looked up in the
registry — never created here: a group made inside a forward would run a collective there, possibly during a
recompute or a graph capture. Make them up front, on every member: :func:`cpscope.hierarchical_cp_groups`, or
``cpscope.new_cp_groups(sizes, hierarchical=True)``; a missing pair is a ``ValueError`` that says so.

Inner size: ``comm="a2a+p2p:N"`` names it; plain ``"a2a+p2p"`` takes :func:`default_inner_size` (the largest
proper divisor of ``cp`` that divides both head counts, at most 8 — one node of 8 GPUs; else one that divides the q
heads, the k/v heads then replicated over the inner group).

Example::

    with cpscope.runtime_cp(groups[8], comm="a2a+p2p:4"):      # 2 x 4: all-to-all in 4s, ring of 2
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd")
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._tensor_cache import register_clear
from ..groups import group_ranks, lookup_hierarchical
from ..scope import CPScope
from ._exchange import GroupCollectives
from ._layout import Packed
from ._mods import Mods
from ._ulysses import UlyssesPlan, check_heads, run

__all__ = ["hierarchical_groups", "default_inner_size", "check_inner_size", "hierarchical_attention"]

_MAX_DEFAULT_INNER = 8
_GROUPS: dict[tuple[int, int], tuple[Any, tuple[dist.ProcessGroup, dist.ProcessGroup]]] = {}  # verified pairs
_LOCK = threading.Lock()


@register_clear  # cpscope.clear_caches() drops the verified pairs (and the references to their process groups)
def _forget_verified() -> None:
    """Drop the (inner, outer) pairs checked so far: the next call looks each up and checks it again."""
    with _LOCK:
        _GROUPS.clear()


def default_inner_size(cp: int, heads: int, kv_heads: int, replicate: bool = False) -> Optional[int]:
    """The largest ``n`` with ``1 < n < cp``, ``n | cp``, ``n | heads``, ``n | kv_heads`` and ``n <= 8``; else None.

    ``replicate`` (cpscope's own a2a, which replicates k/v heads): when no such ``n`` divides the k/v heads, the
    largest that divides the q heads.

    Example::

        default_inner_size(8, 32, 8)                    # 4
        default_inner_size(4, 16, 1)                    # None: MQA has one k/v head to shard
        default_inner_size(4, 16, 1, replicate=True)    # 2: the k/v head replicated over the pair
    """
    sizes = [n for n in range(2, min(cp - 1, _MAX_DEFAULT_INNER) + 1) if cp % n == 0 and heads % n == 0]
    ok = [n for n in sizes if kv_heads % n == 0] or (sizes if replicate else [])
    return max(ok) if ok else None


def check_inner_size(inner: Optional[int], cp: int, heads: int, kv_heads: int, replicate: bool = False) -> int:
    """The inner size to use (``inner`` or the default), or ``ValueError`` naming the sizes that would work.

    ``replicate``: k/v heads are replicated over the inner group as needed (cpscope's own a2a+p2p)."""
    if inner is None:
        inner = default_inner_size(cp, heads, kv_heads, replicate)
        if inner is None:
            divisors = [n for n in range(2, cp) if cp % n == 0]
            raise ValueError(
                f"comm='a2a+p2p' needs an inner size n with 1 < n < cp, n dividing cp={cp} and the q heads {heads}"
                + ("" if replicate else f" and the k/v heads {kv_heads}")
                + f"; proper divisors of cp: {divisors or 'none'}. Use comm='a2a' (all-to-all "
                f"over the whole group), 'all_gather' or 'p2p', or name the size as 'a2a+p2p:N'"
            )
        return inner
    if not 1 < inner < cp or cp % inner:
        raise ValueError(
            f"comm='a2a+p2p:{inner}': the inner size must divide the CP size {cp} and lie strictly between 1 and "
            f"{cp} (use comm='a2a' for an all-to-all over the whole group, 'p2p' for the ring alone)"
        )
    check_heads(heads, kv_heads, inner, variant="a2a+p2p", cp=cp, replicate=replicate)
    return inner


def _expected(group: dist.ProcessGroup, inner: int) -> tuple[list[int], list[int]]:
    ranks = group_ranks(group)
    g = ranks.index(dist.get_rank())
    o, i = divmod(g, inner)
    return ranks[o * inner:(o + 1) * inner], ranks[i::inner]


def hierarchical_groups(group: dist.ProcessGroup, inner: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(inner_group, outer_group)`` of this rank for the CP ``group`` split into inner groups of ``inner`` ranks.

    The pair :func:`cpscope.hierarchical_cp_groups` made up front (looked up: no collective, no new group),
    checked once per (group, inner) to follow the numbering above (inner: consecutive group ranks; outer: every
    ``inner``-th).

    Raises:
        ValueError: the pair was not made up front (with what to call); the groups are numbered otherwise.

    Example::

        inner_g, outer_g = hierarchical_groups(groups[8], 4)    # on global rank 5: ranks [4..7] and [1, 5]
    """
    key = (id(group), inner)
    with _LOCK:
        hit = _GROUPS.get(key)
    if hit is not None and hit[0]() is group:
        return hit[1]
    pair = lookup_hierarchical(group, inner)
    if pair is None:
        raise ValueError(
            f"comm='a2a+p2p:{inner}' on the CP group {group_ranks(group)} needs its inner / outer sub-groups made up "
            f"front, on every member of the group, before training: cpscope.hierarchical_cp_groups(group, {inner}) "
            "(or cpscope.new_cp_groups(sizes, hierarchical=True)); cpscope never creates a group inside a forward, "
            "backward or recompute")
    want = _expected(group, inner)
    got = (group_ranks(pair[0]), group_ranks(pair[1]))
    if got != want:
        raise ValueError(
            f"hierarchical CP groups of a group with ranks {group_ranks(group)} and inner size {inner} must be inner "
            f"{want[0]} and outer {want[1]} on this rank (TE's numbering), got inner {got[0]} and outer {got[1]}"
        )
    with _LOCK:
        _GROUPS[key] = (weakref.ref(group), pair)
    return pair


@torch.compiler.disable  # collectives and a custom Function: always eager
def hierarchical_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, how: Packed, scope: CPScope, causal: bool, scale: float,
    inner: int, mods: Mods = Mods(),
) -> torch.Tensor:
    """``a2a+p2p`` attention on validated packed ``[t, h, d]`` tensors (``inner`` checked by
    :func:`check_inner_size`). Use :func:`cpscope.context_parallel_attention` with ``comm="a2a+p2p"``.

    ``mods``: the call's features; with a window the ring across the outer groups is the halo exchange
    (:mod:`cpscope.attention._halo`)."""
    inner_g, outer_g = hierarchical_groups(scope.group, inner)
    o, i = divmod(scope.rank, inner)
    outer = scope.size // inner
    plan = UlyssesPlan(causal=causal, scale=scale, how=how, inner=(i, inner), outer=(o, outer), device=q.device,
                       mods=mods)
    return run(q, k, v, plan, GroupCollectives(inner_g, inner, i), outer_g)
