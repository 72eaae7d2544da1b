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
    can re-enter it later with :meth:`CPScope.bind` (the one way to re-enter a scope).

State. The active scope lives only in the ContextVar (per thread / asyncio task). Process-wide: the build-time scope
(configuration fixed when a model is built) and a weak cache of each group's facts. Reads and bindings follow the
protocol of :mod:`cpscope.backward_check`; this module knows nothing else of its readers.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ._scope_binding import CP1, UNSET, CPScope, get_active, runtime_cp, scope_for
from .backward_check import check_read, thread_task

__all__ = [
    "CPScope", "runtime_cp", "current_cp_group", "cp_size", "cp_rank", "capture_scope", "resolve_scope",
    "runtime_scope_or", "set_build_time_cp_group", "build_time_cp_group", "build_time_scope", "build_time_cp",
    "UNSET",
]  # scope_for (the local_cp_size check of the adapters) stays importable

# The build-time (static) scope. Process-wide on purpose: it is configuration fixed when the model is built,
# never the per-microbatch group (that one lives only in the ContextVar of cpscope._scope_binding).
_build_time: CPScope = CP1


# ----------------------------------------------------------------------------------------------------------------
# Readers (each a checked read: cpscope.backward_check.check_read)


def runtime_scope_or(default: CPScope) -> CPScope:
    """The bound runtime scope (innermost :func:`runtime_cp`) if any, else ``default``; a checked read (also when
    nothing is bound: a module's build-time default used from a backward recompute is as wrong as a stale scope).

    Example::

        scope = cpscope.runtime_scope_or(self.build_scope)   # in a module's forward: the runtime scope wins
    """
    scope = get_active()
    if scope is None or thread_task() != -1:  # backward_check's protocol: else the read passes
        check_read(scope is not None)
    return default if scope is None else scope


def capture_scope() -> CPScope:
    """The scope in force here: the innermost :func:`runtime_cp` binding, else the build-time scope.

    Keep the result (e.g. on an autograd ``ctx`` or with a microbatch) and re-enter it with ``scope.bind()``.
    Raises :class:`cpscope.ScopeReadInBackwardError` inside a backward pass that did not bind a scope itself.

    Example::

        with cpscope.runtime_cp(groups[2]):
            snap = cpscope.capture_scope()       # CPScope(size=2, rank=…); snap.bind() re-enters it later
    """
    scope = get_active()
    if scope is None:
        check_read(False)
        return _build_time
    if thread_task() != -1:  # backward_check's protocol: else the read passes
        check_read(True)
    return scope


def resolve_scope(group: Any = UNSET) -> CPScope:
    """The scope for a CP consumer: ``group`` when given explicitly (``None`` = CP1), else :func:`capture_scope`.

    How every cpscope function implements "``group=`` explicitly, the active scope by default"; only the default
    (a read of the active scope) is subject to the backward read check.

    Example::

        scope = resolve_scope(group)          # def my_op(x, *, group=UNSET): once, in forward; keep it on ctx
    """
    if group is UNSET:
        return capture_scope()
    return scope_for(group)


def current_cp_group() -> Optional[dist.ProcessGroup]:
    """The active CP group, or ``None`` for CP1 (a size-1 group is reported as ``None``).

    Example::

        group = cpscope.current_cp_group()        # inside runtime_cp(groups[2]): groups[2]
    """
    scope = get_active()
    if scope is None:
        check_read(False)
        scope = _build_time
    elif thread_task() != -1:  # backward_check's protocol: else the read passes
        check_read(True)
    group = scope._ref()  # what the ``group`` property does, without its call overhead (None for CP1)
    return group if group is not None or scope.size == 1 else scope.group  # (dead: the property raises)


def cp_size() -> int:
    """Size of the active CP group (1 for CP1).

    Example::

        assert cpscope.cp_size() == 4             # inside runtime_cp(groups[4])
    """
    return capture_scope().size


def cp_rank() -> int:
    """This process's rank inside the active CP group (0 for CP1).

    Example::

        chunk = cpscope.cp_rank()             # inside runtime_cp(groups[2]): 0 or 1, which pair of chunks
    """
    return capture_scope().rank


# ----------------------------------------------------------------------------------------------------------------
# Build-time group (process-wide configuration)


def set_build_time_cp_group(group: Optional[dist.ProcessGroup]) -> None:
    """Set the build-time (static) CP group: what is active outside every :func:`runtime_cp` scope.

    Call it once after creating the model's static CP group (the default is ``None``, CP1). It is process-wide
    configuration, like Megatron's ``parallel_state``; per-microbatch groups are bound with :func:`runtime_cp`.

    Example::

        cpscope.set_build_time_cp_group(groups[2])   # a model built with static CP2: cp_size() == 2 outside scopes
    """
    global _build_time
    _build_time = scope_for(group)


def build_time_cp_group() -> Optional[dist.ProcessGroup]:
    """The build-time CP group (``None`` for CP1); unaffected by runtime scopes.

    Example::

        static = cpscope.build_time_cp_group()
    """
    return _build_time.group


def build_time_scope() -> CPScope:
    """The build-time :class:`CPScope` (process-wide, never a runtime binding): what modules capture at construction.

    Example::

        self.build_scope = cpscope.build_time_scope()     # in a module's __init__
    """
    return _build_time


class build_time_cp:
    """Temporarily set the build-time group (context manager), restoring the previous one on exit; for model
    construction and tests, not thread-safe (the build-time group is process-wide).

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
