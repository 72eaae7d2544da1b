"""Megatron-style ``PackedSeqParams`` → cpscope scope (no Megatron import).

Megatron's hybrid / dynamic CP carries the microbatch's CP group on its ``PackedSeqParams`` (fields ``cp_group``
and ``local_cp_size``, next to ``qkv_format``, ``cu_seqlens_q`` and ``cu_seqlens_q_padded``). This module reads such
an object — any object with those attributes; Megatron itself is never imported — into a cpscope scope:

* :func:`scope_from_packed_seq_params` → the :class:`~cpscope.CPScope` it describes, or ``None`` when it names no
  group at all (``cp_group`` and ``local_cp_size`` both unset: keep the current scope).
* :func:`packed_seq_scope` — decorator for a ``forward(..., packed_seq_params=...)`` (found by name, keyword or
  positional) that binds that scope for the call; with ``packed_seq_params=None`` the current scope is left as is.
  Also usable as a context manager factory: ``with packed_seq_scope.bind(psp): ...``.
* :func:`read_packed_seq_params` → :class:`PackedSeqInfo`: the scope plus the **global** ``cu_seqlens`` cpscope's
  ``thd`` functions take, validated against the scope that will run them: the one the object names, else the
  enclosing one (the innermost :func:`cpscope.runtime_cp`, else the build-time group).

CP1 has two conventions and both are accepted: ``cp_group=None`` and a size-1 group (``local_cp_size`` 1 or unset).
A contradiction — ``local_cp_size=1`` with a group of 2, or ``local_cp_size=2`` with no group — raises
``ValueError`` naming both values (:func:`cpscope.scope.scope_for`).

Example::

    from cpscope.integrations.megatron import packed_seq_scope

    class Block(torch.nn.Module):
        @packed_seq_scope
        def forward(self, hidden, attention_mask=None, packed_seq_params=None):
            ...   # cpscope RoPE / attention / sharding here see packed_seq_params.cp_group
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, NamedTuple, Optional, TypeVar, overload

import torch

from ..._checks import check_cu_seqlens
from ..._pack import cu_seqlens_list
from ...scope import CPScope, capture_scope, scope_for

__all__ = ["PackedSeqInfo", "scope_from_packed_seq_params", "read_packed_seq_params", "packed_seq_scope"]

F = TypeVar("F", bound=Callable[..., Any])
_ZIGZAG_MODES = (None, "zigzag")


def scope_from_packed_seq_params(packed_seq_params: Any) -> Optional[CPScope]:
    """The scope a ``PackedSeqParams``-like object names, or ``None`` if it names none (``packed_seq_params`` is
    ``None``, or its ``cp_group`` and ``local_cp_size`` are both unset).

    Raises:
        ValueError: ``local_cp_size`` contradicts ``cp_group``; this rank is not in ``cp_group``; the object asks for a
            token layout other than zigzag (``cp_partition_mode``, in some Megatron versions).

    Example::

        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, local_cp_size=2, cp_group=groups[2])
        scope_from_packed_seq_params(psp)     # CPScope(size=2, rank=...)
    """
    if packed_seq_params is None:
        return None
    group = getattr(packed_seq_params, "cp_group", None)
    local = getattr(packed_seq_params, "local_cp_size", None)
    mode = getattr(packed_seq_params, "cp_partition_mode", None)
    if mode not in _ZIGZAG_MODES:
        raise ValueError(
            f"packed_seq_params.cp_partition_mode={mode!r}: cpscope shards in the zigzag (dual-chunk) layout only"
        )
    if group is None and local is None:
        return None
    if local is not None and (isinstance(local, bool) or not isinstance(local, int) or local < 1):
        raise ValueError(f"packed_seq_params.local_cp_size must be a positive int or None, got {local!r}")
    return scope_for(group, local)


class PackedSeqInfo(NamedTuple):
    """What :func:`read_packed_seq_params` returns.

    Attributes:
        scope: the scope named by the object, or ``None`` (keep the current one).
        qkv_format: ``packed_seq_params.qkv_format`` (``"thd"`` for packed batches).
        cu_seqlens: global offsets of the physical layout — ``cu_seqlens_q_padded`` when set, else ``cu_seqlens_q``
            (cpscope's ``cu_seqlens``), or ``None``.
        max_seqlen: ``packed_seq_params.max_seqlen_q`` (or ``None``).

    Example::

        info = read_packed_seq_params(psp)           # a NamedTuple: (scope, qkv_format, cu_seqlens, max_seqlen)
        scope = info.scope or cpscope.capture_scope()  # None: psp names no group, keep the current scope
        out = cpscope.attention.attention_with_scope(q, k, v, scope, qkv_format="thd", cu_seqlens=info.cu_seqlens)
    """

    scope: Optional[CPScope]
    qkv_format: Optional[str]
    cu_seqlens: Optional[torch.Tensor]
    max_seqlen: Optional[int]


def read_packed_seq_params(
    packed_seq_params: Any, *, validate: bool = True, enclosing: Optional[CPScope] = None
) -> PackedSeqInfo:
    """Read a ``PackedSeqParams``-like object into a :class:`PackedSeqInfo` (scope + global ``cu_seqlens``).

    With ``validate`` (default) and a ``thd`` layout, every document of ``cu_seqlens`` must be divisible by 2·cp for
    the CP size that will actually run — the scope the object names, or, when it names none, the ``enclosing``
    scope (default: :func:`cpscope.capture_scope`, i.e. the innermost ``runtime_cp`` or the build-time group) —
    (copies ``cu_seqlens`` to the host once), and ``cu_seqlens_q`` / ``cu_seqlens_kv`` must agree (cpscope does
    self-attention).

    Raises:
        ValueError: see :func:`scope_from_packed_seq_params`; documents not divisible by 2·cp; q/kv offsets differ.

    Example::

        info = read_packed_seq_params(psp)                   # info.scope is None when psp names no group
        with (info.scope or cpscope.capture_scope()).bind():
            out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=info.cu_seqlens)
    """
    scope = scope_from_packed_seq_params(packed_seq_params)
    fmt = getattr(packed_seq_params, "qkv_format", None)
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    cu = padded if padded is not None else getattr(packed_seq_params, "cu_seqlens_q", None)
    if validate and cu is not None and fmt == "thd":
        cu_list = cu_seqlens_list(cu, "cu_seqlens_q_padded" if padded is not None else "cu_seqlens_q")
        kv_padded = getattr(packed_seq_params, "cu_seqlens_kv_padded", None)
        kv = kv_padded if kv_padded is not None else getattr(packed_seq_params, "cu_seqlens_kv", None)
        if kv is not None and kv is not cu:
            kv_list = cu_seqlens_list(kv, "cu_seqlens_kv")
            if kv_list != cu_list:
                raise ValueError(
                    f"packed_seq_params: q offsets {cu_list} differ from kv offsets {kv_list}; cpscope's context "
                    "parallel attention is self-attention over the same documents"
                )
        if scope is not None:
            runs = scope
        else:
            runs = capture_scope() if enclosing is None else enclosing
        check_cu_seqlens(cu_list, runs.size)
    return PackedSeqInfo(scope, fmt, cu, getattr(packed_seq_params, "max_seqlen_q", None))


def _bind(packed_seq_params: Any) -> Any:
    """A fresh context manager binding the scope ``packed_seq_params`` names (a no-op if it names none)."""
    scope = scope_from_packed_seq_params(packed_seq_params)
    return contextlib.nullcontext() if scope is None else scope.bind()


def _find_argument(sig: inspect.Signature, name: str, fn: Callable[..., Any]) -> Optional[int]:
    if name not in sig.parameters:
        raise TypeError(f"packed_seq_scope: {getattr(fn, '__qualname__', fn)!r} has no parameter {name!r}")
    param = sig.parameters[name]
    if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return list(sig.parameters).index(name)
    return None  # keyword-only


class _PackedSeqScope:
    """Implementation of :func:`packed_seq_scope` (decorator with or without arguments, plus ``.bind``).

    Example::

        from cpscope.integrations.megatron import packed_seq_scope

        @packed_seq_scope                  # each call binds the group its packed_seq_params carries
        def forward(self, hidden_states, attention_mask, packed_seq_params=None):
            ...

        with packed_seq_scope.bind(psp):   # or around a block: psp.cp_group / psp.local_cp_size bound
            out = core_attention(q, k, v, None, packed_seq_params=psp)
    """

    @overload
    def __call__(self, fn: F) -> F: ...

    @overload
    def __call__(self, fn: None = None, *, arg_name: str = "packed_seq_params") -> Callable[[F], F]: ...

    def __call__(self, fn: Optional[F] = None, *, arg_name: str = "packed_seq_params") -> Any:
        """Decorate ``fn`` so each call binds the scope of its ``packed_seq_params`` argument.

        The argument is looked up by name (``arg_name``) in ``fn``'s signature, passed by keyword or position; when
        it is ``None`` or names no group, the current scope is left unchanged. Each call binds afresh (recursion
        and threads are safe); the binding ends when the call returns or raises.

        Raises:
            TypeError: at decoration, ``fn`` has no parameter ``arg_name``.
            ValueError: at call, the object's ``local_cp_size`` contradicts its ``cp_group``.

        Example::

            @packed_seq_scope                      # or @packed_seq_scope(arg_name="psp")
            def forward(self, x, packed_seq_params=None): ...
        """
        if fn is None:
            return lambda f: self(f, arg_name=arg_name)
        sig = inspect.signature(fn)
        index = _find_argument(sig, arg_name, fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if arg_name in kwargs:
                psp = kwargs[arg_name]
            elif index is not None and index < len(args):
                psp = args[index]
            else:
                psp = None
            with _bind(psp):
                return fn(*args, **kwargs)

        return wrapper

    @staticmethod
    def bind(packed_seq_params: Any) -> Any:
        """Context manager: bind the scope ``packed_seq_params`` names for the block (nothing if it names none).

        Example::

            with packed_seq_scope.bind(psp):
                out = model(tokens)
        """
        return _bind(packed_seq_params)


packed_seq_scope = _PackedSeqScope()
