"""Fault injection on gloo: every way the ranks of a group can disagree or stall becomes a clear error, in bounded
time, on every rank that can know — never a silent hang.

Each task runs on a fresh CP group with a short collective timeout (3 s), and the sentinel with ``timeout=1.5``, so
that a hang shows as an error within seconds. Scenarios: the sentinel on some ranks only, or switched on one
microbatch later (named by the core's agreement digest on every rank, ``tests/test_sentinel_one_sided.py``); other
``every`` / ``on_mismatch`` on one rank; sampling counters that drift apart after the handshake; a rank that stalls mid-step; a recompute under the wrong scope on one rank only; ``comm="auto"``'s
calibration missing on one rank or different between ranks; real offsets that differ by one token under the same
padded layout; ``a2a+p2p`` without its sub-groups made up front.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import cpscope
from tests.distributed import run_ranks

_GROUP_TIMEOUT_S = 3.0
_SENTINEL_TIMEOUT_S = 1.5
_BOUND_S = 15.0  # every error below must come well within this


def _fresh_group() -> dist.ProcessGroup:
    """A new group of the whole pool with a short timeout: a hang in it shows as an error within seconds."""
    return dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=_GROUP_TIMEOUT_S))


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    # each rank its own rows: identical rows on every rank are reported by the sentinel as unsharded inputs
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    return tuple(torch.randn(1, 8, 2, 4, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))


def _attention(group: dist.ProcessGroup, seed: int = 0) -> torch.Tensor:
    q, k, v = _qkv(seed)
    with cpscope.runtime_cp(group):
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
    out.sum().backward()
    return out


def _outcome(fn, *args) -> tuple[str, str, float]:
    """``(error type or "ok", message, seconds)`` of ``fn(*args)``."""
    t0 = time.monotonic()
    try:
        fn(*args)
        return "ok", "", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the outcome is what the test looks at
        return type(e).__name__, str(e), time.monotonic() - t0


# ---------------------------------------------------------------------------------------------------------------
# The sentinel on some ranks only, or later on one; other options on one rank


def _sentinel_on(late: int, options: dict, marked: bool = True) -> tuple:
    """Rank 1 switches the sentinel on at microbatch ``late`` (0: with rank 0; 2: never in these 2 microbatches),
    with ``options`` (rank 0: the defaults); ``marked=False``: no microbatch markers (sampling per call)."""
    g = _fresh_group()
    rank = dist.get_rank()

    def run() -> None:
        s = None
        try:
            for i in range(2):
                if s is None and (rank == 0 or i == late):
                    opts = {"every": 1, "timeout": _SENTINEL_TIMEOUT_S, **(options if rank == 1 else {})}
                    s = cpscope.sentinel(**opts)
                if s is None or not marked:
                    _attention(g, i)
                    continue
                with s.microbatch(g):
                    _attention(g, i)
        finally:
            if s is not None:
                s.stop()

    return _outcome(run)


@pytest.mark.parametrize("late", [1, 2])
def test_the_sentinel_on_one_rank_only_or_one_microbatch_later_is_an_error_not_a_hang(late):
    (e0, m0, t0), (e1, m1, t1) = run_ranks(2, _sentinel_on, late, {}, timeout=60)
    # the core's agreement digest says rank 0 samples the call and rank 1 does not: named on both, before any
    # collective of the sentinel (before: rank 0 SentinelError alone, rank 1 the group's timeout in its ring)
    for m in (m0, m1):
        assert "cpscope.sentinel sampling this call differs" in m and "rank 1: 'no" in m, m
    assert e0 == e1 == "RanksDisagreeError" and t0 < _BOUND_S and t1 < _BOUND_S, (e1, m1, t0, t1)


def test_other_options_on_one_rank_raise_the_same_error_on_both():
    for options, field in (({"every": 2}, "every"), ({"on_mismatch": "log"}, "on_mismatch"),
                           ({"gradients": False}, "checks switched on"), ({"rows": 8}, "rows")):
        for marked in (True, False):
            (e0, m0, t0), (e1, m1, t1) = run_ranks(2, _sentinel_on, 0, options, marked, timeout=60)
            assert e0 == e1 == "SentinelError" and m0 == m1 and field in m0, (options, m0, m1)
        assert t0 < _BOUND_S and t1 < _BOUND_S


# ---------------------------------------------------------------------------------------------------------------
# Sampling counters drift apart after the handshake; a rank stalls mid-step


def _drift() -> tuple:
    g = _fresh_group()
    rank = dist.get_rank()

    def run() -> None:
        with cpscope.sentinel(every=2, timeout=_SENTINEL_TIMEOUT_S) as s:
            for i in range(3):
                if rank == 1 and i == 1:
                    with s.microbatch(g):  # a marked microbatch with no attention: rank 1's counter runs ahead
                        pass
                with s.microbatch(g):
                    _attention(g, i)

    return _outcome(run)


def test_sampling_counters_that_drift_apart_time_out_naming_the_collective():
    (e0, m0, t0), (e1, m1, t1) = run_ranks(2, _drift, timeout=60)
    # rank 1 samples the microbatch that rank 0 does not: the core's digest names it on both (before: a
    # CollectiveTimeout of the sentinel's digest on one rank)
    assert e0 == e1 == "RanksDisagreeError", (e0, m0, e1, m1)
    assert "cpscope.sentinel sampling this call differs" in m0 and "[0, 1]" in m0, m0
    assert t0 < _BOUND_S and t1 < _BOUND_S


def _stall() -> tuple:
    g = _fresh_group()

    def run() -> None:
        with cpscope.sentinel(every=1, timeout=_SENTINEL_TIMEOUT_S) as s:
            for i in range(2):
                if dist.get_rank() == 1 and i == 1:
                    time.sleep(2 * _SENTINEL_TIMEOUT_S)  # rank 1 stalls (a slow host, a hung data loader)
                with s.microbatch(g):
                    _attention(g, i)

    return _outcome(run)


def test_a_rank_that_stalls_mid_step_gives_a_timeout_naming_the_collective():
    (e0, m0, t0), (e1, m1, t1) = run_ranks(2, _stall, timeout=60)
    assert e0 == "CollectiveTimeout" and "did not complete within 1.5 s" in m0 and "agreement digest" in m0, m0
    assert e1 != "ok" and t0 < _BOUND_S and t1 < _BOUND_S + 2 * _SENTINEL_TIMEOUT_S, (e1, m1)


# ---------------------------------------------------------------------------------------------------------------
# A recompute under the wrong scope on every rank: raised on every rank, at the gradient verdict


def _recompute(wrong_on: tuple, reentrant: bool = False) -> tuple:
    from tests.test_sentinel import _tiny

    cpscope.set_backward_read_check(False)  # the expert opt-out: the sentinel is what catches it
    g = _fresh_group()
    model = _tiny(dtype=torch.float64)
    x_full = torch.randn(2, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    plain = dist.get_rank() in wrong_on

    def run() -> None:
        with cpscope.sentinel(every=1, timeout=_SENTINEL_TIMEOUT_S) as s:
            with cpscope.runtime_cp(g), s.microbatch(g):
                x = cpscope.zigzag_shard(x_full, seq_dim=1).requires_grad_(reentrant)
                if plain:  # plain torch checkpoint: the recompute (outside the scope) runs under CP1
                    y = torch.utils.checkpoint.checkpoint(model.block, x, use_reentrant=reentrant)
                else:
                    y = cpscope.checkpoint(model.block, x, use_reentrant=reentrant)
            y.sum().backward()

    return _outcome(run)


def test_a_recompute_mismatch_is_raised_on_every_rank_not_inside_one_backward():
    for rank, (err, msg, secs) in enumerate(run_ranks(2, _recompute, (0, 1), timeout=60)):
        assert err == "SentinelError" and "activation recompute" in msg and secs < _BOUND_S, (rank, msg)
    # on one rank only: that rank names its recompute; the other's ring backward meets a partner gone elsewhere,
    # and both end within the timeouts instead of hanging
    (e0, m0, t0), (e1, m1, t1) = run_ranks(2, _recompute, (1,), timeout=60)
    assert e1 == "SentinelError" and "activation recompute" in m1, m1
    assert e0 != "ok" and t0 < _BOUND_S and t1 < _BOUND_S, (e0, m0)


def test_a_reentrant_recompute_mismatch_is_raised_on_every_rank():
    """``use_reentrant=True``: the forward runs without autograd (no gradient taps); the recompute's own check is
    the verdict, on every rank — with the wrong scope on one rank only too (named on both)."""
    for rank, (err, msg, secs) in enumerate(run_ranks(2, _recompute, (0, 1), True, timeout=60)):
        assert err == "SentinelError" and "activation recompute" in msg and f"rank {rank}" in msg, (rank, msg)
        assert secs < _BOUND_S
    (e0, m0, t0), (e1, m1, t1) = run_ranks(2, _recompute, (1,), True, timeout=60)
    assert e1 == "SentinelError" and "activation recompute" in m1 and "rank 1" in m1, m1
    assert e0 == "SentinelError" and "rank(s) [1] of the group found a mismatch" in m0, m0  # not a hang
    assert t0 < _BOUND_S and t1 < _BOUND_S


# ---------------------------------------------------------------------------------------------------------------
# comm="auto": a calibration missing on one rank, or another model there; a2a+p2p without its groups up front


def _calibration(case: str) -> tuple:
    import tempfile

    from cpscope.attention import _dispatch as dispatch
    from cpscope.hybrid._comm_cost import CommCostModel
    from cpscope.train._auto import use_calibration
    from tests.hybrid.test_comm_cost import TRUE

    rank = dist.get_rank()
    other = {v: tuple(c * 2 for c in coef) for v, coef in TRUE.items()}
    model = CommCostModel({"bfloat16": other if case == "different" and rank == 1 else TRUE})
    previous = dispatch.set_auto_chooser(None)
    try:
        with tempfile.TemporaryDirectory() as empty:
            if case == "missing" and rank == 1:  # this node has no calibration file
                return _outcome(lambda: use_calibration(directory=empty))
            return _outcome(use_calibration, model)
    finally:
        dispatch.set_auto_chooser(previous)


def test_a_calibration_missing_or_different_on_one_rank_raises_on_every_rank():
    for case, words in (("missing", "on rank(s) [1]"), ("different", "different calibrated cost models")):
        for err, msg, secs in run_ranks(2, _calibration, case, timeout=60):
            assert err == "ValueError" and words in msg and secs < _BOUND_S, (case, msg)
    assert [r[0] for r in run_ranks(2, _calibration, "same", timeout=60)] == ["ok", "ok"]


def _hierarchical() -> tuple:
    # the registry shares sub-groups by member ranks: a pair an earlier test made for these ranks would be found, so
    # start from an empty registry (on every rank of the pool, as clear_cp_group_cache requires)
    cpscope.clear_cp_group_cache()
    g = _fresh_group()
    gen = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, 4, 4, 4, dtype=torch.float64, generator=gen) for _ in range(3))

    def run() -> None:
        with cpscope.runtime_cp(g, comm="a2a+p2p:2"):
            cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)

    missing = _outcome(run)
    cpscope.hierarchical_cp_groups(g, 2)  # up front, on every member
    return missing, _outcome(run)


def test_a2a_p2p_without_its_groups_made_up_front_is_a_clear_error_and_creates_nothing():
    for (err, msg, _), after in run_ranks(4, _hierarchical, timeout=60):
        assert err == "ValueError" and "cpscope.hierarchical_cp_groups(group, 2)" in msg, msg
        assert after[0] == "ok", after


def _hierarchical_pair_made_before() -> bool:
    """What an earlier test in the same pool may leave behind: the (inner, outer) pair of the whole pool."""
    cpscope.hierarchical_cp_groups(cpscope.new_cp_groups([dist.get_world_size()])[dist.get_world_size()], 2)
    return True


def test_a2a_p2p_check_does_not_depend_on_the_tests_before_it():
    """The suite passes in any order: the check above starts from an empty registry, whatever ran before."""
    assert run_ranks(4, _hierarchical_pair_made_before, timeout=60) == [True] * 4
    test_a2a_p2p_without_its_groups_made_up_front_is_a_clear_error_and_creates_nothing()


# ---------------------------------------------------------------------------------------------------------------
# The plan's communication variant survives Megatron's data path and its packed_seq_params


def _megatron_variant() -> tuple:
    from types import SimpleNamespace

    from cpscope.hybrid._plan import Microbatch
    from cpscope.integrations.megatron._carrier import consumer_scope
    from cpscope.integrations.megatron._data import Document, prepare_megatron_microbatches

    groups = cpscope.new_cp_groups([1, 2])
    docs = [Document(torch.arange(n), torch.arange(1, n + 1)) for n in (12, 20)]
    planned = [Microbatch(cp=2, block=0, seqs=(0, 1), tokens_per_rank=16, cost=1.0, comm="a2a")]
    (mb,) = prepare_megatron_microbatches(planned, docs, groups)
    psp = mb.packed_seq_params(cls=lambda **kw: SimpleNamespace(cp_partition_mode=None, **kw))
    with cpscope.runtime_cp(mb.group, local_cp_size=mb.cp, comm=mb.comm):  # what run_microbatches binds
        scope = consumer_scope(psp)  # what the model's entry forward resolves from packed_seq_params
    return mb.comm, scope.comm, scope.size


def test_the_megatron_data_path_keeps_the_planned_variant():
    assert run_ranks(2, _megatron_variant) == [("a2a", "a2a", 2)] * 2


# ---------------------------------------------------------------------------------------------------------------
# Ranks of one group running the same pack with other planned variants: named before the forward


def _loop_variants() -> tuple:
    from cpscope.train._loop import prepare_microbatch, run_microbatches
    from tests.test_sentinel import _docs, _small_gpt

    groups = cpscope.new_cp_groups([1, 2])
    docs = _docs([22, 40])
    comm = "a2a" if dist.get_rank() == 1 else "p2p"  # one rank read another plan (or another calibration)
    mb = prepare_microbatch(docs, cp=2, group=groups[2], seqs=(0, 1), comm=comm)

    def run() -> None:
        with cpscope.sentinel(every=1, timeout=_SENTINEL_TIMEOUT_S):
            run_microbatches(_small_gpt(), [mb], num_targets=60, dp_group=dist.group.WORLD)

    return _outcome(run)


def test_ranks_with_other_planned_variants_are_named_before_the_forward():
    for err, msg, secs in run_ranks(2, _loop_variants, timeout=60):
        assert err == "SentinelError" and "communication variant differs" in msg and "a2a" in msg, msg
        assert secs < _BOUND_S


# ---------------------------------------------------------------------------------------------------------------
# The recompute check fingerprints sampled microbatches only


def test_recomputes_of_unsampled_microbatches_take_no_fingerprint(monkeypatch):
    import cpscope._sentinel.recompute as rc
    from tests.test_sentinel import _tiny

    taken = []
    real = rc.fingerprint
    monkeypatch.setattr(rc, "fingerprint", lambda x: taken.append(1) or real(x))
    model = _tiny(dtype=torch.float64)
    x = torch.randn(2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    per_mb = []
    with cpscope.sentinel(every=2) as s:
        for _ in range(4):  # microbatches 0 and 2 sampled
            before = len(taken)
            with s.microbatch(None):
                y = cpscope.checkpoint(model.block, x, use_reentrant=False)
            y.sum().backward()
            per_mb.append(len(taken) - before)
    assert s.reports == [] and s.summary().checks["recompute"] == 6  # RoPE q, k and attention, twice
    assert per_mb[1] == per_mb[3] == 0 and per_mb[0] > 0 and per_mb[2] > 0, per_mb
