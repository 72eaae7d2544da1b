"""cpscope.sentinel: each failure class injected on gloo ranks is reported at the first sampled microbatch.

The failure classes: a model whose own RoPE uses the build-time group; a foreign sharder (contiguous
split instead of zigzag); ranks with different offsets; a recompute under the wrong scope with the default-on
autograd check switched off; wrong loss normalisation — plus planted kernel bugs (forward, gradient only), a group
whose member order disagrees with cp_rank(), invalid inputs on one rank (a raise everywhere, not a hang), and the
reference itself against torch autograd. transformers models: tests/test_sentinel_hf.py; zero false alarms over
fuzzed correct training: tests/test_sentinel_fuzz.py.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cpscope
from cpscope._sentinel.reference import reference_rows
from cpscope.train._loop import (
    global_num_targets,
    next_token_labels,
    pack_documents,
    prepare_microbatch,
    run_microbatches,
)
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def autograd_read_check(enabled: bool) -> None:
    """Switch cpscope's "scope read inside backward" check (on by default)."""
    cpscope.set_backward_read_check(enabled)


def _summary(e_or_reports) -> list[tuple]:
    ms = e_or_reports.mismatches if isinstance(e_or_reports, cpscope.SentinelError) else e_or_reports
    return [(m.check, m.field, m.rank, m.microbatch) for m in ms]


# ---------------------------------------------------------------------------------------------------------------
# A tiny bshd model whose RoPE group can be pinned (the Megatron pattern: a group captured at construction)

_ACTIVE = object()  # RoPE follows the active scope (no group= argument)


class TinyBshd(nn.Module):
    """Embedding → q/k/v → RoPE (cpscope, ``rope_group`` when pinned) → ring attention → head. x: [b, s_local, e]."""

    def __init__(self, rope_group=_ACTIVE, e: int = 16, h: int = 2, h_kv: int = 1, max_len: int = 64):
        super().__init__()
        self.h, self.h_kv, self.d = h, h_kv, e // h
        self.qkv = nn.Linear(e, (h + 2 * h_kv) * self.d, bias=False)
        self.out = nn.Linear(h * self.d, e, bias=False)
        self.rope_group = rope_group
        self.register_buffer("freqs", cpscope.rotary_freqs(self.d, max_len), persistent=False)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.h_kv * self.d, self.h_kv * self.d], dim=-1)
        q, k, v = q.view(b, s, self.h, self.d), k.view(b, s, self.h_kv, self.d), v.view(b, s, self.h_kv, self.d)
        kw = {} if self.rope_group is _ACTIVE else {"group": self.rope_group}
        q = cpscope.apply_rotary_pos_emb(q, self.freqs, qkv_format="bshd", **kw)
        k = cpscope.apply_rotary_pos_emb(k, self.freqs, qkv_format="bshd", **kw)
        o = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
        return x + self.out(o.reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _tiny(rope_group=_ACTIVE, dtype=torch.float32) -> TinyBshd:
    torch.manual_seed(0)
    return TinyBshd(rope_group).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Pure logic: the reference, the switch


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_reference_rows_match_autograd_of_full_attention(causal, h_kv):
    """The sentinel's hand-written forward and backward equal torch autograd through the tests' own reference."""
    torch.manual_seed(1)
    cu = [0, 8, 8, 20, 32]  # an empty document too
    t, h, d = cu[-1], 4, 8
    q, k, v = (torch.randn(t, n, d, dtype=torch.float64, requires_grad=True) for n in (h, h_kv, h_kv))
    scale = 0.3
    ref = reference_attention(q, k, v, causal=causal, cu=cu, scale=scale)
    dout = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), dout)
    out, score_max, dq, dk, dv, terms = reference_rows(  # every row: the full dk / dv
        q.detach(), torch.arange(t), k.detach(), v.detach(), cu, causal=causal, scale=scale, dtype=torch.float64,
        dout=dout)
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    scores = torch.einsum("ihd,jhd->hij", q.detach(), k.detach().repeat_interleave(h // h_kv, 1)) * scale
    assert score_max == pytest.approx(float(scores.abs()[:, doc[:, None] == doc[None, :]].max()))  # within documents
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, gq, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dk, gk, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dv, gv, rtol=1e-11, atol=1e-11)
    for g, t_abs in zip((dq, dk, dv), terms):  # the term magnitudes bound the gradients
        assert bool((g.abs() <= t_abs + 1e-12).all()) and bool((t_abs > 0).any())
    cache: dict = {}  # the forward's probabilities reused by the backward: the same numbers
    reference_rows(q.detach(), torch.arange(t), k.detach(), v.detach(), cu, causal=causal, scale=scale,
                   dtype=torch.float64, cache=cache)
    assert cache
    again = reference_rows(q.detach(), torch.arange(t), k.detach(), v.detach(), cu, causal=causal, scale=scale,
                           dtype=torch.float64, dout=dout, cache=cache)
    assert not cache and all(torch.equal(x, y) for x, y in zip(again[2:5], (dq, dk, dv)))
    rows = zigzag_index(cu, 2, 1)  # one rank's rows (grouped by document): its output and dq
    out1, _, dq1, _, _, _ = reference_rows(q.detach()[rows], rows, k.detach(), v.detach(), cu, causal=causal, scale=scale,
                                     dtype=torch.float64, dout=dout[rows])
    torch.testing.assert_close(out1, ref.detach()[rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq1, gq[rows], rtol=1e-11, atol=1e-11)


def test_reference_rows_with_a_value_head_dim_of_its_own():
    """Multi-latent attention: v's head dim differs from q/k's; the reference's output and gradients follow it."""
    torch.manual_seed(2)
    cu = [0, 12, 32]
    t, h, h_kv, d, dv = cu[-1], 4, 2, 12, 8
    q, k = (torch.randn(t, n, d, dtype=torch.float64, requires_grad=True) for n in (h, h_kv))
    v = torch.randn(t, h_kv, dv, dtype=torch.float64, requires_grad=True)
    ref = reference_attention(q, k, v, causal=True, cu=cu, scale=0.2)
    dout = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), dout)
    out, _, dq, dk, dvv, terms = reference_rows(q.detach(), torch.arange(t), k.detach(), v.detach(), cu, causal=True,
                                                scale=0.2, dtype=torch.float64, dout=dout)
    assert out.shape == (t, h, dv) and dvv.shape == (t, h_kv, dv) and terms[2].shape == (t, h_kv, dv)
    for got, want in ((out, ref.detach()), (dq, gq), (dk, gk), (dvv, gv)):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_switch_and_context_manager_restore_what_was_active():
    assert cpscope.sentinel.active() is None
    outer = cpscope.sentinel(every=5)  # a switch: on at construction
    try:
        assert cpscope.sentinel.active() is outer
        with cpscope.sentinel(every=1, on_mismatch="log") as inner:
            assert cpscope.sentinel.active() is inner
        assert cpscope.sentinel.active() is outer
    finally:
        summary = outer.stop()
    assert cpscope.sentinel.active() is None and summary.mismatches == 0
    outer.stop()  # idempotent


def test_sentinels_stopped_out_of_order_are_never_active_again_and_the_slots_follow():
    from cpscope import _hooks

    assert _hooks.attention is None and _hooks.rope is None
    a = cpscope.sentinel(every=1, on_mismatch="log")
    b = cpscope.sentinel(every=2, on_mismatch="log")
    c = cpscope.sentinel(every=3, on_mismatch="log")
    try:
        assert cpscope.sentinel.active() is c and _hooks.attention == c.on_attention
        b.stop()  # out of order: c stays active, and b never comes back
        assert cpscope.sentinel.active() is c
        c.stop()
        assert cpscope.sentinel.active() is a and _hooks.attention == a.on_attention
        assert _hooks.microbatches == a.watch_loop and _hooks.hf_positions == a.on_hf_positions
    finally:
        a.stop()
        b.stop()
        c.stop()
    assert cpscope.sentinel.active() is None
    assert all(getattr(_hooks, name) is None for name in _hooks.SLOTS)
    assert not hasattr(cpscope._sentinel, "ACTIVE")  # the active sentinel is read through sentinel.active() only


def test_sampling_is_decided_per_group_and_per_kind_in_one_place():
    from cpscope._sentinel.config import Sampler

    s = Sampler(every=3)
    g1, g2 = object(), object()
    assert [s.microbatch(g1) for _ in range(4)] == [(0, True), (1, False), (2, False), (3, True)]
    assert s.microbatch(g2) == (0, True)  # each group counts its own microbatches
    assert [s.call("rope", g1) for _ in range(2)] == [(0, True), (1, False)]  # and each kind its own calls
    assert s.call("attention", g1) == (0, True)
    assert [s.step() for _ in range(4)] == [(0, True), (1, False), (2, False), (3, True)]


def test_the_package_is_a_client_of_the_core():
    """Inside cpscope/_sentinel: imports point one way (no cycle), private names of the core only where documented
    (the observer slots, the one list of variant names, the registered memo, the attention call that the observer
    slot passes and the agreement check the sentinel shares with attention), files <= 500 lines,
    functions <= 80 lines."""
    import ast

    pkg = Path(cpscope.__file__).parent / "_sentinel"
    allowed = {("cpscope", "_hooks"), ("cpscope._variants", "COMM_CHOICES"),
               ("cpscope._tensor_cache", "lru"),  # the one registered memo (cpscope.clear_caches reaches it)
               # the attention observer slot's protocol (attention's modules are private since issue 30)
               ("cpscope.attention", "_api"), ("cpscope.attention._api", "AttentionCall"),
               ("cpscope.attention._agreement", "STAND_DOWN"), ("cpscope.attention._agreement", "check_call"),
               ("cpscope.attention._agreement", "raise_differ"),
               }
    edges: dict[str, set] = {}
    for f in sorted(pkg.glob("*.py")):
        text = f.read_text()
        assert len(text.splitlines()) <= 500, f.name
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 80, (f.name, node.name)
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 1:
                targets = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                edges.setdefault(f.stem, set()).update(targets)
            elif node.level >= 2 or (node.module or "").startswith("cpscope"):
                mod = "cpscope" + ("." + node.module if node.module else "") if node.level >= 2 else node.module
                for a in node.names:
                    if a.name.startswith("_") or any(p.startswith("_") for p in mod.split(".")[1:]):
                        assert (mod, a.name) in allowed, (f.name, mod, a.name)

    def reach(start, node, seen):
        for nxt in edges.get(node, ()):
            assert nxt != start, f"import cycle through {start}"
            if nxt not in seen:
                seen.add(nxt)
                reach(start, nxt, seen)

    for mod in edges:
        reach(mod, mod, set())


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_every_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"every must be a positive int.*" + repr(bad).replace("'", ".")):
        cpscope.sentinel(every=bad)
    assert cpscope.sentinel.active() is None


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="on_mismatch"):
        cpscope.sentinel(on_mismatch="warn")
    with pytest.raises(ValueError, match="labels"):
        cpscope.sentinel(labels="shifted")
    with pytest.raises(ValueError, match="rtol"):
        cpscope.sentinel(rtol={torch.float32: (0.0, 1e-3)})
    assert cpscope.sentinel.active() is None


def test_check_positions_and_check_targets_for_your_own_code():
    cu = [0, 4, 12]
    with cpscope.sentinel(every=1, on_mismatch="log") as s:
        cpscope.sentinel.check_positions(torch.cat([torch.arange(4), torch.arange(8)]), cu_seqlens=cu)  # right
        cpscope.sentinel.check_positions(torch.arange(12), cu_seqlens=cu, where="my rope")  # not restarted
        cpscope.sentinel.check_positions(torch.arange(5, 13)[None])  # one sequence per row: CP1 allows an offset
        s.check_targets(10, 10)
        s.check_targets(10, 12)
    assert [(m.check, m.field) for m in s.reports] == [("positions", "my rope"), ("loss-normalisation", "num_targets")]
    assert s.reports[0].figures["first"] == 4 and s.reports[0].figures["expected"] == 0
    cpscope.sentinel.check_positions(torch.arange(3))  # no sentinel on: nothing happens


def test_single_process_cp1_checks_pass_and_a_planted_kernel_bug_is_reported(monkeypatch):
    """No process group at all (CP1): the GPT is checked fwd + grads; a 1 % output bug is caught at the first call."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2)).double()
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    ids = torch.randint(64, (32,))
    with cpscope.sentinel(every=1) as s:
        model(ids, cu_seqlens=cu, max_seqlen=16).sum().backward()
    assert s.reports == [] and s.summary().checks["attention"] == 2 and s.summary().checks["attention-grad"] == 2
    import cpscope.attention._api as attn

    orig = attn.ring_attention
    monkeypatch.setattr(attn, "ring_attention", lambda q, k, v, *, plan, group: orig(q, k, v, plan=plan, group=group) * 1.01)
    with cpscope.sentinel(every=1) as s, pytest.raises(cpscope.SentinelError) as e:
        model(ids, cu_seqlens=cu, max_seqlen=16)
    (m,) = e.value.mismatches
    assert (m.check, m.field, m.call) == ("attention", "out", 0)
    assert 5e-3 < m.figures["max_error"] < 2e-2 and m.figures["rtol"] == 1e-9 and m.figures["ratio"] > 1e5


# ---------------------------------------------------------------------------------------------------------------
# 1. A model whose own RoPE uses the build-time group


def _rope_build_time_group(policy):
    groups = cpscope.new_cp_groups([1, 2])
    model = _tiny(rope_group=cpscope.build_time_cp_group())  # captured at construction: None (CP1)
    x_full = torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(3))
    with cpscope.sentinel(every=3, on_mismatch=policy) as s:
        for i in range(5):
            with cpscope.runtime_cp(groups[2]), s.microbatch():
                x = cpscope.zigzag_shard(x_full, seq_dim=1)
                try:
                    y = model(x)
                except cpscope.SentinelError as e:
                    return "raised", i, _summary(e), e.mismatches[0].figures
            y.sum().backward()
    return "ran", _summary(s.reports), None, None


def test_rope_with_the_build_time_group_is_reported_at_the_first_sampled_microbatch():
    for rank, (what, i, ms, figs) in enumerate(run_ranks(2, _rope_build_time_group, "raise")):
        assert (what, i) == ("raised", 0)
        assert ms[0] == ("rope", "positions", rank, 0)
        assert figs["used"] == "CP1" and figs["active"] == f"CP2 rank {rank}" and figs["count"] > 0
    for rank, (what, ms, _, _) in enumerate(run_ranks(2, _rope_build_time_group, "log")):
        assert what == "ran"  # log only: q and k RoPE of the sampled microbatches 0 and 3, nothing else
        assert ms == [("rope", "positions", rank, mb) for mb in (0, 0, 3, 3)]


# ---------------------------------------------------------------------------------------------------------------
# 2. A foreign sharder (contiguous split instead of zigzag), in the hybrid loop


def _contiguous(x: torch.Tensor, cu: list[int], cp: int, rank: int) -> torch.Tensor:
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        n = (b - a) // cp
        parts.append(x[a + rank * n: a + (rank + 1) * n])
    return torch.cat(parts)


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(64, (n,), generator=g) for n in lengths]


def _small_gpt(dtype=torch.float32):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2)).to(dtype)


def _foreign_sharder(foreign: bool):
    groups = cpscope.new_cp_groups([1, 2])
    g, rank = groups[2], dist.get_rank()
    docs = _docs([22, 40])
    mb = prepare_microbatch(docs, cp=2, group=g)  # cpscope's zigzag microbatch
    if foreign:  # the same padded pack, cut contiguously: every rank holds a contiguous half of each document
        ids, cu = pack_documents(docs)
        padded = cpscope.pad_packed_batch(ids, next_token_labels(ids, cu), cu_seqlens=cu, cp=2, pad_value=(0, -100))
        cu_p = padded.cu_seqlens_padded.tolist()
        ids_l, labels_l = (_contiguous(t, cu_p, 2, rank) for t in padded.tensors)
        mb = dataclasses.replace(mb, input_ids=ids_l, labels=labels_l, num_targets=int((labels_l != -100).sum()))
    model = _small_gpt()
    n = global_num_targets([mb], dp_group=dist.group.WORLD)
    with cpscope.sentinel(every=1) as s:
        try:
            run_microbatches(model, [mb], num_targets=n, dp_group=dist.group.WORLD)
        except cpscope.SentinelError as e:
            return _summary(e), e.mismatches[0].message
    return _summary(s.reports), s.summary().checks


def test_foreign_sharder_in_the_loop_is_reported_before_the_forward():
    for ms, msg in run_ranks(2, _foreign_sharder, True):
        assert ms == [("layout", "labels", -1, 0)]
        assert "not the next token" in msg and "zigzag" in msg
    for ms, checks in run_ranks(2, _foreign_sharder, False):  # control: cpscope's own sharding passes
        assert ms == [] and checks["layout"] == 1 and checks["attention"] == 2 and checks["loss-normalisation"] == 1


# ---------------------------------------------------------------------------------------------------------------
# 3. Ranks with different offsets (and a rank with invalid ones: a raise everywhere, never a hang)


def _different_offsets(case):
    groups = cpscope.new_cp_groups([1, 2, 4]) if dist.get_world_size() == 4 else cpscope.new_cp_groups([1, 2])
    rank = dist.get_rank()
    size = dist.get_world_size()
    g = groups[size]
    cu = [0, 16, 32] if size == 2 else [0, 16, 64]
    if case == "different" and rank == (1 if size == 2 else 2):
        cu = [0, 8, 32] if size == 2 else [0, 32, 64]  # same total: equal local lengths, the ring would run wrong
    if case == "invalid" and rank == 1:
        cu = [0, 16, 40]  # 40 tokens: this rank's 16 local tokens do not fit
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(32 // size if size == 2 else 16, 2, 8, generator=gen) for _ in range(3))
    with cpscope.sentinel(every=1), cpscope.runtime_cp(g):
        try:
            cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        except cpscope.SentinelError as e:
            return "SentinelError", _summary(e), e.mismatches[0].figures
        except ValueError as e:
            return "ValueError", str(e), None
    return "ran", None, None


def test_ranks_with_different_offsets_are_named_with_their_offsets():
    for what, ms, figs in run_ranks(2, _different_offsets, "different"):
        assert what == "SentinelError"
        assert ms == [("agreement", "offsets", 0, None), ("agreement", "offsets", 1, None)]  # 1 vs 1: both named
        assert figs["cu_seqlens"] == {0: [0, 16, 32], 1: [0, 8, 32]}


def test_the_odd_rank_out_of_four_is_named():
    for what, ms, figs in run_ranks(4, _different_offsets, "different"):
        assert what == "SentinelError" and ms == [("agreement", "offsets", 2, None)]
        assert figs["cu_seqlens"][2] == [0, 32, 64] and figs["cu_seqlens"][0] == [0, 16, 64]


def test_invalid_inputs_on_one_rank_raise_on_every_rank_instead_of_hanging():
    (w0, ms0, _), (w1, msg1, _) = run_ranks(2, _different_offsets, "invalid", timeout=60)
    assert w1 == "ValueError" and "40" in msg1  # the rank with the bad offsets: its own ValueError
    assert w0 == "SentinelError" and ("agreement", "invalid inputs", 1, None) in ms0


def _offsets_in_the_loop():
    groups = cpscope.new_cp_groups([1, 2, 4])
    rank = dist.get_rank()
    docs = _docs([30, 34, 70])
    seqs = (0, 1) if rank != 3 else (2,)  # rank 3 packs another document of the same padded length
    mb = prepare_microbatch([docs[i] for i in seqs], cp=4, group=groups[4], seqs=seqs)
    with cpscope.sentinel(every=1):
        try:
            run_microbatches(_small_gpt(), [mb], num_targets=100, dp_group=dist.group.WORLD)
        except cpscope.SentinelError as e:
            return _summary(e)
    return []


def test_ranks_running_different_packs_are_caught_by_the_loop_before_the_forward():
    for ms in run_ranks(4, _offsets_in_the_loop):
        assert {m[1] for m in ms} == {"offsets", "docs", "seqs"} and {m[2] for m in ms} == {3}
        assert all(m[0] == "agreement" and m[3] == 0 for m in ms)


# ---------------------------------------------------------------------------------------------------------------
# 4. A recompute under the wrong scope, with the default-on autograd check switched off


def _wrong_recompute(policy, reentrant=False):
    autograd_read_check(False)  # the expert opt-out: without the sentinel this trains wrong in silence
    groups = cpscope.new_cp_groups([1, 2])
    model = _tiny(dtype=torch.float64)
    x_full = torch.randn(2, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with cpscope.sentinel(every=2, on_mismatch=policy) as s:
        for i in range(3):
            with cpscope.runtime_cp(groups[2]), s.microbatch():
                # (the reentrant form needs an input that requires grad, or its output has no graph)
                x = cpscope.zigzag_shard(x_full, seq_dim=1).requires_grad_(reentrant)
                y = torch.utils.checkpoint.checkpoint(model.block, x, use_reentrant=reentrant)  # plain torch
            try:
                y.sum().backward()  # outside the scope: the recompute reads CP1
            except cpscope.SentinelError as e:
                return "raised", i, _summary(e)
    return "ran", None, _summary(s.reports)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_under_the_wrong_scope_is_reported_at_the_first_sampled_microbatch(reentrant):
    for rank, (what, i, ms) in enumerate(run_ranks(2, _wrong_recompute, "raise", reentrant)):
        # the cause first, on every rank; the wrong gradients it made follow
        assert (what, i) == ("raised", 0) and ms[0] == ("recompute", "rope scope", rank, 0), ms
        assert {m[0] for m in ms} <= {"recompute", "attention-grad"} and {m[3] for m in ms} == {0}
    for rank, (what, _, ms) in enumerate(run_ranks(2, _wrong_recompute, "log", reentrant)):
        assert what == "ran"
        fields = {(m[0], m[1]) for m in ms}
        # RoPE and attention recomputed under CP1, and the ring's gradients from those recomputed tensors are wrong
        assert {("recompute", "rope scope"), ("recompute", "scope")} <= fields
        assert {m[3] for m in ms} == {0, 2}  # the sampled microbatches only
        if not reentrant:  # (a reentrant forward runs without autograd: no gradient taps, the recompute is the check)
            assert {f for c, f in fields if c == "attention-grad"} == {"dq", "dk", "dv"}


def _right_recompute():
    autograd_read_check(True)
    groups = cpscope.new_cp_groups([1, 2])
    model = _tiny(dtype=torch.float64)
    x_full = torch.randn(2, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with cpscope.sentinel(every=1) as s:
        for reentrant in (False, True):
            with cpscope.runtime_cp(groups[2]), s.microbatch():
                x = cpscope.zigzag_shard(x_full, seq_dim=1).requires_grad_()
                y = cpscope.checkpoint(model.block, x, use_reentrant=reentrant)
            y.sum().backward()
    return s.reports, s.summary().checks


def test_cpscope_checkpoint_recompute_passes():
    for reports, checks in run_ranks(2, _right_recompute):
        assert reports == [] and checks["recompute"] == 6  # RoPE of q and k and attention, in each recompute
        assert checks["attention-grad"] == 1  # the non-reentrant forward has autograd (and the taps) on


# ---------------------------------------------------------------------------------------------------------------
# 5. Wrong loss normalisation


def _loss_normalisation(mode):
    groups = cpscope.new_cp_groups([1, 2])
    rank = dist.get_rank()
    docs = _docs([12, 20, 40, 14])
    mbs = [prepare_microbatch([docs[rank]], cp=1, group=None, seqs=(rank,)),
           prepare_microbatch([docs[2], docs[3]], cp=2, group=groups[2], seqs=(2, 3))]
    n = global_num_targets(mbs, dp_group=dist.group.WORLD)
    if mode == "local":  # per-rank normalisation
        n = sum(m.num_targets for m in mbs)
    elif mode == "unsharded":  # the CP2 microbatch's targets counted on both of its ranks
        n = n + mbs[1].num_targets * 2
    with cpscope.sentinel(every=1):
        try:
            run_microbatches(_small_gpt(), mbs, num_targets=n, dp_group=dist.group.WORLD)
        except cpscope.SentinelError as e:
            return _summary(e), e.mismatches[0].figures
    return [], None


@pytest.mark.parametrize("mode", ["local", "unsharded"])
def test_wrong_loss_normalisation_is_reported_at_the_first_step(mode):
    results = run_ranks(2, _loss_normalisation, mode)
    for ms, figs in results:
        assert [m[:2] for m in ms] == [("loss-normalisation", "num_targets")] * len(ms) and ms
        assert figs["world_targets"] != figs["num_targets"]
    assert {m[2] for ms, _ in results for m in ms} >= ({0, 1} if mode == "unsharded" else {0})
    assert run_ranks(2, _loss_normalisation, "right") == [([], None), ([], None)]


# ---------------------------------------------------------------------------------------------------------------
# Planted kernel bugs, member order, zero cost off


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.05


def _planted(bug, layout):
    import cpscope.attention._api as attn

    groups = cpscope.new_cp_groups([1, 2])
    orig = attn.ring_attention
    if bug == "out":
        attn.ring_attention = lambda q, k, v, *, plan, group: orig(q, k, v, plan=plan, group=group) * 1.002
    else:  # the ring's dk only is 5 % off
        attn.ring_attention = lambda q, k, v, *, plan, group: orig(q, _ScaleGrad.apply(k), v, plan=plan, group=group)
    try:
        gen = torch.Generator().manual_seed(2 + 100 * dist.get_rank())  # each rank its own shards
        shape = (24, 4, 8) if layout.startswith("thd") else (2, 12, 4, 8)
        q, k, v = (torch.randn(*shape[:-2], n, 8, generator=gen, requires_grad=True) for n in (4, 2, 2))
        cu = torch.tensor([0, 8, 48], dtype=torch.int32)
        kw = {"cu_seqlens": cu} if layout.startswith("thd") else {}
        if layout == "thd+padded":  # Megatron always passes both offsets: equal ones mean no padding, checked fully
            kw["cu_seqlens_padded"] = cu.clone()
        layout = layout.split("+")[0]
        with cpscope.sentinel(every=1) as s, cpscope.runtime_cp(groups[2]):
            try:
                out = cpscope.context_parallel_attention(q, k, v, qkv_format=layout, **kw)
                out.square().sum().backward()
            except cpscope.SentinelError as e:
                return _summary(e), e.mismatches[0].figures
        return _summary(s.reports), None
    finally:
        attn.ring_attention = orig


@pytest.mark.parametrize("layout", ["thd", "bshd", "thd+padded"])
def test_planted_output_bug_is_reported(layout):
    for ms, figs in run_ranks(2, _planted, "out", layout):
        assert ms == [("attention", "out", 0, None), ("attention", "out", 1, None)]
        assert 1e-3 < figs["max_error"] < 3e-3 and figs["rtol"] == 1e-4 and figs["ratio"] > 5


def test_planted_gradient_only_bug_is_reported_in_dk():
    for ms, figs in run_ranks(2, _planted, "dk", "thd"):
        assert ms == [("attention-grad", "dk", 0, None), ("attention-grad", "dk", 1, None)]
        assert 0.04 < figs["max_error"] < 0.06


def _member_order():
    try:
        groups = cpscope.new_cp_groups([2], ranks=[1, 0])
    except ValueError as e:  # the registry refuses a non-ascending block: nothing left to detect
        return "refused", str(e)
    # each rank its own shard (the same rows on every rank would be reported as not sharded)
    q = torch.randn(2, 8, 2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    with cpscope.sentinel(every=1), cpscope.runtime_cp(groups[2]):
        try:
            cpscope.context_parallel_attention(q, q, q, qkv_format="bshd")
        except cpscope.SentinelError as e:
            return "caught", _summary(e)
    return "ran", None


def test_member_order_disagreeing_with_cp_rank_is_caught_before_the_ring():
    """ranks=[1, 0]: the registry sorts the block (group_ranks() == torch's order == cp_rank()), so the members agree
    and the call runs clean; a registry that kept the caller's order would be caught before the ring."""
    for what, detail in run_ranks(2, _member_order, timeout=60):
        assert what in ("refused", "caught", "ran"), detail
        if what == "caught":  # a registry keeping the caller's order [1, 0] while torch's group ranks ascend
            assert detail == [("agreement", "members", 0, None), ("agreement", "members", 1, None)]


def _with_window(windows):
    """A prepared call carrying a sliding window (a feature the reference does not implement), per rank."""
    from cpscope.attention._api import prepare_call, run_call

    groups = cpscope.new_cp_groups([1, 2])
    with cpscope.runtime_cp(groups[2]):
        scope = cpscope.capture_scope()
    q = torch.randn(16, 2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    call = prepare_call(q, q, q, scope, "thd", True, torch.tensor([0, 32], dtype=torch.int32), None, None, None, None,
                        window=windows[dist.get_rank()])
    assert call.error is None, call.error
    with cpscope.sentinel(every=1) as s:
        try:
            s.on_attention(call, run_call)
        except cpscope.SentinelError as e:
            return _summary(e), s.summary().checks
    return _summary(s.reports), s.summary().checks


def test_a_windowed_call_is_agreed_on_and_checked_numerically():
    """A window (or softcap, sinks) is in the digest — ranks with different windows are named — and the reference
    implements it (no false alarm; tests/test_sentinel_features.py plants bugs)."""
    for ms, checks in run_ranks(2, _with_window, [(4, 0), (4, 0)]):
        assert ms == [] and checks == {"agreement": 1, "attention": 1}
    for ms, _ in run_ranks(2, _with_window, [(4, 0), (8, 0)]):
        assert ms == [("agreement", "window", 0, None), ("agreement", "window", 1, None)]


def _zero_cost():
    groups = cpscope.new_cp_groups([1, 2])
    # each rank its own shard (the same rows on every rank would be reported as not sharded)
    q = torch.randn(1, 8, 2, 4, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    names = []
    with cpscope.runtime_cp(groups[2]):
        names.append(type(cpscope.context_parallel_attention(q, q, q).grad_fn).__name__)  # off
        with cpscope.sentinel(every=2) as s:
            with s.microbatch():
                names.append(type(cpscope.context_parallel_attention(q, q, q).grad_fn).__name__)  # sampled
            with s.microbatch():
                names.append(type(cpscope.context_parallel_attention(q, q, q).grad_fn).__name__)  # not sampled
    return names, s.summary().checks


def test_ring_autograd_is_untouched_when_off_or_unsampled():
    for names, checks in run_ranks(2, _zero_cost):
        assert names[0] == names[2] and "Tap" not in names[0] and names[1] == "_TapOutBackward"
        assert checks == {"agreement": 1, "attention": 1}


def test_sentinel_error_pickles_with_its_mismatches():
    import pickle

    m = cpscope.sentinel.Mismatch("agreement", "offsets", 1, "rank 1 differs", {"values": {0: 1, 1: 2}}, step=0)
    e = pickle.loads(pickle.dumps(cpscope.SentinelError([m])))
    assert isinstance(e, cpscope.SentinelError) and e.mismatches == [m] and "rank 1 differs" in str(e)
