"""Decorate a function so that a binding is made around every call — or, for a generator, around every step.

What a context manager that is also a decorator needs (``runtime_cp`` is one): a plain function or a coroutine
function runs bound for the whole call; a generator function is bound around each step only, so a token is never
held across a ``yield`` (the consumer may run anything between steps); async generators are refused. Each call
binds afresh, so recursion and concurrent calls keep their own tokens. Imports nothing of cpscope.

Example::

    wrapped = bound_calls(fn, lambda: var.set(value), var.reset)
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

__all__ = ["bound_calls"]


def bound_calls(fn: Callable[..., Any], enter: Callable[[], Any], exit: Callable[[Any], None]) -> Callable[..., Any]:
    """``fn`` wrapped to run with ``enter()`` made before and ``exit(token)`` after every call (or generator step).

    Raises:
        TypeError: ``fn`` is an async generator function (bind inside its body instead).
    """
    if inspect.isasyncgenfunction(fn):
        raise TypeError("runtime_cp cannot decorate an async generator; bind inside its body instead")
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
            gen = _call(enter, exit, fn, *args, **kwargs)
            return (yield from _stepped(gen, enter, exit))

        return gen_wrapper
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            token = enter()
            try:
                return await fn(*args, **kwargs)
            finally:
                exit(token)

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _call(enter, exit, fn, *args, **kwargs)

    return wrapper


def _call(enter: Callable[[], Any], exit: Callable[[Any], None], fn: Callable[..., Any], /, *args: Any,
          **kwargs: Any) -> Any:
    token = enter()
    try:
        return fn(*args, **kwargs)
    finally:
        exit(token)


def _stepped(gen: Any, enter: Callable[[], Any], exit: Callable[[Any], None]) -> Any:
    """Drive ``gen`` with the binding made around each step only (never holding a token across ``yield``)."""
    try:
        request = _call(enter, exit, next, gen)
        while True:
            try:
                sent = yield request
            except GeneratorExit:
                _call(enter, exit, gen.close)
                raise
            except BaseException as e:  # forward throw() into the generator, bound
                request = _call(enter, exit, gen.throw, e)
            else:
                request = _call(enter, exit, gen.send, sent)
    except StopIteration as stop:
        return stop.value
