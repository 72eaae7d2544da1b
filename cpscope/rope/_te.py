"""TransformerEngine glue shared by the core's fused RoPE path and :mod:`cpscope.integrations.te`.

Private. TransformerEngine is imported lazily, inside these functions only, so ``import cpscope`` never imports it.
The core (``cpscope.rope``) uses :func:`te_rope_if_available` (auto-detection, cached) and :func:`call_te_rope`;
the TE adapter uses :func:`te_rope` (imports TE, raising if it is absent) and :func:`call_te_rope`. Inputs are
validated by the callers (``cpscope.rope.checked_rope_inputs``) before anything here runs.

Example::

    from cpscope.rope._te import call_te_rope, te_rope_if_available

    te_apply = te_rope_if_available()          # None without TransformerEngine
    if te_apply is not None:
        out = call_te_rope(te_apply, t, freqs, qkv_format="bshd", cu_seqlens=None, cu=[0, 2 * t.shape[1]],
                           cp=2, rank=0, interleaved=False, fused=True)
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["te_rope", "te_rope_if_available", "call_te_rope"]

_UNTRIED: Any = object()
_available: Any = _UNTRIED  # _UNTRIED, None (TE absent or broken) or TE's apply_rotary_pos_emb


def te_rope() -> Callable[..., torch.Tensor]:
    """TE's ``apply_rotary_pos_emb`` (imported now; raises ``ImportError`` when TransformerEngine is absent).

    Example::

        te_apply = te_rope()       # ModuleNotFoundError: No module named 'transformer_engine' on a CPU box
    """
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    return apply_rotary_pos_emb


def te_rope_if_available() -> Optional[Callable[..., torch.Tensor]]:
    """TE's ``apply_rotary_pos_emb`` if TransformerEngine imports, else ``None``; the first answer is cached.

    Example::

        use_te = t.is_cuda and te_rope_if_available() is not None
    """
    global _available
    if _available is _UNTRIED:
        try:
            _available = te_rope()
        except Exception:  # noqa: BLE001 - TE absent or broken: callers use the torch path
            _available = None
    return _available


def call_te_rope(
    te_apply: Callable[..., torch.Tensor], t: torch.Tensor, freqs: torch.Tensor, *, qkv_format: str,
    cu_seqlens: Any, cu: list[int], cp: int, rank: int, interleaved: bool, fused: bool,
) -> torch.Tensor:
    """Call TE's ``apply_rotary_pos_emb`` on validated inputs with this rank's ``(cp_size, cp_rank)``.

    ``cu`` is the validated host copy of the global offsets (``thd``); TE gets ``cu_seqlens`` itself when it is
    already an int32 tensor on ``t``'s device, else an int32 copy made from ``cu``. ``freqs`` goes to TE as the
    dense fp32 array its kernel reads.

    Example::

        out = call_te_rope(te_rope(), q, freqs, qkv_format="thd", cu_seqlens=cu_t, cu=cu_t.tolist(), cp=2,
                           rank=1, interleaved=False, fused=True)
    """
    te_cu = None
    if qkv_format == "thd":
        given = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else None
        ok = given is not None and given.dtype == torch.int32 and given.device == t.device
        te_cu = given if ok else torch.tensor(cu, dtype=torch.int32, device=t.device)  # TE reads int32 offsets
    return te_apply(  # TE's kernel reads freqs as a dense [S, rot_dim] fp32 array
        t, freqs.float().contiguous(), tensor_format=qkv_format, interleaved=interleaved, fused=fused,
        cu_seqlens=te_cu, cp_size=cp, cp_rank=rank,
    )
