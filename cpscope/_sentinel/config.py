"""What a sentinel was asked to do: its options, validated once (:class:`Options`), and the sampling policy they set —
which microbatches, calls and steps are checked (:class:`Sampler`, the one place where that is decided).

A sampled unit runs collectives (the agreement digest, K/V gathers, verdicts) that every member of its group must
enter together, so the decision must be the same on every member. Today it is made from counters that every
member advances identically when the ranks run the same program: per group, the microbatches marked so far
(``run_microbatches`` or :meth:`cpscope.sentinel.microbatch`), or without markers the calls of each kind; per
sentinel, the ``run_microbatches`` steps. The ``n``-th unit is sampled when ``n % every == 0`` (the first always).

These counters are per rank: ranks that switched the sentinel on at different points, or with another ``every``,
disagree. Everything that decides is here, so that an agreed decision (one small collective carrying each rank's
choices) replaces it in one place.

Example::

    opts = Options.make(every=100, on_mismatch="log")
    opts.tolerance(torch.bfloat16, grad=True)            # 0.1

    sampler = Sampler(every=100)
    index, sampled = sampler.microbatch(scope.group)     # (0, True), then (1, False), ...
    step, sampled = sampler.step()
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from .comm import DEFAULT_TIMEOUT_S
from .report import Mismatch, tolerance

__all__ = ["Options", "POLICIES", "Sampler"]

POLICIES = ("raise", "log")


@dataclass(frozen=True)
class Options:
    """The arguments of :class:`cpscope.sentinel` (see its docstring), checked by :meth:`make`."""

    every: int = 100
    on_mismatch: Union[str, Callable[[Mismatch], Any]] = "raise"
    attention: bool = True
    gradients: bool = True
    positions: bool = True
    loss: bool = True
    labels: Optional[str] = "next_token"
    rtol: Optional[dict] = None
    reference_dtype: Optional[torch.dtype] = None
    ignore_index: int = -100
    timeout: float = DEFAULT_TIMEOUT_S
    rows: int = 64

    @classmethod
    def make(cls, every: Any = 100, *, on_mismatch: Any = "raise", attention: Any = True, gradients: Any = True,
             positions: Any = True, loss: Any = True, labels: Any = "next_token", rtol: Any = None,
             reference_dtype: Optional[torch.dtype] = None, ignore_index: Any = -100,
             timeout: Any = DEFAULT_TIMEOUT_S, rows: Any = 64) -> "Options":
        """Validated options.

        Raises:
            ValueError: ``every`` not a positive int, an unknown ``on_mismatch`` or ``labels``, a malformed ``rtol``,
                a ``timeout`` that is not a finite number of seconds > 0, ``rows`` not a positive int.
        """
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1:
            raise ValueError(f"sentinel: rows must be a positive int (query rows checked per rank), got {rows!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (
                math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"sentinel: timeout must be a finite number of seconds > 0, got {timeout!r}")
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"sentinel: every must be a positive int (1 = check every microbatch), got {every!r}")
        if not callable(on_mismatch) and on_mismatch not in POLICIES:
            raise ValueError(f"sentinel: on_mismatch must be 'raise', 'log' or a callable, got {on_mismatch!r}")
        if labels not in ("next_token", None):
            raise ValueError(f"sentinel: labels must be 'next_token' or None, got {labels!r}")
        if rtol is not None:
            for dt, pair in rtol.items():
                if not isinstance(dt, torch.dtype) or len(pair) != 2 or not all(
                    isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in pair
                ):
                    raise ValueError(f"sentinel: rtol maps a torch.dtype to (out, grad) positive floats, got {rtol!r}")
        return cls(int(every), on_mismatch, bool(attention), bool(gradients), bool(positions), bool(loss), labels,
                   dict(rtol) if rtol else None, reference_dtype, int(ignore_index), float(timeout), int(rows))

    def tolerance(self, dtype: torch.dtype, grad: bool) -> float:
        """The relative tolerance of the attention check for ``dtype`` (output or gradients), overrides applied."""
        return tolerance(dtype, grad, self.rtol)


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
