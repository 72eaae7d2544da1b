"""What a switched-on sentinel keeps while it watches a job: :class:`Tracker`, and what it tracks — the microbatch
being run (:class:`MicrobatchRecord`), what sampled forwards recorded for their recomputes (:class:`Records`), and
the scope each shard was cut for (:class:`Cuts`).

The checks (attention, positions, the loop's) receive the tracker, never the :class:`cpscope.sentinel` object: it
holds the options, the sampling decision (:mod:`.config`), the verdicts (:mod:`.report`), the recompute
records, the shard cuts and the microbatch being run. The scope is read here only in forward
(``runtime_scope_or``, in :meth:`Tracker.expected_scope`); :func:`in_backward` tells when it must not be read.

**Shard cuts.** Inputs sharded inside one scope and rotated / attended under another (or none) run with positions
and peers of the wrong layout — consistently on every rank, so the other checks see nothing wrong. While the
sentinel is on, ``zigzag_shard`` reports every tensor it cuts under CP > 1 (observer slot ``shard``); :class:`Cuts`
remembers, weakly (no tensor is kept alive), the scope each was cut for. RoPE and attention then look up the tensors
they receive (the tensor itself or the view it was taken from): one cut for another scope is a mismatch. Identity is
proof of provenance: no false alarm, whatever the data.

Example::

    t = Tracker(Options.make(every=10))
    mb = t.begin_microbatch(scope)            # marked: sampling follows microbatches of scope's group
    t.current("attention", scope) is mb       # a call inside it belongs to it
    mb.where(call=1)                          # {"step": None, "microbatch": 0, "call": 1}: a report's where-fields
    t.end_microbatch(mb)                      # the group's verdict on its local checks

    t.cuts.record(scope_cp2, q_local)                # zigzag_shard under CP2
    t.cuts.foreign({"q": q_local}, scope_cp1)        # ("q", scope_cp2): cut for CP2, used under CP1
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..backward_check import graph_task_id as _current_graph_task_id
from ..scope import CPScope, runtime_scope_or
from .agree import handshake, options_code
from .comm import describe, me, same_scope
from .config import Options, Sampler
from .report import Mismatch, Verdicts

__all__ = ["in_backward", "offsets_list", "fingerprint", "MicrobatchRecord", "Records", "Cuts", "cut_mismatch",
           "Tracker"]


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


class Tracker:
    """Options, sampling, verdicts, recompute records and the current microbatch of one sentinel."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.sampler = Sampler(opts.every)
        self.verdicts = Verdicts(opts.on_mismatch, opts.timeout)
        self.records = Records()
        self.cuts = Cuts()  # the scope each live zigzag_shard output was cut for (:class:`Cuts`)
        self.mb: Optional[MicrobatchRecord] = None  # the marked microbatch being run
        self._agreed: set = set()  # groups whose members agreed on this sentinel (:mod:`.agree`)
        self.armed = 0  # recomputes of sampled calls due: checked meanwhile (:mod:`.recompute`)
        self.taps_due = 0  # gradient taps of sampled calls not yet run (a sampled backward is due)
        # a sampled call found peers that do not sample it (:func:`.attention_check.stand_down`): the step boundary
        # raises RanksDisagreeError on every rank; until then this rank runs no collective of its own
        self.stood_down = False

    def begin_microbatch(self, scope: CPScope, *, step: Optional[int] = None) -> MicrobatchRecord:
        """A marked microbatch of ``scope``'s group begins (``run_microbatches``, :meth:`cpscope.sentinel.microbatch`)."""
        index, sampled = self.sampler.microbatch(scope.group)
        if not sampled and not self.taps_due:  # no sampled backward due: an unsampled microbatch's recomputes go unchecked
            self.armed = 0
        mb = MicrobatchRecord(scope, index, sampled, step, marked=True)
        if sampled:  # at its first attention call, after the core's digest showed every rank sampling it
            mb.due.append(lambda: self.agree_options(scope))
        self.mb = mb
        self.verdicts.drop_pending()  # (left by a microbatch that failed: already logged)
        self.verdicts.summary.microbatches += 1
        self.verdicts.summary.sampled += int(sampled)
        return mb

    def end_microbatch(self, mb: Optional[MicrobatchRecord], *, flush: bool = True) -> None:
        """The microbatch ends; ``flush=False`` when it failed (its pending mismatches are logged, its error is on
        its way: no collectives now)."""
        if self.mb is mb:
            self.mb = None
        if not flush:
            self.verdicts.drop_pending()
        elif mb is not None and mb.sampled and mb.unverified:  # else the last attention digest was the verdict
            self.verdicts.agree(mb.scope)

    def current(self, kind: str, scope: CPScope) -> MicrobatchRecord:
        """The microbatch a forward call of ``kind`` under ``scope`` belongs to (a one-call unit without markers)."""
        mb = self.mb
        if mb is not None:
            return mb
        unit = self.expected_scope(None) or scope
        index, sampled = self.sampler.call(kind, unit.group)
        mb = MicrobatchRecord(unit, index, sampled, None, marked=False)
        if sampled and kind == "attention":  # (other kinds run no collective of their own)
            mb.due.append(lambda: self.agree_options(unit))
        return mb

    def agree_options(self, scope: CPScope) -> None:
        """At the first sampled unit of ``scope``'s group: its members agree on how this sentinel runs (on, every,
        policy, checks, steps so far), or every member that got here raises the same error (:mod:`.agree`).
        Run at the unit's first attention call, after the core's agreement digest showed every member sampling it
        (a member without the sentinel is named there, on every rank, before anyone waits here)."""
        if scope.size == 1 or scope.group in self._agreed:
            return
        handshake(scope, {**options_code(self.opts), "steps": self.sampler.steps}, timeout=self.opts.timeout)
        self._agreed.add(scope.group)

    def expected_scope(self, mb: Optional[MicrobatchRecord]) -> Optional[CPScope]:
        """The scope consumers must use in forward: the bound runtime scope, else the marked microbatch's, else
        ``None`` (nothing bound: a consumer's own scope — a static-CP module's build-time scope — is authoritative)."""
        bound = runtime_scope_or(None)  # type: ignore[arg-type]
        if bound is not None:
            return bound
        return mb.scope if mb is not None and mb.marked else None

    def tolerance(self, dtype: torch.dtype, grad: bool) -> float:
        """The attention check's relative tolerance for ``dtype`` (output or gradients)."""
        return self.opts.tolerance(dtype, grad)
