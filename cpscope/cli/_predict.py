"""What ``python -m cpscope plan`` predicts: the hybrid plan of each step against every static CP size and CP1-only
data parallelism, under one cost model — pure logic (numpy and :mod:`cpscope.hybrid`), no process group.

A *schedule* is ``"hybrid"`` (:func:`~cpscope.hybrid.plan_hybrid`) or ``"static CPs"``
(:func:`~cpscope.hybrid.plan_static` with ``cp=s``; ``s = 1`` is CP1-only data parallelism). Its predicted step is
the plan's makespan (the slowest rank's forward + backward of its microbatches, under the cost model), averaged over
the steps; its gain is ``mean static step / mean hybrid step`` (a throughput ratio: the same tokens). A static size
below the longest document's memory minimum does not fit and is reported with the reason.

Example::

    >>> from cpscope.hybrid import CostModel
    >>> steps = [np.array([65536, 8192, 4096, 2048, 1024, 512] * 4)]
    >>> pred = predict(steps, n_ranks=8, capacity=16384, cost=CostModel())
    >>> [s.name for s in pred.schedules]
    ['hybrid', 'static CP4', 'static CP8', 'static CP2', 'static CP1']
    >>> pred.schedules[1].gain > 1.0, pred.schedules[3].fits
    (True, False)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from ..hybrid import CostModel, Plan, StepCost, cp_candidates, plan_hybrid, plan_static

Cost = Union[CostModel, StepCost]  # what the planners take as cost=

__all__ = ["Prediction", "Schedule", "predict"]


@dataclass
class Schedule:
    """One schedule's prediction over the steps: ``step_s`` (mean makespan), ``max_tokens_per_rank`` (the largest
    microbatch a rank runs, over the steps), ``gain`` (mean static step / mean hybrid step, hybrid's own is 1)."""

    name: str
    cp: Optional[int]  # None: hybrid
    fits: bool
    reason: str = ""
    step_s: float = float("nan")
    steps_s: list[float] = field(default_factory=list)
    max_tokens_per_rank: int = 0
    gain: float = float("nan")
    memory: Optional[dict[str, float]] = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class Prediction:
    """Every schedule (hybrid first, then the static sizes from the memory minimum up, CP1 last) and hybrid's plans."""

    n_ranks: int
    capacity: int
    cp_sizes: list[int]
    schedules: list[Schedule]
    plans: list[Plan]  # hybrid's plan of each step
    lower_bounds: list[float]

    def schedule(self, name: str) -> Schedule:
        return next(s for s in self.schedules if s.name == name)


def _run(name: str, cp: Optional[int], make: Callable[[np.ndarray], Plan], steps: Sequence[np.ndarray],
         why: Callable[[ValueError], str] = str) -> tuple[Schedule, list[Plan]]:
    try:
        plans = [make(lengths) for lengths in steps]
    except ValueError as err:  # the longest document does not fit this CP size at the capacity
        return Schedule(name, cp, fits=False, reason=why(err)), []
    spans = [p.makespan for p in plans]
    tokens = max(mb.tokens_per_rank for p in plans for mb in p.microbatches)
    return Schedule(name, cp, True, step_s=float(np.mean(spans)), steps_s=spans, max_tokens_per_rank=int(tokens)), plans


def predict(steps: Sequence[np.ndarray], *, n_ranks: int, capacity: int, cost: Cost, max_cp: Optional[int] = None,
            cp_sizes: Any = None, memory: Optional[Callable[[int], dict[str, float]]] = None) -> Prediction:
    """Plan every step with :func:`~cpscope.hybrid.plan_hybrid` and with :func:`~cpscope.hybrid.plan_static` at each
    allowed CP size; ``memory(tokens_per_rank)`` (optional) prices a schedule's largest microbatch in bytes.

    Raises:
        ValueError: no steps, or a document that fits no allowed CP size (from the planner, naming it).
    """
    if not steps:
        raise ValueError("no steps to plan")
    sizes = cp_candidates(n_ranks, max_cp, cp_sizes).tolist()
    hybrid, plans = _run("hybrid", None, lambda x: plan_hybrid(x, n_ranks, capacity, cost, max_cp=max_cp,
                                                                cp_sizes=cp_sizes), steps)
    if not hybrid.fits:
        raise ValueError(hybrid.reason)
    longest = max(int(x.max()) for x in steps)
    need = next(s for s in sizes if -(-longest // (2 * s)) * 2 <= capacity)  # padded longest / s ≤ capacity

    def why(err: ValueError) -> str:
        return f"the longest document ({longest:,} tokens) needs CP ≥ {need} at a capacity of {capacity:,} tokens"

    static = [_run(f"static CP{s}", s, lambda x, s=s: plan_static(x, n_ranks, capacity, cost, cp=s,
                                                                  cp_sizes=sizes), steps, why)[0]
              for s in sizes]
    fitting = [s for s in static if s.fits]
    first = min((s.cp for s in fitting), default=None)
    # the memory minimum first (what static CP runs), then larger sizes, then those that do not fit, CP1 last
    order = sorted(static, key=lambda s: (s.cp == 1, not s.fits, s.cp != first, s.cp))
    for s in [hybrid] + order:
        if s.fits:
            s.gain = s.step_s / hybrid.step_s
            if memory is not None:
                s.memory = memory(s.max_tokens_per_rank)
    return Prediction(n_ranks, capacity, sizes, [hybrid] + order, plans, [p.lower_bound for p in plans])
