"""The sentinel's bookkeeping: the microbatch being run, what sampled forwards recorded for their recomputes, and
small helpers on offsets and autograd (nothing here reads the ContextVar).

Example::

    mb = MicrobatchRecord(scope, index=0, sampled=True, step=None, marked=True)
    mb.where(call=1)            # {"step": None, "microbatch": 0, "call": 1}: the where-fields of a report
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch

from ..scope import CPScope
from ..backward_check import graph_task_id as _current_graph_task_id

__all__ = ["in_backward", "offsets_list", "fingerprint", "MicrobatchRecord", "Records"]


def in_backward() -> bool:
    """True while autograd runs a backward (hooks, recompute): the ContextVar must not be read there.

    Also true in torch checkpoint's recompute on CUDA device threads, where the engine shows no graph task.
    """
    return _current_graph_task_id() != -1


def offsets_list(cu: "torch.Tensor | Sequence[int]") -> list[int]:
    """Offsets as a list of Python ints (one host copy of a tensor); the consumers that use them validate them."""
    return [int(c) for c in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]


def fingerprint(t: torch.Tensor) -> tuple:
    """Two float64 moments of ``t``: equal for a bitwise-equal recompute, different for other data."""
    x = t.detach().double()
    return tuple(torch.stack([x.sum(), (x * x).sum()]).tolist())


class MicrobatchRecord:
    """What the sentinel knows about the microbatch being run: its group, index, whether it is sampled."""

    __slots__ = ("scope", "index", "sampled", "step", "calls", "rope_layouts", "marked", "unverified", "due")

    def __init__(self, scope: CPScope, index: int, sampled: bool, step: Optional[int], marked: bool) -> None:
        self.scope, self.index, self.sampled, self.step, self.marked = scope, index, sampled, step, marked
        self.calls = 0  # attention calls so far (forward): the next call's index = the layer
        self.rope_layouts: list = []  # offsets RoPE used since the last attention call (sampled only)
        self.unverified = 0  # local-only checks since the last group verdict (RoPE / positions after attention)
        # the unit's own collectives (handshake, the loop's pack checks): run at its first sampled attention call,
        # once the core's agreement digest showed every rank sampling it (:mod:`.attention_check`)
        self.due: list = []

    def where(self, call: Optional[int]) -> dict:
        """Where-fields of a report; without markers the unit is one call: its index among calls of its kind."""
        if self.marked:
            return {"step": self.step, "microbatch": self.index, "call": call}
        return {"step": None, "microbatch": None, "call": self.index}


class Records:
    """(scope, where) of sampled forward calls, keyed by (signature, fingerprint of an input): what a recompute
    of the same call must use. Bounded: the oldest records go first.

    Example::

        records.put(sig, fingerprint(v), (scope, where))       # in a sampled forward
        records.get(sig, fingerprint(v))                       # in its recompute: (scope, where) or None
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._d: OrderedDict = OrderedDict()
        self._sigs: dict[tuple, int] = {}
        self.capacity = capacity

    def put(self, sig: tuple, fp: tuple, value: Any) -> None:
        key = (sig, fp)
        if key not in self._d:
            self._sigs[sig] = self._sigs.get(sig, 0) + 1
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            (old_sig, _), _ = self._d.popitem(last=False)
            self._sigs[old_sig] -= 1
            if not self._sigs[old_sig]:
                del self._sigs[old_sig]

    def has_signature(self, sig: tuple) -> bool:
        return sig in self._sigs

    def get(self, sig: tuple, fp: tuple) -> Optional[Any]:
        return self._d.get((sig, fp))
