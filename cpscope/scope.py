"""The active context-parallel (CP) group, held in a :class:`contextvars.ContextVar`.

Glossary
--------
group
    A ``torch.distributed.ProcessGroup`` whose ranks split one sequence between them. ``None`` or a group of
    size 1 means **CP1**: no context parallelism.
size / rank
    ``cp_size()`` is the number of ranks in the active group (1 for CP1); ``cp_rank()`` is this process's rank
    *inside* that group (0 for CP1).
build-time group
    The group a model was built with (static CP). It is what is active when no :func:`runtime_cp` scope is bound.
    Set it once with :func:`set_build_time_cp_group` (or temporarily with :func:`build_time_cp`).
scope
    A :class:`CPScope`: an immutable snapshot ``(group, size, rank)``. :func:`runtime_cp` binds one;
    :func:`capture_scope` returns the one in force so that autograd, activation recompute or a pipeline schedule
    can re-enter it later with :meth:`CPScope.bind`.

This module imports nothing else of cpscope; every CP consumer (sharding, RoPE, attention, streams) reads it.
"""
from __future__ import annotations

import functools
import inspect
import threading
from contextvars import ContextVar
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

__all__ = [
    "CPScope",
    "runtime_cp",
    "current_cp_group",
    "cp_size",
    "cp_rank",
    "capture_scope",
    "resolve_scope",
    "set_build_time_cp_group",
    "build_time_cp_group",
    "build_time_cp",
    "scope_for",
    "set_debug_autograd_reads",
    "ScopeReadInBackwardError",
]

F = TypeVar("F", bound=Callable[..., Any])
_UNSET: Any = object()


class CPScope:
    """An immutable CP binding: the group, its size and this rank's rank inside it.

    ``CPScope`` objects are what :func:`runtime_cp` stores in the ContextVar and what :func:`capture_scope`
    returns. They are cheap, hashable by identity and safe to keep on an autograd ``ctx``.

    Example::

        snap = cpscope.capture_scope()      # in forward
        ...
        with snap.bind():                   # later, e.g. during activation recompute
            out = block(x)
    """

    __slots__ = ("group", "size", "rank", "comm")
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    comm: Optional[str]  # the attention communication variant this scope carries (None: the default, "p2p")

    def __init__(self, group: Optional[dist.ProcessGroup], size: int, rank: int, comm: Optional[str] = None) -> None:
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "comm", comm)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CPScope is immutable")

    def __repr__(self) -> str:
        comm = "" if self.comm is None else f", comm={self.comm!r}"
        if self.group is None:
            return f"CPScope(CP1{comm})"
        return f"CPScope(size={self.size}, rank={self.rank}, group={self.group!r}{comm})"

    def with_comm(self, comm: Optional[str]) -> "CPScope":
        """This binding carrying the attention communication variant ``comm`` (see :func:`check_comm`)."""
        comm = check_comm(comm)
        return self if comm == self.comm else CPScope(self.group, self.size, self.rank, comm)

    @property
    def is_cp1(self) -> bool:
        """True when this scope means no context parallelism."""
        return self.size == 1

    def bind(self) -> "runtime_cp":
        """A :func:`runtime_cp` scope that re-enters exactly this binding (context manager and decorator)."""
        return runtime_cp._from_scope(self)

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` with this scope bound."""
        token = _ACTIVE.set(self)
        try:
            return fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)


CP1 = CPScope(None, 1, 0)

# Attention communication variants a scope may carry (cpscope.attention._dispatch runs them); "a2a+p2p:N" too.
COMM_CHOICES = ("p2p", "all_gather", "a2a", "a2a+p2p", "auto")


def check_comm(comm: Optional[str]) -> Optional[str]:
    """``comm`` if it names a variant (or is None), else ``ValueError`` listing the choices."""
    if comm is None or comm in COMM_CHOICES:
        return comm
    if isinstance(comm, str) and comm.startswith("a2a+p2p:") and comm[8:].isdigit() and int(comm[8:]) > 1:
        return comm
    raise ValueError(f"comm must be one of {COMM_CHOICES} or 'a2a+p2p:N' (N > 1 the inner size), got {comm!r}")


# The one piece of state: which scope is active in *this* context (thread / asyncio task). None = unbound.
_ACTIVE: ContextVar[Optional[CPScope]] = ContextVar("cpscope_active_cp_scope", default=None)
# The build-time (static) scope. Process-wide on purpose: it is configuration fixed when the model is built,
# never the per-microbatch group (that one lives only in _ACTIVE).
_build_time: CPScope = CP1
# Facts of each group seen, computed once: group -> CPScope. Groups live for the job, so strong refs are fine.
_SCOPES: dict[Any, CPScope] = {}
_SCOPES_LOCK = threading.Lock()


def scope_for(group: Optional[dist.ProcessGroup], local_cp_size: Optional[int] = None) -> CPScope:
    """Validate ``group`` (and ``local_cp_size``) and return its :class:`CPScope`; cached per group.

    Raises ``ValueError`` when this rank is not a member of ``group``, or when ``local_cp_size`` contradicts it
    (``local_cp_size == 1`` ⇔ group is ``None`` or of size 1; otherwise ``local_cp_size == group.size()``).
    """
    if group is None:
        scope = CP1
    else:
        scope = _SCOPES.get(group)
        if scope is None:
            scope = _make_scope(group)
    if local_cp_size is not None and (type(local_cp_size) is not int or local_cp_size != scope.size):
        _raise_local_cp_size(group, scope, local_cp_size)
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
    scope = CP1 if size == 1 else CPScope(group, size, rank)
    with _SCOPES_LOCK:
        return _SCOPES.setdefault(group, scope)


def _raise_local_cp_size(group: Any, scope: CPScope, local_cp_size: Any) -> None:
    import numbers

    if isinstance(local_cp_size, bool) or not isinstance(local_cp_size, numbers.Integral):
        raise ValueError(f"local_cp_size must be an int (or None), got {type(local_cp_size).__name__} {local_cp_size!r}")
    if local_cp_size == scope.size:  # another integral type (numpy int, an int enum) that equals the size
        return
    what = "None (CP1)" if group is None else f"a group of size {scope.size}"
    raise ValueError(
        f"local_cp_size={local_cp_size} contradicts the CP group: got {what}. local_cp_size == 1 requires None or a "
        f"size-1 group; local_cp_size > 1 requires a group of exactly that size"
    )


class runtime_cp:
    """Bind ``group`` as the active CP group for the dynamic extent of a block or call.

    ``with runtime_cp(group): ...`` — or ``@runtime_cp(group)`` on a function. On exit, normally or by exception,
    exactly the previous binding is restored (the enclosing scope, or the build-time group outside every scope).
    Nested scopes: the innermost wins; ``runtime_cp(None)`` inside a CP2 scope means CP1 there.

    Scope: **context-local** (``contextvars``). A binding is seen by the thread / asyncio task that made it, and by
    tasks created inside it (they copy the context); never by other threads — in particular not by autograd's
    backward threads, which is why cpscope's autograd functions keep the scope captured in forward on ``ctx``.
    As a decorator each call binds afresh, so recursion, concurrent calls and generators are safe (a generator
    is bound around each step, never across a ``yield``).

    One ``runtime_cp`` *object* may be re-entered (nested) within one thread or task, but not entered concurrently
    from several threads or tasks (its tokens would interleave): write ``with runtime_cp(g):`` per use —
    construction is cheap — or use it as a decorator, which binds afresh on every call.

    Args:
        group: the CP group for this microbatch; ``None`` or a size-1 group means CP1.
        local_cp_size: optional cross-check (Megatron's convention). ``1`` requires CP1; ``n > 1`` requires a group
            of size ``n``. A contradiction raises ``ValueError`` naming both values.
        comm: the attention communication variant of this microbatch (``"p2p"``, ``"all_gather"``, ``"a2a"``,
            ``"a2a+p2p"``, ``"a2a+p2p:N"``, ``"auto"``), used where attention is called with ``comm=None``;
            default ``"p2p"``. Backward and recompute use the variant of their forward.

    Raises:
        ValueError: this rank is not a member of ``group``, ``local_cp_size`` contradicts ``group``, or ``comm``
            is not a variant.

    Example::

        groups = cpscope.new_cp_groups([1, 2, 4])
        for mb in microbatches:
            with cpscope.runtime_cp(groups[mb.cp]):
                loss = model(mb.shard()).sum()     # RoPE and attention read the group bound here
            loss.backward()                         # backward uses the group captured in forward
    """

    __slots__ = ("_scope", "_tokens")

    def __init__(
        self, group: Optional[dist.ProcessGroup], *, local_cp_size: Optional[int] = None, comm: Optional[str] = None
    ) -> None:
        if group is None and local_cp_size is None:
            self._scope = CP1
        else:
            self._scope = scope_for(group, local_cp_size)
        if comm is not None:
            self._scope = self._scope.with_comm(comm)
        self._tokens: list = []

    @classmethod
    def _from_scope(cls, scope: CPScope) -> "runtime_cp":
        self = cls.__new__(cls)
        self._scope = scope
        self._tokens = []
        return self

    @property
    def scope(self) -> CPScope:
        """The :class:`CPScope` this object binds."""
        return self._scope

    def __enter__(self) -> CPScope:
        self._tokens.append(_ACTIVE.set(self._scope))
        return self._scope

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _ACTIVE.reset(self._tokens.pop())

    def __call__(self, fn: F) -> F:
        scope = self._scope
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
                gen = scope.run(fn, *args, **kwargs)
                return (yield from _step_bound(gen, scope))

            return gen_wrapper  # type: ignore[return-value]
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                token = _ACTIVE.set(scope)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _ACTIVE.reset(token)

            return async_wrapper  # type: ignore[return-value]
        if inspect.isasyncgenfunction(fn):
            raise TypeError("runtime_cp cannot decorate an async generator; bind inside its body instead")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = _ACTIVE.set(scope)
            try:
                return fn(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"runtime_cp({self._scope!r})"


def _step_bound(gen: Any, scope: CPScope) -> Any:
    """Drive ``gen`` binding ``scope`` around each step only (never holding a token across ``yield``)."""
    try:
        request = scope.run(next, gen)
        while True:
            try:
                sent = yield request
            except GeneratorExit:
                scope.run(gen.close)
                raise
            except BaseException as e:  # forward throw() into the generator, bound
                request = scope.run(gen.throw, e)
            else:
                request = scope.run(gen.send, sent)
    except StopIteration as stop:
        return stop.value


# ----------------------------------------------------------------------------------------------------------------
# Readers


_debug_autograd_reads = False
# Debug mode only. The autograd graph task in which this context deliberately re-entered a captured scope
# (activation-checkpoint recompute, a hook wrapped with ``cpscope.scoped``): reads made there see the
# scope that was captured in forward, so they are allowed. -1: none. Set and reset by ``cpscope.checkpoint``.
_REENTERED_IN_TASK: ContextVar[int] = ContextVar("cpscope_scope_reentered_in_graph_task", default=-1)


class ScopeReadInBackwardError(RuntimeError):
    """Raised in debug mode when the active CP scope is read while autograd executes a backward pass.

    Example::

        cpscope.set_debug_autograd_reads(True)
        try:
            loss.backward()
        except cpscope.ScopeReadInBackwardError as e:
            print("a backward / hook / recompute read the ContextVar:", e)
    """


def set_debug_autograd_reads(enabled: bool = True) -> None:
    """Debug mode: raise :class:`ScopeReadInBackwardError` when the ContextVar is read inside autograd's backward.

    Backward functions, hooks and recompute must use the scope captured in forward (autograd runs them on its
    own threads, which do not see the caller's ContextVars). Tests turn this on to prove that nothing does.

    "Inside backward" means: on any thread, while the autograd engine runs a graph task — a node's ``backward``,
    tensor / node / post-accumulate-grad hooks, saved-tensor unpack hooks (non-reentrant checkpoint recompute) and
    ``queue_callback`` callbacks. Reads inside a scope that was deliberately re-entered during that graph task
    (``cpscope.checkpoint`` recompute, ``cpscope.scoped`` hooks) are allowed. Not detectable: a thread
    that a hook starts itself (it is outside every graph task). Off by default; when off, a read costs one
    global-bool check.

    Example::

        cpscope.set_debug_autograd_reads(True)
        loss.backward()            # raises if anything in backward calls cp_size() / current_cp_group() ...
        cpscope.set_debug_autograd_reads(False)
    """
    global _debug_autograd_reads
    _debug_autograd_reads = bool(enabled)


def _check_not_in_backward() -> None:
    import torch

    task = torch._C._current_graph_task_id()  # -1 outside every backward; also set in queue_callback callbacks
    if task == -1 or _REENTERED_IN_TASK.get() == task:
        return
    node = torch._C._current_autograd_node()
    where = f"node {node.name()}" if node is not None else "a callback of the backward pass"
    raise ScopeReadInBackwardError(
        f"the active CP scope was read inside autograd backward ({where}, graph task {task}); use the scope "
        "captured in forward (ctx) instead, or re-enter it explicitly (cpscope.scoped / reentered)"
    )


def capture_scope() -> CPScope:
    """The scope in force here: the innermost :func:`runtime_cp` binding, else the build-time scope.

    Keep the result (e.g. on an autograd ``ctx`` or with a microbatch) and re-enter it with ``scope.bind()``.

    Example::

        with cpscope.runtime_cp(groups[2]):
            snap = cpscope.capture_scope()       # CPScope(size=2, rank=…)
        with snap.bind():                         # CP2 again, anywhere in this thread / task
            ...
    """
    if _debug_autograd_reads:
        _check_not_in_backward()
    scope = _ACTIVE.get()
    return _build_time if scope is None else scope


def resolve_scope(group: Any = _UNSET) -> CPScope:
    """The scope for a CP consumer: ``group`` when given explicitly (``None`` = CP1), else :func:`capture_scope`.

    This is how every cpscope function implements "``group=`` explicitly, the active scope by default".

    Example::

        def my_op(x, *, group=_UNSET):
            scope = resolve_scope(group)          # once, in forward; keep it on ctx for backward
            return x * scope.size
    """
    if group is _UNSET:
        return capture_scope()
    return scope_for(group)


def current_cp_group() -> Optional[dist.ProcessGroup]:
    """The active CP group, or ``None`` for CP1 (a size-1 group is reported as ``None``).

    Example::

        with cpscope.runtime_cp(groups[2]):
            dist.all_reduce(t, group=cpscope.current_cp_group())
    """
    return capture_scope().group


def cp_size() -> int:
    """Size of the active CP group (1 for CP1).

    Example::

        with cpscope.runtime_cp(groups[4]):
            assert cpscope.cp_size() == 4
        assert cpscope.cp_size() == 1            # outside every scope: the build-time group (default CP1)
    """
    return capture_scope().size


def cp_rank() -> int:
    """This process's rank inside the active CP group (0 for CP1).

    Example::

        with cpscope.runtime_cp(groups[2]):
            chunk = cpscope.cp_rank()             # 0 or 1: which zigzag pair of chunks this rank holds
    """
    return capture_scope().rank


# ----------------------------------------------------------------------------------------------------------------
# Build-time group


def set_build_time_cp_group(group: Optional[dist.ProcessGroup]) -> None:
    """Set the build-time (static) CP group: what is active outside every :func:`runtime_cp` scope.

    Call it once after creating the model's static CP group (the default is ``None``, CP1). It is process-wide
    configuration, like Megatron's ``parallel_state``; per-microbatch groups are bound with :func:`runtime_cp`.

    Example::

        groups = cpscope.new_cp_groups([1, 2])
        cpscope.set_build_time_cp_group(groups[2])   # a model built with static CP2
        assert cpscope.cp_size() == 2                # outside every runtime scope
    """
    global _build_time
    _build_time = scope_for(group)


def build_time_cp_group() -> Optional[dist.ProcessGroup]:
    """The build-time CP group (``None`` for CP1).

    Example::

        with cpscope.runtime_cp(None):
            static = cpscope.build_time_cp_group()   # unaffected by the runtime scope
    """
    return _build_time.group


class build_time_cp:
    """Temporarily set the build-time group (context manager), restoring the previous one on exit.

    Meant for model construction and tests; not thread-safe (the build-time group is process-wide).

    Example::

        with cpscope.build_time_cp(groups[2]):
            model = build_model()     # wrappers capture the build-time group at construction
    """

    __slots__ = ("_group", "_saved")

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self._group = group
        self._saved: list[CPScope] = []

    def __enter__(self) -> CPScope:
        global _build_time
        self._saved.append(_build_time)
        _build_time = scope_for(self._group)
        return _build_time

    def __exit__(self, *exc: Any) -> None:
        global _build_time
        _build_time = self._saved.pop()
