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

The dense SDPA kernels' backward takes placeholder outputs of their forward; they travel in the call's
:class:`~cpscope.attention.kernels.block.Placeholders`. No softcap here: blocks with one run elsewhere
(:mod:`.router`).

Example::

    out, lse = SDPA_CUDNN.forward(q, k, v, 0.125, True, None, None, None, ph)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..mods import Band
from .block import Placeholders, Varlen, Window

__all__ = ["Kernel", "SDPA_CUDNN", "SDPA_FLASH", "FLASH_VARLEN", "FLASH"]

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
