"""Example 2 — a decorated forward: ``@runtime_cp(group)`` and ``runtime_cp(group)(model.forward)``.

Two ranks. ``runtime_cp`` is a decorator as well as a context manager; each call binds afresh and restores the
previous binding when it returns (or raises), so a decorated forward can be reused microbatch after microbatch.

* ``forward_cp2`` is decorated once, at definition time, with the CP2 group: every call runs at CP2.
* For a per-microbatch choice, wrap the bound method on the fly: ``runtime_cp(groups[mb.cp])(model.forward)``.

Each microbatch is checked (``_check.check_microbatch``): the group's summed loss and gradients must equal the same
documents run without CP in the same process; a mismatch raises ``RuntimeError``.

Run::

    python examples/decorated_forward.py                   # spawns 2 gloo ranks
    torchrun --nproc_per_node=2 examples/decorated_forward.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import cpscope  # noqa: E402
from cpscope.train import prepare_microbatch, token_loss_sum  # noqa: E402
from _check import check_microbatch, grad_snapshot  # noqa: E402
from _launch import launch, print_rank_reports  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    rank = dist.get_rank()
    groups = cpscope.new_cp_groups([1, 2])  # {1: None, 2: <both ranks>}
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, hidden=32, n_layers=2, n_heads=4))
    docs = [torch.randint(128, (n,)) for n in (120, 33, 50, 7)]
    lines = []

    @cpscope.runtime_cp(groups[2])
    def forward_cp2(ids: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
        lines.append(f"  forward_cp2 runs with cp_size()={cpscope.cp_size()}, cp_rank()={cpscope.cp_rank()}")
        return model(ids, cu_seqlens=cu, max_seqlen=max_len)

    # 1) A function decorated once with the CP2 group: both ranks hold half of document 0.
    mb = prepare_microbatch([docs[0]], cp=2, group=groups[2])
    before = grad_snapshot(model)
    loss = token_loss_sum(forward_cp2(mb.input_ids, mb.cu_seqlens, mb.max_seqlen), mb.labels)
    loss.backward()
    lines.append(f"  after the call: cp_size()={cpscope.cp_size()} (the binding ended with the call)")
    if cpscope.cp_size() != 1:
        raise RuntimeError(f"rank {rank}: cp_size()={cpscope.cp_size()} after the decorated call, expected 1")
    lines.append(f"  CP2 doc 0, summed over the pair: {check_microbatch(model, [docs[0]], groups[2], loss, before)}")

    # 2) Per microbatch: wrap model.forward with the microbatch's group. Doc 1 at CP2; then one CP1 doc per rank.
    schedule = [(2, (1,)), (1, (2,) if rank == 0 else (3,))]
    for cp, ids in schedule:
        mb = prepare_microbatch([docs[i] for i in ids], cp=cp, group=groups[cp])
        fwd = cpscope.runtime_cp(groups[cp])(model.forward)  # binds only while fwd runs
        before = grad_snapshot(model)
        logits = fwd(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)
        loss = token_loss_sum(logits, mb.labels)
        loss.backward()
        lines.append(f"  runtime_cp(groups[{cp}])(model.forward) on docs {list(ids)}: {mb.input_ids.numel()} local "
                     f"tokens of {int(mb.cu_seqlens[-1])}; cp_size() afterwards = {cpscope.cp_size()}")
        lines.append(f"    {check_microbatch(model, [docs[i] for i in ids], groups[cp], loss, before)}")
    if cpscope.cp_size() != 1:
        raise RuntimeError(f"rank {rank}: cp_size()={cpscope.cp_size()} outside every scope, expected 1")

    print_rank_reports(lines)  # gathered, printed by rank 0


if __name__ == "__main__":
    launch(main, 2)
