"""The cuDNN varlen block wrappers, checked on CPU against a fake kernel with cuDNN's documented contract.

The fake reproduces what PyTorch's ``_cudnn_attention_forward/backward`` do with ``cum_seq`` (read in MHA.cpp):
packed ``[t, h, d]`` inputs that must be contiguous (ragged offsets ``cum * h * d``), int32 offsets, and a
token-major log-sum-exp ``[t, h, 1]`` — so a wrapper that passes a head slice, or hands back / takes the lse in the
wrong layout, fails here. The kernel's own numerics are checked on GPU (``bench_attention.py --thd-cudnn``).
"""
from __future__ import annotations

import math

import pytest
import torch

from cpscope.attention import blocks
from cpscope.attention.blocks import Varlen
from tests.attention._reference import reference_attention

CU = [0, 6, 16, 20]
H, H_KV, D = 4, 2, 8


def _check_inputs(cu_q, cu_k, *ts):
    assert all(t.is_contiguous() for t in ts), "cuDNN ragged offsets assume packed contiguous [t, h, d]"
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32


def _scores(q, k, cu_q, cu_k, causal, scale):  # float64 [h, t_q, t_k], -inf outside a document / above diagonal
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        blk = torch.ones(b - a, e - c, dtype=torch.bool)
        allowed[a:b, c:e] = blk.tril() if causal else blk  # top-left, as cuDNN's causal mask
    return s.masked_fill(~allowed, float("-inf"))


def fake_forward(q, k, v, bias, cu_q, cu_k, max_q, max_k, lse_flag, p, causal, dbg, *, scale):
    _check_inputs(cu_q, cu_k, q, k, v)
    s = _scores(q, k, cu_q, cu_k, causal, scale)
    lse = torch.logsumexp(s, -1)  # [h, t]
    vv = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv).to(q.dtype)
    lse_thl = lse.t().contiguous().float().unsqueeze(-1)  # token-major [t, h, 1]
    return out, lse_thl, cu_q, cu_k, max_q, max_k, None, None, None


def fake_backward(dout, q, k, v, out, lse, seed, offset, bias, cu_q, cu_k, max_q, max_k, p, causal, *, scale):
    _check_inputs(cu_q, cu_k, dout, q, k, v, out, lse)
    assert lse.shape == (q.shape[0], q.shape[1], 1), lse.shape
    lse_ht = lse.reshape(q.shape[0], q.shape[1]).t().double()
    g = q.shape[1] // k.shape[1]
    kk, vv = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    p_ = torch.exp(_scores(q, k, cu_q, cu_k, causal, scale) - lse_ht[..., None])
    do = dout.double()
    dp = torch.einsum("qhd,khd->hqk", do, vv)
    ds = p_ * (dp - (do * out.double()).sum(-1).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = (torch.einsum("hqk,qhd->khd", ds, q.double()) * scale).unflatten(1, (k.shape[1], g)).sum(2)
    dv = torch.einsum("hqk,qhd->khd", p_, do).unflatten(1, (v.shape[1], g)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    t = CU[-1]
    # head slices of wider tensors: non-contiguous, as the ring's diagonal head split passes them
    q = torch.randn(t, 2 * H, D, generator=gen, dtype=torch.float64)[:, H:]
    k = torch.randn(t, 2 * H_KV, D, generator=gen, dtype=torch.float64)[:, :H_KV]
    v = torch.randn(t, 2 * H_KV, D, generator=gen, dtype=torch.float64)[:, H_KV:]
    dout = torch.randn(t, H, D, generator=gen, dtype=torch.float64)
    return q, k, v, dout


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cudnn_varlen_wrappers_match_reference(causal):
    q, k, v, dout = _inputs(3)
    cu = torch.tensor(CU, dtype=torch.int32)
    vl = Varlen(cu, cu, 10, 10)
    scale = 1 / math.sqrt(D)
    out, lse = blocks._cudnn_varlen_forward(q, k, v, scale, causal, vl, op=fake_forward)
    ref_in = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    ref = reference_attention(*ref_in, causal=causal, cu=CU)
    ref.backward(dout)
    assert torch.allclose(out, ref.detach(), atol=1e-10)
    assert lse.shape == (H, CU[-1]) and lse.is_contiguous()  # what merge.py expects: [h, t]
    want_lse = torch.logsumexp(_scores(q, k, cu, cu, causal, scale), -1)
    assert torch.allclose(lse.double(), want_lse, atol=1e-5)
    dq, dk, dv = blocks._cudnn_varlen_backward(dout, q, k, v, out, lse.double(), scale, causal, vl, op=fake_backward)
    for got, x in zip((dq, dk, dv), ref_in):
        assert torch.allclose(got, x.grad, atol=1e-5), (got - x.grad).abs().max()


def test_cudnn_varlen_causal_needs_equal_offsets():
    q, k, v, dout = _inputs(4)
    vl = Varlen(torch.tensor(CU, dtype=torch.int32), torch.tensor(CU, dtype=torch.int32), 10, 10)
    with pytest.raises(ValueError, match="identical q/k offsets"):
        blocks._cudnn_varlen_forward(q, k, v, 0.3, True, vl, op=fake_forward)


def test_cudnn_varlen_route_off_by_default():
    assert blocks._USE_CUDNN_VARLEN is False
