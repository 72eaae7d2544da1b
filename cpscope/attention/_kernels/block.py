"""What a block is, to its kernels: the packed-sequence description (:class:`Varlen`), the window type, the dtype blocks
accumulate in, and the per-call :class:`Placeholders` that a dense forward hands to its backward.

A *block* is the attention of some local queries against one set of keys/values (the local ones, or ones received
from another rank). Two shapes, as in flash-attention: **dense** ``q`` ``[b, s_q, h, d]`` (``lse`` ``[b, h, s_q]``)
and **packed** (varlen) ``q`` ``[t_q, h, d]`` (``lse`` ``[h, t_q]``) with a :class:`Varlen`.

Example::

    vl = Varlen(cu, cu, max_len, max_len, cu_host, cu_host)
    ph = Placeholders()                       # one per call: kept on the plan, read by the backward
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["Varlen", "Window", "acc_dtype", "Placeholders"]

# (left, right) around the block's bottom-right-aligned diagonal, -1 unbounded; None: no window. A
# :class:`cpscope.attention._mods.Band` is such a pair.
Window = Optional[tuple[int, int]]


@dataclass(frozen=True, eq=False)
class Varlen:
    """Packed-sequence description of one varlen block (flash's ``cu_seqlens_q/k``, ``max_seqlen_q/k``).

    Built once per pack (see :class:`cpscope.attention._ring_plan.RingGeometry`) and reused by every layer; kernels
    keep what they derive from it (e.g. cuDNN's device offsets) in :attr:`memo`, so it lives exactly as long as the
    pack.
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


class Placeholders:
    """The placeholder outputs of aten's dense attention forwards that their backwards take as arguments
    (``cum_seq_q`` / ``cum_seq_k``, ``None`` for dense inputs, and the philox seed / offset, unused without
    dropout), kept per (kernel, device) for **one call**: an algorithm keeps one on its plan, passes it to every
    block of the call, forward and backward. Only these placeholders are kept — never a block's out or lse.

    Example::

        ph = Placeholders()
        out, lse = block_forward(q, k, v, scale=s, causal=True, placeholders=ph)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=s, causal=True, placeholders=ph)
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[tuple[str, torch.device], tuple[Any, ...]] = {}

    def keep(self, kernel: str, device: torch.device, res: tuple) -> None:
        """Keep the placeholders of a dense forward's result ``res`` for ``kernel``'s backward on ``device``."""
        key = (kernel, device)
        if key not in self._kept:
            self._kept[key] = (res[2], res[3], res[6], res[7])

    def get(self, kernel: str, device: torch.device) -> tuple[Any, ...]:
        """``(cum_seq_q, cum_seq_k, seed, offset)`` of a forward of ``kernel`` on ``device`` in this call."""
        aux = self._kept.get((kernel, device))
        if aux is None:
            raise RuntimeError(f"a dense {kernel} attention backward on {device} without a forward there in this call "
                               "(pass the forward's Placeholders to the backward)")
        return aux

    def kept(self) -> dict[tuple[str, torch.device], tuple[Any, ...]]:
        """What is kept, by (kernel, device) (a copy)."""
        return dict(self._kept)
