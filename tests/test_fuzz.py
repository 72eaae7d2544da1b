"""Differential fuzz test: random packs through zigzag sharding, RoPE and attention, forward and backward, on gloo
ranks, against an independent float64 full-sequence reference cut per rank.

Hypothesis draws a case in the pytest process (document lengths including 0, exactly 2·cp and long ones; padded
or not; cp ∈ {1, 2, 4} inside a 4-rank pool; causal or full; MHA, GQA, MQA; bshd, sbhd, thd; every communication
variant the case allows; a sliding window, attention sinks, softcapping and a v head dim of its own, each or
together); every rank of the
pool runs it and checks its own slice, so a failing case shrinks like any Hypothesis example. The reference
imports nothing of cpscope: its own zigzag index, its own RoPE, plain float64 softmax attention per document.

Padding follows TransformerEngine: every document is padded at its end to a multiple of 2·cp; cpscope gets the real
offsets (``cu_seqlens``) and the layout (``cu_seqlens_padded``; for bshd/sbhd the real row lengths as
``cu_seqlens``). Real rows must equal the reference; padding rows must be zero, and so must the gradients there.

``test_planted_bugs_are_caught`` plants a wrong zigzag chunk order and a reversed ring, and checks the same case
checker reports a mismatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpscope
from tests.distributed import run_ranks

WORLD = 4
D = 8
ROT = 6  # partial rotary: channels past 6 pass through
TOL = 2e-5  # fp32 inputs vs the float64 reference


@dataclass(frozen=True)
class Case:
    cp: int
    layout: str
    causal: bool
    heads: tuple[int, int]  # (q heads, k/v heads)
    real: tuple[int, ...]  # thd: real document lengths; dense: real length of each batch row
    padded: bool  # thd: pass real + layout offsets (TE's cu_seqlens / cu_seqlens_padded); dense: real row lengths
    seq: int  # dense: global sequence length (multiple of 2·cp)
    seed: int
    lay: tuple[int, ...] = ()  # thd: layout (padded) document lengths, multiples of 2·cp, >= real
    comm: str = "p2p"  # the communication variant
    window: Optional[tuple[int, int]] = None  # (left, right), -1 unbounded
    sinks: bool = False  # draw attention sinks (and check their gradient)
    softcap: Optional[float] = None
    dv: int = D  # v's head dim (multi-latent attention when != D)


# ----------------------------------------------------------------------------------------------------------------
# Independent reference (no cpscope)


def ref_zigzag(layout_lens: list[int], cp: int, rank: int) -> torch.Tensor:
    """Full-tensor indices of rank ``rank``'s tokens: per document, chunk ``rank`` then chunk ``2cp-1-rank``."""
    parts, start = [], 0
    for n in layout_lens:
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def ref_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [t, h, D] float64 at positions ``pos``: non-interleaved RoPE on the first ROT channels, base 10000."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROT, 2, dtype=torch.float64) / ROT))
    ang = pos.double()[:, None] * inv[None, :]  # [t, ROT/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., : ROT // 2], x[..., ROT // 2 : ROT]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., ROT:]], dim=-1)


def ref_attention(q, k, v, doc_lens, causal, window=None, sinks=None, softcap=None):
    """float64 [t, h, D] attention per document (k/v heads repeated), positions restarting per document; a window
    ``(left, right)`` (-1 unbounded), sinks ``[h]`` (one logit per head, no value) and a tanh softcap."""
    h, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens, dtype=torch.long))
    pos = torch.cat([torch.arange(n) for n in doc_lens]) if doc_lens else torch.zeros(0, dtype=torch.long)
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        if window[0] != -1:
            allowed &= pos[None, :] >= pos[:, None] - window[0]
        if window[1] != -1:
            allowed &= pos[None, :] <= pos[:, None] + window[1]
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(h, s.shape[1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :q.shape[0]]
    return torch.einsum("hqk,khd->qhd", p, v), pos


# ----------------------------------------------------------------------------------------------------------------
# One case on one rank


def _layout_lens(case: Case) -> list[int]:
    if case.layout == "thd":
        return list(case.lay)
    return [case.seq] * len(case.real)


class _Rows:
    """Where the real tokens sit: in the padded layout (``where``), and which real token each local row holds
    (``local_real``, -1 at padding) in this rank's local order (thd: per document; dense: per batch row)."""

    def __init__(self, case: Case, rank: int) -> None:
        real, lay = list(case.real), _layout_lens(case)
        self.n_lay = sum(lay)
        starts = [sum(lay[:i]) for i in range(len(lay))]
        self.where = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, real)]) if real \
            else torch.zeros(0, dtype=torch.long)
        of_layout = torch.full((self.n_lay,), -1, dtype=torch.long)
        of_layout[self.where] = torch.arange(sum(real))
        if case.layout == "thd":
            idx = ref_zigzag(lay, case.cp, rank)  # [n_local] layout indices of the local rows
        else:  # dense local row (row i, local position j) is layout token i*S + zigzag(j)
            per_row = ref_zigzag([case.seq], case.cp, rank)
            idx = torch.cat([i * case.seq + per_row for i in range(len(real))])
        self.local_real = of_layout[idx]
        self.is_real = self.local_real >= 0

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:  # [n_real, ...] -> [n_lay, ...] with zeros at padding
        out = x.new_zeros((self.n_lay, *x.shape[1:]))
        out[self.where] = x
        return out


def _reference(case: Case, rows: _Rows) -> dict:
    """The case's float64 inputs (real tokens, concatenated) and the reference: out, dq, dk, dv over all rows and
    the sinks' gradient of this rank's rows."""
    g = torch.Generator().manual_seed(case.seed)
    (h, hk), real = case.heads, list(case.real)
    n = sum(real)
    q = torch.randn(n, h, D, generator=g, dtype=torch.float64)
    dout = torch.randn(n, h, case.dv, generator=g, dtype=torch.float64)
    k = torch.randn(n, hk, D, generator=g, dtype=torch.float64)
    v = torch.randn(n, hk, case.dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64) if case.sinks else None
    q_r, k_r, v_r = (t.clone().requires_grad_(True) for t in (q, k, v))
    s_r = None if sinks is None else sinks.clone().requires_grad_(True)
    pos = torch.cat([torch.arange(m) for m in real]) if real else torch.zeros(0, dtype=torch.long)
    out, _ = ref_attention(ref_rope(q_r, pos), ref_rope(k_r, pos), v_r, real, case.causal, case.window, s_r,
                           case.softcap)
    ref = {"inputs": (q, k, v, dout, sinks), "dsinks": None}
    own = rows.local_real[rows.is_real]
    if s_r is not None:  # the sinks' gradient of this rank's rows: what its sinks receive
        (ref["dsinks"],) = torch.autograd.grad((out[own] * dout[own]).sum(), s_r, retain_graph=True)
    out.backward(dout)
    ref.update(out=out.detach(), dq=q_r.grad, dk=k_r.grad, dv=v_r.grad)
    return ref


def _run_cpscope(case: Case, group, full: list, dout_l: torch.Tensor, sk) -> tuple:
    """Shard, rotate and attend under ``group``: ``(out, local q/k/v leaves, local dout)``."""
    real, lay = list(case.real), _layout_lens(case)
    freqs = cpscope.rotary_freqs(ROT, max(lay + [1]))
    feats = dict(window=case.window, sinks=sk, softcap=case.softcap, causal=case.causal, comm=case.comm)
    with cpscope.runtime_cp(group):
        if case.layout == "thd":
            cu_lay = torch.tensor([0] + [sum(lay[: i + 1]) for i in range(len(lay))], dtype=torch.int32)
            cu_real = torch.tensor([0] + [sum(real[: i + 1]) for i in range(len(real))], dtype=torch.int32)
            kw = dict(cu_seqlens=cu_real, cu_seqlens_padded=cu_lay) if case.padded else dict(cu_seqlens=cu_lay)
            loc = [cpscope.zigzag_shard(t, seq_dim=0, cu_seqlens=cu_lay).requires_grad_(True) for t in full]
            rq, rk = (cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="thd", **kw) for t in loc[:2])
            out = cpscope.context_parallel_attention(rq, rk, loc[2], qkv_format="thd", **kw, **feats)
            return out, loc, cpscope.zigzag_shard(dout_l, seq_dim=0, cu_seqlens=cu_lay)
        b, S = len(real), case.seq
        dense = [t.view(b, S, *t.shape[1:]) for t in (*full, dout_l)]  # [b, S, h, D]
        if case.layout == "sbhd":
            dense = [t.transpose(0, 1).contiguous() for t in dense]
        sd = 1 if case.layout == "bshd" else 0
        loc = [cpscope.zigzag_shard(t, seq_dim=sd).requires_grad_(True) for t in dense[:3]]
        kw = {}
        if case.padded:
            kw = dict(cu_seqlens=torch.tensor([0] + [sum(real[: i + 1]) for i in range(b)], dtype=torch.int32))
        rq, rk = (cpscope.apply_rotary_pos_emb(t, freqs, qkv_format=case.layout) for t in loc[:2])
        out = cpscope.context_parallel_attention(rq, rk, loc[2], qkv_format=case.layout, **kw, **feats)
        return out, loc, cpscope.zigzag_shard(dense[3], seq_dim=sd)


def check_case(case: Case, groups: dict) -> Optional[str]:
    """Run ``case`` on this rank; return a description of the first mismatch (None when everything matches)."""
    rank = dist.get_rank(groups[case.cp]) if case.cp > 1 else 0
    rows = _Rows(case, rank)
    ref = _reference(case, rows)
    q, k, v, dout, sinks = ref["inputs"]
    sk = None if sinks is None else sinks.float().requires_grad_(True)
    out, loc, do = _run_cpscope(case, groups[case.cp], [rows.to_layout(t).float() for t in (q, k, v)],
                                rows.to_layout(dout).float(), sk)

    def local_rows(x):  # local tensor -> [n_local rows, ...] in this rank's local order
        if case.layout == "sbhd":
            x = x.transpose(0, 1)
        return x if case.layout == "thd" else x.reshape(-1, *x.shape[2:])

    check = (rows.local_real, rows.is_real, case, rank)
    forward_error = _mismatch("out", local_rows(out.detach()), ref["out"], *check)
    # all ranks agree whether to run backward (a rank skipping it alone would leave the others waiting)
    flag = torch.tensor([forward_error is not None], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        return forward_error or "forward mismatch on another rank"
    out.backward(do)
    for name, leaf in zip(("dq", "dk", "dv"), loc):
        error = _mismatch(name, local_rows(leaf.grad), ref[name], *check)
        if error is not None:
            return error
    if sk is not None:
        want = ref["dsinks"]
        err = (sk.grad.double() - want).abs().max().item()
        if not err <= TOL * max(1.0, want.abs().max().item()) * 4:
            return f"dsinks: max error {err:.3g} on CP rank {rank} for {case}"
    return None


def _mismatch(name, got, ref, local_real, is_real, case, rank) -> Optional[str]:
    """Local rows vs the reference (real rows) and zeros (padding rows)."""
    x = got.double()
    want = torch.zeros_like(x)
    want[is_real] = ref[local_real[is_real]]
    err = (x - want).abs().max().item() if x.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    if not err <= TOL * scale:  # NaN fails too
        return f"{name}: max error {err:.3g} (tolerance {TOL * scale:.3g}) on CP rank {rank} for {case}"
    return None


def _groups() -> dict:
    return cpscope.new_cp_groups([1, 2, 4], hierarchical=True)


def _run(case: Case) -> Optional[str]:
    return check_case(case, _groups())


def _run_planted(case: Case, plant: str) -> Optional[str]:
    """``check_case`` with a planted bug: a swapped zigzag chunk order, or a ring that turns the wrong way."""
    from cpscope import _pack
    from cpscope.attention import _exchange as comm

    cpscope.clear_caches()
    saved_index, saved_init = _pack._zigzag_index, comm.RingComm.__init__
    if plant == "zigzag":
        _pack._zigzag_index = lambda cu, cp, rank: saved_index(cu, cp, cp - 1 - rank)

    if plant == "ring":
        def reversed_init(self, group, rank, size):
            saved_init(self, group, rank, size)
            self.next, self.prev = self.prev, self.next

        comm.RingComm.__init__ = reversed_init
    try:
        return check_case(case, _groups())
    finally:
        _pack._zigzag_index, comm.RingComm.__init__ = saved_index, saved_init
        cpscope.clear_caches()


# ----------------------------------------------------------------------------------------------------------------
# Strategies


@st.composite
def cases(draw) -> Case:
    cp = draw(st.sampled_from([1, 2, 4]))
    layout = draw(st.sampled_from(["thd", "thd", "bshd", "sbhd"]))
    causal = draw(st.booleans())
    heads = draw(st.sampled_from([(4, 4), (4, 2), (4, 1)]))  # MHA, GQA, MQA
    padded = draw(st.booleans())
    m = 2 * cp
    unit = st.one_of(st.just(0), st.just(m), st.integers(1, 3 * m), st.just(4 * m + 2 * m))  # 0, 2cp, any, long
    lay: list[int] = []
    if layout == "thd":
        real = draw(st.lists(unit, min_size=1, max_size=5))
        if sum(real) == 0:
            real = real[:-1] + [m]
        if padded:  # each document padded at its end to a multiple of 2cp, sometimes by one more 2cp block
            lay = [-(-n // m) * m + m * draw(st.integers(0, 1)) for n in real]
        else:
            real = [-(-n // m) * m for n in real]  # whole documents, no padding
            lay = list(real)
        seq = 0
    else:
        seq = m * draw(st.integers(1, 3))
        b = draw(st.integers(1, 2))
        real = [draw(st.integers(0, seq)) if padded else seq for _ in range(b)]
    comms = ["p2p", "auto"]
    if not (padded and not causal):  # padding without a causal mask: only the ring masks it
        comms.append("all_gather")
        if heads[0] % cp == 0:  # k/v heads replicated as needed
            comms.append("a2a")
        if cp == 4:
            comms.append("a2a+p2p:2")
    comm = draw(st.sampled_from(comms))
    side = st.one_of(st.just(-1), st.integers(0, 3 * m), st.integers(0, 2))  # unbounded, within a few chunks, tiny
    window = draw(st.one_of(st.none(), st.tuples(side, st.just(0) if causal else side)))
    sinks, softcap = draw(st.booleans()), draw(st.sampled_from([None, None, 1.5, 30.0]))
    dv = draw(st.sampled_from([D, D, 12]))
    return Case(cp, layout, causal, heads, tuple(real), padded, seq, draw(st.integers(0, 2**16)), tuple(lay), comm,
                window, sinks, softcap, dv)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True, database=None)
@given(case=cases())
def test_fuzz_shard_rope_attention_vs_float64(case):
    results = run_ranks(WORLD, _run, case, timeout=120)
    bad = [r for r in results if r is not None]
    assert not bad, bad[0]


@pytest.mark.parametrize("plant", ["zigzag", "ring"])
def test_planted_bugs_are_caught(plant):
    """The checker is not blind: a wrong zigzag chunk order and a reversed ring both produce mismatches."""
    case = Case(4, "thd", True, (4, 2), (16, 8, 24), False, 0, 7, (16, 8, 24), "p2p")
    assert all(r is None for r in run_ranks(WORLD, _run, case, timeout=60))
    results = run_ranks(WORLD, _run_planted, case, plant, timeout=60)
    assert any(r is not None for r in results), f"planted {plant} bug went unnoticed"
