"""The one collective of a recurrence under CP: a differentiable all-gather of small per-piece tensors.

Forward, every rank contributes its pieces' summaries (or short-convolution tails) and receives everyone's:
``[cp, *shape]``. Each rank then uses the entries of the chunks before its own, so in backward the gradient of rank
``j``'s entry is the **sum** over every rank of what that rank's use gave it: a reduce-scatter (NCCL), or an
all-reduce of the gathered gradient followed by taking one's own slot (gloo, which has no reduce-scatter). The group
is resolved in forward and kept on ``ctx``; backward never reads the active scope.

Why an all-gather rather than a ring prefix scan: the summaries are small (a state and a transition per piece) and an
all-gather is one collective with no dependency between ranks; a ring that passes states along the zigzag order
(0 → 1 → … → cp−1 → cp−1 → … → 0) sends fewer bytes but needs ``2·cp−1`` sequential hops, each waiting on the
previous rank. ``benchmarks/bench_linear_exchange.py`` counts both against the layout-converting all-to-all.

Example::

    gathered = all_gather_pieces(summary, scope)      # [cp, *summary.shape]; differentiable
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..scope import CPScope

__all__ = ["all_gather_pieces"]

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scope: CPScope) -> torch.Tensor:
        ctx.scope = scope  # resolved in forward; backward reads only this
        x = x.contiguous()
        out = torch.empty((scope.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _ALL_GATHER(out, x, group=scope.group)  # rank-major along dim 0
        return out.view(scope.size, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scope: CPScope = ctx.scope
        grad = grad.contiguous()
        if dist.get_backend(scope.group) == "gloo":
            total = grad.clone()
            dist.all_reduce(total, group=scope.group)
            return total[scope.rank].clone(), None
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        _REDUCE_SCATTER(out, grad.flatten(0, 1), group=scope.group)
        return out, None


def all_gather_pieces(x: torch.Tensor, scope: CPScope) -> torch.Tensor:
    """``[cp, *x.shape]``: every rank's ``x`` (at least 1-D; same shape and dtype on every rank), in CP rank order.

    Differentiable: the gradient of this rank's ``x`` is the sum over the ranks of the gradient of its slot. Under
    CP1 it is ``x[None]``.
    """
    if scope.size == 1:
        return x.unsqueeze(0)
    return _AllGather.apply(x, scope)
