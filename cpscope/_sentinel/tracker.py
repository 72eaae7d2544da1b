"""What a switched-on sentinel keeps while it watches a job: :class:`Tracker`.

The checks (attention, positions, the loop's) receive the tracker, never the :class:`cpscope.sentinel` object: it
holds the options, the sampling decision (:mod:`.config`), the verdicts (:mod:`.report`), the recompute
records and the microbatch being run. The scope is read here only in forward (``runtime_scope_or``).

Example::

    t = Tracker(Options.make(every=10))
    mb = t.begin_microbatch(scope)            # marked: sampling follows microbatches of scope's group
    t.current("attention", scope) is mb       # a call inside it belongs to it
    t.end_microbatch(mb)                      # the group's verdict on its local checks
"""
from __future__ import annotations

from typing import Optional

import torch

from ..scope import CPScope, runtime_scope_or
from .agree import handshake, options_code
from .config import Options, Sampler
from .cuts import Cuts
from .report import Verdicts
from .state import MicrobatchRecord, Records

__all__ = ["Tracker"]


class Tracker:
    """Options, sampling, verdicts, recompute records and the current microbatch of one sentinel."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.sampler = Sampler(opts.every)
        self.verdicts = Verdicts(opts.on_mismatch, opts.timeout)
        self.records = Records()
        self.cuts = Cuts()  # the scope each live zigzag_shard output was cut for (:mod:`.cuts`)
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
