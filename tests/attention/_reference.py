"""Independent references for the attention tests: plain float64 softmax(QK^T)V and zigzag index math.

Nothing here imports cpscope: the references must not share code with what they check.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def zigzag_index(cu: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Full-tensor indices of rank ``rank``'s tokens: per document, chunk ``rank`` then chunk ``2cp-1-rank``."""
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(a + chunk * c, a + (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, cu: Optional[Sequence[int]] = None,
    scale: Optional[float] = None, window: Optional[tuple[int, int]] = None, sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None, positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float64 attention on ``[t, h, d]`` (one sequence, or documents ``cu``), k/v heads repeated for GQA.

    ``positions``: each token's position in its document (default: counted from the document's start). A query at
    position ``i`` sees the keys of its document at positions ``j`` with ``j <= i`` (causal) and
    ``i - left <= j <= i + right`` (``window``, ``-1`` unbounded); ``softcap`` caps the scaled scores
    (``c * tanh(s / c)``) before masking; ``sinks`` ``[h]`` add one logit per head to every softmax denominator
    (not capped, no value). ``v`` may have its own head dim. Rows that see nothing are 0.
    """
    t, h, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cu = [0, t] if cu is None else list(cu)
    doc = torch.zeros(t, dtype=torch.long, device=q.device)
    pos = torch.zeros(t, dtype=torch.long, device=q.device)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = i
        pos[a:b] = torch.arange(b - a, device=q.device)
    if positions is not None:
        pos = positions.to(q.device)
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        left, right = window
        if left != -1:
            allowed &= pos[None, :] >= pos[:, None] - left
        if right != -1:
            allowed &= pos[None, :] <= pos[:, None] + right
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # one more column per head: the sink's logit, whose value is 0
        s = torch.cat([s, sinks.double()[:, None, None].expand(h, t, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :t]
    return torch.einsum("hqk,khd->qhd", p, v.double())
