"""Which scope each shard was cut for: ``zigzag_shard``'s outputs against the scope RoPE and attention run under.

Inputs sharded inside one scope and rotated / attended under another (or none) run with positions and peers of the
wrong layout — consistently on every rank, so the other checks see nothing wrong. While the sentinel is on,
``zigzag_shard`` reports every tensor it cuts under CP > 1 (observer slot ``shard``); :class:`Cuts` remembers,
weakly (no tensor is kept alive), the scope each was cut for. RoPE and attention then look up the tensors they
receive (the tensor itself or the view it was taken from): one cut for another scope is a mismatch. Identity is
proof of provenance: no false alarm, whatever the data.

Example::

    cuts = Cuts()
    cuts.record(scope_cp2, q_local)                  # zigzag_shard under CP2
    cuts.foreign({"q": q_local}, scope_cp1)          # ("q", scope_cp2): cut for CP2, used under CP1
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..scope import CPScope
from .comm import describe, me, same_scope
from .report import Mismatch

__all__ = ["Cuts", "cut_mismatch"]


class Cuts:
    """The scope each live shard was cut for (weak keys)."""

    def __init__(self) -> None:
        self._d: Any = WeakIdKeyDictionary()

    def record(self, scope: CPScope, out: torch.Tensor) -> None:
        try:
            self._d[out] = scope
        except TypeError:  # no weak references (e.g. a traced tensor): not remembered
            pass

    def scope_of(self, t: Any) -> Optional[CPScope]:
        """The scope ``t`` (or the tensor it is a view of) was cut for, or ``None``."""
        while isinstance(t, torch.Tensor):
            try:
                hit = self._d.get(t)
            except TypeError:
                return None
            if hit is not None:
                return hit
            t = t._base
        return None

    def foreign(self, tensors: dict[str, Any], scope: CPScope) -> Optional[tuple[str, CPScope]]:
        """The first of ``tensors`` cut for a scope other than ``scope``: ``(name, its scope)``, else ``None``."""
        if not self._d:
            return None
        for name, t in tensors.items():
            cut = self.scope_of(t)
            if cut is not None and not same_scope(cut, scope):
                return name, cut
        return None


def cut_mismatch(where: str, foreign: tuple[str, CPScope], scope: CPScope, fields: dict) -> Mismatch:
    """The report of a tensor cut for one scope and used by ``where`` (RoPE / attention) under another."""
    name, cut = foreign
    return Mismatch(
        "sharding", "scope", me(),
        f"{name} was cut by zigzag_shard for {describe(cut)} but {where} runs under {describe(scope)}: shard, rotate "
        "and attend inside the same cpscope.runtime_cp scope", {"cut_for": describe(cut), "used": describe(scope)},
        **fields)
