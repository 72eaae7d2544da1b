"""Which microbatches, calls and steps the sentinel samples: the one place where that is decided.

A sampled unit runs collectives (the agreement digest, K/V gathers, verdicts) that every member of its group must
enter together, so the decision must be the same on every member. Today it is made from counters that every
member advances identically when the ranks run the same program: per group, the microbatches marked so far
(``run_microbatches`` or :meth:`cpscope.sentinel.microbatch`), or without markers the calls of each kind; per
sentinel, the ``run_microbatches`` steps. The ``n``-th unit is sampled when ``n % every == 0`` (the first always).

These counters are per rank: ranks that switched the sentinel on at different points, or with another ``every``,
disagree. Everything that decides is here, so that an agreed decision (one small collective carrying each rank's
choices) replaces it in one place.

Example::

    sampler = Sampler(every=100)
    index, sampled = sampler.microbatch(scope.group)     # (0, True), then (1, False), ...
    step, sampled = sampler.step()
"""
from __future__ import annotations

from typing import Any

__all__ = ["Sampler"]


class Sampler:
    """Per-rank sampling counters of one sentinel (see the module docstring)."""

    __slots__ = ("every", "_counts", "_steps")

    def __init__(self, every: int) -> None:
        self.every = every
        self._counts: dict[Any, int] = {}
        self._steps = 0

    def _next(self, key: Any) -> tuple[int, bool]:
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return n, n % self.every == 0

    def microbatch(self, group: Any) -> tuple[int, bool]:
        """A marked microbatch of ``group`` begins: its index among the group's microbatches, and whether sampled."""
        return self._next(("mb", group))

    def call(self, kind: str, group: Any) -> tuple[int, bool]:
        """A call of ``kind`` (``"attention"``, ``"rope"``, ...) outside every marked microbatch: a one-call unit."""
        return self._next((kind, group))

    @property
    def steps(self) -> int:
        """``run_microbatches`` steps begun so far."""
        return self._steps

    def step(self) -> tuple[int, bool]:
        """A ``run_microbatches`` step begins: its index, and whether its loss normalisation is checked."""
        n = self._steps
        self._steps += 1
        return n, n % self.every == 0
