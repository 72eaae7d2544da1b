"""Ranks of a CP group that ask for different attention raise on every rank, by default, within seconds — naming the
field and each rank's value — instead of hanging (other variants), returning wrong rows (other ``cu_seqlens``, same
total) or ending in gloo's size error (other lengths). Agreement passes with no false alarm over many calls, any
variant, pack and group order, with rows equal to a float64 reference cut per rank. (Before the check: the variant
case hung past the group timeout, the offsets case returned rows off by ~1.8, the length case raised gloo's
"Received data size doesn't match expected size".)"""
from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.attention import agreement, context_parallel_attention
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

D = 8
H = 4
_BOUND_S = 20.0  # every rank's error comes within this (the pool's group timeout is 90 s: a hang would exceed it)
VARIANTS = {2: ["p2p", "all_gather", "a2a"], 4: ["p2p", "all_gather", "a2a", "a2a+p2p"]}


def _group(cp: int, ranks=None):
    return cpscope.new_cp_groups([cp], ranks=ranks, hierarchical=cp == 4)[cp]


def _outcome(fn: Callable[[], Any]) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return "ok", "", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e), time.monotonic() - t0


def _full(cu: list[int], seed: int, h_kv: int = H) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    t = cu[-1]
    return (torch.randn(t, H, D, generator=g, dtype=torch.float64), torch.randn(t, h_kv, D, generator=g,
            dtype=torch.float64), torch.randn(t, h_kv, D, generator=g, dtype=torch.float64))


def _local(cu: list[int], fmt: str, group, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """This rank's zigzag shards of a fixed full q/k/v (``thd``: documents ``cu``; dense: one row of ``cu[-1]``)."""
    idx = zigzag_index(cu if fmt == "thd" else [0, cu[-1]], group.size(), dist.get_rank(group))
    loc = [t[idx] for t in _full(cu, seed)]
    return tuple(t.float() if fmt == "thd" else t.float()[None] for t in loc)


def _attend(q, k, v, group, fmt: str, cu, comm: str):
    kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if fmt == "thd" else {}
    return context_parallel_attention(q, k, v, qkv_format=fmt, comm=comm, group=group, **kw)


# ------------------------------------------------------------------------------------------------------------------
# other variants (today: a hang)


def _other_variants(cp: int, odd: int) -> tuple[list, str]:
    group = _group(cp)
    me = dist.get_rank(group)
    cu = [0, 4 * cp, 8 * cp]
    q, k, v = _local(cu, "thd", group)
    seen = []
    for mine in VARIANTS[cp]:
        for theirs in VARIANTS[cp]:
            if mine == theirs:
                continue
            comm = mine if me == odd else theirs
            seen.append((mine, theirs, _outcome(lambda: _attend(q, k, v, group, "thd", cu, comm))))
    return seen, str(_attend(q, k, v, group, "thd", cu, "p2p").shape)  # the ranks are still in step


@pytest.mark.parametrize("cp,odd", [(2, 0), (2, 1), (4, 0), (4, 3)])
def test_other_variants_raise_on_every_rank_naming_each_ranks_variant(cp, odd):
    results = run_ranks(cp, _other_variants, cp, odd, timeout=240)
    for rank, (seen, shape) in enumerate(results):
        assert shape == str(torch.Size([8, H, D])), shape
        for mine, theirs, (err, msg, secs) in seen:
            assert err == "RanksDisagreeError", (rank, mine, theirs, err, msg)
            assert "communication variant (comm) differs" in msg, msg
            resolved = {"a2a+p2p": "a2a+p2p:2"}  # the message names the variant that runs (its inner size)
            want = ", ".join(f"rank {r}: {resolved.get(mine if r == odd else theirs, mine if r == odd else theirs)!r}"
                             for r in range(cp))
            assert want in msg, (want, msg)
            assert secs < _BOUND_S, (mine, theirs, secs)


# ------------------------------------------------------------------------------------------------------------------
# other global cu_seqlens with the same total (today: wrong rows on every rank, no error)


def _other_offsets(cp: int, odd: int) -> list:
    group = _group(cp)
    me = dist.get_rank(group)
    unit = 2 * cp
    cu = [0, 2 * unit, 4 * unit] if me != odd else [0, unit, 4 * unit]  # same total, other documents
    q, k, v = _local(cu, "thd", group)
    out = []
    for comm in VARIANTS[cp]:
        out.append((comm, _outcome(lambda: _attend(q, k, v, group, "thd", cu, comm))))
    padded = _outcome(lambda: context_parallel_attention(  # other real offsets, same layout (padding masks)
        q, k, v, qkv_format="thd", group=group, cu_seqlens=torch.tensor([0, unit, 3 * unit - (me == odd)],
                                                                        dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, 2 * unit, 4 * unit], dtype=torch.int32)))
    return out + [("padded", padded)]


@pytest.mark.parametrize("cp,odd", [(2, 1), (4, 2)])
def test_other_offsets_with_the_same_total_raise_on_every_rank_naming_them(cp, odd):
    unit = 2 * cp
    mine, theirs = [0, unit, 4 * unit], [0, 2 * unit, 4 * unit]
    for rank, seen in enumerate(run_ranks(cp, _other_offsets, cp, odd, timeout=240)):
        for comm, (err, msg, secs) in seen:
            assert err == "RanksDisagreeError" and "global cu_seqlens differs" in msg, (rank, comm, err, msg)
            if comm != "padded":
                assert f"rank {odd}: {mine}" in msg and f"rank {(odd + 1) % cp}: {theirs}" in msg, msg
            else:
                assert f"rank {odd}: {{cu_seqlens: [0, {unit}, {3 * unit - 1}]" in msg, msg
            assert secs < _BOUND_S


# ------------------------------------------------------------------------------------------------------------------
# other global lengths (today: gloo's "Received data size doesn't match expected size")


def _other_lengths(cp: int, odd: int) -> list:
    group = _group(cp)
    me = dist.get_rank(group)
    n = 4 * cp if me != odd else 6 * cp  # global length; local n / cp, divisible by 2
    out = []
    for fmt in ("bshd", "thd"):
        cu = [0, n] if fmt == "bshd" else [0, 2 * cp, n]
        q, k, v = _local(cu, fmt, group)
        for comm in VARIANTS[cp]:
            out.append((fmt, comm, _outcome(lambda: _attend(q, k, v, group, fmt, cu, comm))))
    return out


@pytest.mark.parametrize("cp,odd", [(2, 0), (4, 1)])
def test_other_global_lengths_raise_on_every_rank_naming_them(cp, odd):
    for rank, seen in enumerate(run_ranks(cp, _other_lengths, cp, odd, timeout=240)):
        for fmt, comm, (err, msg, secs) in seen:
            assert err == "RanksDisagreeError" and "global length" in msg, (rank, fmt, comm, err, msg)
            assert "Received data size" not in msg
            assert f"rank {odd}: {6 * cp}" in msg and f"rank {(odd + 1) % cp}: {4 * cp}" in msg, msg
            assert secs < _BOUND_S


# ------------------------------------------------------------------------------------------------------------------
# inputs valid on some ranks only; other heads / windows


def _one_rank_invalid(odd: int) -> list:
    group = _group(2)
    me = dist.get_rank(group)
    cu = [0, 8, 16]
    q, k, v = _local(cu, "thd", group)
    bad_cu = [0, 6, 16] if me == odd else cu  # 6 is not divisible by 2*cp: a ValueError on that rank alone
    heads = _outcome(lambda: context_parallel_attention(q, k[:, :2] if me == odd else k, v[:, :2] if me == odd else v,
                                                        qkv_format="thd", group=group,
                                                        cu_seqlens=torch.tensor(cu, dtype=torch.int32)))
    window = _outcome(lambda: context_parallel_attention(q, k, v, qkv_format="thd", group=group,
                                                         window=(3, 0) if me == odd else None,
                                                         cu_seqlens=torch.tensor(cu, dtype=torch.int32)))
    return [_outcome(lambda: _attend(q, k, v, group, "thd", bad_cu, "p2p")), heads, window]


def test_inputs_invalid_on_one_rank_raise_on_every_rank_instead_of_waiting():
    for rank, ((err, msg, secs), heads, window) in enumerate(run_ranks(2, _one_rank_invalid, 1, timeout=120)):
        if rank == 1:
            assert err == "ValueError" and "divisible" in msg, msg  # its own error, unchanged
        else:
            assert err == "RanksDisagreeError" and "rank 1 refused its attention inputs" in msg, msg
            assert "divisible" in msg, msg
        assert heads[0] == "RanksDisagreeError" and "k/v heads differs — rank 0: 4, rank 1: 2" in heads[1], heads
        assert window[0] == "RanksDisagreeError" and "window differs — rank 0: None, rank 1: (3, 0)" in window[1]
        assert secs < _BOUND_S and heads[2] < _BOUND_S and window[2] < _BOUND_S


def _sentinel_unsampled() -> list:
    group = _group(2)
    me = dist.get_rank(group)
    cu = [0, 8, 16]
    q, k, v = _local(cu, "thd", group)
    out = []
    with cpscope.sentinel(every=1000, timeout=30):  # the first call is sampled; the next ones are not
        for comm in ("p2p", "p2p" if me == 0 else "all_gather"):
            out.append(_outcome(lambda: _attend(q, k, v, group, "thd", cu, comm)))
    return out


def test_with_the_sentinel_on_unsampled_calls_are_still_checked():
    for first, second in run_ranks(2, _sentinel_unsampled, timeout=120):
        assert first[0] == "ok", first
        assert second[0] == "RanksDisagreeError" and "communication variant" in second[1], second


# ------------------------------------------------------------------------------------------------------------------
# no false alarm


def _agreeing(cp: int, ranks, calls: int) -> tuple[int, float]:
    group = _group(cp, ranks)
    r = dist.get_rank(group)
    worst = 0.0
    variants = VARIANTS[cp] + ["auto"]
    for i in range(calls):
        unit = 2 * cp
        fmt = "thd" if i % 3 else "bshd"
        cu = [0, unit * (1 + i % 3), unit * 5] if fmt == "thd" else [0, unit * (2 + i % 2)]
        comm = variants[i % len(variants)]
        q, k, v = _local(cu, fmt, group, seed=i)
        out = _attend(q, k, v, group, fmt, cu, comm)
        fq, fk, fv = _full(cu, seed=i)
        ref = reference_attention(fq, fk, fv, causal=True, cu=cu if fmt == "thd" else None)
        idx = zigzag_index(cu if fmt == "thd" else [0, cu[-1]], cp, r)
        got = out if fmt == "thd" else out[0]
        worst = max(worst, (got.double() - ref[idx]).abs().max().item())
    return calls, worst


@pytest.mark.parametrize("cp,ranks", [(2, None), (2, [0, 1]), (4, None), (4, [3, 1, 2, 0]), (2, [0, 2, 1, 3])])
def test_agreeing_ranks_never_raise_and_get_the_reference_rows(cp, ranks):
    world = 4 if ranks is not None and len(ranks) == 4 else cp
    for calls, worst in run_ranks(world, _agreeing, cp, ranks, 40, timeout=240):
        assert calls == 40 and worst < 2e-5, worst


# ------------------------------------------------------------------------------------------------------------------
# pure pieces


def test_digest_is_fixed_size_and_messages_pickle():
    import pickle

    e = agreement.RanksDisagreeError("x differs", {"comm": {0: "p2p", 1: "a2a"}})
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, ValueError) and back.values == e.values and str(back) == "x differs"
    assert len(agreement.FIELDS) == len(set(agreement.FIELDS)) and set(agreement.LABELS) == set(agreement.FIELDS)


def test_cp1_runs_no_check(monkeypatch):
    import cpscope.attention.api as api

    monkeypatch.setattr(api, "check_agreement", lambda call: pytest.fail("CP1 must not agree"))
    q = torch.randn(1, 8, H, D)
    out = context_parallel_attention(q, q, q, group=None)
    assert out.shape == q.shape
