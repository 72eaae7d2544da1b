"""One value for the score features of an attention call: the window as a band, the softcap, the sinks.

A call's features are validated once, where the call is (:func:`cpscope.attention._api.prepare_call`), into one
:class:`Mods`; the variants, the plans, the block kernels and the sentinel's reference all read that value. A window
has one encoding, :class:`Band`:

* ``Band(left, right)`` — key ``j`` is seen by query ``i`` iff ``-left <= j - d(i) <= right`` (``-1``: unbounded),
  where ``d(i)`` is the query's diagonal: its own position for a whole sequence; for a block of ``n_q`` queries
  against ``n_k`` keys the bottom-right-aligned one, ``i + n_k - n_q`` (flash-attention's convention). A
  :class:`Band` is a ``(left, right)`` tuple, so ``left, right = band`` and ``band == (255, 0)`` work.
* :meth:`Band.of` folds a causal mask into a band (``right`` 0); :meth:`Band.effective` drops the sides a window
  cannot reach in sequences of a given length (``None``: the window restricts nothing).

Example::

    mods = Mods.checked(window=(4095, 0), softcap=50.0, sinks=None, heads=32, device=q.device)
    band = mods.band(causal=True, longest=16384)        # Band(left=4095, right=0); None for 2k-token documents
    Band.of(True, None)                                   # Band(left=-1, right=0): the causal mask
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from ._inputs import check_sinks, check_softcap, check_window

__all__ = ["Band", "Mods"]


class Band(NamedTuple):
    """Keys seen around a query's diagonal: ``-left <= j - d(i) <= right``; ``-1`` is an unbounded side."""

    left: int
    right: int

    @staticmethod
    def of(causal: bool, window: Optional[tuple[int, int]]) -> Optional["Band"]:
        """The mask of ``causal`` and ``window`` together, or ``None`` when no key is masked by position.

        Example::

            Band.of(True, (255, 7))     # Band(left=255, right=0)
            Band.of(False, None)        # None
        """
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0 if right == -1 else min(right, 0)
        if left == -1 and right == -1:
            return None
        return Band(int(left), int(right))

    @staticmethod
    def effective(window: Optional[tuple[int, int]], causal: bool, longest: int) -> Optional["Band"]:
        """The window as it restricts sequences of at most ``longest`` tokens: a side reaching past every sequence
        is unbounded, the right side is 0 under ``causal``; ``None`` when nothing is left to restrict.

        Example::

            Band.effective((4096, 0), True, 2048)    # None: every document is shorter than the window
            Band.effective((255, 7), True, 8192)     # Band(left=255, right=0)
        """
        if window is None:
            return None
        left, right = window
        if left >= longest - 1:
            left = -1
        if causal:
            right = 0
        elif right >= longest - 1:
            right = -1
        if left == -1 and (causal or right == -1):
            return None
        return Band(left, right)

    def masked_prefix(self, n_q: int, n_k: int) -> int:
        """How many leading query rows of an ``n_q x n_k`` block see no key at all (only rows before the diagonal's
        start can: row ``i`` sees nothing iff ``i + n_k - n_q + right < 0``)."""
        if n_k == 0:
            return n_q
        if self.right == -1:
            return 0
        return max(0, min(n_q, n_q - n_k - self.right))

    def bounds(self, n_q: int, n_k: int) -> tuple[int, int]:
        """``(lo, hi)``: key ``j`` of query ``i`` is seen iff ``lo <= j - i <= hi`` (an unbounded side's value is
        meaningless and unused)."""
        shift = n_k - n_q
        return shift - self.left, shift + self.right

    def top_left(self, shift: int) -> "Band":
        """The same band relative to the top-left diagonal (``j - i``) of a block whose bottom-right diagonal lies
        ``shift = n_k - n_q`` to its right."""
        return Band(-1 if self.left == -1 else self.left - shift, -1 if self.right == -1 else self.right + shift)


@dataclass(frozen=True, eq=False)
class Mods:
    """The score features of one call: ``window`` (a :class:`Band` relative to each query's position), ``softcap``
    (scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before masking) and ``sinks`` (``[h]``: one logit
    per q head in every softmax denominator, no value). ``Mods()`` is plain attention."""

    window: Optional[Band] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None

    @classmethod
    def checked(cls, window: Any = None, softcap: Any = None, sinks: Any = None, *, heads: int,
                device: torch.device) -> "Mods":
        """The validated features (``ValueError`` naming the values, before any collective or kernel)."""
        w = check_window(window)
        return cls(None if w is None else Band(*w), check_softcap(softcap), check_sinks(sinks, heads, device))

    @property
    def plain(self) -> bool:
        """No window, no softcap, no sinks: plain attention."""
        return self.window is None and self.softcap is None and self.sinks is None

    def band(self, causal: bool, longest: int) -> Optional[Band]:
        """The window as it restricts sequences of at most ``longest`` tokens (:meth:`Band.effective`)."""
        return Band.effective(self.window, causal, longest)

    def within(self, causal: bool, longest: int) -> "Mods":
        """The same features with the window as it restricts sequences of at most ``longest`` tokens
        (:meth:`band`): what the variants, plans and kernels run (no validation: these features were checked)."""
        band = self.band(causal, longest)
        return self if band == self.window else Mods(band, self.softcap, self.sinks)

    def detached(self) -> "Mods":
        """The same features with the sinks detached from autograd (what a reference reads)."""
        return self if self.sinks is None else Mods(self.window, self.softcap, self.sinks.detach())
