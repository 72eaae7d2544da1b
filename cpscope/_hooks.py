"""Observer slots: the places where the core lets an observer (the sentinel) look at what it runs.

Each slot is a module attribute that is ``None`` while nothing observes — the only cost on the hot path is one
attribute read and a ``None`` check. An observer fills the slots when it starts and puts back what it found when
it stops (:func:`install` / :func:`restore`); the core never imports the observer. Slots, and how the core calls
them:

* ``attention(call, run) -> Tensor`` — wraps one prepared attention call (``cpscope.attention``'s validated,
  resolved call object); must return ``run(call)`` or an equal tensor. The observer may call ``run`` itself
  (its own reference runs, taps around the inputs) without the slot being re-entered.
* ``rope(scope, cu_seqlens, qkv_format, t)`` — after RoPE resolved its scope and per-pack positions.
* ``hf_positions(module, query, scope, kwargs)`` — in the transformers attention function, before attention.
* ``shard(scope, out)`` — ``zigzag_shard`` cut ``out`` for ``scope`` (CP > 1 only): the observer may remember which
  scope each shard belongs to (weakly) and compare it with the scope RoPE and attention later run under.
* ``microbatches(microbatches, num_targets) -> iterable`` — the training loop's microbatches of one step
  (the observer may wrap the iterable to mark each microbatch).

Example::

    from cpscope import _hooks
    saved = _hooks.install(rope=my_rope_observer)
    try:
        train()
    finally:
        _hooks.restore(saved)
"""
from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["attention", "rope", "hf_positions", "shard", "microbatches", "install", "restore", "SLOTS"]

attention: Optional[Callable[..., Any]] = None
rope: Optional[Callable[..., None]] = None
hf_positions: Optional[Callable[..., None]] = None
shard: Optional[Callable[..., None]] = None
microbatches: Optional[Callable[..., Any]] = None

SLOTS = ("attention", "rope", "hf_positions", "shard", "microbatches")


def install(**slots: Optional[Callable[..., Any]]) -> dict[str, Optional[Callable[..., Any]]]:
    """Fill the named slots; returns what they held before (for :func:`restore`)."""
    unknown = sorted(set(slots) - set(SLOTS))
    if unknown:
        raise ValueError(f"unknown observer slot(s) {unknown}; the slots are {list(SLOTS)}")
    g = globals()
    saved = {name: g[name] for name in slots}
    g.update(slots)
    return saved


def restore(saved: dict[str, Optional[Callable[..., Any]]]) -> None:
    """Put back what :func:`install` returned."""
    globals().update(saved)
