"""The planner's cost when the communication variant is chosen per microbatch: a model's step from its attention.

:class:`StepCost` turns a fitted :class:`~cpscope.hybrid.CommCostModel` (one attention call, per
variant) into what :func:`~cpscope.hybrid.plan_hybrid` reads: per variant and CP size, each sequence's
per-rank seconds and each microbatch's fixed seconds::

    seq_v(L, cp)  = linear · Lp / cp + layers · (q2_v · Lp² + q1_v · Lp)       # Lp = L padded to 2·cp
    fixed_v(cp)   = layers · fixed_v                                           # rounds and call, per microbatch

so a microbatch of sequences ``L_i`` run with variant ``v`` costs ``Σ seq_v(L_i, cp) + fixed_v(cp)``; the plan
runs each microbatch with its cheapest allowed variant and says which in ``Microbatch.comm``.

Example::

    >>> from cpscope.hybrid import plan_hybrid
    >>> from cpscope.hybrid._comm_cost import CommCostModel
    >>> fit = {"bfloat16": {"local": (1e-12, 1e-10, 0, 0, 1e-4), "p2p": (1e-12, 1e-10, 1e-11, 2e-4, 1e-4),
    ...                     "a2a": (1e-12, 1e-10, 1e-10, 0, 1e-4)}}
    >>> step = StepCost(CommCostModel(fit), heads=32, kv_heads=8, head_dim=128, layers=32, linear=2e-5)
    >>> plan = plan_hybrid([131072] + [1024] * 62, n_ranks=8, capacity=16384, cost=step)
    >>> sorted({(mb.cp, mb.comm) for mb in plan.microbatches})
    [(1, 'p2p'), (8, 'p2p')]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import numpy.typing as npt

from .._variants import VARIANTS
from ._comm_features import check_shape, default_inner, dtype_name, variant_allowed
from ._comm_cost import CommCostModel

__all__ = ["StepCost"]


@dataclass(frozen=True)
class StepCost:
    """Per-rank seconds of a microbatch, with its attention exchange chosen per microbatch.

    Attributes:
        comm: the fitted per-call attention model.
        heads, kv_heads, head_dim, dtype, causal: the model's attention.
        layers: attention calls per microbatch (the number of attention layers).
        linear: seconds per token of everything else (projections, MLP, norms; forward + backward), per rank.
        inner: the ``a2a+p2p`` sub-group size (default ``comm.inner``).
        variants: the variants the planner may use (default all fitted ones).

    Example::

        from cpscope.hybrid import CommCostModel, StepCost, plan_hybrid
        cost = StepCost(CommCostModel.load("comm_cost.json"), heads=32, kv_heads=8, head_dim=128, layers=32)
        cost.microbatch_cost([65536], cp=4)          # per-rank seconds, with the cheapest allowed variant
        plan = plan_hybrid(lengths, n_ranks=8, capacity=32768, cost=cost)   # each microbatch gets .cp and .comm
    """

    comm: CommCostModel
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    layers: int = 1
    linear: float = 0.0
    causal: bool = True
    inner: Optional[int] = None
    variants: Optional[Sequence[str]] = None

    def __post_init__(self) -> None:
        check_shape(1, self.heads, self.kv_heads, self.head_dim)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"StepCost.layers must be an int ≥ 1, got {self.layers!r}")
        if not (isinstance(self.linear, (int, float)) and math.isfinite(self.linear) and self.linear >= 0):
            raise ValueError(f"StepCost.linear must be a finite number ≥ 0, got {self.linear!r}")
        fitted = self.comm.variants(self.dtype)
        if not fitted:
            raise ValueError(f"the cost model has no variant fitted for dtype {self.dtype!r}; calibrated dtypes: "
                             f"{list(self.comm.dtypes())}")
        if self.variants is not None:
            wanted = tuple(self.variants)
            missing = [v for v in wanted if v not in fitted]
            if not wanted or missing:
                raise ValueError(f"StepCost.variants {list(wanted)}: {missing or 'none'} not fitted for "
                                 f"{self.dtype} (fitted: {list(fitted)})")
            object.__setattr__(self, "variants", tuple(v for v in VARIANTS if v in wanted))
        else:
            object.__setattr__(self, "variants", fitted)
        if self.inner is None:
            object.__setattr__(self, "inner", self.comm.inner)

    def _split(self, variant: str, cp: int) -> tuple[float, float, float]:
        q2, q1, fixed = self.comm.split(variant, cp=cp, heads=self.heads, kv_heads=self.kv_heads,
                                        head_dim=self.head_dim, dtype=self.dtype, causal=self.causal,
                                        inner=self.inner)
        return self.layers * q2, self.layers * q1 + self.linear / cp, self.layers * fixed

    def _comm_name(self, variant: str, cp: int) -> str:
        """What a microbatch binds: ``"a2a+p2p:N"`` names the sub-group size the cost was computed with."""
        if variant != "a2a+p2p" or cp == 1:
            return variant
        return f"a2a+p2p:{self.inner or default_inner(cp, self.heads, self.kv_heads)}"

    def _tables(self, padded: np.ndarray, cps: np.ndarray) -> tuple[tuple[str, ...], np.ndarray, np.ndarray,
                                                                    np.ndarray]:
        """The planner's tables (see :mod:`cpscope.hybrid._problem`), one row per variant."""
        names = tuple(self.variants)
        lp = padded.astype(np.float64)
        seq = np.zeros((len(names),) + lp.shape)
        fixed = np.zeros((len(names), cps.size))
        allowed = np.zeros((len(names), cps.size), dtype=bool)
        for k, cp in enumerate(cps.tolist()):
            for v, name in enumerate(names):
                if not variant_allowed(name, cp, self.heads, self.kv_heads, self.inner):
                    continue
                q2, q1, f = self._split(name, cp)
                seq[v, k] = lp[k] * (q2 * lp[k] + q1)
                fixed[v, k] = f
                allowed[v, k] = True
        return names, seq, fixed, allowed

    def microbatch_cost(self, lengths: npt.ArrayLike, cp: int, comm: Optional[str] = None) -> float:
        """Per-rank seconds of one microbatch packing ``lengths`` at ``cp`` with variant ``comm`` (default: the
        cheapest allowed one, as the planner picks it)."""
        usable = [v for v in self.variants if variant_allowed(v, cp, self.heads, self.kv_heads, self.inner)]
        if comm is not None and comm.startswith("a2a+p2p:") and comm == self._comm_name("a2a+p2p", cp):
            comm = "a2a+p2p"
        if comm is not None and comm not in usable:
            raise ValueError(f"variant {comm!r} is not available at cp={cp} in this StepCost (variants "
                             f"{list(self.variants)}, heads={self.heads}, kv_heads={self.kv_heads}, "
                             f"inner={self.inner})")
        lp = np.asarray(lengths, dtype=np.int64)
        lp = (-(-lp // (2 * cp)) * (2 * cp)).astype(np.float64)
        best = math.inf
        for name in usable if comm is None else [comm]:
            q2, q1, f = self._split(name, cp)
            best = min(best, float(np.sum(lp * (q2 * lp + q1))) + f)
        return best

    def describe(self) -> dict[str, Any]:
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "layers": self.layers, "linear": self.linear, "causal": self.causal, "inner": self.inner,
                "variants": list(self.variants)}
