"""Attention sinks on the final ``(out, lse)`` of some query rows, one pass over ``out`` each way (Triton on CUDA,
torch elsewhere).

A sink adds one logit per q head to every softmax denominator, with no value (gpt-oss):
``out_i = sum_j exp(s_ij) v_j / (exp(sink) + sum_j exp(s_ij))``. No kernel needs to know: once the blocks are merged,

* :func:`merge_sinks_` — ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')`` (in place; a row that saw
  no key gets ``out = 0``, ``lse = sink``); the blocks' backward then takes ``(out', lse')`` as the merged statistics;
* :func:`sink_terms` — each row's share of ``d loss / d sink``: ``-exp(sink - lse') * (dout . out')``.

Why fused: in torch ops the two cost fp32 copies of ``out`` and ``dout``, a product and a reduction per forward +
backward, a visible share of the causal attention itself (``docs/attention_kernels.md`` §4, §13); here each is one
read (and one write) of ``out`` in its own dtype.

Layouts (as :mod:`cpscope.attention._kernels.block`): dense ``out`` ``[b, s, h, d]`` with ``lse`` ``[b, h, s]``; varlen
``[t, h, d]`` with ``[h, t]``. Any strides. fp32 math (fp64 inputs take the torch path in fp64).

Example::

    merge_sinks_(out, lse, sinks)                      # after the last block merged
    dsinks = sink_terms(dout, out, lse, sinks).sum((0, 1))   # dense; varlen: .sum(0)
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._tensor_cache import lru

__all__ = ["merge_sinks_", "sink_terms"]

_MAX_TILE = 4096  # elements of one program's [BLOCK_H, BLOCK_D] tile


@lru(maxsize=1)  # cpscope.clear_caches() drops the jitted kernels (Triton's disk cache stays)
def _jitted() -> Optional[tuple]:
    """``(merge, terms)`` jitted kernels, or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def sink_merge_kernel(O, L, SK, H, D, so_b, so_s, so_h, so_d, sl_b, sl_h, sl_s,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        hh = (tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        dd = tl.arange(0, BLOCK_D).to(tl.int64)
        mh, md = hh < H, dd < D
        lp = L + b * sl_b + hh * sl_h + s * sl_s
        lse = tl.load(lp, mask=mh, other=float("-inf")).to(tl.float32)
        sk = tl.load(SK + hh, mask=mh, other=0.0).to(tl.float32)
        m = tl.maximum(lse, sk)
        new = m + tl.log(tl.exp(lse - m) + tl.exp(sk - m))
        w = tl.exp(lse - new)  # 0 for a row that saw no key (lse -inf)
        op = O + b * so_b + s * so_s + hh[:, None] * so_h + dd[None, :] * so_d
        mo = mh[:, None] & md[None, :]
        o = tl.load(op, mask=mo, other=0.0).to(tl.float32)
        tl.store(op, (o * w[:, None]).to(O.dtype.element_ty), mask=mo)
        tl.store(lp, new, mask=mh)

    @triton.jit
    def sink_terms_kernel(DO, O, L, SK, T, H, D, sd_b, sd_s, sd_h, sd_d, so_b, so_s, so_h, so_d, sl_b, sl_h, sl_s,
                     st_b, st_s, st_h, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        hh = (tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        dd = tl.arange(0, BLOCK_D).to(tl.int64)
        mh, md = hh < H, dd < D
        mo = mh[:, None] & md[None, :]
        do = tl.load(DO + b * sd_b + s * sd_s + hh[:, None] * sd_h + dd[None, :] * sd_d, mask=mo, other=0.0)
        o = tl.load(O + b * so_b + s * so_s + hh[:, None] * so_h + dd[None, :] * so_d, mask=mo, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        lse = tl.load(L + b * sl_b + hh * sl_h + s * sl_s, mask=mh, other=float("-inf")).to(tl.float32)
        sk = tl.load(SK + hh, mask=mh, other=0.0).to(tl.float32)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(sk - lse))
        tl.store(T + b * st_b + s * st_s + hh * st_h, -w * delta, mask=mh)

    return sink_merge_kernel, sink_terms_kernel


def _batched(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense views ``[b, s, h, d]`` / ``[b, h, s]`` of either layout."""
    return (out, lse) if out.dim() == 4 else (out.unsqueeze(0), lse.unsqueeze(0))


def _triton(*tensors: torch.Tensor) -> Optional[Any]:
    if not all(t.is_cuda for t in tensors) or any(t.dtype == torch.float64 for t in tensors):
        return None
    return _jitted()


def _tile(h: int, d: int) -> tuple[int, int]:
    import triton

    bd = triton.next_power_of_2(d)
    return max(1, min(triton.next_power_of_2(h), _MAX_TILE // bd)), bd


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """``[b, h, s]`` -> ``[b, s, h]`` (a view)."""
    return x.transpose(1, 2)


def merge_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """In place: ``lse = logaddexp(lse, sinks[h])``, ``out *= exp(lse_old - lse)`` (see the module docstring)."""
    o, lb = _batched(out, lse)
    k = _triton(out, lse)
    if k is None or lse.dtype != torch.float32:
        dt = torch.float64 if torch.float64 in (out.dtype, lse.dtype) else torch.float32
        new = torch.logaddexp(lb.to(dt), sinks.detach().to(device=lse.device, dtype=dt).view(1, -1, 1))
        w = torch.exp(lb.to(dt) - new)
        o.copy_(o.to(dt) * _head_major(w).unsqueeze(-1))
        lb.copy_(new)
        return
    sk = sinks.detach().to(device=lse.device, dtype=torch.float32).contiguous()
    b, s, h, d = o.shape
    bh, bd = _tile(h, d)
    grid = (s, b, (h + bh - 1) // bh)
    k[0][grid](o, lb, sk, h, d, *o.stride(), *lb.stride(), BLOCK_H=bh, BLOCK_D=bd)


def sink_terms(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``-exp(sinks[h] - lse) * (dout . out)`` per row and head: ``[b, s, h]`` (dense) / ``[t, h]`` (varlen), fp32
    (fp64 for fp64); ``out`` / ``lse`` are the final ones (sinks merged); 0 for a row whose ``lse`` is -inf."""
    o, lb = _batched(out, lse)
    do = dout if dout.dim() == 4 else dout.unsqueeze(0)
    k = _triton(dout, out, lse)
    if k is None:
        dt = torch.float64 if torch.float64 in (out.dtype, lse.dtype, dout.dtype) else torch.float32
        delta = (do.to(dt) * o.to(dt)).sum(-1)  # [b, s, h]
        lt = _head_major(lb.to(dt))
        w = torch.exp(sinks.detach().to(device=lse.device, dtype=dt) - lt.masked_fill(lt.isneginf(), 0))
        terms = -(w.masked_fill(lt.isneginf(), 0) * delta)
    else:
        b, s, h, d = o.shape
        terms = torch.empty((b, s, h), dtype=torch.float32, device=out.device)
        sk = sinks.detach().to(device=lse.device, dtype=torch.float32).contiguous()
        bh, bd = _tile(h, d)
        k[1][(s, b, (h + bh - 1) // bh)](do, o, lb, sk, terms, h, d, *do.stride(), *o.stride(), *lb.stride(),
                                         *terms.stride(), BLOCK_H=bh, BLOCK_D=bd)
    return terms if out.dim() == 4 else terms[0]
