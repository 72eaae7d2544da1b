"""One block of attention with its log-sum-exp: exact math on CPU, cuDNN / flash kernels on CUDA.

A *block* is the attention of some local queries against one set of keys/values (the local ones, or ones received
from another rank). The ring merges blocks through their log-sum-exp (:func:`cpscope.attention.merge.merge_rows_`).

Two shapes are supported, as in flash-attention:

* **dense** — ``q`` ``[b, s_q, h, d]``, ``k``/``v`` ``[b, s_k, h_kv, d]``; ``lse`` is ``[b, h, s_q]`` fp32.
* **varlen** — ``q`` ``[t_q, h, d]``, ``k``/``v`` ``[t_k, h_kv, d]`` packing several sequences described by
  :class:`Varlen` (``cu_q``/``cu_k`` int32 offsets); ``lse`` is ``[h, t_q]`` fp32. Sequence *i* of the queries
  attends only to sequence *i* of the keys.

``causal=True`` uses flash-attention's bottom-right alignment (query *i* of a sequence of ``n_q`` queries sees key
*j* of ``n_k`` keys when ``j - n_k <= i - n_q``). ``window=(left, right)`` (``-1``: unbounded) is relative to the same
diagonal: key *j* is seen iff ``-left <= j - (i + n_k - n_q) <= right`` (``right`` is 0 when causal), per sequence.
``softcap``: scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before masking.

Grouped-query attention: ``h`` must be a multiple of ``h_kv``; ``dk``/``dv`` come back with ``h_kv`` heads. ``v`` may
have another head dim than ``q``/``k`` (multi-latent attention); ``out`` has ``v``'s.

Example::

    out, lse = block_forward(q, k, v, scale=d ** -0.5, causal=True)            # dense, CPU or CUDA
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=d ** -0.5, causal=True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["Varlen", "Window", "block_forward", "block_backward", "acc_dtype"]

Window = Optional[tuple[int, int]]  # (left, right) around the aligned diagonal, -1 unbounded; None: no window


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
#
# Every mask this module knows (documents, causal, a window, all relative to each sequence's bottom-right-aligned
# diagonal) gives each query row one contiguous interval of visible keys, ``lo[i] <= j < hi[i]`` in packed key
# indices, nondecreasing in ``i``. The CPU kernels therefore compute scores only over tiles of query rows against
# the key range their rows can see: a banded (windowed) block costs O(rows x window), not O(rows x keys), and no
# tile exceeds ``_TILE_BUDGET`` score elements.

_TILE_BUDGET = 1 << 22  # score elements ([batch, heads, rows, keys]) of one CPU tile


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    g = heads // x.shape[-2]
    return x if g == 1 else x.repeat_interleave(g, dim=-2)


def _reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    h = dx.shape[-2]
    if h == kv_heads:
        return dx
    return dx.unflatten(-2, (kv_heads, h // kv_heads)).sum(-2)


def _key_bounds(t_q: int, t_k: int, causal: bool, vl: Optional[Varlen], window: Window,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``, ``[t_q]`` int64: query row ``i`` sees keys ``lo[i] <= j < hi[i]`` (packed key indices).

    Query ``i`` of a sequence of ``n_q`` queries sees key ``j`` of its ``n_k`` keys iff
    ``-left <= j - (i + n_k - n_q) <= right`` (``-1``: unbounded; ``right`` is 0 when causal).
    """
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if vl is None:
        i = torch.arange(t_q, device=device)
        start, n_k = torch.zeros_like(i), torch.full_like(i, t_k)
        diag = i + (t_k - t_q)  # the key on each query's aligned diagonal
    else:
        cu_q, cu_k = vl.cu_q.to(device=device, dtype=torch.long), vl.cu_k.to(device=device, dtype=torch.long)
        lq = cu_q[1:] - cu_q[:-1]
        seq = torch.repeat_interleave(torch.arange(lq.numel(), device=device), lq, output_size=t_q)
        n_k = (cu_k[1:] - cu_k[:-1])[seq]
        start = cu_k[:-1][seq]
        diag = torch.arange(t_q, device=device) - cu_q[:-1][seq] + n_k - lq[seq]
    zero = torch.zeros_like(n_k)
    lo = zero if left == -1 else torch.minimum(torch.maximum(diag - left, zero), n_k)
    hi = n_k if right == -1 else torch.minimum(torch.maximum(diag + right + 1, zero), n_k)
    return start + lo, start + hi


def _tiles(lo: torch.Tensor, hi: torch.Tensor, per_pair: int) -> list[tuple[int, int, int, int]]:
    """``(i0, i1, k0, k1)``: query rows ``[i0, i1)`` against keys ``[k0, k1)``, at most ``_TILE_BUDGET`` score
    elements each (``per_pair`` elements per (row, key) pair: batch x heads), at least one row each.

    A tile's key range stays within twice its first row's span (at least 128 keys), so the pairs computed stay
    within a small factor of the visible ones: O(rows x window) for a band."""
    lo_l, hi_l = lo.tolist(), hi.tolist()
    n, cap = len(lo_l), max(1, _TILE_BUDGET // max(1, per_pair))
    tiles, i0 = [], 0
    while i0 < n:
        reach = max(2 * (hi_l[i0] - lo_l[i0]), 128)
        a, b = i0 + 1, n  # the largest i1 whose tile fits (bisection: both bounds grow with i1)
        while a < b:
            mid = (a + b + 1) // 2
            width = hi_l[mid - 1] - lo_l[i0]
            if (mid - i0) * width <= cap and width <= reach:
                a = mid
            else:
                b = mid - 1
        tiles.append((i0, a, lo_l[i0], max(lo_l[i0], hi_l[a - 1])))
        i0 = a
    return tiles


def _batched(x: torch.Tensor, vl: Optional[Varlen]) -> torch.Tensor:
    return x.unsqueeze(0) if vl is not None else x


class _Tile:
    """One tile's scores: ``s`` (masked, capped) ``[b, h, rows, keys]`` and the capped scores' ``tanh`` (softcap)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k0: int, scale: float,
                 softcap: Optional[float], dt: torch.dtype) -> None:
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(dt), k.to(dt)) * scale
        self.tanh = None
        if softcap is not None:
            self.tanh = torch.tanh(s / softcap)
            s = self.tanh * softcap
        j = torch.arange(k0, k0 + k.shape[1], device=q.device)
        self.mask = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])  # [rows, keys]
        self.s = s.masked_fill(~self.mask, float("-inf"))

    def probs(self, lse: torch.Tensor) -> torch.Tensor:  # lse [b, h, rows]; -inf rows (nothing visible) give 0
        return torch.exp(self.s - torch.where(lse == float("-inf"), 0.0, lse).unsqueeze(-1))


def _cpu_forward(q, k, v, scale, causal, vl, window=None, softcap=None):
    dt, h = acc_dtype(q.dtype), q.shape[-2]
    qb, kb, vb = _batched(q, vl), _batched(k, vl), _batched(v, vl)
    b, t_q = qb.shape[0], qb.shape[1]
    lo, hi = _key_bounds(t_q, kb.shape[1], causal, vl, window, q.device)
    out = torch.zeros((*qb.shape[:-1], vb.shape[-1]), dtype=dt, device=q.device)
    lse = torch.full((b, h, t_q), float("-inf"), dtype=dt, device=q.device)
    for i0, i1, k0, k1 in _tiles(lo, hi, b * h):
        if k1 == k0:
            continue  # every row of the tile sees nothing: out 0, lse -inf
        tile = _Tile(qb[:, i0:i1], _expand_kv(kb[:, k0:k1], h), lo[i0:i1], hi[i0:i1], k0, scale, softcap, dt)
        lt = torch.logsumexp(tile.s, dim=-1)  # [b, h, rows]
        out[:, i0:i1] = torch.einsum("bhqk,bkhd->bqhd", tile.probs(lt), _expand_kv(vb[:, k0:k1], h).to(dt))
        lse[:, :, i0:i1] = lt
    out = out.to(q.dtype)
    return (out[0], lse[0]) if vl is not None else (out, lse)


def _cpu_backward(dout, q, k, v, out, lse, scale, causal, vl, window=None, softcap=None):
    dt, h, h_kv = acc_dtype(q.dtype), q.shape[-2], k.shape[-2]
    qb, kb, vb = _batched(q, vl), _batched(k, vl), _batched(v, vl)
    dob, ob = _batched(dout, vl).to(dt), _batched(out, vl).to(dt)
    lseb = (lse.unsqueeze(0) if vl is not None else lse).to(dt)  # [b, h, s_q]
    b, t_q = qb.shape[0], qb.shape[1]
    lo, hi = _key_bounds(t_q, kb.shape[1], causal, vl, window, q.device)
    dq = torch.zeros(qb.shape, dtype=dt, device=q.device)
    dk, dv = torch.zeros(kb.shape, dtype=dt, device=q.device), torch.zeros(vb.shape, dtype=dt, device=q.device)
    delta = (dob * ob).sum(-1).transpose(1, 2)  # [b, h, q]
    for i0, i1, k0, k1 in _tiles(lo, hi, b * h):
        if k1 == k0:
            continue
        kt, vt = _expand_kv(kb[:, k0:k1], h).to(dt), _expand_kv(vb[:, k0:k1], h).to(dt)
        qt, dot = qb[:, i0:i1].to(dt), dob[:, i0:i1]
        tile = _Tile(qt, kt, lo[i0:i1], hi[i0:i1], k0, scale, softcap, dt)
        p = tile.probs(lseb[:, :, i0:i1])  # [b, h, q, k]
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", dot, vt) - delta[:, :, i0:i1].unsqueeze(-1))
        if tile.tanh is not None:  # d(softcap * tanh(s / softcap)) / ds = 1 - tanh^2
            ds = ds * (1 - tile.tanh * tile.tanh)
        dq[:, i0:i1] = torch.einsum("bhqk,bkhd->bqhd", ds, kt) * scale
        dk[:, k0:k1] += _reduce_kv(torch.einsum("bhqk,bqhd->bkhd", ds, qt) * scale, h_kv)
        dv[:, k0:k1] += _reduce_kv(torch.einsum("bhqk,bqhd->bkhd", p, dot), h_kv)
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
#   heads 14.2 ms vs flash 24.6 ms and SDPA(enable_gqa) 14.4 ms, docs/attention_kernels.md §10) or on flash
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


def _features(window: Window, softcap: Optional[float]) -> dict[str, Any]:
    """The optional features as keywords of the kernel entry points (none for a plain block: the plain call stays
    what it was, for stand-ins that take only the plain arguments)."""
    kw: dict[str, Any] = {}
    if window is not None:
        kw["window"] = window
    if softcap is not None:
        kw["softcap"] = softcap
    return kw


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, varlen: Optional[Varlen] = None,
    window: Window = None, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: ``(out, lse)``; ``out`` has ``q``'s dtype and ``v``'s head dim, ``lse`` is fp32 (fp64
    for fp64 on CPU).

    ``window=(left, right)`` (``-1``: unbounded) keeps key ``j`` for query ``i`` of a sequence with ``n_q`` queries
    and ``n_k`` keys iff ``-left <= j - (i + n_k - n_q) <= right`` (``right`` is 0 when ``causal``), per sequence in
    varlen blocks. ``softcap``: the scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before masking.
    Fully masked query rows give ``out = 0`` and ``lse = -inf``.

    Example::

        out, lse = block_forward(q, k, v, scale=0.125, causal=True, window=(255, 0), softcap=50.0)
    """
    kw = _features(window, softcap)
    if q.is_cuda:
        return _cuda_forward(q, k, v, scale, causal, varlen, **kw)
    return _cpu_forward(q, k, v, scale, causal, varlen, **kw)


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
    window: Window = None,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the **final** (merged) ``out`` and ``lse`` of these queries.

    With the merged statistics, ``p = exp(s - lse)`` is this block's share of the full softmax, so the per-block
    gradients add up to the full gradients (the standard ring-attention identity) — also when the final ``lse``
    holds terms no block computed (attention sinks). ``window`` / ``softcap`` as in :func:`block_forward`.
    """
    kw = _features(window, softcap)
    if q.is_cuda:
        return _cuda_backward(dout, q, k, v, out, lse, scale, causal, varlen, **kw)
    return _cpu_backward(dout, q, k, v, out, lse, scale, causal, varlen, **kw)
