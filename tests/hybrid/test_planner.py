"""Tests of the hybrid-CP planner: pure logic, no process group."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpscope.hybrid import (
    CostModel,
    Plan,
    cp_candidates,
    long_tail_lengths,
    lower_bound,
    padded_length,
    plan_greedy,
    plan_hybrid,
    plan_static,
)

CAPACITY = 16384
PLANNERS = (plan_hybrid, plan_static, plan_greedy)


def memory_min_cp(length: int, capacity: int) -> int:
    cp = 1
    while int(padded_length(length, cp)) // cp > capacity:
        cp *= 2
    return cp


def check_plan(plan: Plan, lengths, n_ranks: int, capacity: int, cost: CostModel) -> None:
    """Every invariant a plan must satisfy, asserted."""
    lengths = [int(x) for x in lengths]
    assert plan.n_ranks == n_ranks and plan.capacity == capacity and list(plan.lengths) == lengths
    # every sequence planned exactly once, at the CP size the plan reports
    seen = sorted(i for mb in plan.microbatches for i in mb.seqs)
    assert seen == list(range(len(lengths)))
    allowed = set(cp_candidates(n_ranks).tolist())
    for mb in plan.microbatches:
        assert mb.cp in allowed and n_ranks % mb.cp == 0 and mb.cp & (mb.cp - 1) == 0
        assert 0 <= mb.block < n_ranks // mb.cp  # an aligned block [block·cp, (block+1)·cp)
        assert list(mb.ranks) == list(range(mb.block * mb.cp, (mb.block + 1) * mb.cp))
        tokens = sum(int(padded_length(lengths[i], mb.cp)) // mb.cp for i in mb.seqs)
        assert tokens == mb.tokens_per_rank <= capacity  # per-microbatch capacity
        for i in mb.seqs:
            assert plan.cp_sizes[i] == mb.cp >= memory_min_cp(lengths[i], capacity)
        expected = cost.microbatch_cost([lengths[i] for i in mb.seqs], mb.cp)
        assert mb.cost == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # padding: Σ (padded − L)
    assert plan.padding_tokens == sum(int(padded_length(lengths[i], plan.cp_sizes[i])) - lengths[i]
                                      for i in range(len(lengths)))
    # per-rank lists: CP size non-increasing; loads add up; all members of a group see the same microbatches
    per_group: dict[tuple[int, int], dict[int, list]] = {}
    for r in range(n_ranks):
        mine = plan.microbatches_for_rank(r)
        assert [mb.cp for mb in mine] == sorted((mb.cp for mb in mine), reverse=True)
        assert all(r in mb.ranks for mb in mine)
        assert sum(mb.cost for mb in mine) == pytest.approx(plan.rank_loads[r], rel=1e-9, abs=1e-12)
        for mb in mine:
            per_group.setdefault((mb.cp, mb.block), {}).setdefault(r, []).append(mb)
    assert sum(len(next(iter(v.values()))) for v in per_group.values()) == len(plan.microbatches)
    for (cp, block), by_rank in per_group.items():
        assert sorted(by_rank) == list(range(block * cp, (block + 1) * cp))
        first = next(iter(by_rank.values()))
        assert all(lst == first for lst in by_rank.values())
    assert plan.makespan == max(plan.rank_loads)
    assert plan.makespan >= plan.lower_bound * (1 - 1e-9)
    assert simulate(plan) == pytest.approx(plan.makespan, rel=1e-9, abs=1e-12)


def simulate(plan: Plan) -> float:
    """Run every rank's list in order, a microbatch starting once all its members reach it; fail on deadlock.
    Returns the finish time of the last rank."""
    queues = {r: list(plan.microbatches_for_rank(r)) for r in range(plan.n_ranks)}
    clock = [0.0] * plan.n_ranks
    heads = {r: 0 for r in range(plan.n_ranks)}
    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for r in range(plan.n_ranks):
            if heads[r] >= len(queues[r]):
                continue
            mb = queues[r][heads[r]]
            members = list(mb.ranks)
            if all(heads[m] < len(queues[m]) and queues[m][heads[m]] is mb for m in members):
                start = max(clock[m] for m in members)
                for m in members:
                    clock[m] = start + mb.cost
                    heads[m] += 1
                remaining -= len(members)
                progressed = True
        assert progressed, "deadlock: no microbatch has all its members at the head of their queues"
    return max(clock)


# -- behaviour on the long-tail distribution -----------------------------------------------------------------
@pytest.mark.parametrize("n_ranks", [8, 64, 512])
@pytest.mark.parametrize("seed", [0, 1])
def test_planners_satisfy_invariants(n_ranks: int, seed: int) -> None:
    lengths = long_tail_lengths(2 * n_ranks, seed=seed)
    cost = CostModel()
    for planner in PLANNERS:
        check_plan(planner(lengths, n_ranks, CAPACITY, cost), lengths, n_ranks, CAPACITY, cost)


@pytest.mark.parametrize("n_ranks", [64, 512])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_within_5_percent_of_lower_bound(n_ranks: int, seed: int) -> None:
    lengths = long_tail_lengths(2 * n_ranks, seed=seed)
    plan = plan_hybrid(lengths, n_ranks, CAPACITY)
    assert plan.lower_bound == pytest.approx(lower_bound(lengths, n_ranks, CAPACITY))
    assert plan.lower_bound <= plan.makespan <= 1.05 * plan.lower_bound


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_beats_static_and_greedy_at_64_ranks(seed: int) -> None:
    lengths = long_tail_lengths(128, seed=seed)
    hybrid = plan_hybrid(lengths, 64, CAPACITY)
    static = plan_static(lengths, 64, CAPACITY)
    greedy = plan_greedy(lengths, 64, CAPACITY)
    assert static.makespan >= 1.3 * hybrid.makespan
    assert greedy.makespan >= hybrid.makespan
    assert len(set(static.cp_sizes)) == 1 and static.cp_sizes[0] == max(
        memory_min_cp(int(x), CAPACITY) for x in lengths)


def test_deterministic_and_picklable() -> None:
    lengths = long_tail_lengths(1024, seed=3)
    a = plan_hybrid(lengths, 512, CAPACITY)
    b = plan_hybrid(list(lengths), 512, CAPACITY)
    assert a == b
    assert pickle.loads(pickle.dumps(a)) == a  # can be computed once and broadcast


def test_long_sequence_gets_more_cp_and_short_ones_pack() -> None:
    lengths = [131072] + [512] * 64
    plan = plan_hybrid(lengths, 16, CAPACITY)
    check_plan(plan, lengths, 16, CAPACITY, CostModel())
    assert plan.cp_sizes[0] >= 8
    cp1 = [mb for mb in plan.microbatches if mb.cp == 1]
    assert cp1 and max(len(mb.seqs) for mb in cp1) > 1  # several short sequences share a microbatch
    # rank 0 starts with the long sequence (largest CP first)
    assert plan.microbatches_for_rank(0)[0].seqs == (0,)


def test_max_cp_and_non_power_of_two_ranks() -> None:
    lengths = [30000, 20000, 9000, 4000, 1000, 700, 300, 128] * 3
    plan = plan_hybrid(lengths, 12, CAPACITY, max_cp=2)
    check_plan(plan, lengths, 12, CAPACITY, CostModel())
    assert set(plan.cp_sizes) <= {1, 2}
    assert cp_candidates(12).tolist() == [1, 2, 4] and cp_candidates(24, 4).tolist() == [1, 2, 4]


def test_padding_is_planned_and_reported() -> None:
    lengths = [20001, 7, 333]
    plan = plan_hybrid(lengths, 4, CAPACITY)
    check_plan(plan, lengths, 4, CAPACITY, CostModel())
    assert plan.padding_tokens > 0


def test_zero_cost_model() -> None:
    plan = plan_hybrid([100] * 10, 4, 1000, CostModel(0.0, 0.0, 0.0, 0.0))
    check_plan(plan, [100] * 10, 4, 1000, CostModel(0.0, 0.0, 0.0, 0.0))
    assert plan.makespan == 0.0


# -- the lower bound ----------------------------------------------------------------------------------------
def test_lower_bound_dominates_classic_bound() -> None:
    lengths = long_tail_lengths(256, seed=5)
    cost, n_ranks = CostModel(), 64
    cps = cp_candidates(n_ranks)
    alone = np.array([[cost.cost(x, c) if padded_length(x, c) // c <= CAPACITY else np.inf for c in cps]
                      for x in lengths])
    work = np.array([[cost.work(x, c) if padded_length(x, c) // c <= CAPACITY else np.inf for c in cps]
                     for x in lengths])
    classic = max(work.min(axis=1).sum() / n_ranks, alone.min(axis=1).max())
    assert lower_bound(lengths, n_ranks, CAPACITY) >= classic * (1 - 1e-12)


def test_lower_bound_is_tight_for_one_sequence() -> None:
    cost = CostModel()
    bound = lower_bound([65536], 8, CAPACITY, cost)
    assert bound == pytest.approx(min(float(cost.cost(65536, c)) for c in (4, 8)), rel=1e-3)
    assert plan_hybrid([65536], 8, CAPACITY, cost).makespan == pytest.approx(bound, rel=1e-3)


# -- the cost model -----------------------------------------------------------------------------------------
def test_cost_model_formula_and_vectorisation() -> None:
    cm = CostModel(attn=1e-9, linear=1e-4, comm=1e-5, latency=1e-3)
    lp = 4096.0
    assert float(cm.cost(4096, 4)) == pytest.approx((1e-9 * lp * lp + 1e-4 * lp + 1e-5 * 3 * lp) / 4 + 3e-3)
    table = cm.cost(np.array([1024, 4096])[:, None], np.array([1, 2, 4])[None, :])
    assert table.shape == (2, 3)
    assert float(cm.cost(100, 4)) == pytest.approx(float(cm.cost(104, 4)))  # padded to 2·cp
    assert cm.microbatch_cost([1024, 2048], 2) == pytest.approx(
        float(cm.seq_cost(1024, 2) + cm.seq_cost(2048, 2)) + 1e-3)


@pytest.mark.parametrize("relative", [True, False])
def test_cost_model_fit_recovers_coefficients(relative: bool) -> None:
    true = CostModel(attn=3e-9, linear=2e-4, comm=1e-5, latency=2e-3)
    rng = np.random.default_rng(0)
    lengths = rng.choice([1024, 2048, 4096, 8192, 16384, 32768, 65536], size=60)
    cps = rng.choice([1, 2, 4, 8, 16], size=60)
    exact = CostModel.fit(lengths, cps, true.cost(lengths, cps), relative=relative)
    for name in ("attn", "linear", "comm", "latency"):
        assert getattr(exact, name) == pytest.approx(getattr(true, name), rel=1e-6)
    noisy = true.cost(lengths, cps) * (1 + 0.01 * rng.standard_normal(60))
    est = CostModel.fit(lengths, cps, noisy, relative=relative)
    for name in ("attn", "linear"):
        assert getattr(est, name) == pytest.approx(getattr(true, name), rel=0.1)


def test_cost_model_fit_is_non_negative() -> None:
    # only CP1 samples: comm and latency are not identifiable and must come out as 0, not negative
    lengths = np.array([1024, 2048, 4096, 8192])
    est = CostModel.fit(lengths, np.ones(4, dtype=int), 1e-4 * lengths + 2e-9 * lengths**2)
    assert est.comm == 0.0 and est.latency == 0.0 and est.attn == pytest.approx(2e-9)


# -- bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("planner", PLANNERS)
def test_bad_input_raises_value_error_naming_values(planner) -> None:
    with pytest.raises(ValueError, match="-5"):
        planner([100, -5], 4, CAPACITY)
    with pytest.raises(ValueError, match=r"\[0\]"):
        planner([100, 0], 4, CAPACITY)
    with pytest.raises(ValueError, match="n_ranks"):
        planner([100], 0, CAPACITY)
    with pytest.raises(ValueError, match="capacity"):
        planner([100], 4, -1)
    with pytest.raises(ValueError, match="non-empty"):
        planner([], 4, CAPACITY)
    with pytest.raises(ValueError, match="integers"):
        planner([100.5], 4, CAPACITY)
    with pytest.raises(ValueError, match=r"length 70000.*n_ranks=4.*capacity of 16384"):
        planner([1000, 70000], 4, CAPACITY)


def test_other_bad_input() -> None:
    with pytest.raises(ValueError, match="max_cp"):
        plan_hybrid([100], 4, CAPACITY, max_cp=3)
    with pytest.raises(ValueError, match="cp=2"):
        plan_static([40000], 8, CAPACITY, cp=2)
    with pytest.raises(ValueError, match="attn"):
        CostModel(attn=-1.0)
    with pytest.raises(ValueError, match="finite"):
        CostModel(linear=float("nan"))
    with pytest.raises(ValueError, match="measured"):
        CostModel.fit([1024], [1], [0.0])


# -- property test ------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_ranks=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]),
    capacity=st.integers(min_value=64, max_value=4096),
    raw=st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=40),
    cost=st.sampled_from([CostModel(), CostModel(1e-9, 1e-4, 0.0, 0.0), CostModel(1e-8, 1e-5, 1e-5, 1e-2)]),
    max_cp=st.sampled_from([None, 1, 2, 4]),
)
def test_property_invariants(n_ranks: int, capacity: int, raw: list[int], cost: CostModel, max_cp) -> None:
    largest = int(cp_candidates(n_ranks, max_cp)[-1])
    even = capacity - capacity % 2  # zigzag pads to 2·cp: per rank an even count
    lengths = [1 + x % (largest * even) for x in raw]  # every sequence fits some allowed CP size
    plans = [plan_hybrid(lengths, n_ranks, capacity, cost, max_cp=max_cp),
             plan_greedy(lengths, n_ranks, capacity, cost, max_cp=max_cp)]
    if max_cp is None:
        plans.append(plan_static(lengths, n_ranks, capacity, cost))
    for plan in plans:
        check_plan(plan, lengths, n_ranks, capacity, cost)
        assert max(plan.cp_sizes) <= largest
    assert plan_hybrid(lengths, n_ranks, capacity, cost, max_cp=max_cp) == plans[0]


def test_large_groups_split_into_several_microbatches() -> None:
    lengths = [1000 + 8 * i for i in range(200)]  # 2 ranks, 4096 tokens each: ~50 microbatches per rank
    plan = plan_hybrid(lengths, 2, 4096)
    check_plan(plan, lengths, 2, 4096, CostModel())
    assert len(plan.microbatches) >= sum(lengths) // (4096 * 2)  # Σ tokens / (capacity · largest CP)
    groups = [(mb.cp, mb.block) for mb in plan.microbatches]
    assert len(set(groups)) < len(groups)  # some group runs several microbatches


def test_docstring_examples() -> None:
    import doctest
    import importlib

    names = ("cost", "data", "plan", "problem", "bound", "lpt", "packing", "baselines", "planner")
    for module in (importlib.import_module(f"cpscope.hybrid.{n}") for n in names):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
