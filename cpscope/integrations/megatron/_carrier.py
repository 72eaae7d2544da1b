"""The microbatch's scope, resolved once at the model's forward and carried on its ``PackedSeqParams``.

Megatron hands the same ``packed_seq_params`` object from ``GPTModel.forward`` down to every layer, attention and
core attention — and its activation recompute (``recompute_granularity="full"`` / ``"selective"``) keeps that object
in the closure or arguments it calls again during backward. So the entry forward resolves the scope **once**, puts
it on a per-forward copy of ``packed_seq_params`` (with ``cp_group`` / ``local_cp_size`` set to it, Megatron's own
convention) and every consumer below reads it from there: no ContextVar read in backward, recompute included.

Example::

    carrier = with_scope(psp, scope)      # in the entry forward
    ...
    scope = consumer_scope(carrier)       # in a consumer, forward or recompute: the same scope
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from ...backward_check import in_backward
from ...scope import CPScope, capture_scope
from ._packed_seq_params import scope_from_packed_seq_params

__all__ = ["with_scope", "carried_scope", "consumer_scope"]

_ATTR = "_cpscope_scope"


def with_scope(packed_seq_params: Any, scope: CPScope) -> Any:
    """A shallow copy of ``packed_seq_params`` that names ``scope`` (``cp_group``, ``local_cp_size``) and carries it.

    The caller's object is left untouched (a microbatch's params may be reused by the next one).
    """
    carrier = copy.copy(packed_seq_params)
    carrier.cp_group = scope.group
    carrier.local_cp_size = scope.size
    setattr(carrier, _ATTR, scope)
    return carrier


def carried_scope(packed_seq_params: Any) -> Optional[CPScope]:
    """The scope a carrier made by :func:`with_scope` holds, else ``None``."""
    return getattr(packed_seq_params, _ATTR, None) if packed_seq_params is not None else None


def consumer_scope(packed_seq_params: Any) -> CPScope:
    """The scope a CP consumer runs with: the carried one; else the one ``packed_seq_params`` names — the enclosing
    scope when that binds the same group, so that its communication variant (the plan's, bound by
    ``run_microbatches``) stays; else the enclosing scope (:func:`cpscope.capture_scope`, read here, in forward)."""
    scope = carried_scope(packed_seq_params)
    if scope is not None:
        return scope
    named = scope_from_packed_seq_params(packed_seq_params)
    if named is None:
        return capture_scope()
    if not in_backward():
        outer = capture_scope()
        if outer.comm is not None and outer.size == named.size and outer.group is named.group:
            return outer
    return named
