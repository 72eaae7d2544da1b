"""The recompute check: an activation recompute (in backward) of a sampled call runs under its forward's scope.

A sampled forward call records ``(scope, where)`` under its signature (what the call is: kind, layout, shapes,
offsets) and a fingerprint of one input (which data it ran on). A call seen in backward whose signature and
fingerprint match a record is the recompute of that forward: its scope must be the recorded one. Nothing here
reads the ContextVar: the scope compared is the one the consumer itself resolved.

Where the verdict is reached: a forward that ran with autograd on (no checkpoint, or a non-reentrant one) has the
gradient taps of its attention, whose group verdict raises a recompute mismatch on every rank. A forward that ran
with autograd off — the reentrant form of ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=True``) runs its
forward under ``no_grad`` and recomputes it, with autograd on, inside the checkpoint's backward — has no taps: the
recompute of such a call agrees its verdict over the forward's group right at the check (every rank of the group
recomputes the same calls in the same order, so every rank reaches it).

Example::

    remember(t, sig, v, scope, mb.where(call))       # in a sampled forward
    check(t, sig, v, scope, "attention")             # in backward, before the recompute runs
"""
from __future__ import annotations

import torch

from ..scope import CPScope
from .comm import describe, group_of, me, same_scope
from .report import Mismatch
from .state import Tracker, fingerprint

__all__ = ["remember", "check"]

_FIELDS = {"attention": "scope", "RoPE": "rope scope"}


def remember(t: Tracker, sig: tuple, data: torch.Tensor, scope: CPScope, where: dict) -> None:
    """Record a sampled forward call: its signature, a fingerprint of ``data``, its scope and where it ran; its
    recompute is due (``t.armed``)."""
    t.records.put(sig, fingerprint(data), (scope, where, torch.is_grad_enabled()))  # autograd on: taps follow
    t.armed += 1


def check(t: Tracker, sig: tuple, data: torch.Tensor, scope: CPScope, what: str) -> None:
    """In backward: when this call recomputes a recorded forward (same signature, same ``data``), its ``scope``
    must be the forward's. Only while recomputes of sampled calls are due (``t.armed``: records not yet matched,
    cleared when an unsampled marked microbatch begins and no sampled backward is due): the recomputes of unsampled
    microbatches take no fingerprint, no host sync.
    A mismatch is kept pending: the group verdict on the call's gradients raises it on every rank — or, when the
    forward ran without autograd (a reentrant checkpoint), the verdict agreed here."""
    if t.armed <= 0 or not t.records.has_signature(sig):
        return
    _check_now(t, sig, data, scope, what)


def _check_now(t: Tracker, sig: tuple, data: torch.Tensor, scope: CPScope, what: str) -> None:
    hit = t.records.get(sig, fingerprint(data))
    if hit is None:
        return
    forward_scope, where, tapped = hit
    t.armed = max(0, t.armed - 1)
    t.verdicts.count("recompute")
    if not same_scope(forward_scope, scope):
        _report(t, forward_scope, scope, what, where)
    if not tapped:  # a reentrant checkpoint's no-grad forward: no gradient verdict will come, agree here
        t.verdicts.agree(forward_scope)


def _report(t: Tracker, forward_scope: CPScope, scope: CPScope, what: str, where: dict) -> None:
    verb = "ran attention" if what == "attention" else f"applied {what}"
    t.verdicts.emit([Mismatch(
        "recompute", _FIELDS.get(what, what), me(),
        f"an activation recompute in backward {verb} under {describe(scope)}, but the forward of this call ran "
        f"under {describe(forward_scope)}: the recompute must re-enter the forward's scope (use cpscope.checkpoint, "
        "or context_fn=cpscope.scope_context_fn())",
        {"recompute": describe(scope), "forward": describe(forward_scope)}, group=group_of(forward_scope),
        **where)], consistent=forward_scope.size == 1)
