"""Which sentinel is on: a stack of the sentinels switched on and not stopped; the innermost is the active one.

Whenever the stack changes, the observer slots of :mod:`cpscope._hooks` are pointed at the active sentinel's hooks
(or emptied: ``None``, one attribute check on the core's hot path). A sentinel stopped out of order leaves the
stack at once, so it is never active again. Process-wide, like the slots themselves.

Example::

    push(s)            # s is active, the slots call its hooks
    remove(s)          # the sentinel below it (or none) is active again
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Callable, Optional, Protocol

from .. import _hooks

__all__ = ["Observer", "push", "remove", "active"]


class Observer(Protocol):
    """What the switch needs of a sentinel: its hooks, one per observer slot, and a summary to log at exit."""

    def slots(self) -> dict[str, Callable[..., Any]]: ...

    def log_summary(self, suffix: str = "") -> None: ...


_STACK: list[Observer] = []  # switched on and not stopped, in the order they were switched on
_LOCK = threading.Lock()
_EMPTY = dict.fromkeys(_hooks.SLOTS)


def active() -> Optional[Observer]:
    """The innermost sentinel switched on and not stopped, or ``None``."""
    return _STACK[-1] if _STACK else None


def push(s: Observer) -> None:
    """Switch ``s`` on: it becomes the active sentinel."""
    with _LOCK:
        _STACK.append(s)
        _install()


def remove(s: Observer) -> None:
    """Switch ``s`` off (wherever it is on the stack); the innermost one still on becomes active."""
    with _LOCK:
        _STACK.remove(s)
        _install()


def _install() -> None:
    s = active()
    _hooks.install(**(_EMPTY if s is None else s.slots()))


@atexit.register
def _log_summaries() -> None:
    for s in list(_STACK):
        s.log_summary(" (at exit)")
