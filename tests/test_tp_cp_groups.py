"""The registry's groups for tensor parallelism beside runtime CP (:mod:`cpscope.groups._tp_cp`).

Pure block plans against a direct enumeration of Megatron's rank order (TP fastest); on gloo (4 ranks TP2 × CP1/2,
6 ranks TP2 × CP1/3) each group's members and an all-reduce over it, the lookup without communication, the cache
(a second call creates nothing) and the refusals.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpscope.groups import group_ranks, lookup_tp_cp, new_cp_groups, new_tp_cp_groups
from cpscope.groups._tp_cp import plan_tp_cp_blocks
from tests.distributed import run_ranks


def _expected(rank: int, world: int, tp: int, cp: int) -> tuple[list[int], list[int]]:
    """Megatron's order: rank = tp_rank + tp * position; a CP-cp block holds positions [b·cp, (b+1)·cp)."""
    t, pos = rank % tp, rank // tp
    b = pos // cp
    return [t + tp * p for p in range(b * cp, (b + 1) * cp)], list(range(b * cp * tp, (b + 1) * cp * tp))


@pytest.mark.parametrize("world,tp", [(4, 2), (8, 2), (8, 4), (12, 2), (12, 3), (6, 1)])
def test_plan_matches_megatron_order(world, tp):
    positions = world // tp
    sizes = [d for d in range(1, positions + 1) if positions % d == 0]
    plan = plan_tp_cp_blocks(sizes, tp, None, world=world)
    for s in sizes:
        for r in range(world):
            cp, tp_cp = _expected(r, world, tp, s)
            assert list(plan.block_of(r, plan.cp[s])) == cp and list(plan.block_of(r, plan.tp_cp[s])) == tp_cp
        assert sorted(r for b in plan.cp[s] for r in b) == list(range(world))  # a partition
    assert plan.domain == tuple(range(world))


def test_plan_refusals_name_the_values():
    with pytest.raises(ValueError, match="tp_size 3 does not divide the 4 ranks"):
        plan_tp_cp_blocks([1], 3, None, world=4)
    with pytest.raises(ValueError, match=r"CP sizes \[4\] do not divide the 2 DP×CP positions.*\[1, 2\]"):
        plan_tp_cp_blocks([1, 4], 2, None, world=4)
    with pytest.raises(ValueError, match="tp_size must be an int"):
        plan_tp_cp_blocks([1], 2.0, None, world=4)
    with pytest.raises(ValueError, match="distinct global ranks"):
        plan_tp_cp_blocks([1], 2, [0, 0, 1, 2], world=4)


def _check(tp: int, sizes: list[int]) -> int:
    import cpscope.groups._registry as reg

    world, me = dist.get_world_size(), dist.get_rank()
    got = new_tp_cp_groups(sizes, tp_size=tp)
    tp_ranks = [me - me % tp + t for t in range(tp)]
    for s in sizes:
        cp, tp_cp = _expected(me, world, tp, s)
        g = got[s]
        assert group_ranks(g.cp) == (cp if s > 1 else [me])
        assert (g.cp is None) == (s == 1) and (g.tp_cp is None) == (s * tp == 1)
        assert group_ranks(g.tp_cp) == (tp_cp if s * tp > 1 else [me])
        assert group_ranks(g.tp_dp_cp) == list(range(world))
        for group, members in ((g.cp, cp), (g.tp_cp, tp_cp)):
            if group is not None:  # the group communicates among exactly those ranks
                x = torch.tensor([float(2 ** me)])
                dist.all_reduce(x, group=group)
                assert int(x) == sum(2 ** r for r in members)
        assert lookup_tp_cp(g.cp, tp_ranks=tp_ranks) is g.tp_cp  # no collective: a lookup
    report = reg._LAST_REPORT
    again = new_tp_cp_groups(sizes, tp_size=tp)  # cached: no collective, same groups
    assert reg._LAST_REPORT is report and all(again[s] == got[s] for s in sizes)
    if tp > 1:  # a CP group across the TP ranks is refused by the lookup
        with pytest.raises(ValueError, match="holds ranks .* of this rank's TP group"):
            lookup_tp_cp(new_cp_groups([tp])[tp], tp_ranks=tp_ranks)
    assert lookup_tp_cp(got[sizes[-1]].cp, tp_ranks=[me]) is None  # a TP group never registered: not made here
    return report.created


def test_tp2_cp_groups_on_4_ranks():
    created = run_ranks(4, _check, 2, [1, 2])
    # CP2 pair, [tp, cp] = domain (shared with tp_dp_cp), TP pair (CP1's [tp, cp]): 3 new groups on a fresh pool;
    # fewer where an earlier test on the same pool of ranks made some already (the registry shares blocks)
    assert len(set(created)) == 1 and 0 <= created[0] <= 3, created


def test_tp2_cp3_groups_on_6_ranks():
    run_ranks(6, _check, 2, [1, 3])


def _same_as_new_cp_groups() -> bool:
    a = new_cp_groups([1, 2, 4])
    b = new_tp_cp_groups([1, 2, 4], tp_size=1)
    return all(b[s].cp is a[s] and b[s].tp_cp is a[s] for s in (1, 2, 4)) and b[4].tp_dp_cp is a[4]


def test_tp1_shares_new_cp_groups():
    assert all(run_ranks(4, _same_as_new_cp_groups))


def test_simulated_4096_ranks_each_rank_creates_only_its_own_groups():
    """One rank of 4096 at TP8, every divisor of the 512 positions as a CP size (10): it creates its CP group of
    each size > 1 (9) and its [tp, cp] group of each size (10, the largest being the domain) — 19 calls, each
    among the members only, none in lockstep."""
    from cpscope.groups import clear_cp_group_cache
    from cpscope.groups import _registry as G
    from tests._sim import SimulatedLayer

    real, rank = G._LAYER, 2049
    G._LAYER = layer = SimulatedLayer(4096, rank)
    try:
        clear_cp_group_cache()
        sizes = [d for d in range(1, 513) if 512 % d == 0]
        got = new_tp_cp_groups(sizes, tp_size=8, method="local")
        made = [c for c in layer.calls if c[0] == "new_group"]
        assert len(made) == G._LAST_REPORT.created == 19 and G._LAST_REPORT.lockstep == 0
        assert all(rank in c[1] and c[2] for c in made)
        for s in sizes:
            cp, tp_cp = _expected(rank, 4096, 8, s)
            assert (got[s].cp is None and s == 1) or got[s].cp.ranks == cp
            assert got[s].tp_cp.ranks == tp_cp and got[s].tp_dp_cp.ranks == list(range(4096))
    finally:
        G._LAYER = real
        clear_cp_group_cache()


def test_benchmark_simulation_rows():
    """``benchmarks/bench_tp_cp_groups.py``'s simulated part runs and counts what the registry makes."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_tp_cp_groups

    rows = bench_tp_cp_groups.simulate([64], 8)  # 8 positions: CP sizes 1, 2, 4, 8
    assert [r["method"] for r in rows] == ["local", "split"]
    # per rank: CP groups of 2, 4, 8 (3) and [tp, cp] groups of 8, 16, 32, 64 ranks (4, the last the domain)
    assert all(r["created_per_rank"] == 7 and r["cp_sizes"] == 4 for r in rows)
    assert rows[0]["groups_in_job"] == 32 + 16 + 8 + 8 + 4 + 2 + 1  # CP 2/4/8 blocks, [tp, cp] 1/2/4/8 blocks
    assert rows[0]["lockstep"] == 0 and rows[1]["lockstep"] == 7


def _subset() -> list:
    """A domain of some ranks only (one pipeline stage): the others call too, and get nothing."""
    got = new_tp_cp_groups([1, 2], tp_size=1, ranks=[2, 3])
    return [] if not got else group_ranks(got[2].cp) + group_ranks(got[2].tp_dp_cp)


def test_a_domain_of_some_ranks():
    assert run_ranks(4, _subset) == [[], [], [2, 3, 2, 3], [2, 3, 2, 3]]
