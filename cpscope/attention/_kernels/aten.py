"""PyTorch's own attention kernels (aten) as block kernels: cuDNN attention for dense blocks, flash-attention-2 for
dense and packed blocks, with a window and with a v head dim of its own.

* :data:`SDPA_CUDNN` — ``aten._scaled_dot_product_cudnn_attention`` on ``[b, h, s, d]`` views of dense blocks (what
  ``F.scaled_dot_product_attention`` picks on Hopper; GQA / MQA as they are: K/V with fewer heads, dK/dV returned
  with ``h_kv`` heads; any v head dim).
* :data:`SDPA_FLASH` — ``aten._scaled_dot_product_flash_attention`` on the same views.
* :data:`FLASH_VARLEN` — ``aten._flash_attention_forward`` / ``_backward`` on packed blocks.
* :data:`FLASH` — the same kernels with ``window_size_left/right`` (the bottom-right-aligned band of the block API),
  dense or packed. FA2 needs one head dim for q, k and v, so a smaller one is zero-padded (exact: zero columns add
  nothing to ``q . k`` nor to ``out``, whose extra columns are cut off); its ``lse`` of +inf for rows that see no
  key becomes -inf.
* :data:`EFFICIENT` — ``aten._efficient_attention_forward`` / ``_backward`` (the memory-efficient kernels that
  SDPA runs for fp32), dense or packed, causal bottom-right aligned, no window: the CUDA kernel of fp32 blocks
  (cuDNN and flash take fp16 / bf16 only). It takes one head count, so GQA K/V heads are repeated (and their
  gradients summed); its statistics are ``[batch or sequences, h, max_q rounded up to 32]``, so they are cut to
  (and padded back from) the block API's layout.

The dense SDPA kernels' backward takes placeholder outputs of their forward; they travel in the call's
:class:`~cpscope.attention._kernels.block.Placeholders`. No softcap here: blocks with one run elsewhere
(:mod:`.router`).

Example::

    out, lse = SDPA_CUDNN.forward(q, k, v, 0.125, True, None, None, None, ph)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .._mods import Band
from .block import Placeholders, Varlen, Window

__all__ = ["Kernel", "SDPA_CUDNN", "SDPA_FLASH", "FLASH_VARLEN", "FLASH", "EFFICIENT"]

_aten = torch.ops.aten


class Kernel(NamedTuple):
    """A block kernel: ``forward(q, k, v, scale, causal, vl, window, softcap, placeholders)`` → ``(out, lse)`` and
    ``backward(dout, q, k, v, out, lse, scale, causal, vl, window, softcap, placeholders)`` → ``(dq, dk, dv)``."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _ph(placeholders: Optional[Placeholders]) -> Placeholders:
    return placeholders if placeholders is not None else Placeholders()


def _sdpa_cudnn_forward(q, k, v, scale, causal, vl, window, softcap, placeholders):
    # [b, s, h, d] -> [b, h, s, d] views; the kernels read the bshd strides without copying.
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    res = _aten._scaled_dot_product_cudnn_attention.default(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
    _ph(placeholders).keep("cudnn", q.device, res)
    return res[0].transpose(1, 2), res[1].squeeze(-1)  # lse [b, h, s, 1] -> [b, h, s]


def _sdpa_cudnn_backward(dout, q, k, v, out, lse, scale, causal, vl, window, softcap, placeholders):
    cq, ck, seed, offset = _ph(placeholders).get("cudnn", q.device)
    args = [t.transpose(1, 2) for t in (dout, q, k, v, out)]
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward.default(
        *args, lse.unsqueeze(-1).contiguous(), seed, offset, None, cq, ck, q.shape[1], k.shape[1], 0.0, causal,
        scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _sdpa_flash_forward(q, k, v, scale, causal, vl, window, softcap, placeholders):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    res = _aten._scaled_dot_product_flash_attention.default(qt, kt, vt, 0.0, causal, False, scale=scale)
    _ph(placeholders).keep("flash", q.device, res)
    return res[0].transpose(1, 2), res[1]


def _sdpa_flash_backward(dout, q, k, v, out, lse, scale, causal, vl, window, softcap, placeholders):
    cq, ck, seed, offset = _ph(placeholders).get("flash", q.device)
    args = [t.transpose(1, 2) for t in (dout, q, k, v, out)]
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward.default(
        *args, lse.contiguous(), cq, ck, q.shape[1], k.shape[1], 0.0, causal, seed, offset, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _no_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _flash_varlen_forward(q, k, v, scale, causal, vl: Varlen, window, softcap, placeholders):
    out, lse, _rng, _unused, _dbg = _aten._flash_attention_forward(
        q, k, v, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_varlen_backward(dout, q, k, v, out, lse, scale, causal, vl: Varlen, window, softcap, placeholders):
    rng, unused = _no_rng(q.device)
    return _aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, 0.0, causal, rng, unused,
        scale=scale)


def _padded(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


def _band_args(q: torch.Tensor, k: torch.Tensor, causal: bool, vl: Optional[Varlen],
               window: Window) -> tuple[tuple[Any, ...], int, int]:
    band = Band.of(causal, window)
    left, right = band if band is not None else (-1, -1)
    seqs = (None, None, q.shape[1], k.shape[1]) if vl is None else (vl.cu_q, vl.cu_k, vl.max_q, vl.max_k)
    return seqs, left, right


def _flash_forward(q, k, v, scale, causal, vl, window, softcap, placeholders):
    d = max(q.shape[-1], v.shape[-1])
    qp, kp, vp = _padded(q, d), _padded(k, d), _padded(v, d)
    seqs, left, right = _band_args(q, k, causal, vl, window)
    out, lse, _rng, _unused, _dbg = _aten._flash_attention_forward(
        qp, kp, vp, *seqs, 0.0, causal, False, scale=scale, window_size_left=left, window_size_right=right)
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))  # FA2 marks rows with no key +inf
    return out[..., : v.shape[-1]], lse


def _flash_backward(dout, q, k, v, out, lse, scale, causal, vl, window, softcap, placeholders):
    d = max(q.shape[-1], v.shape[-1])
    qp, kp, vp, op, dop = (_padded(x, d) for x in (q, k, v, out, dout))
    seqs, left, right = _band_args(q, k, causal, vl, window)
    rng, unused = _no_rng(q.device)
    lse = lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()  # FA2's mark of a row with no key
    dq, dk, dv = _aten._flash_attention_backward(
        dop, qp, kp, vp, op, lse, *seqs, 0.0, causal, rng, unused, scale=scale, window_size_left=left,
        window_size_right=right)
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]


SDPA_CUDNN = Kernel("aten cuDNN attention", _sdpa_cudnn_forward, _sdpa_cudnn_backward)
SDPA_FLASH = Kernel("aten flash-attention-2", _sdpa_flash_forward, _sdpa_flash_backward)
FLASH_VARLEN = Kernel("aten flash-attention-2 varlen", _flash_varlen_forward, _flash_varlen_backward)
FLASH = Kernel("aten flash-attention-2 with a window", _flash_forward, _flash_backward)


# ---- aten's memory-efficient attention (fp32 on CUDA) -----------------------------------------------------------

_LSE_ALIGN = 32  # the kernels' statistics are padded to a multiple of 32 query rows


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    g = h // x.shape[-2]
    return x if g == 1 else x.repeat_interleave(g, dim=-2)


def _sum_heads(dx: torch.Tensor, h_kv: int) -> torch.Tensor:
    h = dx.shape[-2]
    return dx if h == h_kv else dx.unflatten(-2, (h_kv, h // h_kv)).sum(-2)


def _rows(vl: Varlen, t_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence, position)`` of each packed query row (kept on the pack, as its other derived tensors)."""
    key = ("efficient_rows", device)
    got = vl.memo.get(key)
    if got is None:
        cu = vl.cu_q.to(device=device, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1], output_size=t_q)
        got = vl.memo.setdefault(key, (seq, torch.arange(t_q, device=device) - cu[:-1][seq]))
    return got


def _eff_args(q, k, v, causal, vl):
    h = q.shape[-2]
    qb, kb, vb = (x.unsqueeze(0) if vl is not None else x for x in (q, _heads(k, h), _heads(v, h)))
    seqs = (None, None, None, None) if vl is None else (vl.cu_q, vl.cu_k, vl.max_q, vl.max_k)
    return qb, kb, vb, seqs, 2 if causal else 0  # 2: causal from the bottom right


def _efficient_forward(q, k, v, scale, causal, vl, window, softcap, placeholders):
    qb, kb, vb, seqs, mask = _eff_args(q, k, v, causal, vl)
    out, lse, *_ = _aten._efficient_attention_forward(qb, kb, vb, None, *seqs, 0.0, mask, True, scale=scale)
    if vl is None:
        lse = lse[..., : q.shape[1]]
    else:
        seq, pos = _rows(vl, q.shape[0], q.device)
        out, lse = out[0], lse[seq, :, pos].t()  # [n, h, m] -> [h, t_q]
    if causal:  # rows that see no key (more queries than keys): out 0, lse -inf, whatever the kernel left
        empty = ~torch.isfinite(lse)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.transpose(-1, -2).unsqueeze(-1), 0.0)
    return out, lse.contiguous()


def _efficient_backward(dout, q, k, v, out, lse, scale, causal, vl, window, softcap, placeholders):
    qb, kb, vb, seqs, mask = _eff_args(q, k, v, causal, vl)
    # the backward kernel reads ``out`` as a dense [b, s, h, d_v] tensor (its row stride is h * d_v)
    ob, dob = (x.unsqueeze(0) if vl is not None else x for x in (out.contiguous(), dout.contiguous()))
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # a row that sees no key anywhere: exp(s - inf) = 0
    if vl is None:
        b, h, s_q = lse.shape
        stats = lse.new_full((b, h, -(-s_q // _LSE_ALIGN) * _LSE_ALIGN), float("inf"))
        stats[..., :s_q] = lse
        lens = (q.shape[1], k.shape[1])
    else:
        seq, pos = _rows(vl, q.shape[0], q.device)
        stats = lse.new_full((vl.cu_q.numel() - 1, q.shape[-2], -(-vl.max_q // _LSE_ALIGN) * _LSE_ALIGN),
                             float("inf"))
        stats[seq, :, pos] = lse.t()
        lens = (vl.max_q, vl.max_k)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed / offset: no dropout
    dq, dk, dv, _ = _aten._efficient_attention_backward(
        dob, qb, kb, vb, None, ob, seqs[0], seqs[1], *lens, stats, 0.0, zero, zero, mask, False, scale=scale)
    if vl is not None:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, _sum_heads(dk, k.shape[-2]).to(k.dtype), _sum_heads(dv, v.shape[-2]).to(v.dtype)


EFFICIENT = Kernel("aten memory-efficient attention", _efficient_forward, _efficient_backward)
