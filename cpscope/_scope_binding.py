"""A CP scope and binding it: :class:`CPScope` (the immutable facts of one group: size, rank, comm),
:func:`scope_for` (a group's scope, validated and interned per live group), the ContextVar that holds the active
scope and :class:`runtime_cp`, the one way to bind it. The readers of the active scope and the build-time default
are :mod:`cpscope.scope`, the public home of every name here.

State: the ContextVar (per thread / asyncio task) and a weak cache of each group's facts. Bindings follow the
protocol of :mod:`cpscope.backward_check`.

Example::

    with runtime_cp(groups[2]) as scope:       # CPScope(size=2, rank=...)
        ...
"""
from __future__ import annotations

import numbers
import weakref
from contextvars import ContextVar, Token
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from ._checks import check_int
from ._contextlib import bound_calls
from ._variants import check_comm
from .backward_check import mark_binding, thread_task, unmark_binding

__all__ = ["CP1", "CPScope", "UNSET", "get_active", "runtime_cp", "scope_for"]

F = TypeVar("F", bound=Callable[..., Any])
UNSET: Any = object()  # the default of every ``group=`` argument: "not given", read the active scope


def _no_group() -> None:
    return None


def _group_ref(group: Any, callback: Optional[Callable[[Any], None]] = None) -> Callable[[], Any]:
    """A weak reference to ``group``; a strong one for objects that refuse weak references (test stand-ins)."""
    if group is None:
        return _no_group
    try:
        return weakref.ref(group, callback)
    except TypeError:
        return lambda: group


class CPScope:
    """An immutable CP binding: the group, its size and this rank's rank inside it.

    ``CPScope`` objects are what :func:`runtime_cp` stores in the ContextVar and what :func:`capture_scope`
    returns. They are cheap, hashable by identity and safe to keep on an autograd ``ctx``. A scope refers to its
    process group *weakly*, so neither a scope nor cpscope's cache keeps a destroyed group (and its communicators)
    alive; ``scope.group`` of a group that was destroyed and dropped raises ``RuntimeError``. ``copy`` /
    ``copy.deepcopy`` return the scope itself (a process group cannot be copied); pickling is refused.

    Example::

        snap = cpscope.capture_scope()      # in forward
        with snap.bind():                   # later, e.g. during activation recompute
            out = block(x)
    """

    __slots__ = ("_ref", "size", "rank", "comm")
    size: int
    rank: int
    comm: Optional[str]  # the attention communication variant this scope carries (None: the default)

    def __init__(self, group: Optional[dist.ProcessGroup], size: int, rank: int, comm: Optional[str] = None) -> None:
        self._set(_group_ref(group), size, rank, comm)

    def _set(self, ref: Callable[[], Any], size: int, rank: int, comm: Optional[str] = None) -> "CPScope":
        size = check_int(size, "CPScope size", low=1)
        object.__setattr__(self, "_ref", _no_group if size == 1 else ref)  # a size-1 group means CP1: no group
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rank", check_int(rank, "CPScope rank", low=0))
        object.__setattr__(self, "comm", check_comm(comm))
        return self

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group (``None`` for CP1)."""
        group = self._ref()
        if group is None and self.size > 1:
            raise RuntimeError(
                f"the CP group of this scope (size {self.size}, rank {self.rank}) was destroyed "
                "(torch.distributed.destroy_process_group) and released; bind a live group"
            )
        return group

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CPScope is immutable")

    def __copy__(self) -> "CPScope":
        return self

    def __deepcopy__(self, memo: dict) -> "CPScope":
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a CPScope refers to a live process group and cannot be pickled; send (size, rank) instead")

    def __repr__(self) -> str:
        comm = "" if self.comm is None else f", comm={self.comm!r}"
        if self.size == 1:
            return f"CPScope(CP1{comm})"
        group = self._ref()
        shown = "<destroyed>" if group is None else repr(group)
        return f"CPScope(size={self.size}, rank={self.rank}, group={shown}{comm})"

    def with_comm(self, comm: Optional[str]) -> "CPScope":
        """This binding carrying the attention communication variant ``comm`` (see ``cpscope._variants``)."""
        comm = check_comm(comm)
        return self if comm == self.comm else CPScope.__new__(CPScope)._set(self._ref, self.size, self.rank, comm)

    @property
    def is_cp1(self) -> bool:
        """True when this scope means no context parallelism."""
        return self.size == 1

    def bind(self) -> "runtime_cp":
        """A :func:`runtime_cp` scope that re-enters exactly this binding (context manager and decorator).

        Example::

            with snap.bind():
                assert cpscope.capture_scope() is snap
        """
        return runtime_cp._from_scope(self)


CP1 = CPScope(None, 1, 0)

# The one piece of per-context state: which scope is active in *this* context (thread / asyncio task). None = unbound.
_ACTIVE: ContextVar[Optional[CPScope]] = ContextVar("cpscope_active_cp_scope", default=None)
get_active = _ACTIVE.get  # the readers' one access to the ContextVar (cpscope.scope)
# Facts of each group seen: weakref.ref(group) (callback-less: the same key while the group lives) -> its CPScope.
# A lookup finds only this very group's entry (references to two objects never compare equal, whatever their ids);
# a second reference's callback drops the entry when the group dies: the cache never keeps a group alive.
_SCOPES: "dict[weakref.ref[Any], CPScope]" = {}
_CALLBACKS: "dict[weakref.ref[Any], weakref.ref[Any]]" = {}  # keeps each entry's dropping reference alive
_wref = weakref.ref


def _bind(scope: CPScope) -> Any:
    """Bind ``scope`` here, marked when made inside a graph task (backward_check's protocol); tokens for _unbind."""
    task = thread_task()
    return _ACTIVE.set(scope) if task == -1 else (_ACTIVE.set(scope), mark_binding(task))


def _unbind(tokens: Any) -> None:
    if type(tokens) is tuple:
        unmark_binding(tokens[1])
        _ACTIVE.reset(tokens[0])
    else:
        _ACTIVE.reset(tokens)


def scope_for(group: Optional[dist.ProcessGroup], local_cp_size: Optional[int] = None) -> CPScope:
    """Validate ``group`` (and ``local_cp_size``) and return its :class:`CPScope`; cached per group.

    Raises ``ValueError`` when this rank is not a member of ``group``, or when ``local_cp_size`` (any integer, not a
    bool or float) contradicts it (``1`` ⇔ group ``None`` or of size 1; otherwise ``group.size()``).

    Example::

        scope = scope_for(groups[2], local_cp_size=2)    # CPScope(size=2, rank=…); the same object every call
    """
    if group is None:
        scope = CP1
    else:
        try:
            scope = _SCOPES.get(_wref(group))
        except TypeError:  # refuses weak references: not a ProcessGroup (_make_scope says so)
            scope = None
        if scope is None:
            scope = _make_scope(group)
    if local_cp_size is not None and (type(local_cp_size) is not int or local_cp_size != scope.size):
        _check_local_cp_size(group, scope, local_cp_size)
    return scope


def _make_scope(group: Any) -> CPScope:
    if not isinstance(group, dist.ProcessGroup):
        # torch returns a sentinel (GroupMember.NON_GROUP_MEMBER) to ranks outside a new group.
        if group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
            raise ValueError(
                "runtime_cp: this rank is not a member of the given CP group (got GroupMember.NON_GROUP_MEMBER); "
                "bind only the group returned for this rank, e.g. new_cp_groups([...])[size]"
            )
        raise ValueError(f"runtime_cp: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    size = group.size()
    rank = dist.get_rank(group)
    if rank < 0:
        me = dist.get_rank() if dist.is_initialized() else "?"
        try:
            members = dist.get_process_group_ranks(group)
        except Exception:  # pragma: no cover - depends on torch internals
            members = "?"
        raise ValueError(
            f"runtime_cp: global rank {me} is not a member of the CP group of size {size} (its global ranks: "
            f"{members}); bind only a group this rank belongs to"
        )
    key = _wref(group)

    def forget(_: Any, key: Any = key) -> None:  # the group died: drop its entry
        _SCOPES.pop(key, None)
        _CALLBACKS.pop(key, None)

    _CALLBACKS[key] = ref = _wref(group, forget)
    scope = CP1 if size == 1 else CPScope.__new__(CPScope)._set(ref, size, rank)
    _SCOPES[key] = scope
    return scope


def _check_local_cp_size(group: Any, scope: CPScope, local_cp_size: Any) -> None:
    if isinstance(local_cp_size, bool) or not isinstance(local_cp_size, numbers.Integral):
        raise ValueError(f"local_cp_size must be an int (or None), got {type(local_cp_size).__name__} {local_cp_size!r}")
    value = int(local_cp_size)
    if value != scope.size:
        what = "None (CP1)" if group is None else f"a group of size {scope.size}"
        raise ValueError(
            f"local_cp_size={value} contradicts the CP group: got {what}. local_cp_size == 1 requires None or a "
            f"size-1 group; local_cp_size > 1 requires a group of exactly that size"
        )


class runtime_cp:
    """Bind ``group`` as the active CP group for the dynamic extent of a block or call (``@runtime_cp(group)``).

    On exit, normally or by exception, exactly the previous binding is restored (the enclosing scope, or the
    build-time group outside every scope). Nested scopes: the innermost wins; ``runtime_cp(None)`` means CP1 there.

    Scope: **context-local** (``contextvars``): seen by the thread / asyncio task that made it and by tasks created
    inside it; never by other threads — not by autograd's backward threads either, which is why cpscope's autograd
    functions keep the scope captured in forward on ``ctx``. As a decorator each call binds afresh (recursion,
    concurrent calls and generators are safe: a generator is bound around each step, never across a ``yield``).
    One object may be re-entered (nested) within one thread or task, not entered concurrently from several.
    Entered inside an autograd backward pass, the binding counts as deliberate for the backward read check.

    Args:
        group: the CP group for this microbatch; ``None`` or a size-1 group means CP1.
        local_cp_size: optional cross-check (Megatron's), any integer: ``1`` requires CP1, ``n > 1`` a group of size n.
        comm: the attention variant (``cpscope._variants``) where attention is called with ``comm=None``.

    Raises:
        ValueError: this rank is not in ``group``; ``local_cp_size`` contradicts it; ``comm`` is not a variant.

    Example::

        for mb in microbatches:
            with cpscope.runtime_cp(groups[mb.cp]):
                loss = model(mb.shard()).sum()     # RoPE and attention read the group bound here
            loss.backward()                         # backward uses the group captured in forward
    """

    __slots__ = ("_scope", "_tokens")

    def __init__(
        self, group: Optional[dist.ProcessGroup], *, local_cp_size: Optional[int] = None, comm: Optional[str] = None
    ) -> None:
        if local_cp_size is None and comm is None:  # the hot path: scope_for's cache hit, inlined
            if group is None:
                self._scope = CP1
                self._tokens = None
                return
            try:
                scope = _SCOPES.get(_wref(group))
            except TypeError:  # refuses weak references: scope_for says why
                scope = None
            if scope is not None:
                self._scope = scope
                self._tokens = None
                return
        scope = scope_for(group, local_cp_size)
        self._scope = scope if comm is None else scope.with_comm(comm)
        # What __exit__ must undo: None (not entered), one binding's token(s), or a list of them when nested.
        # (No list for the common single use: this is the hot path.)
        self._tokens: Any = None

    @classmethod
    def _from_scope(cls, scope: CPScope) -> "runtime_cp":
        self = cls.__new__(cls)
        self._scope = scope
        self._tokens = None
        return self

    @property
    def scope(self) -> CPScope:
        """The :class:`CPScope` this object binds."""
        return self._scope

    def __enter__(self) -> CPScope:
        scope = self._scope
        if self._tokens is None and thread_task() == -1:  # the hot path: one binding, outside every backward
            self._tokens = _ACTIVE.set(scope)
            return scope
        tokens = _bind(scope)
        held = self._tokens
        if held is None:
            self._tokens = tokens
        elif type(held) is list:
            held.append(tokens)
        else:
            self._tokens = [held, tokens]
        return scope

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        held = self._tokens
        if type(held) is Token:  # the hot path
            self._tokens = None
            _ACTIVE.reset(held)
            return
        if type(held) is list:
            tokens = held.pop()
            if not held:
                self._tokens = None
        else:
            tokens, self._tokens = held, None
        _unbind(tokens)

    def __call__(self, fn: F) -> F:
        scope = self._scope
        return bound_calls(fn, lambda: _bind(scope), _unbind)  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"runtime_cp({self._scope!r})"
