"""Exact non-negative least squares for the few columns of a cost model (both :class:`~cpscope.hybrid.CostModel`
and :class:`~cpscope.hybrid.CommCostModel` fit their coefficients with it). Pure numpy.

Example::

    >>> import numpy as np
    >>> nnls(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0]), relative=False).tolist()
    [2.0, 0.0]
"""
from __future__ import annotations

import itertools

import numpy as np

__all__ = ["nnls"]


def nnls(x: np.ndarray, y: np.ndarray, *, relative: bool) -> np.ndarray:
    """Exact non-negative least squares ``min ‖x·c − y‖, c ≥ 0`` for a handful of columns: the best
    unconstrained fit over every subset of columns allowed to be non-zero whose solution is non-negative.
    ``relative`` weights row ``i`` by ``1 / y_i``. Columns are scaled first (coefficients span many decades)."""
    if relative:
        x, y = x / y[:, None], np.ones_like(y)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    xs = x / scale
    m = x.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, m + 1):
        for subset in itertools.combinations(range(m), k):
            cols = list(subset)
            sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(m)
            coef[cols] = sol
            resid = float(np.sum((xs @ coef - y) ** 2))
            if best is None or resid < best[0] * (1 - 1e-12):
                best = (resid, coef)
    return np.zeros(m) if best is None else best[1] / scale
