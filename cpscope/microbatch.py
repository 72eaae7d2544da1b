"""Carry a CP scope with a microbatch through a pipeline schedule (1F1B, interleaved).

Pipeline schedules separate a microbatch's forward from its backward: microbatch B's forward (bound to, say, CP4)
runs before microbatch A's backward (its forward ran under CP2). The scope must therefore travel with the
*microbatch*, never with the loop. :class:`MicrobatchScope` holds the :class:`~cpscope.CPScope` of one microbatch:

* :meth:`MicrobatchScope.forward` runs a step with that scope bound;
* :meth:`MicrobatchScope.backward` runs autograd with **nothing** bound — cpscope's autograd functions use the scope
  they captured in forward (on ``ctx``), and binding the loop's idea of the scope around backward would only hide
  code that wrongly reads the ContextVar there (on CPU it would see it; on CUDA's autograd threads it would not);
* :meth:`MicrobatchScope.hook` / :meth:`MicrobatchScope.register_hook` wrap a user hook that explicitly needs the
  scope.

Not to be confused with :class:`cpscope.hybrid.Microbatch`, the hybrid planner's item (which sequences one block of
ranks runs at which CP size). ``MicrobatchScope`` only carries a scope.

Example::

    mbs = [MicrobatchScope.of(groups[cp]) for cp in plan]                          # e.g. CP2, CP4
    losses = [mb.forward(model, mb_inputs) for mb, mb_inputs in zip(mbs, inputs)]   # forward A, forward B
    for mb, loss in zip(mbs, losses):
        mb.backward(loss)                     # backward A, backward B: each uses its own group
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist

from .recompute import scoped
from .scope import CPScope, capture_scope, scope_for

__all__ = ["MicrobatchScope"]

F = TypeVar("F", bound=Callable[..., Any])
Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


class MicrobatchScope:
    """The CP scope of one microbatch, carried with it from forward to backward.

    Immutable; cheap to create per microbatch. Make one with :meth:`of` (a group, as in ``runtime_cp``) or
    :meth:`capture` (the scope active now).

    Example::

        mb = MicrobatchScope.of(groups[2], local_cp_size=2)
        loss = mb.forward(step, batch)        # step runs with CP2 bound
        ...                                   # other microbatches' forwards, any scope bound
        mb.backward(loss)                     # gradients use CP2 (captured by the autograd functions)
    """

    __slots__ = ("scope",)
    scope: CPScope

    def __init__(self, scope: CPScope) -> None:
        if not isinstance(scope, CPScope):
            raise ValueError(
                f"MicrobatchScope: expected a CPScope (use MicrobatchScope.of(group) for a group), got {type(scope).__name__}"
            )
        object.__setattr__(self, "scope", scope)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MicrobatchScope is immutable")

    @classmethod
    def of(cls, group: Optional[dist.ProcessGroup], *, local_cp_size: Optional[int] = None) -> "MicrobatchScope":
        """The microbatch of ``group`` (``None`` = CP1); validated like :func:`cpscope.runtime_cp`."""
        return cls(scope_for(group, local_cp_size))

    @classmethod
    def capture(cls) -> "MicrobatchScope":
        """The microbatch of the scope active now."""
        return cls(capture_scope())

    def forward(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with this microbatch's scope bound (restored afterwards)."""
        with self.scope.bind():
            return fn(*args, **kwargs)

    def backward(self, tensors: Tensors, grad_tensors: Optional[Tensors] = None, **kwargs: Any) -> None:
        """``torch.autograd.backward(tensors, grad_tensors, **kwargs)``; it binds **no** scope on purpose.

        Whatever the caller has bound stays bound (this method neither binds this microbatch's scope nor unbinds
        the caller's): backward must not depend on it. cpscope's autograd functions and checkpoints use the scope
        captured in this microbatch's forward; hooks that need it ask for it with :meth:`hook`. Anything in
        backward that reads the ContextVar (which CUDA's autograd threads would not see) raises
        :class:`cpscope.ScopeReadInBackwardError` (the default backward read check).
        """
        torch.autograd.backward(tensors, grad_tensors, **kwargs)

    def hook(self, fn: F) -> F:
        """``fn`` wrapped to run with this microbatch's scope bound, on whichever thread autograd calls it."""
        return scoped(fn, self.scope)

    def register_hook(self, tensor: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> Any:
        """``tensor.register_hook(self.hook(fn))``: a gradient hook that sees this microbatch's scope."""
        return tensor.register_hook(self.hook(fn))

    def __repr__(self) -> str:
        return f"MicrobatchScope({self.scope!r})"
