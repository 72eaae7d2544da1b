"""Activation checkpointing of transformers models under cpscope: the recompute re-enters the forward's scope.

Private part of :mod:`cpscope.integrations.hf` (which re-exports :class:`ScopedCheckpointFunction` and
:func:`enable_scoped_recompute` and calls :func:`install_checkpoint_wrapper` when imported). transformers installs
one checkpoint function per layer (``PreTrainedModel._set_gradient_checkpointing``); the wrapper installed here makes
every such function a :class:`ScopedCheckpointFunction`, which captures the scope at each checkpointed layer call
and re-enters it in the recompute (any ``use_reentrant``), for models whose ``config._attn_implementation`` is
``"cpscope"`` at call time.

Example::

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    cphf.enable_scoped_recompute(model)   # only needed when checkpointing was enabled before the import
"""
from __future__ import annotations

import copy
import functools
import weakref
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel

from ...recompute import scoped

__all__ = ["ATTN_IMPLEMENTATION", "ScopedCheckpointFunction", "enable_scoped_recompute", "install_checkpoint_wrapper"]

# The name cpscope registers with transformers' AttentionInterface and AttentionMaskInterface, e.g.
# ``AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION)`` (that is, "cpscope").
ATTN_IMPLEMENTATION = "cpscope"


def _uses_cpscope(config: Any) -> bool:
    """Whether ``config`` (or one of its sub-configs, for composite models) selects ``attn_implementation="cpscope"``."""
    if getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        return True
    for name in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, name, None)
        if sub is not None and getattr(sub, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
            return True
    return False


class ScopedCheckpointFunction:
    """transformers' per-layer checkpoint function, made to re-enter the forward's CP scope in the recompute.

    ``GradientCheckpointingLayer`` calls ``self._gradient_checkpointing_func(partial(forward, self, **kw), *args)``
    at each checkpointed layer call. This wrapper replaces ``function`` with :func:`cpscope.scoped` (``function``)
    — capturing the scope bound *now*, at the forward call — and calls the wrapped checkpoint function (torch's
    ``checkpoint`` with the model's ``use_reentrant`` / ``context_fn`` / offload settings) with it, so the recompute
    in backward runs under the forward's scope on whichever thread, in either mode.

    With ``model`` given, it scopes only while ``model.config`` selects ``attn_implementation="cpscope"`` (checked
    at each call) and calls the checkpoint function unchanged otherwise, so other models are untouched.

    Example::

        layer._gradient_checkpointing_func = ScopedCheckpointFunction(
            functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True))
    """

    __slots__ = ("inner", "_model")

    def __init__(self, inner: Callable[..., Any], model: Optional[torch.nn.Module] = None) -> None:
        if not callable(inner):
            raise ValueError(f"ScopedCheckpointFunction needs a callable checkpoint function, got {inner!r}")
        self.inner = inner
        self._model = None if model is None else weakref.ref(model)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._model is not None:
            model = self._model()
            if model is None or not _uses_cpscope(getattr(model, "config", None)):
                return self.inner(function, *args, **kwargs)
        return self.inner(scoped(function), *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "ScopedCheckpointFunction":
        model = None if self._model is None else self._model()
        twin = memo.get(id(model), model) if model is not None else None  # the copied model, when it is copied too
        return ScopedCheckpointFunction(copy.deepcopy(self.inner, memo), twin)

    def __reduce__(self) -> Any:
        return ScopedCheckpointFunction, (self.inner,)  # pickled: scopes unconditionally (no weak reference)

    def __repr__(self) -> str:
        return f"ScopedCheckpointFunction({self.inner!r})"


def enable_scoped_recompute(model: torch.nn.Module) -> int:
    """Make every checkpoint function already installed in ``model`` scope-preserving; returns how many it wrapped.

    Not needed for ``attn_implementation="cpscope"`` models whose checkpointing is enabled after importing this
    module (that is automatic). Use it when checkpointing was enabled before the import, or by code that sets
    ``_gradient_checkpointing_func`` itself. Wrapped functions scope unconditionally (the model asked for it).

    Example::

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        cphf.enable_scoped_recompute(model)
    """
    wrapped = 0
    for module in model.modules():
        fn = module.__dict__.get("_gradient_checkpointing_func")
        if fn is not None and not isinstance(fn, ScopedCheckpointFunction):
            module._gradient_checkpointing_func = ScopedCheckpointFunction(fn)
            wrapped += 1
        elif isinstance(fn, ScopedCheckpointFunction) and fn._model is not None:
            module._gradient_checkpointing_func = ScopedCheckpointFunction(fn.inner)  # now unconditional
            wrapped += 1
    return wrapped


def install_checkpoint_wrapper() -> None:
    """Wrap ``PreTrainedModel._set_gradient_checkpointing`` (once) so every checkpoint function it installs is a
    :class:`ScopedCheckpointFunction` bound to that model."""
    original = PreTrainedModel._set_gradient_checkpointing
    if getattr(original, "_cpscope_scoped", False):
        return

    @functools.wraps(original)
    def _set_gradient_checkpointing(
        self: Any, enable: bool = True, gradient_checkpointing_func: Callable[..., Any] = torch.utils.checkpoint.checkpoint,
        *args: Any, **kwargs: Any,
    ) -> Any:
        if enable and not isinstance(gradient_checkpointing_func, ScopedCheckpointFunction):
            gradient_checkpointing_func = ScopedCheckpointFunction(gradient_checkpointing_func, self)
        return original(self, enable, gradient_checkpointing_func, *args, **kwargs)

    _set_gradient_checkpointing._cpscope_scoped = True  # type: ignore[attr-defined]
    PreTrainedModel._set_gradient_checkpointing = _set_gradient_checkpointing  # type: ignore[method-assign]
