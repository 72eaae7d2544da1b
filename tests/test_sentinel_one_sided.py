"""A sentinel switched on by some ranks of a CP group only (issue 33 item 11): an error on every rank, never a hang.

The core's agreement digest (``cpscope/attention/_agreement.py``), which every rank all-reduces on every CP > 1
attention call, carries a ``sentinel`` field: 1 when the sentinel samples the call (its own collectives follow), 0
otherwise. A sampling rank always reads that verdict and runs the sentinel's collectives (its handshake, the loop's
pack checks, its digest, the reference) only after every rank was seen sampling the call. Before, the rank with the
sentinel waited for its handshake and raised ``SentinelError`` alone; the rank without it ran into the ring and
ended in the group's collective timeout (the 60 s ring timeout of the issue).

Each task runs on a fresh group with a 3 s collective timeout and the sentinel with ``timeout=1.5``: a hang shows as
a timeout error within seconds, which these tests reject. Results that run are compared with a float64 reference
cut per rank.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import cpscope
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

_GROUP_TIMEOUT_S = 3.0
_SENTINEL_TIMEOUT_S = 1.5
_BOUND_S = 15.0
_SEQ, _H, _D = 16, 2, 4


def _fresh_group() -> dist.ProcessGroup:
    return dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=_GROUP_TIMEOUT_S))


def _full(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(_SEQ, _H, _D, dtype=torch.float64, generator=gen) for _ in range(3))


def _attend(group: dist.ProcessGroup, seed: int, s: Any = None) -> float:
    """One CP attention call on this rank's zigzag shard of a fixed sequence (inside ``s.microbatch`` when ``s``
    is given); returns its largest deviation from the float64 reference rows of this rank."""
    idx = zigzag_index([0, _SEQ], group.size(), dist.get_rank(group))
    q, k, v = (t[idx][None].clone() for t in _full(seed))
    with cpscope.runtime_cp(group):
        if s is None:
            out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
        else:
            with s.microbatch(group):
                out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
    fq, fk, fv = _full(seed)
    ref = reference_attention(fq, fk, fv, causal=True)[idx]
    return (out[0] - ref).abs().max().item()


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any, float]:
    """``(error type or "ok", (message, values) or the result, seconds)``."""
    t0 = time.monotonic()
    try:
        return "ok", fn(), time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return type(e).__name__, (str(e), getattr(e, "values", None)), time.monotonic() - t0


def _one_sided(on: tuple, marked: bool, late: int = 0) -> tuple:
    """Two microbatches; the ranks in ``on`` run them with ``sentinel(every=1)`` (rank 1 switches it on only at
    microbatch ``late``), the others without; ``marked``: inside ``s.microbatch`` (else sampling per call)."""
    g = _fresh_group()
    rank = dist.get_rank()

    def run() -> list:
        errs, s = [], None
        try:
            for i in range(2):
                if s is None and rank in on and i >= (late if rank == 1 else 0):
                    s = cpscope.sentinel(every=1, timeout=_SENTINEL_TIMEOUT_S)
                errs.append(_attend(g, i, s if marked else None))
        finally:
            if s is not None:
                s.stop()
        return errs

    return _outcome(run)


def _assert_named_on_every_rank(results: list, off: set) -> None:
    for rank, (err, detail, secs) in enumerate(results):
        assert err == "RanksDisagreeError", (rank, err, detail)
        msg, values = detail
        assert "cpscope.sentinel sampling this call" in msg and "sentinel" in values, msg
        states = values["sentinel"]
        assert {r for r, v in states.items() if v.startswith("no")} == off, states
        assert secs < _BOUND_S, (rank, secs)


@pytest.mark.parametrize("marked", [True, False])
def test_the_sentinel_on_one_rank_only_raises_ranks_disagree_on_both_naming_it(marked):
    # before: rank 0 SentinelError after its handshake's wait, rank 1 the group's collective timeout in the ring
    _assert_named_on_every_rank(run_ranks(2, _one_sided, (0,), marked, timeout=60), off={1})


def test_a_rank_switching_the_sentinel_on_one_microbatch_later_is_named_at_the_first():
    _assert_named_on_every_rank(run_ranks(2, _one_sided, (0, 1), True, 1, timeout=60), off={1})


def test_one_rank_of_four_without_the_sentinel_is_named_on_all_four():
    _assert_named_on_every_rank(run_ranks(4, _one_sided, (0, 1, 3), True, timeout=60), off={2})


def test_sentinel_on_everywhere_or_nowhere_runs_and_matches_the_reference():
    for on in ((0, 1), ()):
        for marked in (True, False):
            for err, errs, secs in run_ranks(2, _one_sided, on, marked, timeout=60):
                assert err == "ok", errs
                assert max(errs) < 1e-10, errs


def _switched_on_mid_step() -> tuple:
    """Both ranks run a call without the sentinel (agreed); then rank 0 alone switches it on and repeats the call:
    rank 1 repeats a call it saw agreed (no host read), so rank 0 stands down, runs the call as rank 1 does, and
    both raise at the step boundary."""
    g = _fresh_group()

    def run() -> tuple:
        first = _attend(g, 0)
        s = cpscope.sentinel(every=1, timeout=_SENTINEL_TIMEOUT_S) if dist.get_rank() == 0 else None
        try:
            second = _attend(g, 0, s)
        finally:
            if s is not None:
                s.stop()
        return first, second, _outcome(cpscope.verify_agreement)

    return _outcome(run)


def test_a_sentinel_switched_on_mid_step_on_one_rank_raises_at_the_step_boundary_on_both():
    for rank, (err, result, secs) in enumerate(run_ranks(2, _switched_on_mid_step, timeout=60)):
        assert err == "ok", (rank, result)
        first, second, (verr, (msg, values), _) = result
        assert first < 1e-10 and second < 1e-10  # the call ran alike on both ranks: the right rows
        assert verr == "RanksDisagreeError" and "sentinel" in values, (rank, msg)
        assert secs < _BOUND_S
