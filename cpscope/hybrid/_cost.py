"""The cost model of the hybrid-CP planner: how long one sequence takes on each rank of its CP group.

A sequence of ``L`` tokens run with context-parallel size ``cp`` (ring attention over the zigzag layout) is first
padded to ``Lp``, the next multiple of ``2·cp`` (zigzag needs ``2·cp`` equal chunks). Each of the ``cp`` ranks then
spends, in seconds::

    seq_cost(L, cp) = attn · Lp² / cp            # causal attention: total work ∝ Lp², split cp ways
                    + linear · Lp / cp           # per-token work (projections, MLP, norms) of the local tokens
                    + comm · (cp − 1) · Lp / cp  # ring K/V traffic: cp − 1 steps of Lp / cp tokens each

and a *microbatch* (several sequences packed in ``thd``, all at the same ``cp``, run by one CP group) takes::

    microbatch_cost = Σ seq_cost(L_i, cp) + latency · (cp − 1)   # one fixed latency per ring step

``comm`` is the *exposed* (not overlapped) cost per token of K/V received; ``latency`` the fixed cost of one ring
step (kernel launches, handshakes) summed over layers and passes. All four coefficients are settable, and
:meth:`CostModel.fit` measures them from timed runs by non-negative least squares.

**Hybrid models.** Only attention layers cost quadratic time and send K/V around the ring; linear-attention,
state-space and short-convolution layers cost linear time in the document length (their per-token work is part of
``linear``) and exchange a fixed-size state summary per microbatch. :meth:`CostModel.for_layer_mix` turns the
cost of a model whose blocks all attend into that of the same model with only ``mix.attention`` of its
``mix.layers`` blocks attending (:class:`~cpscope.hybrid.LayerMix`, e.g. from a transformers config).

Example::

    >>> cm = CostModel(attn=2.5e-9, linear=1e-4, comm=2e-6, latency=1e-3)
    >>> round(float(cm.cost(32768, 4)), 4)        # one 32k sequence alone at CP4
    1.5424
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Union

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ._layer_mix import LayerMix
from ._nnls import nnls

__all__ = ["CostModel", "padded_length"]

logger = logging.getLogger(__name__)

ArrayLike = Union[int, float, npt.ArrayLike]


def padded_length(lengths: ArrayLike, cp: ArrayLike) -> np.ndarray:
    """``lengths`` rounded up to a multiple of ``2·cp`` (the zigzag layout's granularity); broadcasts.

    Example::

        >>> padded_length([100, 128], 4).tolist()
        [104, 128]
    """
    length = np.asarray(lengths, dtype=np.int64)
    step = 2 * np.asarray(cp, dtype=np.int64)
    return -(-length // step) * step


@dataclass(frozen=True)
class CostModel:
    """Per-rank time of a sequence / microbatch under CP; see the module docstring for the formula.

    The defaults are illustrative only (roughly a 7B-parameter model, forward + backward, on one H100-class GPU
    per rank); fit your own with :meth:`fit`. All coefficients must be finite and ≥ 0. The total work
    ``cp · seq_cost`` then never decreases from a CP size to a multiple of it (splitting buys time, never saves
    work); between sizes that do not divide each other padding can reverse that (``L = 8``: ``Lp = 12`` at CP3,
    ``8`` at CP4), which the planner and its lower bound do not rely on.

    Attributes:
        attn: seconds per token² of causal attention (the whole sequence's attention is ``attn·Lp²``).
        linear: seconds per token of per-token work.
        comm: exposed seconds per token of K/V received around the ring.
        latency: fixed seconds per ring step of a microbatch (``cp − 1`` steps).

    Example::

        from cpscope.hybrid import CostModel, plan_hybrid
        cost = CostModel()                                  # the default coefficients; or fitted to measurements:
        cost = CostModel.fit([4096, 16384, 16384, 65536], [1, 1, 2, 4], [0.011, 0.12, 0.065, 0.3])
        cost.seq_cost(16384, 2)                             # predicted seconds of a 16k sequence at CP2
        plan = plan_hybrid([16384, 2048, 2048], n_ranks=2, capacity=16384, cost=cost)
    """

    attn: float = 2.5e-9
    linear: float = 1.0e-4
    comm: float = 2.0e-6
    latency: float = 1.0e-3

    _RING_FIELDS = ("comm",)  # per-token ring traffic: only attention layers send it (see for_layer_mix)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{f.name} must be a finite number ≥ 0, got {value!r}")

    def for_layer_mix(self, mix: "LayerMix") -> "CostModel":
        """This cost (of the model with **every** block attending) for the same model with ``mix.attention`` of its
        ``mix.layers`` blocks attending, the others linear-time mixers.

        The quadratic term ``attn`` and the ring traffic ``comm`` scale by ``mix.attention_fraction``; the
        per-token ``linear`` is kept (a linear-time mixer's projections and chunked recurrence take the place of
        the attention layer's projections and per-token work); so is ``latency`` (every mixer, attention or not,
        synchronises with its CP peers: a ring step or a summary exchange). A subclass names its other per-token
        ring-traffic fields in ``_RING_FIELDS``; they scale like ``comm``.

        Example::

            >>> from cpscope.hybrid._layer_mix import LayerMix
            >>> hybrid = CostModel(attn=4e-9, comm=2e-6).for_layer_mix(LayerMix(attention=1, linear=3, layers=4))
            >>> hybrid.attn, hybrid.comm, hybrid.linear == CostModel().linear
            (1e-09, 5e-07, True)
        """
        f = mix.attention_fraction
        ring = {name: getattr(self, name) * f for name in self._RING_FIELDS}
        return dataclasses.replace(self, attn=self.attn * f, **ring)

    # -- evaluation (all vectorised; numpy broadcasting between lengths and cp) --------------------------
    def seq_cost(self, lengths: ArrayLike, cp: ArrayLike) -> np.ndarray:
        """Per-rank seconds of each sequence at ``cp``, without the per-microbatch latency (lengths padded)."""
        return self.padded_seq_cost(padded_length(lengths, cp), cp)

    def padded_seq_cost(self, padded: ArrayLike, cp: ArrayLike) -> np.ndarray:
        """:meth:`seq_cost` of lengths already padded to a multiple of ``2·cp``."""
        cp_arr = np.asarray(cp, dtype=np.float64)
        lp = np.asarray(padded, dtype=np.float64)
        return lp * (self.attn * lp + (self.linear - self.comm) + self.comm * cp_arr) / cp_arr

    def cost(self, lengths: ArrayLike, cp: ArrayLike) -> np.ndarray:
        """Per-rank seconds of each sequence run **alone** in a microbatch at ``cp`` (latency included)."""
        return self.seq_cost(lengths, cp) + self.latency * (np.asarray(cp, dtype=np.float64) - 1.0)

    def work(self, lengths: ArrayLike, cp: ArrayLike) -> np.ndarray:
        """Rank-seconds a sequence occupies at ``cp``: ``cp · seq_cost`` (latency excluded); non-decreasing in cp."""
        return np.asarray(cp, dtype=np.float64) * self.seq_cost(lengths, cp)

    def microbatch_cost(self, lengths: ArrayLike, cp: int) -> float:
        """Per-rank seconds of one microbatch packing ``lengths`` (each padded on its own) at ``cp``."""
        return float(np.sum(self.seq_cost(lengths, cp))) + self.latency * (cp - 1)

    def _tables(self, padded: np.ndarray, cps: np.ndarray) -> tuple[tuple[str, ...], np.ndarray, np.ndarray,
                                                                    np.ndarray]:
        """The planner's tables (see :mod:`cpscope.hybrid._problem`): one variant, the ring (``"p2p"``)."""
        seq = self.padded_seq_cost(padded, cps[:, None])[None]  # [1, K, n]
        fixed = (self.latency * (cps.astype(np.float64) - 1.0))[None]  # [1, K]
        return ("p2p",), seq, fixed, np.ones(fixed.shape, dtype=bool)

    # -- measurement ---------------------------------------------------------------------------------------
    @staticmethod
    def features(lengths: ArrayLike, cp: ArrayLike) -> np.ndarray:
        """Design matrix ``[n, 4]`` whose dot with ``(attn, linear, comm, latency)`` is :meth:`cost`."""
        length, cp_arr = np.broadcast_arrays(np.asarray(lengths), np.asarray(cp))
        cp_f = cp_arr.astype(np.float64).ravel()
        lp = padded_length(length.ravel(), cp_arr.ravel()).astype(np.float64)
        return np.stack([lp * lp / cp_f, lp / cp_f, (cp_f - 1.0) * lp / cp_f, cp_f - 1.0], axis=1)

    @classmethod
    def fit(
        cls, lengths: ArrayLike, cp: ArrayLike, seconds: ArrayLike, *, relative: bool = True
    ) -> "CostModel":
        """Fit the four coefficients to measured ``(L, cp, seconds)`` samples by non-negative least squares.

        Each sample is the measured per-rank time of one sequence of ``L`` tokens run alone at ``cp``. The
        solution is the best fit over every subset of coefficients that are allowed to be non-zero (exact NNLS for
        four unknowns). With ``relative=True`` (default) residuals are relative (rows weighted by ``1/seconds``),
        so short and long sequences count alike. Coefficients the samples cannot identify (e.g. ``comm`` with
        only ``cp = 1`` samples) come out as 0.

        Example::

            >>> true = CostModel(attn=3e-9, linear=2e-4, comm=1e-5, latency=2e-3)
            >>> L = np.array([1024, 4096, 16384, 4096, 32768, 65536]); c = np.array([1, 1, 2, 4, 8, 8])
            >>> est = CostModel.fit(L, c, true.cost(L, c))
            >>> bool(np.allclose([est.attn, est.linear, est.comm, est.latency], [3e-9, 2e-4, 1e-5, 2e-3]))
            True
        """
        x = cls.features(lengths, cp)
        y = np.asarray(seconds, dtype=np.float64).ravel()
        if y.shape[0] != x.shape[0] or y.shape[0] == 0:
            raise ValueError(f"CostModel.fit: need the same non-zero number of lengths, cp and seconds, "
                             f"got {x.shape[0]} (lengths × cp) and {y.shape[0]} seconds")
        if not np.all(np.isfinite(y)) or np.any(y <= 0):
            raise ValueError("CostModel.fit: every measured time must be finite and > 0")
        coef = nnls(x, y, relative=relative)
        model = cls(*(float(c) for c in coef))
        logger.debug("CostModel.fit on %d samples -> %s", y.shape[0], model)
        return model
