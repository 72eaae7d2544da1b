"""RoPE as one Triton kernel per call (forward and backward), reading angles from the table by position.

Why: RoPE runs twice per layer (q and k). The ``torch.compile`` path's host time per call (guards, AOT-autograd
wrappers) is as much as the attention call around it for a short pack. This kernel takes the local tensor, the
pack's cached positions and the TE-style table directly: one launch, no angle gather, a fraction of that host time
(figures: docs/attention_kernels.md §10).

Math (TE's convention): ``out[j] = x[j]·cos f[p, j] + rot(x)[j]·sin f[p, j]`` for ``j < rot_dim`` with
``rot(x) = [-x2, x1]`` (halves) or ``(-x[2i+1], x[2i])`` (pairs); channels past ``rot_dim`` are copied. Computed in
fp32, stored in the input dtype. The backward applies the transpose (``gx[j] = c_j g_j + s_{j'} g_{j'}``,
``gx[j'] = c_{j'} g_{j'} − s_j g_j`` for partners ``j < j'``), exact also for tables whose two halves differ.

Layouts: the tensor is seen as ``[A, B, H, D]`` (thd: ``A = 1``) with any strides except a unit stride in ``D``;
the position of a token is ``pos[b]`` (bshd, thd) or ``pos[a]`` (sbhd). Triton is imported lazily; ``available``
says whether this process can use it (CUDA tensors, or CPU under Triton's interpreter in tests).

Example::

    from cpscope.rope import _kernel as _rope_kernel
    if _rope_kernel.usable(t):
        out = _rope_kernel.rope(t, table, positions, interleaved=False, seq_is_a=False)   # differentiable
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._tensor_cache import lru
from ..attention import kernel_policy

__all__ = ["usable", "rope"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@lru(maxsize=1)  # cpscope.clear_caches() drops the jitted kernels (Triton's disk cache stays)
def _kernel() -> Optional[Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rope_kernel(
        X, Y, T, P, B, H, D, s_xa, s_xb, s_xh,  # few runtime arguments: Triton's launch cost grows with them
        ROT_HALF: tl.constexpr, SEQ_IS_A: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        # Y is contiguous [A, B, H, D]; the table T is contiguous [S, 2 * ROT_HALF]
        rot_half = ROT_HALF
        s_t = 2 * ROT_HALF
        s_yh = D
        s_yb = H * D
        s_ya = B * s_yb
        tok = tl.program_id(0).to(tl.int64)
        a = tok // B
        b = tok % B
        hh = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        hm = hh < H
        pos = tl.load(P + (a if SEQ_IS_A else b)).to(tl.int64)
        j = tl.arange(0, BLOCK_R).to(tl.int64)  # pair index
        jm = j < rot_half
        if INTERLEAVED:
            c0, c1 = 2 * j, 2 * j + 1  # partners (c0, c1)
        else:
            c0, c1 = j, j + rot_half
        f0 = tl.load(T + pos * s_t + c0, mask=jm, other=0.0).to(tl.float32)
        f1 = tl.load(T + pos * s_t + c1, mask=jm, other=0.0).to(tl.float32)
        cos0, sin0, cos1, sin1 = tl.cos(f0), tl.sin(f0), tl.cos(f1), tl.sin(f1)
        xb = X + a * s_xa + b * s_xb + hh[:, None] * s_xh
        yb = Y + a * s_ya + b * s_yb + hh[:, None] * s_yh
        m = hm[:, None] & jm[None, :]
        x0 = tl.load(xb + c0[None, :], mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(xb + c1[None, :], mask=m, other=0.0).to(tl.float32)
        if BACKWARD:  # the transpose of the forward map
            y0 = x0 * cos0[None, :] + x1 * sin1[None, :]
            y1 = x1 * cos1[None, :] - x0 * sin0[None, :]
        else:
            y0 = x0 * cos0[None, :] - x1 * sin0[None, :]
            y1 = x1 * cos1[None, :] + x0 * sin1[None, :]
        tl.store(yb + c0[None, :], y0.to(Y.dtype.element_ty), mask=m)
        tl.store(yb + c1[None, :], y1.to(Y.dtype.element_ty), mask=m)
        # channels past rot_dim pass through
        k = 2 * rot_half + tl.arange(0, BLOCK_P).to(tl.int64)
        km = hm[:, None] & (k < D)[None, :]
        tl.store(yb + k[None, :], tl.load(xb + k[None, :], mask=km, other=0.0), mask=km)

    return rope_kernel


def usable(t: torch.Tensor) -> bool:
    """Whether the kernel can run on ``t`` (CUDA, a supported dtype, Triton importable)."""
    return (t.is_cuda or kernel_policy().triton_on_cpu) and t.dtype in _DTYPES and _kernel() is not None


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _launch(x: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, interleaved: bool, seq_is_a: bool,
            backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() == 3:  # [t, h, d] as [1, t, h, d]
        A, (B, H, D) = 1, x.shape
        s_a, (s_b, s_h, _) = 0, x.stride()
    else:
        A, B, H, D = x.shape
        s_a, s_b, s_h, _ = x.stride()
    rot = table.shape[-1]
    block_r = _pow2(rot // 2)
    block_h = min(_pow2(H), max(1, 4096 // block_r))
    _kernel()[(A * B, -(-H // block_h))](
        x, y, table, pos, B, H, D, s_a, s_b, s_h,
        ROT_HALF=rot // 2, SEQ_IS_A=seq_is_a, INTERLEAVED=interleaved, BACKWARD=backward,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=_pow2(max(D - rot, 1)),
    )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, interleaved: bool,
                seq_is_a: bool) -> torch.Tensor:
        ctx.save_for_backward(table, pos)
        ctx.interleaved, ctx.seq_is_a = interleaved, seq_is_a
        return _launch(x, table, pos, interleaved, seq_is_a, backward=False)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        table, pos = ctx.saved_tensors
        return _launch(g, table, pos, ctx.interleaved, ctx.seq_is_a, backward=True), None, None, None, None


def rope(t: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, *, interleaved: bool, seq_is_a: bool
         ) -> torch.Tensor:
    """RoPE of ``t`` (``[t, h, d]`` or ``[A, B, h, d]``) at positions ``pos`` from ``table`` (``[S, rot_dim]`` fp32,
    contiguous); differentiable w.r.t. ``t``. Inputs are validated by the caller."""
    return _Rope.apply(t, table, pos, interleaved, seq_is_a)
