"""The examples' self-check: a microbatch run under CP vs. the same documents run without CP in this process.

After a microbatch's ``loss_sum.backward()``, :func:`check_microbatch` sums the loss and this microbatch's share of
every parameter gradient over the microbatch's CP group, runs the same documents unsharded at CP1 on the same model
(``torch.autograd.grad``, so the accumulated ``.grad`` is left alone) and raises ``RuntimeError`` on a mismatch.

Example::

    before = grad_snapshot(model)
    with cpscope.runtime_cp(group):
        loss_sum = token_loss_sum(model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen), mb.labels)
    loss_sum.backward()
    line = check_microbatch(model, docs, group, loss_sum, before)   # "loss ... vs no-CP ...; grads ... OK"
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

import cpscope
from cpscope.train import prepare_microbatch, token_loss_sum

__all__ = ["LOSS_RTOL", "GRAD_RTOL", "grad_snapshot", "check_microbatch"]

LOSS_RTOL = 1e-5  # fp32: ring vs. full attention and per-rank partial sums round differently
GRAD_RTOL = 1e-5  # per parameter tensor, relative (norm of the difference / norm of the reference)


def grad_snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of every parameter's ``.grad`` (zeros where there is none yet), in ``model.parameters()`` order."""
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def check_microbatch(
    model: torch.nn.Module,
    docs: Sequence[torch.Tensor],
    group: Any,
    loss_sum: torch.Tensor,
    grads_before: list[torch.Tensor],
) -> str:
    """Compare one microbatch (after its backward) with the same ``docs`` run without CP; raise on a mismatch.

    Collective over ``group`` (``None``: CP1, nothing to reduce): every member must call it for the microbatch.
    Returns a one-line summary.
    """
    params = list(model.parameters())
    delta = [(p.grad if p.grad is not None else torch.zeros_like(p)) - b for p, b in zip(params, grads_before)]
    flat = torch.cat([torch.cat([g.reshape(-1) for g in delta]), loss_sum.detach().reshape(1)]).double()
    if group is not None:  # group=None is CP1 for cpscope but "the world" for torch.distributed: no reduction
        dist.all_reduce(flat, group=group)
    group_loss = flat[-1].item()
    sizes = [p.numel() for p in params]
    group_grads = [g.view_as(p) for g, p in zip(flat[:-1].split(sizes), params)]

    ref = prepare_microbatch(list(docs), cp=1, group=None)
    with cpscope.runtime_cp(None):  # CP1, whatever is bound around the call
        ref_loss_t = token_loss_sum(
            model(ref.input_ids, cu_seqlens=ref.cu_seqlens, max_seqlen=ref.max_seqlen), ref.labels
        )
    ref_grads = torch.autograd.grad(ref_loss_t, params, allow_unused=True)
    ref_loss = ref_loss_t.item()

    where = f"rank {dist.get_rank() if dist.is_initialized() else 0}, CP{1 if group is None else group.size()}"
    if not abs(group_loss - ref_loss) <= LOSS_RTOL * abs(ref_loss):
        raise RuntimeError(f"{where}: group loss {group_loss} != no-CP loss {ref_loss} (rtol {LOSS_RTOL})")
    worst, worst_name = 0.0, ""
    for (name, p), got, want in zip(model.named_parameters(), group_grads, ref_grads):
        want = torch.zeros_like(p) if want is None else want
        err = float((got - want.double()).norm() / want.double().norm().clamp_min(1e-30))
        if not err <= GRAD_RTOL:
            raise RuntimeError(f"{where}: gradient of {name} differs from the no-CP run: relative error {err:.3g} "
                               f"> {GRAD_RTOL}")
        if err >= worst:
            worst, worst_name = err, name
    return f"loss {group_loss:.4f} vs no-CP {ref_loss:.4f}, worst gradient rel. err {worst:.1e} ({worst_name}) OK"
