"""The sentinel's sampled check (``sentinel(rows=R)`` with more local rows than ``R``): the sampled rows' output
and ``dq`` against a reference streamed over each rank's own keys, ``dk`` / ``dv`` through attention's identities.

Correct runs (thd, bshd, GQA, padded, CP1 and CP2, float64 and float32) give no mismatch; planted bugs — the output,
``dk`` only, ``dv`` only, a padding mask ignored — are caught, each on every rank; and the check gathers no K/V
(its collectives carry only the sampled rows and a few sums).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope._pack import pack_for
from tests.distributed import run_ranks


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.05


def _inputs(layout: str, dtype: torch.dtype, h_kv: int):
    gen = torch.Generator().manual_seed(3 + 100 * dist.get_rank())
    shape = {"thd": (48,), "bshd": (2, 24), "sbhd": (24, 2)}[layout]
    q, k, v = (torch.randn(*shape, n, 8, dtype=dtype, generator=gen, requires_grad=True) for n in (4, h_kv, h_kv))
    kw = {"qkv_format": layout}
    if layout == "thd":
        kw["cu_seqlens"] = torch.tensor([0, 16, 40, 96], dtype=torch.int32)
    return q, k, v, kw


def _run(case: str, layout: str, dtype: torch.dtype = torch.float64, h_kv: int = 2, padded: bool = False):
    import cpscope.attention._api as api

    groups = cpscope.new_cp_groups([1, 2])
    q, k, v, kw = _inputs(layout, dtype, h_kv)
    if padded:  # one layout, real lengths shorter
        kw.update(cu_seqlens=torch.tensor([0, 13, 37, 90], dtype=torch.int32),
                  cu_seqlens_padded=torch.tensor([0, 16, 40, 96], dtype=torch.int32), causal=False)
    orig_ring, orig_run = api.ring_attention, api.run_call
    if case == "out":
        api.ring_attention = lambda q, k, v, *, plan, group: orig_ring(q, k, v, plan=plan, group=group) * 1.002
    elif case in ("dk", "dv"):
        def ring(q, k, v, *, plan, group):
            k, v = (_Scale.apply(k), v) if case == "dk" else (k, _Scale.apply(v))
            return orig_ring(q, k, v, plan=plan, group=group)
        api.ring_attention = ring
    elif case == "mask":
        api.run_call = lambda call: orig_run(dataclasses.replace(
            call, pack=pack_for(call.pack.cu, call.scope.size, call.scope.rank)))
    sent = []
    try:
        with cpscope.sentinel(every=1, rows=5) as s, cpscope.runtime_cp(groups[2]):
            try:
                cpscope.context_parallel_attention(q, k, v, **kw).square().sum().backward()
            except cpscope.SentinelError as e:
                return sorted({(m.check, m.field) for m in e.mismatches}), None
        sent = sorted({(m.check, m.field) for m in s.reports})
        return sent, s.summary().checks
    finally:
        api.ring_attention, api.run_call = orig_ring, orig_run


@pytest.mark.parametrize("layout", ["thd", "bshd", "sbhd"])
def test_correct_runs_pass_the_sampled_check(layout):
    for dtype, h_kv, padded in ((torch.float64, 2, False), (torch.float32, 1, False), (torch.float64, 4, True)):
        if padded and layout != "thd":
            continue
        for ms, checks in run_ranks(2, _run, "none", layout, dtype, h_kv, padded):
            assert ms == [] and checks["attention"] == 1 and checks["attention-grad"] == 1, (dtype, ms, checks)


def test_planted_bugs_are_caught_by_the_sampled_check():
    want = {"out": {("attention", "out")}, "dk": {("attention-grad", "dk")}, "dv": {("attention-grad", "dv")}}
    for case, fields in want.items():
        for ms, _ in run_ranks(2, _run, case, "thd"):
            assert fields <= set(ms), (case, ms)
    for ms, _ in run_ranks(2, _run, "mask", "thd", torch.float64, 2, True):
        assert ms and {c for c, _ in ms} <= {"attention", "attention-grad"}, ms


def _gathers():
    """The shapes every all-gather of a sampled call carries."""
    seen = []
    orig = dist.all_gather

    def spy(parts, tensor, *a, **kw):
        seen.append(tuple(tensor.shape))
        return orig(parts, tensor, *a, **kw)

    dist.all_gather = spy
    try:
        ms, _ = _run("none", "thd")
    finally:
        dist.all_gather = orig
    return ms, seen


def test_the_sampled_check_gathers_no_keys_or_values():
    """Every all-gather of a sampled call carries the sampled rows (5 per rank) or a few figures, never K/V (24
    local rows here)."""
    for ms, seen in run_ranks(2, _gathers):
        assert ms == [] and seen
        assert all(s[0] <= 5 or len(s) == 1 for s in seen), seen  # rows [5, h, d], indices [5], digests [n]


def _small_chunks(cases):
    """``_run`` for each case with chunks of 5 keys / rows (many chunks, inside and across batch rows)."""
    import cpscope._sentinel.attention_sampled as sampled

    saved = sampled._KEYS_PER_CHUNK, sampled._CHUNK_ELEMENTS
    sampled._KEYS_PER_CHUNK, sampled._CHUNK_ELEMENTS = 5, 1
    try:
        return [_run(*c) for c in cases]
    finally:
        sampled._KEYS_PER_CHUNK, sampled._CHUNK_ELEMENTS = saved


def test_the_sampled_check_in_many_chunks():
    """The streamed reference and the identities read the local tensors in views of a few rows each: the same
    verdicts as in one chunk — correct runs pass in every layout (padded too), planted bugs are caught."""
    correct = [("none", lay, torch.float64, 2, False) for lay in ("thd", "bshd", "sbhd")]
    correct.append(("none", "thd", torch.float64, 4, True))
    bugs = [("out", "bshd"), ("dk", "sbhd"), ("dv", "thd")]
    for results in run_ranks(2, _small_chunks, correct + bugs):
        for case, (ms, checks) in zip(correct, results):
            assert ms == [] and checks["attention"] == 1 and checks["attention-grad"] == 1, (case, ms, checks)
        for (case, _), (ms, _) in zip(bugs, results[len(correct):]):
            want = ("attention", "out") if case == "out" else ("attention-grad", case)
            assert want in set(ms), (case, ms)
