"""A fake of aten's memory-efficient attention ops (``_efficient_attention_forward`` / ``_backward``) for CPU tests of
cpscope's glue around them (:data:`cpscope.attention._kernels.aten.EFFICIENT`).

It follows the ops' contract as the CUDA kernels implement it, not cpscope's block API: ``[B, M, H, K]`` inputs with
**one** head count for q, k and v (no GQA); packed inputs as ``B = 1`` with ``cu_seqlens_q/k`` and ``max_seqlen``;
``custom_mask_type`` 0 (none), 1 (causal from the top left) or 2 (causal from the bottom right, per sequence);
statistics ``[B or sequences, H, ceil(max_q / 32) * 32]`` (row ``i`` of sequence ``n`` at ``[n, :, i]``), the rows
past a sequence's end padded with ``+inf``, rows that see no key ``-inf`` with an undefined output (NaN here, so that
glue that forgets them fails); the backward reads the statistics in that layout. Nothing here imports cpscope.
"""
from __future__ import annotations

import math
import types

import torch

ALIGN = 32


def _segments(q, k, cu_q, cu_k):
    if cu_q is None:
        return [(b, slice(0, q.shape[1]), slice(0, k.shape[1])) for b in range(q.shape[0])]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(0, slice(a, b), slice(c, e)) for a, b, c, e in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])]


def _mask(n_q: int, n_k: int, kind: int) -> torch.Tensor:
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    if kind == 0:
        return torch.ones(n_q, n_k, dtype=torch.bool)
    return j <= i + (n_k - n_q if kind == 2 else 0)


def _check(q, k, v):
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise RuntimeError(f"fake efficient attention: q/k/v heads must match, got {q.shape[2]}, {k.shape[2]}, "
                           f"{v.shape[2]}")


def forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            custom_mask_type, compute_log_sumexp=False, *, scale=None, seqlen_k=None, window_size=None):
    assert bias is None and dropout_p == 0.0 and compute_log_sumexp and window_size is None
    _check(query, key, value)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    segs = _segments(query, key, cu_seqlens_q, cu_seqlens_k)
    m = query.shape[1] if cu_seqlens_q is None else max_seqlen_q
    n = query.shape[0] if cu_seqlens_q is None else len(segs)
    out = torch.full((*query.shape[:3], value.shape[-1]), float("nan"), dtype=query.dtype)
    lse = torch.full((n, query.shape[2], -(-m // ALIGN) * ALIGN), float("inf"), dtype=torch.float32)
    for idx, (b, sq, sk) in enumerate(segs):
        qs, ks, vs = (x[b].double() for x in (query[:, sq], key[:, sk], value[:, sk]))
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(~_mask(qs.shape[0], ks.shape[0], custom_mask_type), float("-inf"))
        lt = torch.logsumexp(s, -1)  # [h, q]; -inf where nothing is visible
        o = torch.einsum("hqk,khd->qhd", torch.exp(s - lt.unsqueeze(-1)), vs)  # NaN rows where nothing is visible
        out[b, sq] = o.to(query.dtype)
        lse[idx if cu_seqlens_q is not None else b, :, : qs.shape[0]] = lt.float()
    z = torch.zeros((), dtype=torch.int64)
    return out, lse, z, z, m, key.shape[1] if cu_seqlens_k is None else max_seqlen_k


def backward(grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type, bias_requires_grad, *, scale=None,
             num_splits_key=None, window_size=None, shared_storage_dqdkdv=False):
    assert bias is None and dropout_p == 0.0 and not bias_requires_grad
    _check(query, key, value)
    m = query.shape[1] if cu_seqlens_q is None else max_seqlen_q
    if logsumexp.shape[-1] != -(-m // ALIGN) * ALIGN:
        raise RuntimeError(f"fake efficient attention: logsumexp {tuple(logsumexp.shape)} for max_seqlen_q {m}")
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype) for x in (query, key, value))
    for idx, (b, sq, sk) in enumerate(_segments(query, key, cu_seqlens_q, cu_seqlens_k)):
        qs, ks, vs, os_, dos = (x[b].double() for x in (query[:, sq], key[:, sk], value[:, sk], out[:, sq],
                                                           grad_out[:, sq]))
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(~_mask(qs.shape[0], ks.shape[0], custom_mask_type), float("-inf"))
        lt = logsumexp[idx if cu_seqlens_q is not None else b, :, : qs.shape[0]].double()
        p = torch.exp(s - lt.unsqueeze(-1))  # an lse of +inf gives p = 0
        delta = (dos * os_).sum(-1).t()  # [h, q]
        ds = p * (torch.einsum("qhd,khd->hqk", dos, vs) - delta.unsqueeze(-1))
        dq[b, sq] = (torch.einsum("hqk,khd->qhd", ds, ks) * scale).to(dq.dtype)
        dk[b, sk] = (torch.einsum("hqk,qhd->khd", ds, qs) * scale).to(dk.dtype)
        dv[b, sk] = torch.einsum("hqk,qhd->khd", p, dos).to(dv.dtype)
    return dq, dk, dv, torch.empty(0)


def fake_aten() -> types.SimpleNamespace:
    """An object with the two ops, to stand in for ``torch.ops.aten`` where the glue calls them."""
    return types.SimpleNamespace(_efficient_attention_forward=forward, _efficient_attention_backward=backward)
