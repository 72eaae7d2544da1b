"""How mismatches become verdicts: logged, recorded, raised on every rank of the group together, or kept pending.

A check that every rank of the group runs alike (a gathered comparison) raises at once (``consistent``); a local
check (positions seen by one rank) keeps its mismatch *pending* until the group's next verdict point — the next
agreement digest, which carries a "pending" flag, or the end of the microbatch — so that a raise happens on every
rank at the same collective and no rank is left waiting.

Example::

    v = Verdicts("raise")
    v.emit([mismatch], consistent=False)     # logged, kept pending
    v.agree(scope)                           # at a point every rank reaches: SentinelError on all of them
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Union

import torch

from .comm import collective_device, exchange, group_of
from .report import Mismatch, SentinelError, Summary, logger

__all__ = ["Verdicts"]


class Verdicts:
    """Reports of one sentinel, its summary, and the mismatches pending a group verdict."""

    def __init__(self, policy: Union[str, Callable[[Mismatch], Any]], timeout: Optional[float] = None) -> None:
        self.policy = policy
        self.timeout = timeout
        self.reports: list[Mismatch] = []
        self.summary = Summary()
        self._pending: list[Mismatch] = []
        self._pending_exc: Optional[BaseException] = None
        self._warned_nonfinite = False

    def count(self, check: str, n: int = 1) -> None:
        """One more run of ``check`` in the summary."""
        self.summary.count(check, n)

    def emit(self, mismatches: list[Mismatch], *, consistent: bool, force_raise: bool = False) -> None:
        """Log and record ``mismatches``; raise now when every rank of the group reaches the same verdict here
        (``consistent``), else keep them for the group's next verdict point. ``force_raise``: raise whatever the
        policy (continuing would deadlock or crash the ring)."""
        if not mismatches:
            return
        for m in mismatches:
            self.reports.append(m)
            self.summary.add(m)
            logger.error("%s", m)
        exc: Optional[BaseException] = None
        if callable(self.policy):
            for m in mismatches:
                try:
                    self.policy(m)
                except BaseException as e:  # noqa: BLE001 - re-raised at a point every rank reaches
                    exc = exc or e
        if not (force_raise or self.policy == "raise" or exc is not None):
            return
        if consistent:
            raise exc if exc is not None and not force_raise else SentinelError(mismatches)
        self._pending.extend(mismatches)
        self._pending_exc = self._pending_exc or exc

    def nonfinite(self, what: str, rank: int) -> None:
        """A comparison skipped because its inputs held inf / NaN or scores beyond the arithmetic's range (a
        diverged run, not a CP fault): counted, and logged once as a warning."""
        self.summary.count("skipped: non-finite inputs")
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            logger.warning("cpscope sentinel: %s of rank %d skipped: its inputs hold inf / NaN or scores too large "
                           "for the kernels' arithmetic (the run has diverged); further skips are only counted in "
                           "the summary", what, rank)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def drop_pending(self) -> None:
        """Forget pending mismatches (already logged): their microbatch failed, its error is on its way."""
        self._pending, self._pending_exc = [], None

    def raise_pending(self, others: Iterable[int] = ()) -> None:
        """Called where every rank of the group learns that some rank has pending mismatches: raise on all."""
        if self._pending:
            pending, exc = self._pending, self._pending_exc
            self.drop_pending()
            if exc is not None:
                raise exc
            raise SentinelError(pending)
        others = list(others)
        if others:
            raise SentinelError([Mismatch("agreement", "mismatch on another rank", others[0],
                                          f"rank(s) {others} of the group found a mismatch (see their log)",
                                          {"ranks": others})])

    def pending_first(self, error: BaseException) -> None:
        """A sentinel collective failed (``error``, e.g. a timeout): a mismatch this rank holds is the cause to
        report (its partner went elsewhere because of it); else ``error`` itself."""
        if self._pending:
            self.raise_pending()
        raise error

    def agree(self, scope: Any, device: Optional[torch.device] = None) -> None:
        """Agree over ``scope``'s group whether anyone holds pending mismatches, and raise on every rank if so."""
        if self.policy == "log":
            return
        if scope.size == 1:
            self.raise_pending()
            return
        rows = exchange(scope.group, {"pending": int(self.has_pending)}, collective_device(scope.group, device),
                        timeout=self.timeout, what="verdict")
        members = group_of(scope)
        self.raise_pending([members[i] for i, r in enumerate(rows) if r["pending"] and i < len(members)])

    def log_summary(self, suffix: str = "") -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s%s", self.summary.text(), suffix)
