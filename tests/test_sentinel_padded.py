"""The sentinel on padded packs (TE's / Megatron's ``cu_seqlens`` beside ``cu_seqlens_padded``; bshd rows with real
lengths): checked numerically — forward and gradients, no false alarm on correct runs, a planted bug that ignores the
padding mask is caught — and the real offsets are part of the agreement digest.

The reference (``reference_rows(..., real=...)``) is first checked against torch autograd of a full, masked
attention computed here independently.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import cpscope
from cpscope._pack import pack_for
from cpscope._sentinel.reference import reference_rows
from tests.distributed import run_ranks


def _masked_full(q, k, v, cu, real, causal, scale):
    """Full attention over the layout stream ``cu`` with only the real tokens as keys; padding rows give zero."""
    t = q.shape[0]
    doc = torch.zeros(t, dtype=torch.long)
    pos = torch.zeros(t, dtype=torch.long)
    for i in range(len(cu) - 1):
        doc[cu[i]:cu[i + 1]] = i
        pos[cu[i]:cu[i + 1]] = torch.arange(cu[i + 1] - cu[i])
    is_real = pos < torch.tensor([real[i + 1] - real[i] for i in range(len(cu) - 1)])[doc]
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    vis = (doc[:, None] == doc[None, :]) & is_real[None, :]
    if causal:
        vis &= torch.arange(t)[None, :] <= torch.arange(t)[:, None]
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, vv) * is_real[:, None, None]


def test_the_padded_reference_matches_autograd_of_a_masked_attention():
    cu, real = (0, 8, 24), (0, 5, 18)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, h, 4, dtype=torch.float64, generator=gen, requires_grad=True) for h in (4, 2, 2))
    rows = torch.arange(24)
    for causal in (True, False):
        want = _masked_full(q, k, v, cu, real, causal, 0.5)
        do = torch.randn_like(want)
        dq, dk, dv = torch.autograd.grad(want, (q, k, v), do)
        ref = reference_rows(q.detach(), rows, k.detach(), v.detach(), cu, causal=causal, scale=0.5,
                             dtype=torch.float64, dout=do, real=real)
        for got, exp in ((ref.out, want), (ref.dq, dq), (ref.dk, dk), (ref.dv, dv)):
            torch.testing.assert_close(got, exp.detach(), rtol=1e-12, atol=1e-12)


def _padded(case):
    groups = cpscope.new_cp_groups([1, 2])
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7 + 100 * rank)
    if case.startswith("bshd"):
        q, k, v = (torch.randn(2, 8, h, 4, dtype=torch.float64, generator=gen, requires_grad=True) for h in (2, 1, 1))
        kw = {"qkv_format": "bshd", "cu_seqlens": torch.tensor([0, 11, 27], dtype=torch.int32)}  # rows of 16
    else:
        q, k, v = (torch.randn(16, h, 4, dtype=torch.float64, generator=gen, requires_grad=True) for h in (2, 1, 1))
        real = [0, 15, 31] if not (case == "thd-offsets" and rank == 1) else [0, 16, 32]
        kw = {"qkv_format": "thd", "cu_seqlens": torch.tensor(real, dtype=torch.int32),
              "cu_seqlens_padded": torch.tensor([0, 16, 32], dtype=torch.int32)}
    kw["causal"] = not case.endswith("noncausal")
    import cpscope.attention._api as api

    orig = api.run_call
    if case.endswith("bug"):  # a kernel that ignores the padding mask: the layout offsets as if all were real
        def unmasked(call):
            pack = pack_for(call.pack.cu, call.scope.size, call.scope.rank)
            return orig(dataclasses.replace(call, pack=pack))
        api.run_call = unmasked
    try:
        with cpscope.sentinel(every=1) as s, cpscope.runtime_cp(groups[2]):
            try:
                cpscope.context_parallel_attention(q, k, v, **kw).square().sum().backward()
            except cpscope.SentinelError as e:
                return [(m.check, m.field, m.rank) for m in e.mismatches], e.mismatches[0].figures
        return [(m.check, m.field, m.rank) for m in s.reports], s.summary().checks
    finally:
        api.run_call = orig


def test_padded_packs_are_checked_numerically_and_a_mask_bug_is_caught():
    for case in ("thd", "thd-noncausal", "bshd", "bshd-noncausal"):
        for ms, checks in run_ranks(2, _padded, case):
            assert ms == [] and checks.get("attention") == 1 and checks.get("attention-grad") == 1, (case, checks)
    for case in ("thd-noncausal-bug", "bshd-noncausal-bug"):
        for ms, _ in run_ranks(2, _padded, case):
            assert ms and {m[0] for m in ms} <= {"attention", "attention-grad"}, (case, ms)


def test_real_offsets_one_token_apart_under_one_padded_layout_are_caught():
    for ms, figs in run_ranks(2, _padded, "thd-offsets"):
        assert ms == [("agreement", "offsets", 0), ("agreement", "offsets", 1)], ms
        assert figs["real_offsets"] == {0: [0, 15, 31], 1: None}, figs
