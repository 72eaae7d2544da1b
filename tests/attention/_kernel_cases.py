"""Parity of cpscope's CUDA blocks with windows, softcapping and multi-latent head dims against float64 references
computed on the GPU (``tests/attention/test_kernels_gpu.py``; ``benchmarks/bench_attention_features.py --check``).

Each case runs one block through the router (:mod:`cpscope.attention._kernels.router`) under the policy its route
names (``cudnn`` / ``plain``: the default, cuDNN where the table allows it; ``flash``: cuDNN off, so
flash-attention-2; ``flex``, given to :func:`run_case`: FlexAttention first),
forward and backward — the backward given the reference's out and lse, as the ring gives the merged ones — and
returns relative errors of out, lse (rows that see a key), dq, dk, dv, whether rows that see no key came out as
``out = 0, lse = -inf``, ``ok``, what cuDNN refused to build in this case (``cudnn_refused``: the block then ran on
the next route, see :mod:`cpscope.attention._kernels.router`) and the route each block took (``routes``). ``split``
cases cut the keys of one windowed block in two blocks (each with the window that the bottom-right alignment gives
it), merge the two by their log-sum-exp and run both backwards with the merged statistics: external statistics,
blocks with more queries than keys, and rows with no key.

The reference is written here from the block contract (query ``i`` of ``n_q`` sees key ``j`` of ``n_k`` iff
``-left <= j - (i + n_k - n_q) <= right``; ``right`` 0 when causal; softcap before the mask), not from cpscope.

Example::

    results = [run_case(c, torch.device("cuda")) for c in CASES]
"""
from __future__ import annotations

import math
from typing import Any

import torch

from tests.attention._fake_cudnn import visible  # the block contract's mask (one copy)

REL_TOL = 1e-2
W_SMALL = 255  # the window of the small parity cases

# name: (route, layout, (n_q, n_k) or (cu_q, cu_k), (h, h_kv, d, d_v), causal, window, softcap)
_CU = [0, 300, 812, 1024, 1536]
_CU_HALO = [0, 428, 1068, 1408, 2048]  # each sequence 128 keys longer than its queries (a halo before them)
CASES: dict[str, tuple] = {
    "dense_causal_band": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), True, None, None),
    "dense_window": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "dense_window_sbhd": ("cudnn", "sbhd", (1024, 1024), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "dense_window_full": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), False, (100, 50), None),
    "dense_right_only": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), False, (-1, 64), None),
    "dense_left_only": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), False, (128, -1), None),
    "dense_halo_window": ("cudnn", "bshd", (768, 1024), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "dense_more_q_window": ("cudnn", "bshd", (1024, 768), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "dense_softcap_full": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), False, None, 30.0),
    "dense_softcap_causal": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), True, None, 30.0),
    "dense_softcap_window": ("cudnn", "bshd", (1024, 1024), (8, 2, 128, 128), True, (W_SMALL, 0), 30.0),
    "dense_softcap_halo": ("cudnn", "bshd", (768, 1024), (8, 2, 128, 128), True, (W_SMALL, 0), 30.0),
    "dense_softcap_more_q": ("cudnn", "bshd", (1024, 768), (8, 2, 128, 128), True, (W_SMALL, 0), 30.0),
    "dense_mla_window": ("cudnn", "bshd", (1024, 1024), (8, 8, 192, 128), True, (W_SMALL, 0), None),
    "dense_mla_softcap": ("cudnn", "bshd", (1024, 1024), (8, 8, 192, 128), True, None, 30.0),
    "dense_mla_plain": ("plain", "bshd", (1024, 1024), (8, 8, 192, 128), True, None, None),
    "split_window": ("cudnn", "split", (1024, 1024), (8, 2, 128, 128), True, (511, 0), None),
    "split_softcap_window": ("cudnn", "split", (1024, 1024), (8, 2, 128, 128), True, (511, 0), 30.0),
    "thd_causal_band": ("cudnn", "thd", (_CU, _CU), (8, 2, 128, 128), True, (-1, 0), None),
    "thd_window": ("cudnn", "thd", (_CU, _CU), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "thd_window_full": ("cudnn", "thd", (_CU, _CU), (8, 2, 128, 128), False, (100, 50), None),
    "thd_halo_window": ("cudnn", "thd", (_CU, _CU_HALO), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "thd_more_q_window": ("cudnn", "thd", (_CU_HALO, _CU), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "thd_softcap_causal": ("cudnn", "thd", (_CU, _CU), (8, 2, 128, 128), True, None, 30.0),
    "thd_softcap_window": ("cudnn", "thd", (_CU, _CU), (8, 2, 128, 128), True, (W_SMALL, 0), 30.0),
    "thd_softcap_halo": ("cudnn", "thd", (_CU, _CU_HALO), (8, 2, 128, 128), True, (W_SMALL, 0), 30.0),
    "thd_mla_window": ("cudnn", "thd", (_CU, _CU), (8, 8, 192, 128), True, (W_SMALL, 0), None),
    "thd_mla_plain": ("plain", "thd", (_CU, _CU), (8, 8, 192, 128), True, None, None),
    "flash_dense_window": ("flash", "bshd", (1024, 1024), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "flash_dense_window_full": ("flash", "bshd", (1024, 1024), (8, 2, 128, 128), False, (100, 50), None),
    "flash_dense_more_q": ("flash", "bshd", (1024, 768), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "flash_dense_halo": ("flash", "bshd", (768, 1024), (8, 2, 128, 128), True, (W_SMALL, 0), None),
    "flash_mla_window": ("flash", "bshd", (1024, 1024), (8, 8, 192, 128), True, (W_SMALL, 0), None),
    "flash_thd_window": ("flash", "thd", (_CU, _CU), (8, 2, 128, 128), True, (W_SMALL, 0), None),
}


def reference(q, k, v, dout, scale, causal, window, softcap, cu=None):
    """float64 ``(out, lse, dq, dk, dv)``; dense ``[b, s, h, d]`` (lse ``[b, h, s]``) or packed with
    ``cu = (cu_q, cu_k)`` (lse ``[h, t]``)."""
    qr, kr, vr = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    if cu is None:
        segs = [(qr[i], kr[i], vr[i]) for i in range(q.shape[0])]
    else:
        segs = [(qr[a:b], kr[c:e], vr[c:e]) for a, b, c, e in zip(cu[0][:-1], cu[0][1:], cu[1][:-1], cu[1][1:])]
    outs, lses = [], []
    for qs, ks, vs in segs:
        g = qs.shape[1] // ks.shape[1]
        s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(g, 1)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible(qs.shape[0], ks.shape[0], causal, window, q.device), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        outs.append(torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(g, 1)))
        lses.append(lse)
    out = torch.stack(outs) if cu is None else torch.cat(outs)
    lse = torch.stack(lses) if cu is None else torch.cat(lses, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(layout, shape, dims, dev, gen):
    h, h_kv, d, dv = dims
    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    if layout == "thd":
        cu_q, cu_k = shape
        return mk(cu_q[-1], h, d), mk(cu_k[-1], h_kv, d), mk(cu_k[-1], h_kv, dv), mk(cu_q[-1], h, dv)
    n_q, n_k = shape
    q, k, v, do = mk(2, n_q, h, d), mk(2, n_k, h_kv, d), mk(2, n_k, h_kv, dv), mk(2, n_q, h, dv)
    if layout == "sbhd":  # [s, b, h, d] memory, seen as [b, s, h, d] views
        q, k, v, do = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v, do))
    return q, k, v, do


def _taken(direction: str, q, k, v, vl, c, w, sc) -> dict:
    """After a block ran: the first route the table offers it here (``first``; ``first_bf16``: for bf16 inputs),
    the route it takes now (``took``: the next one where cuDNN refused the graph) and the recorded refusal
    (``refused``, ``None`` if none) — all under the policy in force."""
    from cpscope.attention._kernels import router

    kind = router.kind_of(q, k, v, causal=c, varlen=vl, window=w, softcap=sc)
    caps = router.caps_of(q.device)
    first = router.routes_for(kind, caps, q.dtype)[0]
    took = router.choose(q, k, v, causal=c, varlen=vl, window=w, softcap=sc, direction=direction)
    why = router.fallbacks().get(router._refusal_key(first, kind, direction, q, k, v))
    return {"direction": direction, "kind": kind, "first": first, "took": took, "refused": why,
            "first_bf16": router.routes_for(kind, caps, torch.bfloat16)[0]}


def _block_fns(route: str, vl: Any, routes: list):
    from cpscope.attention._kernels import Placeholders, block_backward, block_forward
    from cpscope.attention._policy import use_kernel_policy

    ph = Placeholders()  # one call's: the dense forwards' placeholders for their backwards
    changes = {"flash": {"dense_cudnn": False, "varlen": "flash"}, "flex": {"flex": "first"}}.get(route, {})

    def fwd(q, k, v, s, c, w, sc):
        with use_kernel_policy(**changes):
            res = block_forward(q, k, v, scale=s, causal=c, varlen=vl, window=w, softcap=sc, placeholders=ph)
            routes.append(_taken("forward", q, k, v, vl, c, w, sc))
            return res

    def bwd(do, q, k, v, o, l, s, c, w, sc):
        with use_kernel_policy(**changes):
            res = block_backward(do, q, k, v, o, l, scale=s, causal=c, varlen=vl, window=w, softcap=sc,
                                 placeholders=ph)
            routes.append(_taken("backward", q, k, v, vl, c, w, sc))
            return res

    return fwd, bwd


def _errors(out, lse, grads, ref) -> dict:
    seen = torch.isfinite(ref[1])
    res = {"out": rel(out, ref[0]), "lse": rel(lse[seen], ref[1][seen]),
           "dq": rel(grads[0], ref[2]), "dk": rel(grads[1], ref[3]), "dv": rel(grads[2], ref[4])}
    res["unseen_rows"] = int((~seen).sum())
    res["unseen_ok"] = bool(torch.equal(torch.isfinite(lse), seen))
    res["ok"] = res["unseen_ok"] and all(res[n] <= REL_TOL for n in ("out", "dq", "dk", "dv")) and res["lse"] < 1e-3
    return res


def _split(q, k, v, do, fwd, bwd, scale, causal, window, softcap):
    """Keys cut at ``n_k - m``: block 1 sees the window ``(left - m, m)`` (not causal), block 2 ``(left, 0)``."""
    left, m = window[0], 384
    cut = k.shape[1] - m
    parts = [(k[:, :cut], v[:, :cut], False, (left - m, m)), (k[:, cut:], v[:, cut:], causal, window)]
    res = [fwd(q, kk, vv, scale, c, w, softcap) for kk, vv, c, w in parts]
    lse = torch.logaddexp(res[0][1], res[1][1])
    out = sum(o.float() * torch.exp(l_ - lse).transpose(1, 2).unsqueeze(-1) for o, l_ in res).to(q.dtype)
    ref = reference(q, k, v, do, scale, causal, window, softcap)
    grads = [bwd(do, q, kk, vv, ref[0].to(q.dtype), ref[1].float(), scale, c, w, softcap) for kk, vv, c, w in parts]
    dq = grads[0][0].float() + grads[1][0].float()
    dk, dv = torch.cat([grads[0][1], grads[1][1]], 1), torch.cat([grads[0][2], grads[1][2]], 1)
    return _errors(out, lse, (dq, dk, dv), ref)


def run_case(name: str, dev: torch.device, seed: int = 0, route: Any = None) -> dict:
    """Relative errors of case ``name`` (see :data:`CASES`) and whether it is within tolerance (``ok``); ``route``
    (e.g. ``"flex"``: FlexAttention first) replaces the case's own."""
    from cpscope.attention._kernels import Varlen

    own, layout, shape, dims, causal, window, softcap = CASES[name]
    route = route or own
    gen = torch.Generator(device=dev).manual_seed(1000 + seed)
    q, k, v, do = _inputs("bshd" if layout == "split" else layout, shape, dims, dev, gen)
    scale = 1.0 / math.sqrt(dims[2])
    vl, cu = None, None
    if layout == "thd":
        cu = shape
        lens = [[b - a for a, b in zip(c[:-1], c[1:])] for c in cu]
        t = lambda c: torch.tensor(c, dtype=torch.int32, device=dev)  # noqa: E731
        vl = Varlen(t(cu[0]), t(cu[1]), max(lens[0]), max(lens[1]), tuple(cu[0]), tuple(cu[1]))
    from cpscope.attention._kernels import fallbacks

    routes: list = []
    fwd, bwd = _block_fns(route, vl, routes)
    before = set(fallbacks())
    if layout == "split":
        res = _split(q, k, v, do, fwd, bwd, scale, causal, window, softcap)
    else:
        out, lse = fwd(q, k, v, scale, causal, window, softcap)
        ref = reference(q, k, v, do, scale, causal, window, softcap, cu)
        grads = bwd(do, q, k, v, ref[0].to(q.dtype), ref[1].float(), scale, causal, window, softcap)
        res = _errors(out, lse, grads, ref)
    refused = {str(k[0]): why for k, why in fallbacks().items() if k not in before}
    return {"route": route, "layout": layout, **res, "cudnn_refused": refused, "routes": routes}
