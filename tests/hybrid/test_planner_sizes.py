"""The planner at any CP size: every divisor of the ranks, nested or not (pure logic, no process group)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpscope.hybrid import (
    CostModel,
    cp_candidates,
    long_tail_lengths,
    lower_bound,
    padded_length,
    plan_greedy,
    plan_hybrid,
    plan_static,
)
from cpscope.hybrid._data import sft_like_lengths
from cpscope.hybrid._problem import divisors, is_nested
from tests.hybrid.test_planner import CAPACITY, check_plan, optimum, simulate, toy_step

MIXES = {
    "long_tail": lambda n, seed: long_tail_lengths(2 * n, seed=seed),
    "sft": lambda n, seed: sft_like_lengths(2 * n, seed=seed),
}


def test_divisors_and_nesting() -> None:
    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(97) == [1, 97]
    assert is_nested([1, 2, 4, 8]) and is_nested([1, 3, 6, 12]) and is_nested([2, 6])
    assert not is_nested([1, 2, 3]) and not is_nested([1, 4, 6, 12])
    assert cp_candidates(384).tolist() == divisors(384)
    assert cp_candidates(384, cp_sizes="pow2").tolist() == [1, 2, 4, 8, 16, 32, 64, 128]
    assert cp_candidates(12, cp_sizes={6, 1, 3}).tolist() == [1, 3, 6]


@pytest.mark.parametrize("n_ranks", [3, 5, 6, 12, 24, 96])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_plans_at_non_power_of_two_worlds_are_valid_and_exact(n_ranks: int, mix: str) -> None:
    capacity = CAPACITY if n_ranks >= 8 else 65536  # every length fits the largest size
    for cost in (CostModel(), toy_step(heads=12, kv_heads=6)):
        lengths = MIXES[mix](n_ranks, 1)
        for planner in (plan_hybrid, plan_greedy, plan_static):
            plan = planner(lengths, n_ranks, capacity, cost)
            check_plan(plan, lengths, n_ranks, capacity, cost)  # incl. the event simulation of every rank's list
            assert plan.cp_candidates == tuple(divisors(n_ranks))


@pytest.mark.parametrize("n_ranks", [12, 24, 96, 384])
def test_all_divisors_within_5_percent_of_the_bound_and_not_worse_than_powers_of_two(n_ranks: int) -> None:
    """Fixed-seed figures (the planner is deterministic), as in docs/hybrid_planner.md."""
    for mix in sorted(MIXES):
        for seed in (0, 1, 2):
            lengths = MIXES[mix](n_ranks, seed)
            plan = plan_hybrid(lengths, n_ranks, CAPACITY)
            assert plan.lower_bound <= plan.makespan <= 1.05 * plan.lower_bound, (mix, n_ranks, seed)
            try:
                pow2 = plan_hybrid(lengths, n_ranks, CAPACITY, cp_sizes="pow2")
            except ValueError:  # a long document fits no power of two here (12 ranks: CP4 holds 64k)
                assert n_ranks == 12 and mix == "sft"
                continue
            assert plan.lower_bound <= pow2.lower_bound * (1 + 1e-4)  # more sizes: no higher (bisection: 1e-4)
            assert plan.makespan <= pow2.makespan * (1 + 1e-9), (mix, n_ranks, seed)


def test_sft_mix_at_24_ranks_gains_most() -> None:
    # one 128k document per 64 ranks; with 24 ranks the powers of two stop at CP8 (slow alone), divisors reach 24
    lengths = sft_like_lengths(48, seed=0)
    plan, pow2 = plan_hybrid(lengths, 24, CAPACITY), plan_hybrid(lengths, 24, CAPACITY, cp_sizes="pow2")
    assert 24 in plan.sizes_used and max(pow2.sizes_used) == 8
    assert pow2.makespan >= 2.0 * plan.makespan


def test_a_sequence_takes_a_non_power_of_two_size_when_that_fits() -> None:
    # 40k tokens at 16k per rank need 3 ranks (13.3k each); of 6 ranks the powers of two (1, 2) hold 32k at most
    lengths = [40000] + [4000] * 30
    plan = plan_hybrid(lengths, 6, CAPACITY)
    check_plan(plan, lengths, 6, CAPACITY, CostModel())
    assert plan.cp_sizes[0] == 3 and plan.sizes_used == (1, 3) and plan.cp_candidates == (1, 2, 3, 6)
    with pytest.raises(ValueError, match=r"largest CP size 2 .*CP sizes \[1, 2\]"):
        plan_hybrid(lengths, 6, CAPACITY, cp_sizes="pow2")
    # with little other work the long one is worth splitting further: CP6
    assert plan_hybrid(lengths[:11], 6, CAPACITY).cp_sizes[0] == 6


def test_the_plan_over_all_divisors_is_never_worse_than_its_nested_subsets() -> None:
    # the planner also plans the nested subsets (the smallest-multiple chain, the powers of two) and keeps the best
    for lengths, n in (([40000] + [4000] * 80, 12), (long_tail_lengths(48, seed=8, median=512), 24)):
        plan = plan_hybrid(lengths, n, CAPACITY)
        for sizes in ("pow2", [d for d in divisors(n) if d & (d - 1) == 0] + [n]):
            assert plan.makespan <= plan_hybrid(lengths, n, CAPACITY, cp_sizes=sizes).makespan * (1 + 1e-12)


def test_nested_non_power_of_two_sets_never_wait() -> None:
    lengths = long_tail_lengths(48, seed=4)
    for sizes in ([1, 3, 6, 12, 24], [1, 2, 6, 24], [2, 4, 12, 24]):
        plan = plan_hybrid(lengths, 24, CAPACITY, cp_sizes=sizes)
        check_plan(plan, lengths, 24, CAPACITY, CostModel())
        assert plan.cp_candidates == tuple(sizes) and plan.rank_finish == plan.rank_loads


def test_non_nested_plans_may_wait_and_the_plan_says_so() -> None:
    # waits happen where blocks straddle: their makespan is the finish time, not the busy time
    waited = False
    for seed in range(6):
        lengths = long_tail_lengths(24, seed=seed)
        plan = plan_hybrid(lengths, 12, CAPACITY)
        check_plan(plan, lengths, 12, CAPACITY, CostModel())
        waited |= any(f > busy * (1 + 1e-9) for f, busy in zip(plan.rank_finish, plan.rank_loads))
        greedy = plan_greedy(lengths, 12, CAPACITY)
        assert simulate(greedy) == pytest.approx(greedy.makespan, rel=1e-9)
    assert waited


def test_powers_of_two_behave_as_before() -> None:
    # rows of the table in docs/hybrid_planner.md, planned by the power-of-two-only code before CP sizes widened
    for mix, n, seed, makespan in (("long_tail", 8, 0, 0.729), ("long_tail", 64, 1, 1.756), ("sft", 64, 0, 1.541),
                                   ("sft", 512, 2, 1.578)):
        plan = plan_hybrid(MIXES[mix](n, seed), n, CAPACITY)
        assert round(plan.makespan, 3) == makespan and plan.rank_finish == plan.rank_loads
    lengths = long_tail_lengths(24, seed=0)
    explicit = plan_hybrid(lengths, 12, CAPACITY, cp_sizes=[1, 2, 4])
    assert plan_hybrid(lengths, 12, CAPACITY, cp_sizes="pow2") == explicit and explicit.cp_candidates == (1, 2, 4)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_ranks=st.sampled_from([6, 10, 12, 18, 20, 30]),
    subset=st.integers(min_value=0, max_value=2**16),
    raw=st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=30),
    cost=st.sampled_from([CostModel(), CostModel(1e-8, 1e-5, 1e-5, 1e-2), CostModel(0.0, 1e-4, 0.0, 0.3)]),
)
def test_property_any_set_of_sizes(n_ranks: int, subset: int, raw: list[int], cost: CostModel) -> None:
    divs = divisors(n_ranks)
    sizes = [d for i, d in enumerate(divs) if subset >> i & 1 or d == n_ranks]  # a random set with the largest
    capacity = 2048
    lengths = [1 + x % (n_ranks * capacity) for x in raw]
    for planner in (plan_hybrid, plan_greedy, plan_static):
        plan = planner(lengths, n_ranks, capacity, cost, cp_sizes=sizes)
        check_plan(plan, lengths, n_ranks, capacity, cost)
        assert set(plan.sizes_used) <= set(sizes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_ranks=st.sampled_from([3, 6]),
    capacity=st.sampled_from([64, 256, 2048]),
    raw=st.lists(st.integers(min_value=1, max_value=8192), min_size=1, max_size=3),
    cost_i=st.integers(min_value=0, max_value=2),
)
def test_lower_bound_never_exceeds_the_exhaustive_optimum_at_non_nested_sizes(n_ranks, capacity, raw, cost_i) -> None:
    """``optimum`` minimises the largest rank *load* over every assignment: at most the best makespan, since
    waits only add — so the bound must lie below it and every plan above it."""
    cost = [CostModel(), CostModel(1e-8, 1e-5, 1e-5, 5e-2), CostModel(0.0, 1e-4, 0.0, 0.3)][cost_i]
    lengths = [1 + x % (n_ranks * capacity) for x in raw]
    best = optimum(lengths, n_ranks, capacity, cost)
    assert lower_bound(lengths, n_ranks, capacity, cost) <= best * (1 + 1e-9) + 1e-15
    assert plan_hybrid(lengths, n_ranks, capacity, cost).makespan >= best * (1 - 1e-9) - 1e-15


def test_padding_at_non_power_of_two_sizes() -> None:
    lengths = [20001, 7, 333, 6000]
    plan = plan_hybrid(lengths, 6, CAPACITY)
    check_plan(plan, lengths, 6, CAPACITY, CostModel())
    assert plan.padding_tokens == sum(int(padded_length(n, c)) - n for n, c in zip(lengths, plan.cp_sizes))
    assert all(int(padded_length(n, c)) % (2 * c) == 0 for n, c in zip(lengths, plan.cp_sizes))
    assert np.all(padded_length([7, 12, 13], 3) == [12, 12, 18])


@pytest.mark.parametrize("n_ranks", [6, 12, 30, 96])
def test_placement_plans_of_straddling_sizes_are_valid_and_exact(n_ranks: int) -> None:
    """The all-sizes pass alone (before the nested subsets compete): blocks wait, the order is the placement's."""
    from cpscope.hybrid._bound import problem_bound
    from cpscope.hybrid._bin_packing import build_plan
    from cpscope.hybrid._planner import DEFAULT_TARGETS, _search
    from cpscope.hybrid._problem import Problem

    waits = 0
    for seed in range(3):
        for cost in (CostModel(), toy_step(heads=30, kv_heads=6)):
            lengths = long_tail_lengths(2 * n_ranks, seed=seed, median=1024)
            p = Problem(lengths, n_ranks, CAPACITY, cost, None)
            assert not p.nested
            lb = problem_bound(p)
            planned, k, block, seg = _search(p, lb, DEFAULT_TARGETS)
            plan = build_plan(p, "hybrid", k, block, lb=lb, seg=seg)
            check_plan(plan, lengths, n_ranks, CAPACITY, cost)
            assert plan.makespan <= planned * lb / 2**24 * (1 + 1e-6)  # packing only shortens the planned schedule
            waits += sum(f > busy * (1 + 1e-9) for f, busy in zip(plan.rank_finish, plan.rank_loads))
    assert waits > 0
