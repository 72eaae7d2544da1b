"""TransformerEngine's CP settings on one attention module: read them (:func:`te_cp_settings`), bind a scope's for the
duration of a block and restore the module's own ones after (:func:`bind_te_cp`). Public through
:mod:`cpscope.integrations.te`; the variant TE runs a module's features with is :mod:`._te_features`'.

TransformerEngine itself is not imported: any module with TE's ``set_context_parallel_group`` and attributes works.

Example::

    with bind_te_cp(te_attn, cpscope.capture_scope()):
        out = te_attn(q, k, v)
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .._variants import VARIANTS
from ..groups import group_ranks
from ..scope import CPScope
from ..streams import cp_stream
from ._te_features import te_variant

__all__ = ["CP_SETTINGS", "StreamProvider", "apply_settings", "bind_te_cp", "te_cp_settings"]

#: The attributes ``DotProductAttention.set_context_parallel_group`` sets (TE 2.x); ``load_balancing_strategy``
#: only exists in recent TE versions and is saved / restored when present. :func:`te_cp_settings` reads them and
#: :func:`bind_te_cp` saves / restores them. Example::
#:
#:     assert all(hasattr(te_attn, name) for name in CP_SETTINGS)   # what a TE-like module must have
CP_SETTINGS = ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type")
_LBS = "load_balancing_strategy"

StreamProvider = Callable[[Optional[torch.device]], Any]


def te_cp_settings(module: nn.Module) -> dict[str, Any]:
    """The CP settings a TE attention module holds now (``CP_SETTINGS`` plus ``load_balancing_strategy`` if any).

    Raises:
        ValueError: ``module`` lacks ``set_context_parallel_group`` or one of ``CP_SETTINGS``.

    Example::

        attn = te.DotProductAttention(16, 128)
        te_cp_settings(attn)["cp_group"]          # None: built without CP
        te_cp_settings(torch.nn.Linear(2, 2))     # ValueError: not a DotProductAttention-like module
    """
    missing = [name for name in CP_SETTINGS if not hasattr(module, name)]
    if missing or not callable(getattr(module, "set_context_parallel_group", None)):
        raise ValueError(
            f"{type(module).__name__} is not a TransformerEngine DotProductAttention-like module: it needs "
            f"set_context_parallel_group() and the attributes {CP_SETTINGS} (missing: {missing})"
        )
    settings = {name: getattr(module, name) for name in CP_SETTINGS}
    if hasattr(module, _LBS):
        settings[_LBS] = getattr(module, _LBS)
    return settings


def apply_settings(module: nn.Module, settings: dict[str, Any]) -> None:
    extra = {_LBS: settings[_LBS]} if _LBS in settings else {}
    module.set_context_parallel_group(
        settings["cp_group"], settings["cp_global_ranks"], settings["cp_stream"], settings["cp_comm_type"], **extra
    )


@contextlib.contextmanager
def bind_te_cp(
    module: nn.Module,
    scope: CPScope,
    *,
    cp_comm_type: Optional[str] = None,
    stream_provider: StreamProvider = cp_stream,
    device: Optional[torch.device] = None,
    call: Optional[dict[str, Any]] = None,
) -> Iterator[None]:
    """Give a TE attention module the CP settings of ``scope`` inside the block; restore its own ones on exit.

    Scope: the module's attributes are process-wide, so do not run the same module concurrently in two threads
    with different scopes. Restoration happens in ``finally`` (also after an exception).

    Args:
        module: a TE ``DotProductAttention`` (or anything with its ``set_context_parallel_group`` and attributes).
        scope: the scope to bind (``resolve_scope(group)``); CP1 binds ``cp_group=None``.
        cp_comm_type: TE's CP communication (``"p2p"``, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"`` — bound as TE's
            pair of groups — or ``"auto"``); default the variant ``scope`` carries, else the module's own.
        stream_provider: ``provider(device)`` → the CUDA stream for CP communication; default
            :func:`cpscope.cp_stream`.
        device: passed to ``stream_provider``.
        call: the forward's arguments, if known (a per-call ``window_size``, the key / value head dims).

    Raises:
        ValueError: CP > 1 and the provider returned ``None`` (no CUDA stream for ``device``), a variant the
            module's heads / the CP size cannot run (``"a2a"``, ``"a2a+p2p"``), or one TE 2.20.2 does not run the
            module's sliding window / sinks / MLA head dims with (:mod:`._te_features`; ``"auto"`` avoids those).

    Example::

        with bind_te_cp(te_attn, cpscope.capture_scope()):
            out = te_attn(q, k, v)
    """
    saved = te_cp_settings(module)
    comm = cp_comm_type if cp_comm_type is not None else scope.comm if scope.comm is not None else saved["cp_comm_type"]
    cp_group = scope.group
    if scope.size == 1:
        comm = comm if comm in VARIANTS else saved["cp_comm_type"]  # TE ignores it without CP
        bound: dict[str, Any] = {"cp_group": None, "cp_global_ranks": None, "cp_stream": None, "cp_comm_type": comm}
    else:
        cp_group, comm = te_variant(scope, comm, module, call)  # what TE runs the module's features with
        stream = stream_provider(device)
        if stream is None:
            raise ValueError(
                f"no CUDA stream for CP communication on device {device} (stream_provider {stream_provider!r} returned "
                f"None) while binding a CP group of size {scope.size}; TransformerEngine context parallelism needs "
                "CUDA tensors and a stream (cpscope.cp_stream() returns one on a CUDA device)"
            )
        bound = {"cp_group": cp_group, "cp_global_ranks": group_ranks(scope.group), "cp_stream": stream,
                 "cp_comm_type": comm}
    # cpscope's layout is TE's default DUAL_CHUNK_SWAP, which set_context_parallel_group applies when not given.
    apply_settings(module, bound)
    try:
        yield
    finally:
        apply_settings(module, saved)
