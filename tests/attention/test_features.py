"""Sliding windows, attention sinks, softcapping and multi-latent head dims on every variant: rows and gradients
(q, k, v and sinks) equal an independent float64 full-sequence reference cut per rank, on 2 and 4 gloo ranks.

One rank task runs a whole (world size, variant) matrix — layouts x causal/full x MHA/GQA/MQA x {window, sinks,
softcap, MLA, all of them} — so the pool's start-up is paid once. Windows are drawn per case from short ones
(inside one chunk: the halo of one neighbour), ones spanning several chunks, one-sided and, without a causal mask,
right-reaching ones; documents shorter than the window and empty ones occur in ``thd``.
"""
from __future__ import annotations

import random
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.attention import ContextParallelAttention, context_parallel_attention
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

D, DV = 8, 12  # q/k head dim; v head dim of the MLA cases
TOL = 2e-5  # fp32 inputs against the float64 reference
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
FEATURES = ("window", "sinks", "softcap", "mla", "all")
CAUSAL_WINDOWS = [(3, 0), (6, 0), (1, 0), (9, 0)]
FULL_WINDOWS = [(3, 2), (6, 5), (-1, 3), (2, -1), (0, 9)]


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _lens(seed: int, unit: int) -> list[int]:
    """2-4 documents of 1-4 units (a unit is 2·cp tokens: chunks of 1-4), one of them empty every other seed."""
    rnd = random.Random(seed)
    lens = [unit * rnd.randint(1, 4) for _ in range(rnd.randint(2, 4))]
    if seed % 2:
        lens.insert(1, 0)
    return lens


def features(name: str, causal: bool, seed: int) -> dict[str, Any]:
    """The keywords of one feature case (``dv``: v's head dim; ``sinks``: whether to draw them)."""
    windows = CAUSAL_WINDOWS if causal else FULL_WINDOWS
    every = {"window": windows[seed % len(windows)], "sinks": True, "softcap": 1.5, "dv": DV}
    keys = {"window": ("window",), "sinks": ("sinks",), "softcap": ("softcap",), "mla": ("dv",),
            "all": tuple(every)}[name]
    return {k: every[k] for k in keys}


def _inputs(fmt: str, h: int, h_kv: int, dv: int, seed: int, cu: list[int], seq: int, batch: int, sinks: bool):
    """Full float64 q, k, v, dout ``[b, t, h, d]`` (b = 1 for thd) and sinks ``[h]`` (or None)."""
    g = torch.Generator().manual_seed(seed)
    b, t = (1, cu[-1]) if fmt == "thd" else (batch, seq)
    q = torch.randn(b, t, h, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, h_kv, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, h_kv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, t, h, dv, generator=g, dtype=torch.float64)
    s = torch.randn(h, generator=g, dtype=torch.float64) if sinks else None
    return q, k, v, dout, s


def _reference(q, k, v, dout, sinks, idx, *, causal, cu, window, softcap):
    """float64 out, dq, dk, dv over the whole sequences, and the sinks' gradient of the rows ``idx`` only."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    s = None if sinks is None else sinks.clone().requires_grad_(True)
    out = torch.stack([reference_attention(q[i], k[i], v[i], causal=causal, cu=cu, window=window, sinks=s,
                                           softcap=softcap) for i in range(len(q))])
    own = None
    if s is not None:  # this rank's rows only: what its sinks receive
        (own,) = torch.autograd.grad((out[:, idx] * dout[:, idx]).sum(), s, retain_graph=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, own


def _to_layout(x: torch.Tensor, fmt: str) -> torch.Tensor:  # canonical [b, t, h, d] -> fmt
    return x[0] if fmt == "thd" else (x.transpose(0, 1) if fmt == "sbhd" else x)


def check(group, comm: Optional[str], fmt: str, causal: bool, h: int, h_kv: int, feats: dict, *, seed: int = 0,
          batch: int = 2, lens: Optional[list[int]] = None, module: bool = False, wrap=None) -> float:
    """One call on this rank against the reference (forward, dq/dk/dv, the sinks' gradient); the worst error.

    ``module``: through :class:`ContextParallelAttention` (window / softcap at construction, sinks per call);
    ``wrap(fn, *tensors)``: runs the call (e.g. inside a checkpoint).
    """
    cp = 1 if group is None else group.size()
    r = 0 if group is None else dist.get_rank(group)
    seq = 8 * cp
    cu = _cu(lens if lens is not None else _lens(seed, 2 * cp)) if fmt == "thd" else [0, seq]
    window, softcap = feats.get("window"), feats.get("softcap")
    q, k, v, dout, sinks = _inputs(fmt, h, h_kv, feats.get("dv", D), seed, cu, seq, batch, feats.get("sinks", False))
    idx = zigzag_index(cu, cp, r)
    ref = _reference(q, k, v, dout, sinks, idx, causal=causal, cu=cu if fmt == "thd" else None, window=window,
                     softcap=softcap)
    loc = [_to_layout(t[:, idx], fmt).float().requires_grad_(True) for t in (q, k, v)]
    sk = None if sinks is None else sinks.float().requires_grad_(True)
    extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if fmt == "thd" else {}

    def attend(qq, kk, vv, ss):
        if module:
            attn = ContextParallelAttention(qkv_format=fmt, causal=causal, comm=comm, window=window, softcap=softcap)
            return attn(qq, kk, vv, sinks=ss, **extra)
        return context_parallel_attention(qq, kk, vv, qkv_format=fmt, causal=causal, comm=comm, window=window,
                                          softcap=softcap, sinks=ss, **extra)

    with cpscope.runtime_cp(group):
        out = wrap(attend, *loc, sk) if wrap is not None else attend(*loc, sk)
    out.backward(_to_layout(dout[:, idx], fmt).float())  # outside the scope, as in training
    got = [out, *(t.grad for t in loc)]
    want = [_to_layout(x[:, idx], fmt) for x in ref[:4]]
    if sk is not None:
        got.append(sk.grad)
        want.append(ref[4])
    worst = 0.0
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert a is not None and a.shape == b.shape, f"{name}: {None if a is None else a.shape} vs {b.shape}"
        err = (a.double() - b).abs().max().item() if b.numel() else 0.0
        assert err <= TOL * max(1.0, b.abs().max().item()), \
            f"{comm} {name}: max abs err {err:.3g} ({fmt}, causal={causal}, cp={cp}, rank={r}, heads {h}/{h_kv}, " \
            f"{feats}, cu={cu})"
        worst = max(worst, err)
    return worst


# ------------------------------------------------------------------------------------------------ the matrix


def _matrix(world: int, comm: str, formats: tuple[str, ...]) -> int:
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world])[world]
    n = 0
    for fmt in formats:
        for causal in (True, False):
            for s, (h, h_kv) in enumerate(HEADS):
                for j, name in enumerate(FEATURES):
                    seed = 100 * s + 10 * j + causal
                    check(group, comm, fmt, causal, h, h_kv, features(name, causal, seed), seed=seed)
                    n += 1
    return n


@pytest.mark.parametrize("world,comm", [(2, "p2p"), (4, "p2p"), (2, "all_gather"), (4, "all_gather"), (2, "a2a"),
                                        (4, "a2a"), (4, "a2a+p2p"), (2, "auto"), (4, "auto")])
def test_features_match_reference(world, comm):
    assert run_ranks(world, _matrix, world, comm, ("bshd", "sbhd", "thd")) == [90] * world
