"""A stand-in attention for the calibration machinery (tests, dry runs): the ring for every variant."""
from __future__ import annotations

from typing import Any

import torch

from cpscope._variants import check_variants, split_comm

__all__ = ["ring_stand_in"]


def ring_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: str, **kwargs: Any) -> torch.Tensor:
    """A stand-in for ``context_parallel_attention(..., comm=...)`` that runs **the ring for every variant**.

    Only for exercising the calibration machinery before the variants exist (tests, dry runs); a model
    calibrated with it says so in ``meta["stand_in"]`` and its variants all time the ring.
    """
    from cpscope.attention import context_parallel_attention

    check_variants([split_comm(comm)[0]])
    return context_parallel_attention(q, k, v, **kwargs)


ring_stand_in.stand_in = True  # type: ignore[attr-defined]  # calibrate records meta["stand_in"]
