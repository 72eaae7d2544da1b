"""One block of attention with its log-sum-exp: exact math on CPU, cuDNN / flash kernels on CUDA.

A *block* is the attention of some local queries against one set of keys/values (the local ones, or ones received
from another rank). The ring merges blocks through their log-sum-exp (:func:`cpscope.attention.merge.merge_rows_`).

Two shapes are supported, as in flash-attention:

* **dense** — ``q`` ``[b, s_q, h, d]``, ``k``/``v`` ``[b, s_k, h_kv, d]``; ``lse`` is ``[b, h, s_q]`` fp32.
* **varlen** — ``q`` ``[t_q, h, d]``, ``k``/``v`` ``[t_k, h_kv, d]`` packing several sequences described by
  :class:`Varlen` (``cu_q``/``cu_k`` int32 offsets); ``lse`` is ``[h, t_q]`` fp32. Sequence *i* of the queries
  attends only to sequence *i* of the keys.

``causal=True`` uses flash-attention's bottom-right alignment (query *i* of a sequence of ``n_q`` queries sees key
*j* of ``n_k`` keys when ``j - n_k <= i - n_q``); the ring only uses it with ``n_q == n_k``.

Grouped-query attention: ``h`` must be a multiple of ``h_kv``; ``dk``/``dv`` come back with ``h_kv`` heads.

Example::

    out, lse = block_forward(q, k, v, scale=d ** -0.5, causal=True)            # dense, CPU or CUDA
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=d ** -0.5, causal=True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["Varlen", "block_forward", "block_backward", "acc_dtype"]


@dataclass(frozen=True, eq=False)
class Varlen:
    """Packed-sequence description of one varlen block (flash's ``cu_seqlens_q/k``, ``max_seqlen_q/k``).

    Built once per pack (see :class:`cpscope.attention.ring.RingGeometry`) and reused by every layer; kernels keep
    what they derive from it (e.g. cuDNN's device offsets) in :attr:`memo`, so it lives exactly as long as the pack.
    """

    cu_q: torch.Tensor  # [n + 1] int32, on the tensors' device
    cu_k: torch.Tensor  # [n + 1] int32
    max_q: int
    max_k: int
    cu_q_host: Optional[tuple] = None  # the same offsets on the host, where known (saves a sync in cuDNN blocks)
    cu_k_host: Optional[tuple] = None
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks compute in and return ``lse`` in (fp64 for fp64 inputs, else fp32); the ring's merges and
    dQ accumulate in it too."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------------------
# CPU (and any non-CUDA device): exact math


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    g = heads // x.shape[-2]
    return x if g == 1 else x.repeat_interleave(g, dim=-2)


def _reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    h = dx.shape[-2]
    if h == kv_heads:
        return dx
    return dx.unflatten(-2, (kv_heads, h // kv_heads)).sum(-2)


def _varlen_mask(vl: Varlen, causal: bool, device: torch.device) -> torch.Tensor:
    """``[t_q, t_k]`` bool: True where query i may attend key j (same sequence; causal bottom-right)."""
    cu_q, cu_k = vl.cu_q.to(device=device, dtype=torch.long), vl.cu_k.to(device=device, dtype=torch.long)
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    n = lq.numel()
    seq_q = torch.repeat_interleave(torch.arange(n, device=device), lq)  # [t_q]
    seq_k = torch.repeat_interleave(torch.arange(n, device=device), lk)  # [t_k]
    mask = seq_q[:, None] == seq_k[None, :]
    if causal:
        # position counted from the end of its sequence (bottom-right alignment)
        from_end_q = cu_q[1:][seq_q] - torch.arange(seq_q.numel(), device=device)  # n_q - i
        from_end_k = cu_k[1:][seq_k] - torch.arange(seq_k.numel(), device=device)  # n_k - j
        mask &= from_end_k[None, :] >= from_end_q[:, None]
    return mask


def _dense_mask(s_q: int, s_k: int, causal: bool, device: torch.device) -> Optional[torch.Tensor]:
    if not causal:
        return None
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_k, device=device)[None, :]
    return j - s_k <= i - s_q


def _mask(q: torch.Tensor, k: torch.Tensor, causal: bool, vl: Optional[Varlen]) -> Optional[torch.Tensor]:
    if vl is not None:
        return _varlen_mask(vl, causal, q.device)
    return _dense_mask(q.shape[1], k.shape[1], causal, q.device)


def _cpu_scores(q, k, scale, mask, dt):  # q [b,s,h,d], k [b,s_k,h,d] -> [b,h,s,s_k]
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dt), k.to(dt)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _batched(x: torch.Tensor, vl: Optional[Varlen]) -> torch.Tensor:
    return x.unsqueeze(0) if vl is not None else x


def _cpu_forward(q, k, v, scale, causal, vl):
    dt = acc_dtype(q.dtype)
    mask = _mask(q, k, causal, vl)
    qb, kb, vb = _batched(q, vl), _batched(_expand_kv(k, q.shape[-2]), vl), _batched(_expand_kv(v, q.shape[-2]), vl)
    s = _cpu_scores(qb, kb, scale, mask, dt)  # [b, h, s_q, s_k]
    lse = torch.logsumexp(s, dim=-1)  # [b, h, s_q]; -inf for fully masked rows
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, vb.to(dt)).to(q.dtype)
    lse = lse.to(dt)
    if vl is not None:
        return out[0], lse[0]
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, scale, causal, vl):
    dt = acc_dtype(q.dtype)
    h, h_kv = q.shape[-2], k.shape[-2]
    mask = _mask(q, k, causal, vl)
    qb, kb, vb = _batched(q, vl).to(dt), _batched(_expand_kv(k, h), vl).to(dt), _batched(_expand_kv(v, h), vl).to(dt)
    dob, ob = _batched(dout, vl).to(dt), _batched(out, vl).to(dt)
    lseb = (lse.unsqueeze(0) if vl is not None else lse).to(dt)  # [b, h, s_q]
    s = _cpu_scores(qb, kb, scale, mask, dt)
    p = torch.exp(s - torch.where(torch.isinf(lseb), 0.0, lseb).unsqueeze(-1))  # [b, h, q, k]
    dp = torch.einsum("bqhd,bkhd->bhqk", dob, vb)
    delta = (dob * ob).sum(-1).transpose(1, 2)  # [b, h, q]
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kb) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qb) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dob)
    dk, dv = _reduce_kv(dk, h_kv), _reduce_kv(dv, h_kv)
    if vl is not None:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------------------------
# CUDA: PyTorch's cuDNN and flash-attention kernels (aten)
#
# Private test / benchmark knobs (process-wide, read per block; not an API):
# * _USE_CUDNN — dense blocks on cuDNN attention (True, the default: what F.scaled_dot_product_attention picks on
#   Hopper; ~1.7x faster than the flash-attention-2 kernels there, GQA / MQA included: cuDNN takes K/V with fewer
#   heads as they are and returns dK/dV with h_kv heads — H200, 32 q heads x 128, bf16, causal fwd+bwd: 16k 8 k/v
#   heads 14.2 ms vs flash 24.6 ms and SDPA(enable_gqa) 14.4 ms, benchmarks/attention_notes.md §10) or on flash
#   (False; benchmarks compare the two).
# * _VARLEN_KERNEL — packed (varlen) blocks on "flash" (PyTorch's bundled flash-attention-2 varlen kernels),
#   "cudnn" (cuDNN's ragged fused attention through the cuDNN frontend, see _cudnn_thd; ~1.9x faster on H200, needs
#   nvidia-cudnn-frontend; raises where it is missing) or "auto" (the default: cuDNN where available).

_aten = torch.ops.aten
_USE_CUDNN = True
_VARLEN_KERNEL = "auto"

# The dense kernels' backward takes placeholder outputs of their forward as arguments: cum_seq_q / cum_seq_k (None
# for dense inputs) and the philox seed / offset (unused without dropout). Every forward on a device returns equal
# placeholders, so the first one's, kept per (kernel, device), serves every later backward on that device (several
# devices in one process each have their own). Only these placeholders are kept: never a block's out or lse, which
# are returned to the caller (and which the ring merges into in place).
_AUX: dict[tuple[str, torch.device], tuple[Any, ...]] = {}


def _remember_aux(kernel: str, device: torch.device, res: tuple) -> None:
    """Keep the placeholders of a dense forward's result ``res`` for ``kernel``'s backward on ``device``."""
    key = (kernel, device)
    if key not in _AUX:
        _AUX[key] = (res[2], res[3], res[6], res[7])


def _aux(kernel: str, device: torch.device) -> tuple[Any, ...]:
    """The placeholders a dense backward of ``kernel`` on ``device`` takes: ``(cum_seq_q, cum_seq_k, seed, offset)``."""
    aux = _AUX.get((kernel, device))
    if aux is None:
        raise RuntimeError(f"a dense {kernel} attention backward on {device} without any forward there")
    return aux


def _use_cudnn(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a dense block runs on cuDNN attention (else flash); the place for a per-shape choice."""
    return _USE_CUDNN


def _varlen_on_cudnn(q: torch.Tensor) -> bool:
    if _VARLEN_KERNEL == "flash":
        return False
    from . import _cudnn_thd

    ok = _cudnn_thd.available(q.device)
    if not ok and _VARLEN_KERNEL == "cudnn":
        raise RuntimeError("varlen kernel 'cudnn' requested but the cuDNN frontend / cuDNN >= 9.6 / sm90 is missing")
    return ok


def _features_route(q, k, v, vl, window, softcap) -> Optional[bool]:
    """Whether the block's cuDNN route is on (to pass to :mod:`._kernels`) when the block needs that module (a window,
    a softcap, or a v head dim other than q/k's off cuDNN); None when the plain routes below run it."""
    if window is None and softcap is None and v.shape[-1] == q.shape[-1]:
        return None
    on_cudnn = _use_cudnn(q, k) if vl is None else _varlen_on_cudnn(q)
    if window is None and softcap is None and on_cudnn:
        return None  # multi-latent head dims: cuDNN takes them as they are
    return on_cudnn


def _cuda_forward(q, k, v, scale, causal, vl, window=None, softcap=None):
    on_cudnn = _features_route(q, k, v, vl, window, softcap)
    if on_cudnn is not None:
        from . import _kernels

        return _kernels.forward(q, k, v, scale, causal, vl, window, softcap, cudnn=on_cudnn, exact=_cpu_forward)
    if vl is None:
        # [b, s, h, d] -> [b, h, s, d] views; the kernels read the bshd strides without copying.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if _use_cudnn(q, k):
            res = _aten._scaled_dot_product_cudnn_attention.default(qt, kt, vt, None, True, 0.0, causal, False,
                                                                     scale=scale)
            _remember_aux("cudnn", q.device, res)
            return res[0].transpose(1, 2), res[1].squeeze(-1)  # lse [b, h, s, 1] -> [b, h, s]
        res = _aten._scaled_dot_product_flash_attention.default(qt, kt, vt, 0.0, causal, False, scale=scale)
        _remember_aux("flash", q.device, res)
        return res[0].transpose(1, 2), res[1]
    if _varlen_on_cudnn(q):
        from . import _cudnn_thd

        return _cudnn_thd.forward(q, k, v, vl, scale=scale, causal=causal)
    out, lse, _rng, _unused, _dbg = _aten._flash_attention_forward(
        q, k, v, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, 0.0, causal, False, scale=scale
    )
    return out, lse


def _cuda_backward(dout, q, k, v, out, lse, scale, causal, vl, window=None, softcap=None):
    on_cudnn = _features_route(q, k, v, vl, window, softcap)
    if on_cudnn is not None:
        from . import _kernels

        return _kernels.backward(dout, q, k, v, out, lse, scale, causal, vl, window, softcap, cudnn=on_cudnn,
                                 exact=_cpu_backward)
    if vl is None:
        args = [t.transpose(1, 2) for t in (dout, q, k, v, out)]
        if _use_cudnn(q, k):
            cq, ck, seed, offset = _aux("cudnn", q.device)
            dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward.default(
                *args, lse.unsqueeze(-1).contiguous(), seed, offset, None, cq, ck, q.shape[1], k.shape[1], 0.0,
                causal, scale=scale,
            )
        else:
            cq, ck, seed, offset = _aux("flash", q.device)
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward.default(
                *args, lse.contiguous(), cq, ck, q.shape[1], k.shape[1], 0.0, causal, seed, offset, scale=scale,
            )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if _varlen_on_cudnn(q):
        from . import _cudnn_thd

        return _cudnn_thd.backward(dout, q, k, v, out, lse, vl, scale=scale, causal=causal)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    return _aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), vl.cu_q, vl.cu_k, vl.max_q, vl.max_k, 0.0, causal, rng, unused,
        scale=scale,
    )


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, varlen: Optional[Varlen] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: ``(out, lse)``; ``out`` has ``q``'s dtype, ``lse`` is fp32 (fp64 for fp64 on CPU).

    Fully masked query rows (possible in varlen blocks) give ``out = 0`` and ``lse = -inf``.
    """
    if q.is_cuda:
        return _cuda_forward(q, k, v, scale, causal, varlen)
    return _cpu_forward(q, k, v, scale, causal, varlen)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    varlen: Optional[Varlen] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the **final** (merged) ``out`` and ``lse`` of these queries.

    With the merged statistics, ``p = exp(s - lse)`` is this block's share of the full softmax, so the per-block
    gradients add up to the full gradients (the standard ring-attention identity).
    """
    if q.is_cuda:
        return _cuda_backward(dout, q, k, v, out, lse, scale, causal, varlen)
    return _cpu_backward(dout, q, k, v, out, lse, scale, causal, varlen)
