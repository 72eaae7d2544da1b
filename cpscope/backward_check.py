"""The backward read check: is this thread inside an autograd backward pass, and may it read the CP scope there?

Backward functions, hooks and activation recompute must use the scope captured in forward: autograd runs them later
(another microbatch's group may be bound by then) and, on CUDA, on its own device threads, which do not see the
caller's ContextVars. A read of the active scope there would silently return a wrong group. So the scope
(:mod:`cpscope.scope`) asks this module at every read, and a read inside a backward pass raises
:class:`ScopeReadInBackwardError` unless the scope read was bound inside that same backward pass.

Detection
---------
:func:`graph_task_id` is the autograd graph task this thread runs (``torch._C._current_graph_task_id()``, ``>= 0``
inside a backward: node backwards, tensor / node / post-accumulate-grad hooks, saved-tensor unpack hooks,
``queue_callback`` callbacks). One place reads ``-1`` although it runs for a backward pass: the recompute of a
non-reentrant ``torch.utils.checkpoint`` on autograd's CUDA device thread (H200, torch 2.11). torch marks that
recompute by installing its own saved-tensor hooks (``torch.utils.checkpoint._recomputation_hook``); they are
recognised by the identity of their unpack hook's code object, resolved once at import
(:func:`_resolve_recompute_code`). If a torch version no longer has that code object, the hooks are matched by the
name of the class that defines them (``_recomputation_hook``) instead, and a warning says so once.

Cost on the hot path (a scope bind and a scope read, measured in ``benchmarks/bench_scope.py``): one C call each
(the graph task id). The saved-tensor-hook probe runs only for a read outside every graph task **with no scope bound
in this context** — what a read in torch's recompute on a device thread sees (that thread's context starts empty);
so a read there raises, and a read under a binding made inside the recompute (``cpscope.checkpoint``,
``scope_context_fn``, an explicit ``runtime_cp``) passes. Not told apart (a read under *any* binding outside every
graph task passes): torch's recompute triggered outside every backward by code that unpacks a saved tensor by hand
on a thread with a binding of its own — the recompute then reads that binding.

The switch
----------
Process-wide configuration, because autograd's threads must see it: :func:`set_backward_read_check` turns the check
on or off; :class:`allow_scope_reads_in_backward` is an allowance counted while active. The check runs when the
switch is on **and** no allowance is active, so allowances that exit in any order (several threads) never leave it
off. Both are thread-safe (one lock).

Example::

    from cpscope import backward_check
    backward_check.in_backward()            # False here
    with cpscope.allow_scope_reads_in_backward():
        loss.backward()                     # a hook of yours reads cpscope.cp_size() on purpose
"""
from __future__ import annotations

import functools
import logging
import threading
import types
from contextvars import ContextVar, Token
from typing import Any, Callable, Optional, TypeVar

import torch
from torch._C import _current_graph_task_id as _task_of_thread  # -1 on this thread outside every graph task
from torch._C._autograd import _top_saved_tensors_default_hooks as _top_hooks

# The public names (the contract's). graph_task_id, in_backward, thread_task, mark_binding, unmark_binding and
# check_read are the protocol between this module and the scope (and the adapters that detect a backward): internal.
__all__ = [
    "ScopeReadInBackwardError",
    "set_backward_read_check",
    "backward_read_check_enabled",
    "allow_scope_reads_in_backward",
]

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

IN_TORCH_RECOMPUTE = -2  # what graph_task_id() returns inside torch checkpoint's recompute outside a graph task


# ----------------------------------------------------------------------------------------------------------------
# Detection


def _resolve_recompute_code(module: Any = None) -> Optional[types.CodeType]:
    """The code object of ``torch.utils.checkpoint._recomputation_hook``'s unpack hook, or ``None`` if absent.

    The hook is a closure defined in the class's ``__init__``: its code object is one of that function's constants,
    and every hook function torch installs for a recompute shares it.
    """
    if module is None:
        import torch.utils.checkpoint as module
    init = getattr(getattr(module, "_recomputation_hook", None), "__init__", None)
    consts = getattr(getattr(init, "__code__", None), "co_consts", ())
    codes = [c for c in consts if isinstance(c, types.CodeType) and c.co_name == "unpack_hook"]
    return codes[0] if len(codes) == 1 else None


_RECOMPUTE_UNPACK: Optional[types.CodeType] = _resolve_recompute_code()
if _RECOMPUTE_UNPACK is None:  # pragma: no cover - depends on the torch version
    logger.warning(
        "cpscope: torch %s has no torch.utils.checkpoint._recomputation_hook unpack hook to recognise; torch "
        "checkpoint's recompute is detected by the hooks' names instead (the backward read check may miss a read in "
        "a plain torch checkpoint recompute on CUDA if torch renamed them)", torch.__version__,
    )


def _is_torch_recompute(hooks: Any, code: Optional[types.CodeType]) -> bool:
    """Whether the top saved-tensor hooks ``(pack, unpack)`` are torch checkpoint's recompute hooks."""
    if hooks is None:
        return False
    if code is not None:
        return getattr(hooks[1], "__code__", None) is code
    return any("_recomputation_hook" in getattr(h, "__qualname__", "") for h in hooks)  # the fallback


def graph_task_id() -> int:
    """The autograd graph task this thread runs (``>= 0``); ``-2`` inside the recompute of a non-reentrant
    ``torch.utils.checkpoint`` where autograd reports no graph task (CUDA device threads); else ``-1``.

    Example::

        assert graph_task_id() == -1                  # not inside a backward pass
        y.register_hook(lambda g: print(graph_task_id()))   # >= 0 when the hook runs
    """
    task = _task_of_thread()
    if task == -1 and _is_torch_recompute(_top_hooks(False), _RECOMPUTE_UNPACK):
        return IN_TORCH_RECOMPUTE
    return task


def in_backward() -> bool:
    """Whether this thread runs for an autograd backward pass (a graph task, or torch checkpoint's recompute).

    Example::

        if not in_backward():
            scope = cpscope.capture_scope()
    """
    return graph_task_id() != -1


# ----------------------------------------------------------------------------------------------------------------
# The protocol with cpscope.scope (its hot path: one C call per binding and per read)
#
#   binding:  task = thread_task(); token = mark_binding(task) if task != -1 else None; ...; unmark_binding(token)
#   read:     if not bound or thread_task() != -1: check_read(bound)    (a read under a binding outside every
#             graph task always passes, so it needs no further call)

thread_task: Callable[[], int] = _task_of_thread
"""The raw graph task id of this thread (``>= 0`` inside a backward, ``-1`` outside; a C call). Unlike
:func:`graph_task_id` it does not recognise torch checkpoint's recompute on a device thread (it reads ``-1``)."""

# The graph task during which the innermost binding of this context was made (-1: made outside every backward).
# A read inside graph task T is allowed only when this is T: the scope the code bound there, not whatever the
# caller's context happened to hold when backward started (a stale marker of another backward never passes).
_BOUND_IN_TASK: ContextVar[int] = ContextVar("cpscope_scope_bound_in_graph_task", default=-1)


def mark_binding(task: int) -> Token:
    """Mark the binding being made as made inside graph task ``task`` (``thread_task()``, not -1); returns the token
    for :func:`unmark_binding` on exit (bindings unwind in reverse order)."""
    return _BOUND_IN_TASK.set(task)


def unmark_binding(token: Token) -> None:
    """Undo :func:`mark_binding`."""
    _BOUND_IN_TASK.reset(token)


def check_read(bound: bool) -> None:
    """Check a read of the active scope; ``bound`` says whether a scope is bound in this context.

    Raises :class:`ScopeReadInBackwardError` when the check is on and this thread runs a backward pass whose
    scope was not bound inside it: in a graph task without a binding made in that task; in torch checkpoint's
    recompute outside a graph task (a CUDA device thread, whose context starts empty) with nothing bound.
    """
    if not _checking:
        return
    task = _task_of_thread()
    if task == -1:
        if not bound:
            hooks = _top_hooks(False)
            if hooks is not None and _is_torch_recompute(hooks, _RECOMPUTE_UNPACK):
                raise _read_in_backward_error(IN_TORCH_RECOMPUTE)
    elif _BOUND_IN_TASK.get() != task:
        raise _read_in_backward_error(task)


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


def _read_in_backward_error(task: int) -> ScopeReadInBackwardError:
    if task == IN_TORCH_RECOMPUTE:
        where = "the recompute of a non-reentrant torch.utils.checkpoint"
    else:
        node = torch._C._current_autograd_node()
        where = f"node {node.name()}, graph task {task}" if node is not None else \
            f"a callback of the backward pass, graph task {task}"
    return ScopeReadInBackwardError(
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


# ----------------------------------------------------------------------------------------------------------------
# The switch (process-wide configuration: autograd's threads must see it)

_lock = threading.Lock()
_switch = True  # set_backward_read_check
_allowances = 0  # active allow_scope_reads_in_backward contexts, all threads
_checking = True  # _switch and not _allowances: what check_read consults (written under _lock)


def _update(switch: Optional[bool] = None, allowances: int = 0) -> bool:
    """Change the switch and / or the allowance count under the lock; returns the previous switch."""
    global _switch, _allowances, _checking
    with _lock:
        previous = _switch
        if switch is not None:
            _switch = switch
        if _allowances + allowances < 0:
            raise RuntimeError("allow_scope_reads_in_backward exited more often than it was entered")
        _allowances += allowances
        _checking = _switch and _allowances == 0
    return previous


def set_backward_read_check(enabled: bool = True) -> bool:
    """Turn the backward read check's switch on (the default) or off, process-wide; returns the previous switch.

    With the check on, every read of the active scope (:func:`cpscope.capture_scope`, :func:`cpscope.resolve_scope`
    without ``group=``, :func:`cpscope.current_cp_group`, :func:`cpscope.cp_size`, :func:`cpscope.cp_rank`,
    :func:`cpscope.runtime_scope_or`, and so every cpscope consumer that reads the scope) raises
    :class:`ScopeReadInBackwardError` while autograd runs a backward pass on that thread, unless the scope read was
    bound inside that backward: ``cpscope.checkpoint`` and ``scope_context_fn`` recompute, ``cpscope.scoped`` /
    ``MicrobatchScope.hook`` hooks, or an explicit ``runtime_cp`` / ``CPScope.bind()`` there. Reads with an explicit
    ``group=`` are never checked. Not detectable: a thread that a hook starts itself (it runs outside every backward).

    The check runs while the switch is on and no :class:`allow_scope_reads_in_backward` is active. Prefer that
    context manager around the one call that needs it. Thread-safe.

    Example::

        previous = cpscope.set_backward_read_check(False)   # expert opt-out
        try:
            loss.backward()
        finally:
            cpscope.set_backward_read_check(previous)
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"set_backward_read_check takes True or False, got {type(enabled).__name__} {enabled!r}")
    return _update(switch=enabled)


def backward_read_check_enabled() -> bool:
    """Whether the backward read check runs now: the switch is on and no allowance is active (on by default).

    Example::

        assert cpscope.backward_read_check_enabled()
    """
    return _checking


class allow_scope_reads_in_backward:
    """Context manager (and decorator): no backward read check while it is active (expert opt-out).

    Scope: **process-wide**, not context-local — autograd's backward threads must see it, and they do not see the
    caller's ContextVars; other threads' backward passes are unchecked meanwhile too. Allowances are counted: the
    check is back once every active allowance has exited, in whatever order (e.g. two threads), and the switch of
    :func:`set_backward_read_check` is left as it was. Re-entrant and thread-safe.

    Example::

        with cpscope.allow_scope_reads_in_backward():
            loss.backward()       # a hook of yours reads cpscope.cp_size() on purpose
    """

    __slots__ = ()

    def __enter__(self) -> None:
        _update(allowances=1)

    def __exit__(self, *exc: Any) -> None:
        _update(allowances=-1)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with allow_scope_reads_in_backward():
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
