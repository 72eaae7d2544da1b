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
backward read check
    On by default: reading the scope (:func:`capture_scope`, :func:`resolve_scope` without ``group=``,
    :func:`current_cp_group`, :func:`cp_size`, :func:`cp_rank`, :func:`runtime_scope_or`) while autograd runs a
    backward pass raises :class:`ScopeReadInBackwardError`, unless the scope was bound inside that backward
    (``cpscope.checkpoint`` / ``scope_context_fn`` recompute, ``cpscope.scoped`` hooks, an explicit ``runtime_cp``).
    Experts opt out with :func:`set_backward_read_check` / :class:`allow_scope_reads_in_backward`.

This module imports nothing else of cpscope; every CP consumer (sharding, RoPE, attention, streams) reads it.
"""
from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch._C import _current_graph_task_id as _graph_task_id  # -1 on this thread outside every graph task
from torch._C._autograd import _top_saved_tensors_default_hooks as _top_saved_tensors_hooks


def _current_graph_task_id() -> int:
    """The autograd graph task this thread is running (``>= 0``), ``-2`` inside the recompute of a non-reentrant
    ``torch.utils.checkpoint`` where the engine shows no graph task, else ``-1`` (not inside a backward pass).

    Why the second signal: on CUDA the recompute runs in a saved-tensor unpack hook on autograd's device thread,
    where ``torch._C._current_graph_task_id()`` reads -1 (H200, torch 2.11: a plain non-reentrant checkpoint's
    recompute read the scope unchecked); torch marks its recompute by installing its ``_recomputation_hook``
    saved-tensor hooks, which is what is looked for (one more C call, ~60 ns, only when the first reads -1).
    """
    task = _graph_task_id()
    if task != -1:
        return task
    hooks = _top_saved_tensors_hooks(False)
    if hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook"):
        return -2
    return -1

__all__ = [
    "CPScope",
    "runtime_cp",
    "current_cp_group",
    "cp_size",
    "cp_rank",
    "capture_scope",
    "resolve_scope",
    "runtime_scope_or",
    "set_build_time_cp_group",
    "build_time_cp_group",
    "build_time_scope",
    "build_time_cp",
    "scope_for",
    "ScopeReadInBackwardError",
    "set_backward_read_check",
    "backward_read_check_enabled",
    "allow_scope_reads_in_backward",
    "set_debug_autograd_reads",
]

F = TypeVar("F", bound=Callable[..., Any])
_UNSET: Any = object()


def _no_group() -> None:
    return None


class _Strong:
    """A strong stand-in for a weak reference, for group objects that refuse weak references (test stand-ins)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


def _group_ref(group: Any, callback: Optional[Callable[[Any], None]] = None) -> Callable[[], Any]:
    if group is None:
        return _no_group
    try:
        return weakref.ref(group, callback)
    except TypeError:
        return _Strong(group)


class CPScope:
    """An immutable CP binding: the group, its size and this rank's rank inside it.

    ``CPScope`` objects are what :func:`runtime_cp` stores in the ContextVar and what :func:`capture_scope`
    returns. They are cheap, hashable by identity and safe to keep on an autograd ``ctx``. A scope refers to its
    process group *weakly*, so neither a scope nor cpscope's cache keeps a destroyed group (and its communicators)
    alive; ``scope.group`` of a group that was destroyed and dropped raises ``RuntimeError``. ``copy`` /
    ``copy.deepcopy`` return the scope itself (a process group cannot be copied); pickling is refused.

    Example::

        snap = cpscope.capture_scope()      # in forward
        ...
        with snap.bind():                   # later, e.g. during activation recompute
            out = block(x)
    """

    __slots__ = ("_ref", "size", "rank", "comm")
    size: int
    rank: int
    comm: Optional[str]  # the attention communication variant this scope carries (None: the default, "p2p")

    def __init__(self, group: Optional[dist.ProcessGroup], size: int, rank: int, comm: Optional[str] = None) -> None:
        object.__setattr__(self, "_ref", _group_ref(group))
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "comm", comm)

    @classmethod
    def _with_ref(cls, ref: Callable[[], Any], size: int, rank: int, comm: Optional[str] = None) -> "CPScope":
        self = cls.__new__(cls)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "comm", comm)
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
        """This binding carrying the attention communication variant ``comm`` (see :func:`check_comm`)."""
        comm = check_comm(comm)
        return self if comm == self.comm else CPScope._with_ref(self._ref, self.size, self.rank, comm)

    @property
    def is_cp1(self) -> bool:
        """True when this scope means no context parallelism."""
        return self.size == 1

    def bind(self) -> "runtime_cp":
        """A :func:`runtime_cp` scope that re-enters exactly this binding (context manager and decorator)."""
        return runtime_cp._from_scope(self)

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` with this scope bound."""
        tokens = _bind(self)
        try:
            return fn(*args, **kwargs)
        finally:
            _unbind(tokens)


CP1 = CPScope(None, 1, 0)

# Attention communication variants a scope may carry (cpscope.attention.variants runs them); "a2a+p2p:N" too.
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
# The autograd graph task (backward pass) during which the innermost binding of this context was made, or -1 when
# it was made outside every backward. A read inside a backward is allowed only when the scope was bound inside a
# backward (recompute re-entering a capture, a scoped hook, an explicit runtime_cp there): then it is the scope the
# code chose, not whatever the caller's context happened to hold when backward started.
_BOUND_IN_TASK: ContextVar[int] = ContextVar("cpscope_scope_bound_in_graph_task", default=-1)
# The build-time (static) scope. Process-wide on purpose: it is configuration fixed when the model is built,
# never the per-microbatch group (that one lives only in _ACTIVE).
_build_time: CPScope = CP1
# Facts of each group seen, computed once: id(group) -> (weak reference to the group, its CPScope). Nothing here
# holds the group strongly (a CPScope refers to its group weakly too) and the weak reference's callback drops the
# entry when the group dies, so the cache never keeps a destroyed group (and its communicators) alive.
_SCOPES: dict[int, tuple[Callable[[], Any], CPScope]] = {}


def _bind(scope: CPScope) -> Any:
    """Bind ``scope`` in this context; returns the token(s) for :func:`_unbind`.

    Outside backward (the common case) that is one ContextVar token; inside a backward pass a pair, the second
    marking the binding as made inside it (an enclosing marker cannot exist outside backward, so none is reset).
    ``runtime_cp.__enter__`` / ``__exit__`` inline the same logic (this is the hot path).
    """
    task = _current_graph_task_id()
    if task == -1:
        return _ACTIVE.set(scope)
    return _ACTIVE.set(scope), _BOUND_IN_TASK.set(task)


def _unbind(tokens: Any) -> None:
    if type(tokens) is tuple:
        _BOUND_IN_TASK.reset(tokens[1])
        _ACTIVE.reset(tokens[0])
    else:
        _ACTIVE.reset(tokens)


def scope_for(group: Optional[dist.ProcessGroup], local_cp_size: Optional[int] = None) -> CPScope:
    """Validate ``group`` (and ``local_cp_size``) and return its :class:`CPScope`; cached per group.

    Raises ``ValueError`` when this rank is not a member of ``group``, or when ``local_cp_size`` contradicts it
    (``local_cp_size == 1`` ⇔ group is ``None`` or of size 1; otherwise ``local_cp_size == group.size()``).

    Example::

        scope = scope_for(groups[2], local_cp_size=2)    # CPScope(size=2, rank=…); the same object every call
    """
    if group is None:
        scope = CP1
    else:
        # An entry under id(group) is this group's: the weak reference's callback drops an entry synchronously
        # when its group dies, before the id can be reused (and a strongly held stand-in never dies).
        hit = _SCOPES.get(id(group))
        scope = hit[1] if hit is not None else _make_scope(group)
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
    key = id(group)

    def forget(ref: Any, key: int = key) -> None:  # the group died: drop its entry (if it is still this one)
        entry = _SCOPES.get(key)
        if entry is not None and entry[0] is ref:
            _SCOPES.pop(key, None)

    existing = _SCOPES.get(key)
    if existing is not None and existing[0]() is group:  # another thread made it meanwhile
        return existing[1]
    ref = _group_ref(group, forget)
    scope = CP1 if size == 1 else CPScope._with_ref(ref, size, rank)
    _SCOPES[key] = (ref, scope)
    return scope


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

    Entered inside an autograd backward pass (a hook, a custom recompute), the binding counts as deliberate for the
    backward read check: reads under it are allowed there (:func:`set_backward_read_check`).

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
            hit = _SCOPES.get(id(group)) if local_cp_size is None else None  # scope_for's cache hit, inlined
            self._scope = hit[1] if hit is not None else scope_for(group, local_cp_size)
        if comm is not None:
            self._scope = self._scope.with_comm(comm)
        # What __enter__ must undo: None (not entered), one binding's token(s), or a list of them when nested.
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
        task = _current_graph_task_id()  # inlined _bind: this is the hot path
        tokens = _ACTIVE.set(scope) if task == -1 else (_ACTIVE.set(scope), _BOUND_IN_TASK.set(task))
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
        if type(held) is list:
            tokens = held.pop()
            if not held:
                self._tokens = None
        else:
            tokens, self._tokens = held, None
        if type(tokens) is tuple:
            _BOUND_IN_TASK.reset(tokens[1])
            _ACTIVE.reset(tokens[0])
        else:
            _ACTIVE.reset(tokens)

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
                tokens = _bind(scope)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _unbind(tokens)

            return async_wrapper  # type: ignore[return-value]
        if inspect.isasyncgenfunction(fn):
            raise TypeError("runtime_cp cannot decorate an async generator; bind inside its body instead")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tokens = _bind(scope)
            try:
                return fn(*args, **kwargs)
            finally:
                _unbind(tokens)

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


_check_reads = True  # the backward read check (process-wide: autograd's threads must see it too)


class ScopeReadInBackwardError(RuntimeError):
    """The active CP scope was read inside an autograd backward pass that did not re-enter a captured scope.

    Raised by default (see :func:`set_backward_read_check`). Backward functions, hooks and activation recompute
    must use the scope captured in forward: autograd runs them later (another microbatch's group may be bound by
    then) and, on CUDA, on its own threads, which do not see the caller's ContextVars — a read there returns a
    wrong group, silently. The message says where the read happened and how to fix it.

    Example::

        with cpscope.runtime_cp(groups[2]):
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)   # recompute reads the scope
        y.sum().backward()        # ScopeReadInBackwardError: use cpscope.checkpoint(block, x) instead
    """


def set_backward_read_check(enabled: bool = True) -> bool:
    """Turn the backward read check on (the default) or off, process-wide; returns the previous setting.

    With the check on, every read of the active scope (:func:`capture_scope`, :func:`resolve_scope` without
    ``group=``, :func:`current_cp_group`, :func:`cp_size`, :func:`cp_rank`, :func:`runtime_scope_or`, and so every
    cpscope consumer that reads the scope: sharding, RoPE, attention, the modules and adapters) raises
    :class:`ScopeReadInBackwardError` while the autograd engine runs a backward pass on that thread — a node's
    ``backward``, tensor / node / post-accumulate-grad hooks, saved-tensor unpack hooks (non-reentrant checkpoint
    recompute), ``queue_callback`` callbacks — unless the scope read was bound inside that backward:
    ``cpscope.checkpoint`` and ``scope_context_fn`` recompute, ``cpscope.scoped`` / ``MicrobatchScope.hook``
    hooks, or an explicit ``runtime_cp`` / ``CPScope.bind()`` there. Reads with an explicit ``group=`` are never
    checked. Not detectable: a thread that a hook starts itself (it runs outside every backward).

    Turning it off is for experts who read the scope in backward on purpose and know their backward runs where
    the caller's binding is visible; prefer :class:`allow_scope_reads_in_backward` around the one call. Cost with
    the check on: one C call per read (measured in ``benchmarks/bench_scope.py``, ``docs/benchmarks.md``).

    Example::

        previous = cpscope.set_backward_read_check(False)   # expert opt-out
        try:
            loss.backward()
        finally:
            cpscope.set_backward_read_check(previous)
    """
    global _check_reads
    previous, _check_reads = _check_reads, bool(enabled)
    return previous


def backward_read_check_enabled() -> bool:
    """Whether the backward read check is on (it is by default).

    Example::

        assert cpscope.backward_read_check_enabled()
    """
    return _check_reads


class allow_scope_reads_in_backward:
    """Context manager (and decorator): the backward read check is off inside, restored on exit (expert opt-out).

    Scope: **process-wide**, not context-local — autograd's backward threads must see it, and they do not see the
    caller's ContextVars. Do not use it while other threads run backward passes that should stay checked.

    Example::

        with cpscope.allow_scope_reads_in_backward():
            loss.backward()       # a hook of yours reads cpscope.cp_size() on purpose
    """

    __slots__ = ("_saved",)

    def __init__(self) -> None:
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved.append(set_backward_read_check(False))

    def __exit__(self, *exc: Any) -> None:
        set_backward_read_check(self._saved.pop())

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with allow_scope_reads_in_backward():
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def set_debug_autograd_reads(enabled: bool = True) -> None:
    """Deprecated: the backward read check is now on by default; use :func:`set_backward_read_check`.

    ``set_debug_autograd_reads(True)`` keeps the check on; ``set_debug_autograd_reads(False)`` turns it **off**
    (an opt-out, no longer "leave debug mode"). Both warn with ``DeprecationWarning``.

    Example::

        cpscope.set_backward_read_check(True)     # instead of set_debug_autograd_reads(True)
    """
    warnings.warn(
        "cpscope.set_debug_autograd_reads is deprecated: the backward read check is on by default. Use "
        "cpscope.set_backward_read_check(enabled) (or the context manager cpscope.allow_scope_reads_in_backward()) "
        f"-- set_debug_autograd_reads({enabled!r}) now {'keeps it on' if enabled else 'turns it OFF'}",
        DeprecationWarning,
        stacklevel=2,
    )
    set_backward_read_check(enabled)


def _raise_read_in_backward(task: int) -> None:
    node = torch._C._current_autograd_node()
    if task == -2:
        where = "the recompute of a non-reentrant torch.utils.checkpoint"
    else:
        where = f"node {node.name()}, graph task {task}" if node is not None else \
            f"a callback of the backward pass, graph task {task}"
    raise ScopeReadInBackwardError(
        f"the active CP scope was read inside autograd backward ({where}) without re-entering "
        "the scope captured in forward; outside the forward's runtime_cp the read would see another microbatch's "
        "group or none (and, on CUDA, autograd's threads never see the caller's binding). Fix: checkpoint with "
        "cpscope.checkpoint(fn, *args) instead of torch.utils.checkpoint.checkpoint, or pass "
        "context_fn=cpscope.scope_context_fn() to a non-reentrant torch checkpoint (transformers: "
        "attn_implementation='cpscope' models wrap their checkpointing automatically); wrap a function recomputed "
        "by other code (Megatron's tensor_parallel.checkpoint) or a hook with cpscope.scoped(fn), built in forward; "
        "a custom autograd.Function must resolve the scope in forward and keep it on ctx. Experts can opt out with "
        "cpscope.allow_scope_reads_in_backward() or cpscope.set_backward_read_check(False)"
    )


def runtime_scope_or(default: CPScope) -> CPScope:
    """The bound runtime scope (innermost :func:`runtime_cp`) if any, else ``default``; a checked read.

    The read is checked like every scope read (:func:`set_backward_read_check`), also when nothing is bound: a
    module's build-time default used from a backward recompute is as wrong as a stale runtime scope.

    Example::

        class MyOp(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.build_scope = cpscope.build_time_scope()     # captured at construction
            def forward(self, x):
                scope = cpscope.runtime_scope_or(self.build_scope)  # runtime scope wins
                return x * scope.size
    """
    if _check_reads:
        task = _current_graph_task_id()
        if task != -1 and _BOUND_IN_TASK.get() != task:  # bound in THIS backward (a stale marker must not pass)
            _raise_read_in_backward(task)
    scope = _ACTIVE.get()
    return default if scope is None else scope


def capture_scope() -> CPScope:
    """The scope in force here: the innermost :func:`runtime_cp` binding, else the build-time scope.

    Keep the result (e.g. on an autograd ``ctx`` or with a microbatch) and re-enter it with ``scope.bind()``.
    Raises :class:`ScopeReadInBackwardError` inside a backward pass that did not bind a scope itself
    (:func:`set_backward_read_check`).

    Example::

        with cpscope.runtime_cp(groups[2]):
            snap = cpscope.capture_scope()       # CPScope(size=2, rank=…)
        with snap.bind():                         # CP2 again, anywhere in this thread / task
            ...
    """
    if _check_reads:
        task = _current_graph_task_id()
        if task != -1 and _BOUND_IN_TASK.get() != task:  # bound in THIS backward (a stale marker must not pass)
            _raise_read_in_backward(task)
    scope = _ACTIVE.get()
    return _build_time if scope is None else scope


def resolve_scope(group: Any = _UNSET) -> CPScope:
    """The scope for a CP consumer: ``group`` when given explicitly (``None`` = CP1), else :func:`capture_scope`.

    This is how every cpscope function implements "``group=`` explicitly, the active scope by default". Only the
    default (a read of the active scope) is subject to the backward read check.

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
    if _check_reads:
        task = _current_graph_task_id()
        if task != -1 and _BOUND_IN_TASK.get() != task:  # bound in THIS backward (a stale marker must not pass)
            _raise_read_in_backward(task)
    scope = _ACTIVE.get()
    if scope is None:
        scope = _build_time
    if scope.size == 1:
        return None
    group = scope._ref()  # what the ``group`` property does, without its call overhead
    return group if group is not None else scope.group  # (dead: the property raises)


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


def build_time_scope() -> CPScope:
    """The build-time :class:`CPScope` (process-wide, never a runtime binding): what modules capture at construction.

    Example::

        with cpscope.runtime_cp(groups[2]):
            assert cpscope.build_time_scope().is_cp1     # the runtime CP2 binding is not the build-time group
    """
    return _build_time


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
