"""What the sentinel reports, and how: :class:`Mismatch`, :class:`SentinelError`, the tolerances, the run summary, and
the verdicts that turn mismatches into a raise on every rank of the group together (:class:`Verdicts`).

A mismatch names the check, the field, the rank it is about and the figures (max error and tolerance, or the
values that differ), and where it happened: the step (``run_microbatches`` call), the microbatch (its index among
the microbatches of its group) and the call (which attention / RoPE call of the microbatch — the layer).

A check that every rank of the group runs alike (a gathered comparison) raises at once (``consistent``); a local
check (positions seen by one rank) keeps its mismatch *pending* until the group's next verdict point — the next
agreement digest, which carries a "pending" flag, or the end of the microbatch — so that a raise happens on every
rank at the same collective and no rank is left waiting.

Example::

    try:
        loss.backward()
    except cpscope.SentinelError as e:
        for m in e.mismatches:
            print(m.check, m.field, m.rank, m.figures)

    v = Verdicts("raise")
    v.emit([mismatch], consistent=False)     # logged, kept pending
    v.agree(scope)                           # at a point every rank reaches: SentinelError on all of them
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch

from .comm import collective_device, exchange, group_of

__all__ = ["Mismatch", "SentinelError", "TOLERANCES", "tolerance", "Summary", "Verdicts"]

logger = logging.getLogger("cpscope.sentinel")

# Relative tolerances (max |got − ref| / max |ref|) of the attention check, per input dtype: (output, gradients).
# The reference is float64 on CPU / float32 on CUDA over the same inputs. Measured worst cases of correct runs on
# CPU (docs/sentinel.md): float64 ~2e-15, float32 ~3e-6, bfloat16 ~1e-2 (out) / ~1.7e-2 (grads) — so the margin is
# ≥ 5x for bf16 and ≥ 30x otherwise, while wrong groups, layouts or offsets give errors of order 0.1-1.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 2e-4),
    torch.bfloat16: (5e-2, 1e-1),
    torch.float16: (1e-2, 2e-2),
}


def tolerance(dtype: torch.dtype, grad: bool, overrides: Optional[dict] = None) -> float:
    """The relative tolerance for ``dtype`` (``overrides``: ``{dtype: (out, grad)}`` from ``sentinel(rtol=…)``)."""
    table = TOLERANCES if not overrides else {**TOLERANCES, **overrides}
    out_tol, grad_tol = table.get(dtype, TOLERANCES[torch.bfloat16])
    return grad_tol if grad else out_tol


@dataclass(frozen=True)
class Mismatch:
    """One failed check.

    Attributes:
        check: ``"agreement"``, ``"attention"``, ``"attention-grad"``, ``"rope"``, ``"positions"``, ``"recompute"``,
            ``"layout"`` (labels vs. the zigzag order), ``"sharding"`` (a shard used under another scope) or
            ``"loss-normalisation"``.
        field: what differs, e.g. ``"offsets (cu_seqlens)"``, ``"out"``, ``"dk"``, ``"positions"``.
        rank: the global rank the mismatch is about (``-1``: the whole group).
        message: the figures in words.
        figures: the same as numbers (``max_error``, ``tolerance``, values per rank, …).
        step, microbatch, call: where (``None`` when unknown): ``run_microbatches`` call, index of the microbatch
            among those of its group, index of the attention / RoPE call inside the microbatch (the layer).
        group: global ranks of the group checked (``(rank,)`` for CP1).
    """

    check: str
    field: str
    rank: int
    message: str
    figures: dict = dataclasses.field(default_factory=dict)
    step: Optional[int] = None
    microbatch: Optional[int] = None
    call: Optional[int] = None
    group: tuple = ()

    def __str__(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.microbatch is not None:
            where.append(f"microbatch {self.microbatch}")
        if self.call is not None:
            where.append(f"call {self.call}")
        if self.group:
            where.append(f"group {list(self.group)}")
        who = f"rank {self.rank}" if self.rank >= 0 else "group"
        return f"[{self.check}] {self.field} on {who} ({', '.join(where) or 'outside a microbatch'}): {self.message}"


class SentinelError(RuntimeError):
    """A correctness check of :class:`cpscope.sentinel` failed; ``.mismatches`` lists what, where and by how much.

    Raised on every rank of the group at the same point (the verdict travels with the sentinel's collectives), so
    no rank is left waiting in a collective.

    Example::

        with cpscope.sentinel(every=100):
            try:
                train_step()
            except cpscope.SentinelError as e:
                log.error("stopping: %s", e)
                raise
    """

    def __init__(self, mismatches: list[Mismatch]) -> None:
        self.mismatches = list(mismatches)
        lines = [str(m) for m in self.mismatches[:8]]
        more = len(self.mismatches) - len(lines)
        super().__init__("cpscope sentinel: " + "\n  ".join(lines) + (f"\n  … and {more} more" if more > 0 else ""))

    def __reduce__(self) -> tuple:  # picklable with its mismatches (multiprocessing, test harnesses)
        return (SentinelError, (self.mismatches,))


@dataclass
class Summary:
    """Counters of a sentinel run (``sentinel.summary()``), logged when the sentinel stops."""

    microbatches: int = 0
    sampled: int = 0
    checks: dict = field(default_factory=dict)  # check name -> how many were run
    worst: dict = field(default_factory=dict)  # "attention out bfloat16" -> worst error / tolerance seen
    mismatches: int = 0
    by_field: dict = field(default_factory=dict)  # "check/field" -> count

    def count(self, check: str, n: int = 1) -> None:
        self.checks[check] = self.checks.get(check, 0) + n

    def worst_ratio(self, key: str, ratio: float) -> None:
        if ratio > self.worst.get(key, -1.0):
            self.worst[key] = ratio

    def add(self, m: Mismatch) -> None:
        self.mismatches += 1
        key = f"{m.check}/{m.field}"
        self.by_field[key] = self.by_field.get(key, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        checks = ", ".join(f"{k} {v}" for k, v in sorted(self.checks.items())) or "none"
        worst = ", ".join(f"{k} {v:.2g}" for k, v in sorted(self.worst.items())) or "-"
        bad = ", ".join(f"{k} ×{v}" for k, v in sorted(self.by_field.items())) or "none"
        return (
            f"cpscope sentinel summary: {self.microbatches} microbatches seen, {self.sampled} sampled; checks run: "
            f"{checks}; worst error/tolerance: {worst}; mismatches: {self.mismatches} ({bad})"
        )


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
