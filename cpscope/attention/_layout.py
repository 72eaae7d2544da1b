"""The packed form the collective variants compute on, from and back to the caller's layout.

Every collective variant (all-gather, all-to-all, hierarchical) works on ``[t, h, d]`` tensors holding whole
zigzag-sharded sequences one after the other, described by *global* offsets ``cu`` (``thd``: the documents;
``bshd`` / ``sbhd``: ``b`` rows of global length ``S``, so ``cu = (0, S, 2S, ...)`` and ``q.reshape(b * s, h, d)`` is
a view). :func:`packed` / :func:`unpacked` convert; :class:`Packed` records how.

Example::

    qp, kp, vp, how = packed(q, k, v, qkv_format="bshd", cu=None, cp=scope.size)   # [b * s, h, d] views
    out = unpacked(out_packed, how)                                                # back to [b, s, h, d]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Packed", "packed", "unpacked"]


@dataclass(frozen=True)
class Packed:
    """How a layout was packed: ``fmt``, ``rows`` (dense batch rows; None for thd) and the packed ``cu``."""

    fmt: str
    rows: Optional[int]
    cu: tuple[int, ...]


def packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qkv_format: str, cu: Optional[tuple[int, ...]], cp: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Packed]:
    """q/k/v of any layout as packed ``[t, h, d]`` (views for contiguous ``bshd`` / ``thd``; ``sbhd`` is copied).

    ``cu`` is the validated global ``cu_seqlens`` for ``thd`` (else ignored); ``cp`` the CP size the local tensors
    are sharded over.
    """
    if qkv_format == "thd":
        assert cu is not None
        return q, k, v, Packed("thd", None, tuple(cu))
    if qkv_format == "sbhd":  # [s, b, h, d] -> [b, s, h, d]
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    b, s = q.shape[:2]
    g = s * cp  # global length of every row
    flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
    return flat[0], flat[1], flat[2], Packed(qkv_format, b, tuple(range(0, b * g + 1, g)))


def unpacked(out: torch.Tensor, how: Packed) -> torch.Tensor:
    """Inverse of :func:`packed` for the output: ``[t, h, d]`` back to the caller's layout."""
    if how.rows is None:
        return out
    x = out.view(how.rows, out.shape[0] // how.rows, *out.shape[1:])
    return x.transpose(0, 1).contiguous() if how.fmt == "sbhd" else x
