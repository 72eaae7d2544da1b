"""The CP group registry: rank order, creation at scale, hierarchical groups, stale entries.

Layers: the block planning is pure (no process group); the creation engine runs against a fake dist layer
(call counts at 4096 simulated ranks); the rest runs on the 4-rank (and 2-rank) gloo pool. Every numerical check
compares ring attention with a float64 full-sequence reference cut at the rank that torch gives this rank inside
its group (``dist.get_rank(group)``), forward and dq/dk/dv.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope import groups as G
from cpscope._group_blocks import hierarchical_blocks, pad_schedule, plan_cp_blocks
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

# ---------------------------------------------------------------------------------------------------------------
# Pure planning


def test_blocks_are_aligned_and_each_ascends():
    p = plan_cp_blocks([1, 2, 4], [2, 3, 0, 1], world=4)
    assert p.blocks[2] == ((2, 3), (0, 1)) and p.blocks[4] == ((0, 1, 2, 3),)
    assert p.reordered == ((2, 3, 0, 1),)  # the caller's size-4 block, which the group orders ascending
    assert p.block_of(0, 2) == (0, 1) and p.block_of(3, 4) == (0, 1, 2, 3) and p.block_of(0, 1) == (0,)
    q = plan_cp_blocks([2, 4], [0, 4, 1, 5, 2, 6, 3, 7], world=8)  # cross-node interleaving
    assert q.blocks[2] == ((0, 4), (1, 5), (2, 6), (3, 7)) and q.blocks[4] == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert q.steps() == [q.blocks[2], q.blocks[4]]
    assert plan_cp_blocks([2, 1, 2], None, world=2).sizes == (2, 1)  # de-duplicated, caller's order
    assert plan_cp_blocks([2], [5, 1], world=8).block_of(0, 2) is None  # not in the ranks split


@pytest.mark.parametrize(
    "sizes,ranks,world,match",
    [
        ([2, 3], None, 4, r"CP sizes \[3\] do not divide the 4 ranks"),
        ([0], None, 4, r"CP sizes \[0\]"),
        ([2], [0, 0], 4, r"distinct global ranks in \[0, 4\), got \[0, 0\]"),
        ([2], [0, 4], 4, r"distinct global ranks in \[0, 4\), got \[0, 4\]"),
        ([2], [], 4, "ranks is empty"),
        ([2.0], None, 4, "must be an int, got float 2.0"),
        ([True], None, 4, "must be an int, got bool"),
        ([2], ["0", "1"], 4, "must be an int, got str"),
    ],
)
def test_bad_arguments_raise_value_errors_that_name_them(sizes, ranks, world, match):
    with pytest.raises(ValueError, match=match):
        plan_cp_blocks(sizes, ranks, world=world)


def test_hierarchical_blocks_orders():
    inner, outer = hierarchical_blocks([1, 3, 5, 7, 9, 11], 2)  # CP ranks 0..5 are global ranks 1, 3, ..., 11
    assert inner == ((1, 3), (5, 7), (9, 11))  # consecutive CP ranks; inner rank = cp_rank % 2
    assert outer == ((1, 5, 9), (3, 7, 11))  # same inner index; outer rank = cp_rank // 2
    with pytest.raises(ValueError, match=r"inner_size 4 does not divide the CP size 6"):
        hierarchical_blocks([1, 3, 5, 7, 9, 11], 4)
    with pytest.raises(ValueError, match=r"must ascend.*got \[3, 1\]"):
        hierarchical_blocks([3, 1], 1)


def test_pad_schedule_aligns_the_members_of_every_block():
    # ranks 0, 1 have 3 torch groups, ranks 2, 3 have 2 (say rank 0, 1 made a pair group of their own)
    counts = {0: 3, 1: 3, 2: 2, 3: 2}
    steps = [((0, 1), (2, 3)), ((0, 1, 2, 3),)]
    pads = pad_schedule(steps, counts)
    assert pads == [{}, {2: 1, 3: 1}]  # pairs agree already; before the 4-block, 2 and 3 catch up by one
    # a block already cached (not created) at step 0 on ranks 2, 3: they are behind by 2 before step 1
    assert pad_schedule([((0, 1),), ((0, 1, 2, 3),)], {0: 2, 1: 2, 2: 2, 3: 2}) == [{}, {2: 1, 3: 1}]


# ---------------------------------------------------------------------------------------------------------------
# Ring attention on permuted / interleaved rank lists (issue #13.1): rows and dq/dk/dv against float64


def _ring_check(group, fmt: str, seed: int) -> float:
    """Ring attention under ``runtime_cp(group)`` vs the float64 reference cut at torch's rank in ``group``."""
    cp, r = group.size(), dist.get_rank(group)
    me = dist.get_rank()
    assert cpscope.group_ranks(group) == dist.get_process_group_ranks(group)  # the real member order
    with cpscope.runtime_cp(group):
        assert cpscope.cp_rank() == r == cpscope.group_ranks(group).index(me)
    h, h_kv, d = 4, 2, 8
    cu = [0, 4 * cp, 10 * cp] if fmt == "thd" else [0, 8 * cp]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(cu[-1], h, d, generator=g, dtype=torch.float64)
    k = torch.randn(cu[-1], h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(cu[-1], h_kv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(cu[-1], h, d, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*full, causal=True, cu=cu if fmt == "thd" else None)
    ref.backward(dout)
    idx = zigzag_index(cu, cp, r)
    loc = [t[idx].clone().requires_grad_(True) for t in (q, k, v)]
    kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if fmt == "thd" else {}
    args = loc if fmt == "thd" else [t.unsqueeze(0) for t in loc]
    with cpscope.runtime_cp(group):
        out = cpscope.context_parallel_attention(*args, qkv_format=fmt, causal=True, **kw)
    out = out.reshape(idx.numel(), h, d)
    out.backward(dout[idx])  # outside the scope, as in training
    worst = 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc)),
                               (ref, *(t.grad for t in full))):
        err = (got - want[idx]).abs().max().item()
        assert err <= 1e-10, f"{name}: max abs err {err:.3g} ({fmt}, cp={cp}, cp rank {r}, global rank {me})"
        worst = max(worst, err)
    return worst


def _permuted_ring(ranks: list[int], sizes: list[int]) -> dict:
    cpscope.set_debug_autograd_reads(True)
    got = cpscope.new_cp_groups(sizes, ranks=ranks)
    me = dist.get_rank()
    for s in sizes:
        if s == 1:
            assert got[1] is None
            continue
        members = cpscope.group_ranks(got[s])
        assert members == sorted(members) and me in members  # documented: ascending global ranks
        for i, fmt in enumerate(("bshd", "thd")):
            _ring_check(got[s], fmt, seed=10 * s + i)
    return {s: cpscope.group_ranks(g) if g is not None else None for s, g in got.items()}


@pytest.mark.parametrize("ranks", [[2, 3, 0, 1], [3, 1, 2, 0], [0, 2, 1, 3]], ids=["blocks-swapped", "shuffled",
                                                                                 "interleaved"])
def test_ring_on_permuted_rank_lists_equals_reference(ranks):
    out = run_ranks(4, _permuted_ring, ranks, [1, 2, 4])
    for me, got in enumerate(out):
        pos = ranks.index(me)
        assert got[2] == sorted(ranks[pos - pos % 2: pos - pos % 2 + 2])
        assert got[4] == [0, 1, 2, 3]


def test_ring_on_two_ranks_listed_backwards():
    # ranks=[1, 0]: with the caller's order kept, each rank's ring "next" was itself (gloo fails, NCCL wrong)
    assert run_ranks(2, _permuted_ring, [1, 0], [2]) == [{2: [0, 1]}] * 2


def _cross_node_interleaving():
    # 4 ranks as 2 "nodes" of 2: [0, 2, 1, 3] keeps CP2 across nodes; CP4 is everything, ascending
    return _permuted_ring([0, 2, 1, 3], [2, 4])


def test_cross_node_interleaving_pairs_across_nodes():
    out = run_ranks(4, _cross_node_interleaving)
    assert [o[2] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _te_ranks_follow_torch():
    got = cpscope.new_cp_groups([4], ranks=[2, 3, 0, 1])[4]
    # what the TE adapter passes as cp_global_ranks: index i is the rank TE's CP rank i talks to
    ranks = cpscope.group_ranks(got)
    return [dist.get_global_rank(got, i) for i in range(4)] == ranks


def test_te_global_ranks_follow_the_group_rank_order():
    assert run_ranks(4, _te_ranks_follow_torch) == [True] * 4


# ---------------------------------------------------------------------------------------------------------------
# The hybrid loop's plan / group check with a permuted rank list


def _loop_on_permuted_ranks():
    from cpscope.hybrid import Microbatch
    from cpscope.hybrid.loop import prepare_microbatches

    cpscope.set_debug_autograd_reads(True)
    ranks = [2, 3, 0, 1]
    groups = cpscope.new_cp_groups([1, 2, 4], ranks=ranks)
    me = dist.get_rank()
    pos = ranks.index(me)  # this rank's position in the planned rank list
    doc = torch.arange(40)
    # CP4 over all positions, then CP2 over this rank's block of positions
    planned = [Microbatch(4, 0, (0,), 10, 0.0), Microbatch(2, pos // 2, (0,), 20, 0.0)]
    mbs = prepare_microbatches(planned, [doc], groups, ranks=ranks)
    gathered = []
    for mb in mbs:  # each group's local parts put back together are the whole padded document
        full = cpscope.zigzag_unshard(mb.input_ids, seq_dim=0, cu_seqlens=mb.cu_seqlens, group=mb.group)
        gathered.append(torch.equal(full[:40], doc))
    # a plan for the wrong block of positions fails before any collective
    with pytest.raises(ValueError, match=r"planned on global ranks"):
        prepare_microbatches([Microbatch(2, 1 - pos // 2, (0,), 20, 0.0)], [doc], groups, ranks=ranks)
    return gathered


def test_loop_accepts_groups_over_a_permuted_rank_list():
    assert run_ranks(4, _loop_on_permuted_ranks) == [[True, True]] * 4
