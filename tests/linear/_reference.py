"""Float64 sequential references for the recurrences of cpscope.linear: plain per-token loops, written from the
models' definitions (transformers' recurrent forms), independent of the chunked / CP code under test.

Each takes full (unsharded) tensors ``[B, T, ...]`` and optional global ``cu_seqlens`` (``B == 1``): every document
runs on its own from a zero state.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F


def _per_document(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], cu: Optional[Sequence[int]]
                  ) -> torch.Tensor:
    """Apply ``fn`` to each row (``cu`` None) or each document of the single row, concatenating the outputs."""
    if cu is None:
        return torch.stack([fn(*(t[b] for t in tensors)) for b in range(tensors[0].shape[0])])
    parts = [fn(*(t[0, a:e] for t in tensors)) for a, e in zip(cu[:-1], cu[1:])]
    return torch.cat(parts)[None]


def delta_rule(q, k, v, g, beta, *, scale=None, cu=None, l2=False) -> torch.Tensor:
    """S_t = (I - b k kᵀ) diag(exp g) S_{t-1} + b k vᵀ; o_t = S_tᵀ (scale q_t); one row/document: [T, ...]."""
    H, K = q.shape[-2:]
    HV = v.shape[-2]
    scale = K ** -0.5 if scale is None else scale

    def one(q, k, v, g, beta):
        q, k = q.repeat_interleave(HV // H, 1), k.repeat_interleave(HV // H, 1)
        if l2:
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        S = q.new_zeros(HV, K, v.shape[-1])
        out = []
        for t in range(q.shape[0]):
            decay = g[t].exp()
            S = S * (decay[:, :, None] if g.dim() == 3 else decay[:, None, None])
            pred = torch.einsum("hkv,hk->hv", S, k[t])
            S = S + beta[t][:, None, None] * torch.einsum("hk,hv->hkv", k[t], v[t] - pred)
            out.append(torch.einsum("hkv,hk->hv", S, q[t] * scale))
        return torch.stack(out) if out else v.new_zeros(0, HV, v.shape[-1])

    return _per_document(one, (q, k, v, g, beta), cu)


def mamba2(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, float("inf")), cu=None):
    """s_t = exp(dt A) s_{t-1} + dt x_t B_tᵀ; y_t = s_t C_t + D x_t (transformers' recurrent Mamba2 step)."""
    H = x.shape[-2]

    def one(x, dt, B, C):
        if dt_bias is not None:
            dt = dt + dt_bias
        if dt_softplus:
            dt = F.softplus(dt)
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
        B, C = (t.repeat_interleave(H // t.shape[1], 1) for t in (B, C))
        s = x.new_zeros(H, x.shape[-1], B.shape[-1])
        out = []
        for t in range(x.shape[0]):
            s = torch.exp(dt[t] * A)[:, None, None] * s + torch.einsum("h,hp,hn->hpn", dt[t], x[t], B[t])
            y = torch.einsum("hpn,hn->hp", s, C[t])
            if D is not None:
                y = y + (D[:, None] if D.dim() == 1 else D) * x[t]
            out.append(y)
        return torch.stack(out) if out else x.new_zeros(0, *x.shape[1:])

    return _per_document(one, (x, dt, B, C), cu)


def conv1d(x, weight, bias=None, *, activation=None, cu=None) -> torch.Tensor:
    """y_t = act(bias + Σ_i w[:, i] x_{t-W+1+i}), x zero before the document start."""
    W = weight.shape[1]

    def one(x):
        out = []
        for t in range(x.shape[0]):
            y = bias.clone() if bias is not None else x.new_zeros(x.shape[1])
            for i in range(W):
                s = t - W + 1 + i
                if s >= 0:
                    y = y + weight[:, i] * x[s]
            out.append(F.silu(y) if activation else y)
        return torch.stack(out) if out else x.new_zeros(0, x.shape[1])

    return _per_document(one, (x,), cu)
