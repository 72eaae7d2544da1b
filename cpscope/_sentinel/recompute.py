"""The recompute check: an activation recompute (in backward) of a sampled call runs under its forward's scope.

A sampled forward call records ``(scope, where)`` under its signature (what the call is: kind, layout, shapes,
offsets) and a fingerprint of one input (which data it ran on). A call seen in backward whose signature and
fingerprint match a record is the recompute of that forward: its scope must be the recorded one. Nothing here
reads the ContextVar: the scope compared is the one the consumer itself resolved.

Example::

    remember(t, sig, v, scope, mb.where(call))       # in a sampled forward
    check(t, sig, v, scope, "attention")             # in backward, before the recompute runs
"""
from __future__ import annotations

import torch

from ..scope import CPScope
from .report import Mismatch
from .state import describe, fingerprint, group_of, me, same_scope
from .tracker import Tracker

__all__ = ["remember", "check"]

_FIELDS = {"attention": "scope", "RoPE": "rope scope"}


def remember(t: Tracker, sig: tuple, data: torch.Tensor, scope: CPScope, where: dict) -> None:
    """Record a sampled forward call: its signature, a fingerprint of ``data``, its scope and where it ran."""
    t.records.put(sig, fingerprint(data), (scope, where))


def check(t: Tracker, sig: tuple, data: torch.Tensor, scope: CPScope, what: str) -> None:
    """In backward: when this call recomputes a recorded forward (same signature, same ``data``), its ``scope``
    must be the forward's; a mismatch is reported (on this rank: every rank recomputes alike)."""
    if not t.records.has_signature(sig):  # never sampled: no fingerprint taken
        return
    hit = t.records.get(sig, fingerprint(data))
    if hit is None:
        return
    forward_scope, where = hit
    t.verdicts.count("recompute")
    if same_scope(forward_scope, scope):
        return
    verb = "ran attention" if what == "attention" else f"applied {what}"
    t.verdicts.emit([Mismatch(
        "recompute", _FIELDS.get(what, what), me(),
        f"an activation recompute in backward {verb} under {describe(scope)}, but the forward of this call ran "
        f"under {describe(forward_scope)}: the recompute must re-enter the forward's scope (use cpscope.checkpoint, "
        "or context_fn=cpscope.scope_context_fn())",
        {"recompute": describe(scope), "forward": describe(forward_scope)}, group=group_of(forward_scope),
        **where)], consistent=True)
