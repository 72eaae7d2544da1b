"""Example 1 — a wrapped microbatch loop: ``for mb in microbatches: with runtime_cp(groups[mb.cp]): ...``

Four ranks, one step. The microbatches mix CP sizes: a long document at CP4 (all ranks), two at CP2 (ranks 0-1 and
2-3), short ones at CP1 (each rank its own). Every rank runs its list in order — CP size descending, so the
members of a group arrive at its microbatches together — binding the group around the forward only. For each
microbatch the group's summed loss and gradients are checked against the same documents run without CP in the same
process (``_check.check_microbatch``); a mismatch raises ``RuntimeError``.

Run::

    python examples/microbatch_loop.py                     # spawns 4 gloo ranks
    torchrun --nproc_per_node=4 examples/microbatch_loop.py
"""
from __future__ import annotations

import sys
from pathlib import Path
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import cpscope  # noqa: E402
from cpscope.hybrid import Microbatch  # noqa: E402
from cpscope.train import prepare_microbatch, token_loss_sum  # noqa: E402
from _check import check_microbatch, grad_snapshot  # noqa: E402
from _launch import launch, print_rank_reports  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def _planned(cp: int, block: int, seqs: tuple[int, ...]) -> Microbatch:
    """A planned microbatch: documents ``seqs`` (indices into the global batch) on ranks ``block·cp … +cp-1``."""
    return Microbatch(cp=cp, block=block, seqs=seqs, tokens_per_rank=0, cost=0.0)


# Per rank, in execution order: what cpscope.hybrid.plan_hybrid would hand out (plan.microbatches_for_rank(rank)).
SCHEDULE = {
    0: [_planned(4, 0, (0,)), _planned(2, 0, (1,)), _planned(1, 0, (3, 4))],
    1: [_planned(4, 0, (0,)), _planned(2, 0, (1,)), _planned(1, 1, (5,))],
    2: [_planned(4, 0, (0,)), _planned(2, 1, (2,)), _planned(1, 2, (6,))],
    3: [_planned(4, 0, (0,)), _planned(2, 1, (2,)), _planned(1, 3, (7, 8))],
}
LENGTHS = [203, 96, 77, 30, 12, 41, 25, 18, 9]


def main() -> None:
    rank = dist.get_rank()
    groups = cpscope.new_cp_groups([1, 2, 4])  # collective, once: {1: None, 2: <pair>, 4: <all>}
    torch.manual_seed(0)  # same weights and data on every rank
    model = GPT(GPTConfig(vocab_size=128, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2))
    docs = [torch.randint(128, (n,)) for n in LENGTHS]

    lines = []
    for mb in SCHEDULE[rank]:
        group = groups[mb.cp]
        assert dist.get_rank() in mb.ranks  # the planned block of ranks holds this rank
        local = prepare_microbatch([docs[i] for i in mb.seqs], cp=mb.cp, group=group)  # pack, pad, shard
        before = grad_snapshot(model)  # for the check below
        with cpscope.runtime_cp(group):  # RoPE and attention inside the model read this group
            seen = (cpscope.cp_size(), cpscope.cp_rank())
            logits = model(local.input_ids, cu_seqlens=local.cu_seqlens, max_seqlen=local.max_seqlen)
            loss_sum = token_loss_sum(logits, local.labels)
        loss_sum.backward()  # outside the scope: the attention kept its group from forward
        # Check: the group's summed loss and gradients equal the same documents without CP (raises if not).
        result = check_microbatch(model, [docs[i] for i in mb.seqs], group, loss_sum, before)
        lines.append(
            f"  bound CP{seen[0]} (cp rank {seen[1]}) for docs {list(mb.seqs)}: {local.input_ids.numel()} local "
            f"tokens of {int(local.cu_seqlens[-1])}, group {result}"
        )
    assert cpscope.cp_size() == 1  # outside every scope: back to the build-time group (CP1)

    print_rank_reports(lines)  # gathered, printed by rank 0


if __name__ == "__main__":
    launch(main, 4)
