"""The adapters' one class-swap helper: give a module a subclass that runs each forward under the right scope.

The TransformerEngine and megatron-core adapters convert a model in place, as FSDP2's ``fully_shard`` does: each
module whose forward must follow the active scope gets its class swapped for a cached subclass
``(*mixins, base)`` (one mixin or several) that keeps the base class's name and module. Parameters, buffers and ``state_dict`` keys are unchanged.

* :func:`swap_class` — swap in (idempotent: the same mixins again only update the state they are given);
* :func:`unswap` / :func:`unswap_all` — the original class again, and every per-module attribute the swap (or the
  mixin, later) stored is removed: by convention their names start with ``_cpscope_``;
* :func:`original_class` — the class a module had before it was swapped;
* :class:`ForwardSignature` — a mixin base whose subclasses get ``_cpscope_signature``, the base forward's
  signature without ``self`` (to bind a call's arguments by name);
* :func:`call_with_attributes` — run a call with some attributes of an object set for its duration only, restored
  in ``finally`` (also when the call raises).

Swapped classes are created once per ``(base, mixins)`` under a lock (threads converting models concurrently get the
same class). ``copy.deepcopy`` and ``pickle`` of a swapped module rebuild the swapped class from ``(base, mixins)``
(both must be importable by name for pickle), so a copy behaves as the original; whatever the mixin's state holds
must itself be copyable / picklable (a process group is not picklable).

Example::

    class _Traced(ForwardSignature):
        def forward(self, *args, **kwargs):
            call = self._cpscope_signature.bind(*args, **kwargs)     # arguments by name
            return super().forward(*call.args, **call.kwargs)

    swap_class(layer, _Traced, _cpscope_note="x")    # type(layer).__name__ is unchanged
    unswap(layer)                                    # the original class; _cpscope_note removed
"""
from __future__ import annotations

import copyreg
import inspect
import threading
from typing import Any, Callable, Optional, Union

from torch import nn

__all__ = [
    "ForwardSignature",
    "call_with_attributes",
    "original_class",
    "signature_without_self",
    "swap_class",
    "swapped_class",
    "unswap",
    "unswap_all",
]

PREFIX = "_cpscope_"  # every attribute a swap stores on a module starts with it (unswap removes them all)

Mixins = Union[type, tuple[type, ...]]

_CLASSES: dict[tuple[type, tuple[type, ...]], type] = {}
_LOCK = threading.Lock()


def signature_without_self(function: Callable[..., Any]) -> inspect.Signature:
    """The signature of an unbound method without its first parameter (``self``).

    Example::

        signature_without_self(torch.nn.Linear.forward)       # <Signature (input: torch.Tensor) -> torch.Tensor>
    """
    sig = inspect.signature(function)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


class ForwardSignature:
    """Mixin base: the swapped class gets ``_cpscope_signature``, its base ``forward``'s signature without ``self``."""

    _cpscope_signature: inspect.Signature

    @classmethod
    def _cpscope_prepare(cls, base: type) -> dict[str, Any]:
        return {"_cpscope_signature": signature_without_self(base.forward)}  # type: ignore[attr-defined]


def _new_swapped(base: type, mixins: Mixins, *args: Any) -> Any:
    """Unpickling / deepcopy: a new, empty instance of the swapped class of ``(base, mixins)``."""
    cls = swapped_class(base, mixins)
    return cls.__new__(cls, *args)


def _reduce_ex(self: Any, protocol: int) -> Any:
    cls = type(self)
    rv = super(cls, self).__reduce_ex__(max(protocol, 2))
    if isinstance(rv, tuple) and rv[0] is copyreg.__newobj__ and rv[1][0] is cls:
        return (_new_swapped, (cls._cpscope_base, cls._cpscope_mixins, *rv[1][1:]), *rv[2:])
    return rv


def _as_mixins(mixins: Mixins) -> tuple[type, ...]:
    out = (mixins,) if isinstance(mixins, type) else tuple(mixins)
    if not out or not all(isinstance(m, type) for m in out):
        raise ValueError(f"swap_class: mixins must be a class or a non-empty tuple of classes, got {mixins!r}")
    return out


def swapped_class(base: type, mixins: Mixins) -> type:
    """The subclass ``(*mixins, base)`` with ``base``'s name, created once per ``(base, mixins)`` (thread-safe).

    ``mixins``: one class or a tuple of them, in method resolution order (the first one's ``forward`` runs first).
    A mixin may define a classmethod ``_cpscope_prepare(base) -> dict`` of class attributes to add (computed once,
    from the base class; for the same attribute the earlier mixin wins). The class records ``_cpscope_mixins`` (the
    tuple) and ``_cpscope_mixin`` (the one mixin, or the tuple when there are several).

    Example::

        swapped_class(TransformerLayer, (EntryMixin, MoELayerMixin))    # one class, both behaviours
    """
    key = (base, _as_mixins(mixins))
    cls = _CLASSES.get(key)
    if cls is not None:
        return cls
    with _LOCK:
        cls = _CLASSES.get(key)
        if cls is None:
            chain = key[1]
            attrs: dict[str, Any] = {"__module__": base.__module__, "__qualname__": base.__qualname__,
                                     "__reduce_ex__": _reduce_ex, "_cpscope_base": base, "_cpscope_mixins": chain,
                                     "_cpscope_mixin": chain[0] if len(chain) == 1 else chain}
            for mixin in reversed(chain):  # the earlier mixin's attributes win
                prepare = getattr(mixin, "_cpscope_prepare", None)
                if prepare is not None:
                    attrs.update(prepare(base))
            cls = _CLASSES[key] = type(base.__name__, (*chain, base), attrs)
    return cls


def original_class(module: Any) -> type:
    """The class ``module`` had before :func:`swap_class` (its class if it was never swapped)."""
    return type(module).__dict__.get("_cpscope_base", type(module))


def _clear_state(module: Any) -> None:
    for name in [k for k in vars(module) if k.startswith(PREFIX)]:
        del module.__dict__[name]


def swap_class(module: nn.Module, mixins: Mixins, **state: Any) -> bool:
    """Give ``module`` the swapped class of its original class and ``mixins`` (one class or a tuple of them, see
    :func:`swapped_class`); store ``state`` on it.

    ``state`` goes into the instance ``__dict__`` as is: never registered as a submodule, parameter or buffer, so
    ``state_dict`` and ``named_modules`` are unchanged.

    Idempotent: a module already swapped with ``mixins`` keeps its class and the state it has, updated with
    ``state``. A module swapped with other mixins is swapped again, and the old mixins' state is removed first.
    Returns whether the class changed.

    Raises:
        ValueError: a ``state`` name that does not start with ``_cpscope_`` (:func:`unswap` could not remove it);
            ``mixins`` neither a class nor a non-empty tuple of classes.

    Example::

        swap_class(module, _ScopedMixin, _cpscope_opts=opts)     # True; again: False, opts updated
        swap_class(layer, (EntryMixin, MoELayerMixin))           # several behaviours in one swapped class
    """
    bad = [name for name in state if not name.startswith(PREFIX)]
    if bad:
        raise ValueError(f"swap_class: state names must start with {PREFIX!r}, got {bad}")
    target = swapped_class(original_class(module), mixins)
    changed = type(module) is not target
    if changed:
        _clear_state(module)
        module.__class__ = target
    module.__dict__.update(state)
    return changed


def unswap(module: Any) -> bool:
    """Undo :func:`swap_class`: the original class, and no ``_cpscope_*`` attribute left; whether it was swapped."""
    base = type(module).__dict__.get("_cpscope_base")
    if base is None:
        return False
    module.__class__ = base
    _clear_state(module)
    return True


def unswap_all(model: nn.Module) -> list[str]:
    """:func:`unswap` every module of ``model``; returns the qualified names of those that were swapped."""
    return [name for name, module in list(model.named_modules()) if unswap(module)]


def call_with_attributes(obj: Any, values: dict[str, Any], function: Callable[..., Any], *args: Any,
                         **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with ``obj``'s attributes ``values`` set for the call, restored in ``finally``.

    The attributes live on ``obj`` (shared by every thread): do not run the same object concurrently in two threads
    with different values.

    Example::

        call_with_attributes(mha, {"cp_size": 2, "cp_rank": 1}, super().forward, x)
    """
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        return function(*args, **kwargs)
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)
