"""The sentinel's reference with a sliding window, a softcap and sinks: the exact reference against an independent
float64 attention (tests/attention/_reference.py) through autograd; correct CP2 calls pass on the exact and the
sampled path; a kernel that drops the feature is caught.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope._sentinel.reference import Mods, reference_rows
from tests.attention._reference import reference_attention
from tests.distributed import run_ranks

_FEATURES = {"window": Mods(window=(5, 3)), "softcap": Mods(softcap=1.5), "sinks": Mods(sinks=True),
             "all": Mods(window=(6, -1), softcap=2.0, sinks=True)}


def _mods(name: str, h: int, dtype=torch.float64) -> Mods:
    m = _FEATURES[name]
    sinks = torch.linspace(-1.0, 1.5, h, dtype=dtype) if m.sinks is not None else None
    return Mods(m.window, m.softcap, sinks)


@pytest.mark.parametrize("causal", [True, False])
def test_the_reference_with_features_matches_autograd_of_an_independent_attention(causal):
    cu = [0, 12, 40]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(40, h, 8, dtype=torch.float64, generator=gen, requires_grad=True) for h in (4, 2, 2))
    for name in _FEATURES:
        mods = _mods(name, 4)
        want = reference_attention(q, k, v, causal=causal, cu=cu, scale=0.4, window=mods.window, sinks=mods.sinks,
                                   softcap=mods.softcap)
        do = torch.randn_like(want)
        grads = torch.autograd.grad(want, (q, k, v), do)
        ref = reference_rows(q.detach(), torch.arange(40), k.detach(), v.detach(), cu, causal=causal, scale=0.4,
                             dtype=torch.float64, dout=do, mods=mods)
        for got, exp in zip((ref.out, ref.dq, ref.dk, ref.dv), (want, *grads)):
            torch.testing.assert_close(got, exp.detach(), rtol=1e-12, atol=1e-12, msg=name)


def _features(name: str, rows: int, bug: bool):
    import cpscope.attention._api as api
    from cpscope.attention._mods import Mods as CallMods

    groups = cpscope.new_cp_groups([1, 2])
    gen = torch.Generator().manual_seed(5 + 100 * dist.get_rank())
    q, k, v = (torch.randn(48, h, 8, dtype=torch.float64, generator=gen, requires_grad=True) for h in (4, 2, 2))
    mods = _mods(name, 4)
    kw = {"window": mods.window, "softcap": mods.softcap, "sinks": mods.sinks}
    orig = api.run_call
    if bug:  # a kernel that drops the feature
        api.run_call = lambda call: orig(dataclasses.replace(call, mods=CallMods()))
    try:
        with cpscope.sentinel(every=1, rows=rows) as s, cpscope.runtime_cp(groups[2]):
            try:
                out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", causal=True,
                                                         cu_seqlens=torch.tensor([0, 24, 96], dtype=torch.int32),
                                                         **kw)
                out.square().sum().backward()
            except cpscope.SentinelError as e:
                return sorted({(m.check, m.field) for m in e.mismatches}), None
        return sorted({(m.check, m.field) for m in s.reports}), s.summary().checks
    finally:
        api.run_call = orig


def test_calls_with_features_are_checked_exactly_and_sampled():
    for name in _FEATURES:
        for rows in (64, 5):  # 48 local rows: every row, then 5 sampled rows
            for ms, checks in run_ranks(2, _features, name, rows, False):
                assert ms == [] and checks["attention"] == 1 and checks["attention-grad"] == 1, (name, rows, ms)
            for ms, _ in run_ranks(2, _features, name, rows, True):
                assert ("attention", "out") in ms, (name, rows, ms)
