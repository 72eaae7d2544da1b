"""What a sentinel was asked to check, validated once: :class:`Options`.

Example::

    opts = Options.make(every=100, on_mismatch="log")
    opts.tolerance(torch.bfloat16, grad=True)            # 0.1
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from .comm import DEFAULT_TIMEOUT_S
from .report import Mismatch, tolerance

__all__ = ["Options", "POLICIES"]

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
