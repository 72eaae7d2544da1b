"""Scope-preserving activation checkpointing: recompute runs in the scope captured at forward time.

Activation checkpointing runs a block's forward a second time during backward. By then the training loop may have
bound another microbatch's CP group (1F1B and interleaved schedules run microbatch B's forward before A's
backward), or nothing at all, and the recompute may run on an autograd worker thread that does not see the
caller's ContextVars. A recompute that read the active scope would therefore shard, rotate and attend with the
wrong group. The rule is simple: **capture in forward, re-enter the capture in recompute**.

* :func:`checkpoint` — ``torch.utils.checkpoint.checkpoint`` that captures the active scope when called and
  re-enters it whenever ``fn`` runs (forward and recompute; non-reentrant by default, reentrant works too).
* :func:`scoped` — ``fn`` wrapped to run under a scope captured *now*: the building block for checkpoint
  implementations that call a function again later (Megatron's ``tensor_parallel.checkpoint`` and
  ``CheckpointWithoutOutput``), and for autograd hooks that really need the scope.
* :func:`scope_context_fn` — a ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
  (and any code that forwards ``context_fn`` to it).

All three re-enter the capture with :meth:`cpscope.CPScope.bind` (the one way to re-enter a scope) and are
re-exported by the package (``cpscope.checkpoint``, ``cpscope.scoped``, ``cpscope.scope_context_fn``). The module is named ``recompute`` so that ``cpscope.checkpoint`` is only ever the
function. Recompute that does *not* re-enter the scope raises :class:`cpscope.ScopeReadInBackwardError` at the
first scope read (the default backward read check), on every rank at the same point, so nothing hangs.

Plugging into other checkpointing code (each captures at the moment of the forward call, never at build time)::

    # PyTorch, directly
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=scope_context_fn())

    # Hugging Face transformers: nothing to do for attn_implementation="cpscope" models once
    # cpscope.integrations.hf is imported (it wraps the model's checkpoint function, any use_reentrant);
    # for other models, pass the context_fn (torch calls it afresh at every checkpointed forward):
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": scope_context_fn()})

    # Megatron-style: wrap the function *inside forward*, per call (a wrapper built once at model construction
    # would capture the build-time scope instead)
    out = tensor_parallel.checkpoint(scoped(self._block), False, hidden, mask)
    ckpt = CheckpointWithoutOutput(); y = ckpt.checkpoint(scoped(self._act), x)

The wrong way, for contrast: ``context_fn=lambda: (nullcontext(), cpscope.runtime_cp(cpscope.current_cp_group()))``
reads the scope at *recompute* time, which is exactly the bug.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.utils.checkpoint

from .scope import CPScope, capture_scope

__all__ = ["checkpoint", "scoped", "scope_context_fn"]

F = TypeVar("F", bound=Callable[..., Any])
ContextFn = Callable[[], "tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]"]


def _checked(scope: Any, who: str) -> CPScope:
    if not isinstance(scope, CPScope):
        raise ValueError(f"{who}: expected a CPScope (from cpscope.capture_scope()), got {type(scope).__name__}: {scope!r}")
    return scope


def scoped(fn: F, scope: Optional[CPScope] = None) -> F:
    """Return ``fn`` wrapped so that every call runs under ``scope`` — by default the scope active **now**.

    Build the wrapper when the scope is the right one (in the forward of the microbatch), not at model
    construction. The wrapper works on any thread, so it is safe for autograd hooks and for recompute.

    Example::

        with cpscope.runtime_cp(groups[2]):
            out = megatron_checkpoint(scoped(block), False, x)   # recompute sees CP2
            y.register_hook(scoped(lambda g: g / cpscope.cp_size()))
    """
    bound = capture_scope() if scope is None else _checked(scope, "scoped")

    @functools.wraps(fn)
    def run_scoped(*args: Any, **kwargs: Any) -> Any:
        with bound.bind():  # a fresh binder per call: concurrent calls on several threads keep their own tokens
            return fn(*args, **kwargs)

    run_scoped.cp_scope = bound  # type: ignore[attr-defined]
    return run_scoped  # type: ignore[return-value]


def checkpoint(fn: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    """Activation checkpointing whose recompute runs in the CP scope active at this call.

    ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=use_reentrant, **kwargs)`` with ``fn`` wrapped by
    :func:`scoped`: the scope is captured now and re-entered around both the forward call and the recompute, so
    the recompute gives the same tensors whatever is bound (or not) when backward runs, and on whichever thread it
    runs. Works in both modes (non-reentrant recomputes inside a saved-tensor unpack hook, reentrant inside the
    checkpoint node's backward). Other keyword arguments (``context_fn``, ``preserve_rng_state``,
    ``determinism_check``, …) go to torch unchanged.

    Example::

        with cpscope.runtime_cp(groups[2]):
            h = checkpoint(layer, h)      # recompute in backward binds CP2 again
        h.sum().backward()                                   # outside any scope: still CP2 for the recompute
    """
    return torch.utils.checkpoint.checkpoint(scoped(fn), *args, use_reentrant=use_reentrant, **kwargs)


def scope_context_fn(context_fn: Optional[ContextFn] = None) -> ContextFn:
    """A ``context_fn`` for non-reentrant ``torch.utils.checkpoint.checkpoint`` that re-enters the forward's scope.

    torch calls the returned function at each checkpointed forward: it captures the active scope then and returns
    ``(forward_ctx, recompute_ctx)`` where ``recompute_ctx`` re-enters that capture around the recompute. Pass
    ``context_fn`` to combine with another one (e.g. selective activation checkpointing's
    ``functools.partial(create_selective_checkpoint_contexts, policy)``): its contexts are entered inside ours.

    Example::

        ctx_fn = scope_context_fn()
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=ctx_fn)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": ctx_fn})
    """
    if context_fn is not None and not callable(context_fn):
        raise ValueError(f"scope_context_fn: context_fn must be callable, got {type(context_fn).__name__}")

    def cpscope_context_fn() -> tuple[Any, Any]:
        scope = capture_scope()
        if context_fn is None:
            return contextlib.nullcontext(), scope.bind()
        forward_ctx, recompute_ctx = context_fn()
        return forward_ctx, _Nested(scope.bind(), recompute_ctx)

    return cpscope_context_fn


class _Nested:
    """Enter ``outer`` then ``inner``; exit in reverse (one use at a time, as torch's recompute does)."""

    __slots__ = ("_outer", "_inner", "_stack")

    def __init__(self, outer: Any, inner: Any) -> None:
        self._outer, self._inner = outer, inner
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self._outer)
        try:
            stack.enter_context(self._inner)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def __exit__(self, *exc: Any) -> Any:
        stack, self._stack = self._stack, None
        assert stack is not None, "_Nested exited without being entered"
        return stack.__exit__(*exc)
