"""The sentinel reports misuse only a running job can see (issue 33): inputs sharded inside one scope and rotated /
attended under another or none — at the first sampled microbatch, on every rank (before: no report, rows off by
1.7–2.4 under CP1 on the local shard)."""
from __future__ import annotations

import pytest
import torch

import cpscope
from tests.distributed import run_ranks


def _qkv():
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(1, 16, 2, 8, dtype=torch.float64, generator=gen) for _ in range(3)]


def _sharded_in_scope_used_outside(what: str):
    groups = cpscope.new_cp_groups([2])
    freqs = cpscope.rotary_freqs(8, 64).double()
    q, k, v = _qkv()
    with cpscope.sentinel(every=1):
        with cpscope.runtime_cp(groups[2]):
            q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
        try:
            if what == "rope":
                cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="bshd")
            else:
                cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
        except cpscope.SentinelError as e:
            return [(m.check, m.field) for m in e.mismatches], str(e)
    return None, ""


@pytest.mark.parametrize("what", ["rope", "attention"])
def test_shards_cut_for_cp2_used_outside_the_scope_are_reported_on_every_rank(what):
    for found, msg in run_ranks(2, _sharded_in_scope_used_outside, what, timeout=120):
        assert found == [("sharding", "scope")], msg
        assert "cut by zigzag_shard for CP2" in msg and "runs under CP1" in msg, msg


def _correct_use_is_quiet():
    groups = cpscope.new_cp_groups([2])
    freqs = cpscope.rotary_freqs(8, 64).double()
    q, k, v = _qkv()
    with cpscope.sentinel(every=1) as s:
        with cpscope.runtime_cp(groups[2]):
            q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
            q, k = (cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="bshd") for t in (q, k))
            cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
    return len(s.reports)


def test_shards_used_in_their_scope_raise_nothing():
    assert run_ranks(2, _correct_use_is_quiet, timeout=120) == [0, 0]


def _not_sharded(layout: str):
    """Item 1: every rank passes the same full q/k/v (zigzag_shard forgotten)."""
    groups = cpscope.new_cp_groups([2])
    q, k, v = _qkv()
    if layout == "sbhd":
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    with cpscope.sentinel(every=1), cpscope.runtime_cp(groups[2]):
        try:
            cpscope.context_parallel_attention(q, k, v, qkv_format=layout, causal=True)
        except cpscope.SentinelError as e:
            return [(m.check, m.field) for m in e.mismatches], str(e)
    return None, ""


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_unsharded_inputs_under_cp2_are_reported_on_every_rank(layout):
    for found, msg in run_ranks(2, _not_sharded, layout, timeout=120):
        assert found == [("sharding", "not sharded")], msg
        assert "not zigzag-sharded" in msg
