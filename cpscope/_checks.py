"""Input validation shared by sharding, RoPE and attention.

Every check raises ``ValueError`` naming the received values *before* any collective or kernel runs: these are the
inputs that a kernel would otherwise turn into an illegal memory access, a NaN or a silently wrong position.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence

import torch

__all__ = [
    "QKV_FORMATS",
    "check_qkv_format",
    "check_int",
    "offsets_values",
    "check_cu_seqlens",
    "check_divisible_seq",
    "check_local_thd_len",
    "check_seq_dim",
]

QKV_FORMATS = ("bshd", "sbhd", "thd")


def check_qkv_format(qkv_format: str) -> str:
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    return qkv_format


def check_int(value: Any, name: str, *, low: Optional[int] = None) -> int:
    """``value`` as an ``int``: any integer (``numbers.Integral``: Python's, NumPy's) except a bool, at least ``low``.

    Example::

        check_int(np.int64(2), "cp", low=1)     # 2
        check_int(2.0, "cp")                     # ValueError: cp must be an integer, got float 2.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return value


def offsets_values(cu_seqlens: "torch.Tensor | Sequence[int]", name: str = "cu_seqlens") -> tuple[int, ...]:
    """``cu_seqlens`` (an int tensor or a sequence of integers) as a tuple of ints, after checking dtype, rank, start
    at 0 and monotonicity. Uncached: one host copy of a tensor each call (``cpscope._pack.host_offsets`` caches it).

    Example::

        offsets_values([0, 4, 12])          # (0, 4, 12)
    """
    if isinstance(cu_seqlens, torch.Tensor):
        return _tensor_offsets(cu_seqlens, name)
    if isinstance(cu_seqlens, (str, bytes)) or not hasattr(cu_seqlens, "__iter__"):
        raise ValueError(f"{name} must be an int tensor or a sequence of ints, got {type(cu_seqlens).__name__}")
    values = list(cu_seqlens)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must hold integers, got {values}")
    return tuple(_validated([int(v) for v in values], name))


def _tensor_offsets(cu_seqlens: torch.Tensor, name: str) -> tuple[int, ...]:
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 (or int64) tensor, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    return tuple(_validated(cu_seqlens.tolist(), name))


def _validated(values: list, name: str) -> list[int]:
    if len(values) < 2:
        raise ValueError(f"{name} must have at least 2 entries (0 and the total), got {values}")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]} (cu_seqlens={values})")
    bad = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if bad:
        i = bad[0]
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{i}]={values[i]} < {name}[{i - 1}]={values[i - 1]} "
            f"(cu_seqlens={values})"
        )
    return values


def check_cu_seqlens(cu: list[int], cp: int, name: str = "cu_seqlens") -> None:
    """Every document length must be divisible by 2·cp (zigzag cuts each document into 2·cp chunks)."""
    if cp == 1:
        return
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    bad = [(i, n) for i, n in enumerate(lens) if n % (2 * cp)]
    if bad:
        shown = ", ".join(f"document {i} has length {n}" for i, n in bad[:5])
        raise ValueError(
            f"with CP size {cp} every document length must be divisible by 2*cp={2 * cp}: {shown} "
            f"({name}={cu}); pad documents with cpscope.pad_packed_batch"
        )


def check_divisible_seq(seqlen: int, cp: int, what: str = "sequence length") -> None:
    if cp > 1 and seqlen % (2 * cp):
        raise ValueError(
            f"with CP size {cp} the global {what} must be divisible by 2*cp={2 * cp}, got {seqlen}; pad it"
        )


def check_local_thd_len(local_tokens: int, cu: list[int], cp: int, name: str = "tensor") -> None:
    total = cu[-1]
    if total % cp or local_tokens != total // cp:
        raise ValueError(
            f"{name} holds {local_tokens} local tokens, but cu_seqlens[-1]={total} with CP size {cp} needs "
            f"cu_seqlens[-1]/cp={total / cp:g}; cu_seqlens must be the global (unsharded) offsets"
        )


def check_seq_dim(x: torch.Tensor, seq_dim: int) -> int:
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return seq_dim % x.dim()


# ----------------------------------------------------------------------------------------------------------------
# RoPE checks


_ROPE_TABLE_DTYPES = (torch.float32, torch.float64)


def check_rope_table_dtype(freqs: torch.Tensor, name: str = "freqs") -> None:
    """A RoPE angle table must be float32 or float64: in bf16 / fp16 the angles of long positions are rounded to
    garbage (position 65535 x inv_freq 1 is off by up to 256 radians in bf16) before any kernel sees them.

    Example::

        check_rope_table_dtype(cpscope.rotary_freqs(64, 4096))               # fine: float32
        check_rope_table_dtype(cpscope.rotary_freqs(64, 4096).bfloat16())    # ValueError naming torch.bfloat16
    """
    if freqs.dtype not in _ROPE_TABLE_DTYPES:
        raise ValueError(
            f"{name} (the RoPE angle table) must be float32 or float64, got {freqs.dtype}: in a low-precision dtype "
            f"the angles of long positions are rounded to garbage; build the table in float32 (cpscope.rotary_freqs "
            f"/ RotaryEmbedding do) and keep it out of model.to(dtype) conversions"
        )


def check_rope_freqs(freqs: torch.Tensor, head_dim: int, global_len: int, what: str = "global sequence length") -> int:
    """Check a TE-style RoPE table ``[max_seqlen, 1, 1, rot_dim]`` against the input; return ``rot_dim``.

    ``rot_dim`` must be even, positive and at most ``head_dim``; the table must cover ``global_len`` positions.
    """
    if not isinstance(freqs, torch.Tensor):
        raise ValueError(f"freqs must be a tensor of shape [max_seqlen, 1, 1, rot_dim], got {type(freqs).__name__}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [max_seqlen, 1, 1, rot_dim], got {tuple(freqs.shape)}")
    if not freqs.is_floating_point():
        raise ValueError(f"freqs must be a floating-point tensor of angles, got dtype {freqs.dtype}")
    check_rope_table_dtype(freqs)
    rot_dim = freqs.shape[-1]
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim (freqs.shape[-1]) must be a positive even number, got {rot_dim}")
    if rot_dim > head_dim:
        raise ValueError(f"rot_dim (freqs.shape[-1]) = {rot_dim} exceeds the head dimension {head_dim}")
    if freqs.shape[0] < global_len:
        raise ValueError(
            f"freqs covers {freqs.shape[0]} positions but the {what} is {global_len}; freqs must cover the global "
            f"(unsharded) length — build it with max_seqlen >= {global_len}"
        )
    return rot_dim


def check_tensor_dims(t: torch.Tensor, qkv_format: str, name: str = "t") -> None:
    """``bshd`` / ``sbhd`` tensors are 4-D, ``thd`` tensors 3-D."""
    want = 3 if qkv_format == "thd" else 4
    if t.dim() != want:
        raise ValueError(
            f"{name} must be {want}-D for qkv_format={qkv_format!r} ({'[t, h, d]' if want == 3 else qkv_format}), "
            f"got shape {tuple(t.shape)}"
        )


__all__ += ["check_rope_freqs", "check_rope_table_dtype", "check_tensor_dims"]
