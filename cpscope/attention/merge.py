"""Log-sum-exp merging of partial attention outputs.

Attention over the union of two key sets is the lse-weighted mix of the attention over each set::

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

computed in fp32 (fp64 for fp64 inputs) with ``torch.logaddexp`` (``max + log1p(exp(-|a - b|))``). A row that
saw no key in one block has ``lse = -inf`` there and gets weight 0 from it; a row that saw no key at all keeps
``lse = -inf`` and ``out = 0``; no NaN either way.

Example::

    out, lse = block_forward(q, k0, v0, ...)
    out2, lse2 = block_forward(q, k1, v1, ...)
    merge_into(out_acc, lse_acc, out2, lse2)       # out_acc/lse_acc updated in place

The ring merges through :func:`cpscope.attention._fused.merge_rows_` (one fused pass on CUDA, also over a subset of
the accumulators' rows); :func:`merge_into` is its all-rows form.
"""
from __future__ import annotations

import torch

from ._fused import merge_rows_

__all__ = ["merge_into", "merged"]


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(merged lse, weight of a, weight of b); weights shaped ``[..., s, h, 1]`` to scale outputs."""
    a, b = lse_a, lse_b.to(lse_a.dtype)
    lse = torch.logaddexp(a, b)  # max + log1p(exp(-|a - b|)); -inf when both are -inf (no NaN)
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
    wa = torch.exp(a - lse_safe).transpose(-1, -2).unsqueeze(-1)
    wb = torch.exp(b - lse_safe).transpose(-1, -2).unsqueeze(-1)
    return lse, wa, wb


def merged(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results. ``out_*`` ``[..., s, h, d]``, ``lse_*`` ``[..., h, s]`` (dense or varlen).

    Returns ``(out, lse)`` in the accumulation dtype of ``lse_a`` (fp32 or fp64).
    """
    lse, wa, wb = _weights(lse_a, lse_b)
    # one pass each: out_a upcast and scaled into a buffer with out_a's strides (as `out_a.to(dtype)` would have), and
    # addcmul_ upcasting out_b in-kernel
    res = torch.mul(out_a, wa, out=torch.empty_like(out_a, dtype=torch.promote_types(out_a.dtype, lse_a.dtype)))
    return res.addcmul_(out_b, wb), lse


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In-place :func:`merged` into the accumulators (which may be views, e.g. the second half of a sequence).

    ``out_acc`` may be in a low-precision dtype: the math runs in fp32 (fp64) and rounds once
    (:func:`~cpscope.attention._fused.merge_rows_` over all rows).
    """
    merge_rows_(out_acc, lse_acc, out_b, lse_b)
