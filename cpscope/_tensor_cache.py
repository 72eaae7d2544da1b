"""The one cache of what cpscope derives from small tensors (offsets), and the one :func:`clear_caches`.

cpscope derives a lot from a microbatch's offsets tensor (``cu_seqlens``): a validated host copy, the per-pack
metadata (zigzag indices, positions, the ring's plan, cuDNN's device offsets). :func:`derived` keeps such values
**per tensor**, keyed by the tensor's identity, and drops them with the tensor:

* Identity. Entries are found by ``id(tensor)`` and count only when their weak reference resolves to that very
  tensor (an id is reused once its object is gone); the reference's callback drops the entry when the tensor dies,
  so memory stays flat over a long run with a fresh offsets tensor per microbatch.
* Content. An entry is valid while the tensor keeps its content. Writes through torch bump the tensor's in-place
  version, and a new storage changes its data pointer; both are compared on every hit. Writes that torch does not
  see — ``cu = torch.from_numpy(buf)`` reused while a loader refills ``buf[:]`` — are caught **for CPU tensors** by
  comparing the tensor's bytes with a snapshot taken when the entry was made (a few hundred bytes for offsets:
  ~0.1 µs). For **CUDA** tensors the version and the data pointer are trusted: a content check would synchronise
  with the device. A CUDA offsets tensor written behind torch's back (DLPack, CuPy, a custom kernel) must be a new
  tensor, or call :func:`clear_caches`.
* Bounds. At most :data:`PER_TENSOR` values per tensor (the oldest goes first); values keyed by value
  (offsets given as Python sequences, one sequence length) go to :func:`by_value`, an LRU of
  :data:`VALUE_CACHE_SIZE` entries.
* Threads. Lookups take no lock (single dict operations); insertions and evictions take one lock; the weak
  reference callback takes none (it may run inside a garbage collection anywhere).

Values are shared by every caller: treat them as read-only, and never hand one to a user (copy it first).

:func:`clear_caches` (``cpscope.clear_caches``) drops this cache and calls every function registered with
:func:`register_clear` (the cuDNN graph cache of packed attention registers itself). A function-level memo is
written with :func:`lru` (``functools.lru_cache``, registered with :func:`clear_caches`), never with
``functools.lru_cache`` directly; a cache kept on an object (a module's tables) is made with :func:`owned`, which
:func:`clear_caches` empties too. ``tests/test_caches.py`` scans the package for caches that :func:`clear_caches`
cannot reach. Nothing cached is needed for correctness; clearing frees memory and costs a rebuild on next use.

Example::

    host = derived(cu, ("host_offsets",), lambda: tuple(cu.tolist()))   # one host copy while cu is unchanged
    cpscope.clear_caches()
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, TypeVar

import torch

__all__ = [
    "derived", "by_value", "lru", "owned", "register_clear", "registered", "clear_caches", "stats", "PER_TENSOR",
    "VALUE_CACHE_SIZE",
]

V = TypeVar("V")
F = TypeVar("F", bound=Callable[..., Any])
PER_TENSOR = 16  # values kept per tensor: a host copy and the packs of a few (cp, rank, real offsets)
VALUE_CACHE_SIZE = 64  # values kept for value keys (offsets given as Python sequences, sequence lengths)

_MISSING: Any = object()
_LOCK = threading.Lock()
_CLEARS: list[Callable[[], None]] = []
_OWNED: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()  # object -> names of its caches


class _Entry:
    """What is cached for one tensor: valid while ``ref()`` is it, its stamp is ``stamp`` and (CPU) its content
    equals ``snapshot`` (read through ``view``, an alias of its storage that does not keep the tensor alive)."""

    __slots__ = ("ref", "stamp", "view", "snapshot", "values")

    def __init__(self, ref: "weakref.ref[torch.Tensor]", stamp: tuple, view: Any, snapshot: Any) -> None:
        self.ref, self.stamp, self.view, self.snapshot = ref, stamp, view, snapshot
        self.values: dict[Hashable, Any] = {}

    def fresh(self, t: torch.Tensor, stamp: tuple) -> bool:
        if self.ref() is not t or self.stamp != stamp:
            return False
        if self.view is None:
            return True
        if type(self.snapshot) is bytes:
            return self.view.tobytes() == self.snapshot
        return torch.equal(self.view, self.snapshot)


_BY_TENSOR: dict[int, _Entry] = {}
_BY_VALUE: "OrderedDict[Hashable, Any]" = OrderedDict()


def _stamp(t: torch.Tensor) -> Optional[tuple]:
    """``(in-place version, data pointer, shape)``, or ``None`` for a tensor the cache cannot follow."""
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # no storage (fake, functional tensors)
        return None
    try:
        version = t._version
    except RuntimeError:  # inference tensors keep no version counter: only a content check can follow them
        if not t.is_cpu:
            return None
        version = None
    return (version, ptr, t.shape)


def _new_entry(t: torch.Tensor, stamp: tuple) -> Optional[_Entry]:
    """An entry for ``t`` with a snapshot of its content now (CPU), or ``None`` if ``t`` cannot be followed."""
    tid = id(t)
    try:
        ref = weakref.ref(t, lambda r, tid=tid: _drop(tid, r))
        view = snapshot = None
        if t.is_cpu:
            alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            try:
                view = alias.numpy()
                snapshot = view.tobytes()
            except (TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16, ...): compare with torch
                view, snapshot = alias, alias.clone()
    except (TypeError, RuntimeError):  # tensors that refuse weak references or storage aliases
        return None
    return _Entry(ref, stamp, view, snapshot)


def _drop(tid: int, ref: Any) -> None:
    # A weak-reference callback: it may run inside a garbage collection triggered anywhere, even with _LOCK held
    # by this thread, so it takes no lock (a race can only drop a newer entry: a later miss, never a wrong value).
    entry = _BY_TENSOR.get(tid)
    if entry is not None and entry.ref is ref:
        _BY_TENSOR.pop(tid, None)


def derived(t: torch.Tensor, key: Hashable, build: Callable[[], V],
            untracked: Optional[Callable[[], V]] = None) -> V:
    """``build()`` once per ``key`` while ``t`` lives and keeps its content; then the same object.

    ``untracked`` (default ``build``) computes the value for a tensor the cache cannot follow (an inference-mode
    CUDA tensor, a fake tensor). A ``build`` that raises caches nothing.

    Example::

        pack = derived(cu, ("pack", cp, rank), lambda: Pack(host_offsets(cu), cp, rank))
    """
    stamp = _stamp(t)
    if stamp is None:
        return (untracked or build)()
    tid = id(t)
    entry = _BY_TENSOR.get(tid)
    if entry is not None and entry.fresh(t, stamp):
        value = entry.values.get(key, _MISSING)
        if value is not _MISSING:
            return value
        new = False
    else:
        entry = _new_entry(t, stamp)  # its snapshot is taken before build() reads the content
        if entry is None:
            return (untracked or build)()
        new = True
    value = build()
    with _LOCK:
        if new:
            _BY_TENSOR[tid] = entry
        value = entry.values.setdefault(key, value)  # a concurrent build of the same key: keep the first
        while len(entry.values) > PER_TENSOR:
            del entry.values[next(iter(entry.values))]
    return value


def by_value(key: Hashable, build: Callable[[], V]) -> V:
    """``build()`` once per (hashable) ``key``, kept in an LRU of :data:`VALUE_CACHE_SIZE` entries.

    Example::

        pack = by_value(("pack", (0, 4, 12), 2, 1), lambda: Pack((0, 4, 12), 2, 1))
    """
    with _LOCK:
        value = _BY_VALUE.get(key, _MISSING)
        if value is not _MISSING:
            _BY_VALUE.move_to_end(key)
            return value
    value = build()
    with _LOCK:
        value = _BY_VALUE.setdefault(key, value)
        _BY_VALUE.move_to_end(key)
        while len(_BY_VALUE) > VALUE_CACHE_SIZE:
            _BY_VALUE.popitem(last=False)
    return value


def register_clear(fn: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`clear_caches` call ``fn()`` too (a cache of a higher layer); returns ``fn`` (a decorator too).

    Example::

        _tensor_cache.register_clear(clear_cache)      # in cpscope/attention/_kernels/cudnn_frontend.py
    """
    with _LOCK:
        if fn not in _CLEARS:
            _CLEARS.append(fn)
    return fn


def lru(maxsize: Optional[int] = 128) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)`` whose cache :func:`clear_caches` empties too (the one way cpscope memoises a
    function: the cache test refuses a bare ``functools.lru_cache`` in the package).

    Example::

        @_tensor_cache.lru(maxsize=16)
        def _load(path: str, mtime_ns: int) -> CommCostModel: ...
    """

    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        register_clear(cached.cache_clear)
        return cached  # type: ignore[return-value]

    return wrap


def owned(owner: Any, name: str) -> dict:
    """The dict ``owner.__dict__[name]`` (made on first use): a cache that lives and dies with ``owner`` — a module's
    tables — and that :func:`clear_caches` empties too. Call it on every use: a copy of ``owner`` (``deepcopy``
    copies its ``__dict__``) is then known as well.

    Example::

        tables = owned(self, "_cpscope_tables")       # in a module's forward
    """
    cache = owner.__dict__.get(name)
    if cache is None:
        cache = owner.__dict__[name] = {}
    names = _OWNED.get(owner)
    if names is None or name not in names:
        with _LOCK:
            _OWNED.setdefault(owner, set()).add(name)
    return cache


def registered() -> tuple[Callable[[], None], ...]:
    """The functions :func:`clear_caches` calls besides dropping this module's own caches (for tests)."""
    with _LOCK:
        return tuple(_CLEARS)


def clear_caches() -> None:
    """Drop every cache cpscope keeps: per-tensor and per-value values, the caches kept on objects (:func:`owned`)
    and every registered cache.

    Nothing cached is needed for correctness (a pending backward keeps what it uses); clearing frees memory and
    costs a rebuild on next use.

    Example::

        cpscope.clear_caches()        # e.g. between phases of a job, or in tests measuring memory
    """
    with _LOCK:
        _BY_TENSOR.clear()
        _BY_VALUE.clear()
        clears = list(_CLEARS)
        owned_now = [(owner, tuple(names)) for owner, names in _OWNED.items()]
    for owner, names in owned_now:
        for name in names:
            cache = owner.__dict__.get(name)
            if cache is not None:
                cache.clear()
    for fn in clears:
        fn()


def stats() -> dict[str, int]:
    """What is cached, for tests and memory checks: ``{"tensors": …, "derived": …, "values": …}``."""
    with _LOCK:
        entries = list(_BY_TENSOR.values())
        return {"tensors": len(entries), "derived": sum(len(e.values) for e in entries), "values": len(_BY_VALUE)}
