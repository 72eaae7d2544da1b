"""Fused row kernels of the ring: in-place log-sum-exp merge and row scatter-add (Triton on CUDA, torch elsewhere).

* :func:`merge_rows_` merges a partial block ``(out_b, lse_b)`` into accumulators ``(out_acc, lse_acc)`` over the
  rows the block covers (all rows, a contiguous range, or an index list), in one pass: fp32 math (fp64 for fp64),
  one rounding to ``out_acc``'s dtype — so a bf16 accumulator merged once equals an fp32 accumulator cast at the end.
* :func:`rows_add_` adds ``val[r]`` into ``acc[idx[r]]`` for unique ``idx`` (fp32 math, stored in ``acc``'s dtype):
  a plain gather-add-store per row, no atomics (``index_add_`` on CUDA uses atomics and a generic kernel).

Layouts (as :mod:`cpscope.attention._kernels.block`): dense ``out`` ``[b, s, h, d]`` with ``lse`` ``[b, h, s]``; varlen ``out``
``[t, h, d]`` with ``lse`` ``[h, t]``. Any strides are accepted (views of larger tensors, transposed lse).

Triton is imported lazily, on the first CUDA tensor (the module imports without it); without Triton, for fp64, or on
other devices the torch fallback runs with the same semantics. The kernel policy's ``triton_on_cpu`` (tests only,
:func:`cpscope.attention.use_kernel_policy`) sends CPU tensors through the Triton kernels too, for Triton's
interpreter (``TRITON_INTERPRET=1``).

* :func:`merge_sinks_` merges attention sinks (one logit per head, no value) into final ``(out, lse)``, and
  :func:`sink_terms` gives each row's share of their gradient.

Example::

    merge_rows_(out, lse, o_back, l_back, rows=plan.back)      # varlen: rows listed by index
    merge_rows_(out, lse, o_back, l_back, rows=(c, c))         # dense/varlen: rows c .. 2c-1
    rows_add_(dq, back_idx, dq_back)
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch

from .._tensor_cache import lru
from ._policy import kernel_policy

__all__ = ["merge_rows_", "rows_add_", "merge_sinks_", "sink_terms", "sinks_grad"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_TILE = 4096  # elements of one merge program's [BLOCK_H, BLOCK_D] tile
_ADD_BLOCK = 2048  # elements of one rows_add_ program

Rows = Union[None, slice, tuple[int, int], torch.Tensor]


@lru(maxsize=1)  # cpscope.clear_caches() drops the jitted kernels (Triton's disk cache stays)
def _kernels() -> Optional[Any]:
    """The jitted kernels, or None when Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def merge_kernel(
        OA, LA, OB, LB, IDX, start, H, D,
        s_oa_b, s_oa_s, s_oa_h, s_oa_d, s_la_b, s_la_h, s_la_s,
        s_ob_b, s_ob_s, s_ob_h, s_ob_d, s_lb_b, s_lb_h, s_lb_s,
        HAS_IDX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)  # row of the block
        bb = tl.program_id(1).to(tl.int64)  # batch row (dense) / 0 (varlen)
        hh = (tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        dd = tl.arange(0, BLOCK_D).to(tl.int64)
        if HAS_IDX:
            ar = tl.load(IDX + r).to(tl.int64)  # row of the accumulators
        else:
            ar = r + start
        hm = hh < H
        m = hm[:, None] & (dd < D)[None, :]
        p_la = LA + bb * s_la_b + hh * s_la_h + ar * s_la_s
        la = tl.load(p_la, mask=hm, other=float("-inf")).to(tl.float32)
        lb = tl.load(LB + bb * s_lb_b + hh * s_lb_h + r * s_lb_s, mask=hm, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(la, lb)
        mn = tl.minimum(la, lb)
        lse = mx + tl.log(1.0 + tl.exp(mn - tl.where(mx == float("-inf"), 0.0, mx)))  # -inf when both are
        lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
        wa = tl.exp(la - lse_safe)[:, None]
        wb = tl.exp(lb - lse_safe)[:, None]
        p_oa = OA + bb * s_oa_b + ar * s_oa_s + hh[:, None] * s_oa_h + dd[None, :] * s_oa_d
        oa = tl.load(p_oa, mask=m, other=0.0).to(tl.float32)
        ob = tl.load(OB + bb * s_ob_b + r * s_ob_s + hh[:, None] * s_ob_h + dd[None, :] * s_ob_d, mask=m,
                     other=0.0).to(tl.float32)
        res = tl.where(wa > 0.0, oa * wa, 0.0) + tl.where(wb > 0.0, ob * wb, 0.0)
        tl.store(p_oa, res.to(OA.dtype.element_ty), mask=m)
        tl.store(p_la, lse.to(LA.dtype.element_ty), mask=hm)

    @triton.jit
    def rows_add_kernel(ACC, VAL, IDX, F, s_acc, s_val, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        m = c < F
        ar = tl.load(IDX + r).to(tl.int64)
        p_acc = ACC + ar * s_acc + c
        a = tl.load(p_acc, mask=m, other=0.0).to(tl.float32)
        v = tl.load(VAL + r * s_val + c, mask=m, other=0.0).to(tl.float32)
        tl.store(p_acc, (a + v).to(ACC.dtype.element_ty), mask=m)

    return {"triton": triton, "merge": merge_kernel, "rows_add": rows_add_kernel}


def _on_device(t: torch.Tensor) -> Any:
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _use_triton(*tensors: torch.Tensor) -> bool:
    t = tensors[0]
    if not (t.is_cuda or kernel_policy().triton_on_cpu):
        return False
    if any(x.dtype not in _TRITON_DTYPES for x in tensors):
        return False
    return _kernels() is not None


# ----------------------------------------------------------------------------------------------------------------
# merge


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _as_batched(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen ``[t, h, d]``/``[h, t]`` as a batch of one; dense unchanged."""
    return (out.unsqueeze(0), lse.unsqueeze(0)) if out.dim() == 3 else (out, lse)


def _check_merge(out_acc, lse_acc, out_b, lse_b) -> None:
    if out_acc.dim() not in (3, 4) or out_b.dim() != out_acc.dim() or lse_acc.dim() != out_acc.dim() - 1 \
            or lse_b.dim() != lse_acc.dim():
        raise ValueError(
            f"merge_rows_ expects out [b, s, h, d] with lse [b, h, s] or out [t, h, d] with lse [h, t]; got out_acc "
            f"{tuple(out_acc.shape)}, lse_acc {tuple(lse_acc.shape)}, out_b {tuple(out_b.shape)}, lse_b "
            f"{tuple(lse_b.shape)}")
    oa, la = _as_batched(out_acc, lse_acc)
    ob, lb = _as_batched(out_b, lse_b)
    b, s, h, _ = oa.shape
    if la.shape != (b, h, s) or lb.shape != (ob.shape[0], h, ob.shape[1]) or ob.shape[0] != b \
            or ob.shape[2:] != oa.shape[2:]:
        raise ValueError(
            f"merge_rows_: inconsistent shapes out_acc {tuple(out_acc.shape)}, lse_acc {tuple(lse_acc.shape)}, "
            f"out_b {tuple(out_b.shape)}, lse_b {tuple(lse_b.shape)}")
    if not lse_acc.is_floating_point() or lse_acc.dtype in (torch.float16, torch.bfloat16):
        raise ValueError(f"merge_rows_: lse_acc must be fp32 or fp64, got {lse_acc.dtype}")


def _row_range(rows: Rows, n_acc: int, n_b: int) -> Optional[tuple[int, int]]:
    """(start, length) of a contiguous row selection; None for an index tensor. Validates against the shapes."""
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32) or rows.numel() != n_b:
            raise ValueError(f"rows index must be a 1-D int64 tensor of {n_b} entries (the block's rows), got "
                             f"{rows.dtype} of shape {tuple(rows.shape)}")
        return None
    if rows is None:
        start, length = 0, n_acc
    elif isinstance(rows, slice):
        if rows.step not in (None, 1):
            raise ValueError(f"rows slice must have step 1, got {rows}")
        start, stop, _ = rows.indices(n_acc)
        length = stop - start
    else:
        start, length = (int(x) for x in rows)
    if length != n_b or start < 0 or start + length > n_acc:
        raise ValueError(f"rows (start={start}, length={length}) must select the block's {n_b} rows within the "
                         f"accumulators' {n_acc}")
    return start, length


def _merge_torch(oa, la, ob, lb) -> None:
    """Fallback on aligned views (batched layout): same math as the kernel."""
    dt = _acc_dtype(oa, la, ob, lb)
    a, b = la.to(dt), lb.to(dt)
    lse = torch.logaddexp(a, b)  # -inf when both are -inf (no NaN)
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
    wa = torch.exp(a - lse_safe).transpose(-1, -2).unsqueeze(-1)  # [b, s, h, 1]
    wb = torch.exp(b - lse_safe).transpose(-1, -2).unsqueeze(-1)
    if oa.dtype == dt:
        oa.mul_(wa).addcmul_(ob, wb)  # out_b upcast inside addcmul_; no full-size temporary
    else:
        res = torch.mul(oa, wa, out=torch.empty(oa.shape, dtype=dt, device=oa.device))
        oa.copy_(res.addcmul_(ob, wb))  # one rounding to out_acc's dtype
    la.copy_(lse)


def _merge_triton(k, oa, la, ob, lb, idx: Optional[torch.Tensor], start: int) -> None:
    triton = k["triton"]
    b, n, h, d = ob.shape
    if n == 0 or b == 0 or h == 0 or d == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(h), max(1, _MAX_TILE // block_d))
    grid = (n, b, triton.cdiv(h, block_h))
    with _on_device(oa):
        k["merge"][grid](
            oa, la, ob, lb, idx if idx is not None else oa, start, h, d,
            *oa.stride(), *la.stride(), *ob.stride(), *lb.stride(),
            HAS_IDX=idx is not None, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=True,
        )


def merge_rows_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *, rows: Rows = None
) -> None:
    """Merge block ``(out_b, lse_b)`` into ``(out_acc, lse_acc)`` in place, over the rows the block covers.

    ``lse = logaddexp(lse_acc, lse_b)``; ``out = out_acc * exp(lse_acc - lse) + out_b * exp(lse_b - lse)``, in fp32
    (fp64 when any input is fp64), rounded once to ``out_acc``'s dtype. Rows where both lse are ``-inf`` get
    ``out = 0``, ``lse = -inf``; a row with ``lse_b = -inf`` keeps ``out_acc``.

    Args:
        out_acc, lse_acc: accumulators, dense ``[b, s, h, d]`` / ``[b, h, s]`` or varlen ``[t, h, d]`` / ``[h, t]``
            (``lse_acc`` fp32 or fp64); any strides.
        out_b, lse_b: the block, same layout with ``n`` rows instead of ``s`` (``t``).
        rows: which accumulator rows the block's rows are: ``None`` (all, ``n == s``), a ``slice`` or
            ``(start, length)`` (rows ``start .. start+n-1``, per batch row when dense), or a 1-D int64 tensor of
            ``n`` distinct row indices.

    Raises:
        ValueError: inconsistent shapes or a row selection that does not match the block.
    """
    _check_merge(out_acc, lse_acc, out_b, lse_b)
    oa, la = _as_batched(out_acc, lse_acc)
    ob, lb = _as_batched(out_b, lse_b)
    rng = _row_range(rows, oa.shape[1], ob.shape[1])
    idx = None if rng is not None else rows
    devices = {t.device for t in (out_acc, lse_acc, out_b, lse_b)} | ({idx.device} if idx is not None else set())
    if len(devices) > 1:
        raise ValueError(f"merge_rows_: tensors on different devices {sorted(map(str, devices))}")
    if _use_triton(oa, la, ob, lb):
        if idx is not None and idx.dtype != torch.int64:
            idx = idx.long()
        _merge_triton(_kernels(), oa, la, ob, lb, idx, rng[0] if rng is not None else 0)
        return
    if idx is None:
        start, length = rng
        _merge_torch(oa.narrow(1, start, length), la.narrow(-1, start, length), ob, lb)
        return
    idx = idx.long()
    sub_o, sub_l = oa.index_select(1, idx), la.index_select(-1, idx)
    _merge_torch(sub_o, sub_l, ob, lb)
    oa.index_copy_(1, idx, sub_o)
    la.index_copy_(-1, idx, sub_l)


# ----------------------------------------------------------------------------------------------------------------
# row scatter-add


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Whether every row ``x[r]`` is one contiguous run of memory."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def rows_add_(acc: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """``acc[idx[r]] += val[r]`` along dim 0 for distinct ``idx`` (fp32 math, stored in ``acc``'s dtype); returns acc.

    Raises:
        ValueError: ``idx`` not a 1-D integer tensor with one entry per row of ``val``, or ``val`` rows not shaped
            like ``acc`` rows.
    """
    if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32) or idx.numel() != val.shape[0]:
        raise ValueError(f"rows_add_: idx must be a 1-D integer tensor with one entry per row of val "
                         f"({val.shape[0]}), got {idx.dtype} of shape {tuple(idx.shape)}")
    if acc.shape[1:] != val.shape[1:]:
        raise ValueError(f"rows_add_: rows of val {tuple(val.shape)} do not match rows of acc {tuple(acc.shape)}")
    if not acc.device == idx.device == val.device:
        raise ValueError(f"rows_add_: acc, idx and val on different devices ({acc.device}, {idx.device}, "
                         f"{val.device})")
    if val.shape[0] == 0 or acc[0:1].numel() == 0:
        return acc
    if _use_triton(acc, val) and _rows_contiguous(acc) and _rows_contiguous(val):
        k = _kernels()
        triton = k["triton"]
        f = acc[0].numel()
        block = min(_ADD_BLOCK, triton.next_power_of_2(f))
        grid = (val.shape[0], triton.cdiv(f, block))
        with _on_device(acc):
            k["rows_add"][grid](acc, val, idx.long(), f, acc.stride(0), val.stride(0), BLOCK=block, num_warps=4,
                                enable_fp_fusion=True)
        return acc
    if val.dtype == acc.dtype or acc.dtype == _acc_dtype(acc, val):
        return acc.index_add_(0, idx.long(), val.to(acc.dtype))
    # low-precision accumulator, higher-precision value: add in the higher precision, round once
    sub = acc.index_select(0, idx.long()).to(val.dtype).add_(val)
    return acc.index_copy_(0, idx.long(), sub.to(acc.dtype))


# ----------------------------------------------------------------------------------------------------------------
# attention sinks: one more "block" per head with lse = sinks[h] and out = 0

from ._sink_kernels import merge_sinks_, sink_terms  # noqa: E402


# merge_sinks_ / sink_terms: one fused pass each (Triton on CUDA, torch elsewhere), in ._sink_kernels


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor],
               wanted: bool) -> Optional[torch.Tensor]:
    """The gradient of ``sinks`` from these rows, in the sinks' dtype (``None`` without sinks or when not wanted)."""
    if sinks is None or not wanted:
        return None
    terms = sink_terms(dout, out, lse, sinks)
    return terms.reshape(-1, terms.shape[-1]).sum(0).to(sinks.dtype)
