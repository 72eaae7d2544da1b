"""Deferred cuDNN graph builds: a packed block whose graph is new runs elsewhere once; its graph is built when its
shape comes back (:attr:`~cpscope.attention.KernelPolicy.defer_builds`, off by default).

Why: a loader's stream of new packs at CP1 meets a new ragged graph key every few packs, and each build costs tens
of milliseconds, more than the block itself takes on flash-attention-2 (figures: ``docs/attention_kernels.md`` §7,
``docs/benchmarks.md`` §7–§8). With deferral a key is built the **second** time it is seen, so recurring
shapes get cuDNN and one-off shapes never pay a build.

How: :mod:`.cudnn_thd` computes the graph key before it allocates anything; with ``defer=True`` it asks
:func:`check`, which raises :class:`BuildDeferred` for a key that is neither built nor seen before (and remembers
it in a bounded LRU of :data:`SEEN_SIZE` keys, emptied by ``cpscope.clear_caches()``). The router
(:mod:`.router`) passes ``defer=True`` only where the block's next route is a CUDA kernel that takes it
(:data:`TARGETS`: flash-attention-2, bf16 / fp16) and, on :class:`BuildDeferred`, runs that route for this call —
no refusal is recorded (unlike :class:`~.cudnn_frontend.GraphUnsupported`). Forward and backward keys differ, so
each direction decides on its own; mixing kernels is exact because a block's backward takes the merged ``out`` /
``lse`` ([h, t] fp32 on both kernels: cuDNN's is a view of token-major statistics, which the flash kernels read
through ``.contiguous()``, and cuDNN's backward transposes flash's back).

Example::

    with use_kernel_policy(defer_builds=True):
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)   # new shape: flash
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)   # again: cuDNN (built)
    seen_keys()         # the graph keys seen once (oldest first)
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

from ..._tensor_cache import register_clear
from . import cudnn_frontend as fe

__all__ = ["BuildDeferred", "SEEN_SIZE", "TARGETS", "check", "target", "seen_keys", "clear_seen"]

SEEN_SIZE = 1024  # graph keys remembered as seen once (a few per pack shape: forward, backward)
TARGETS = ("flash",)  # the routes a deferred block may run on: CUDA kernels with no per-shape build
_lock = threading.Lock()
_seen: "OrderedDict[tuple, None]" = OrderedDict()


class BuildDeferred(Exception):
    """A cuDNN graph whose build was deferred (its key seen for the first time); raised before any kernel ran or any
    output was allocated. Not a refusal: the router runs the block's next route for this call only."""


def check(key: tuple) -> None:
    """Return if the graph of ``key`` is built or ``key`` was seen before (the caller builds and runs it); else
    remember ``key`` and raise :class:`BuildDeferred`.

    Example::

        check(key)                     # first sighting: BuildDeferred
        check(key)                     # second: returns (the caller builds the graph now)
    """
    if fe.has_graph(key):
        return
    with _lock:
        if key in _seen:
            _seen.move_to_end(key)
            return
        _seen[key] = None
        while len(_seen) > SEEN_SIZE:
            _seen.popitem(last=False)
    raise BuildDeferred(f"cuDNN graph {key[:1]} seen for the first time: its build is deferred")


def target(routes: Sequence[str]) -> Optional[str]:
    """The route a packed block defers to: the one after ``"cudnn"`` in ``routes`` (the block's routes that are
    available, take its dtype and were not refused, in the table's order) if it is one of :data:`TARGETS`, else
    ``None`` (no deferral: the graph is built now).

    Example::

        target(["cudnn", "flash", "exact"])       # 'flash'
        target(["cudnn", "flex", "exact"])        # None
    """
    if "cudnn" not in routes:
        return None
    i = list(routes).index("cudnn") + 1
    return routes[i] if i < len(routes) and routes[i] in TARGETS else None


def seen_keys() -> list[tuple]:
    """The graph keys seen once and not built then, oldest first (tests and benchmarks count them)."""
    with _lock:
        return list(_seen)


@register_clear  # cpscope.clear_caches() forgets them too
def clear_seen() -> None:
    """Forget the keys seen (the next block of each shape runs elsewhere once more)."""
    with _lock:
        _seen.clear()
