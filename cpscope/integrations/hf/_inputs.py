"""The per-call input checks shared by the ``"cpscope"`` attention function and the bound token mixers.

* :func:`check_mask` — a 2-D all-ones mask is harmless; padding zeros or a 4-D mask raise ``ValueError`` (checked
  once per mask tensor: :func:`cpscope._tensor_cache.derived` remembers it, so later layers add no host sync);
* :func:`packed_offsets` — a packed batch's global document offsets from the ``cu_seq_lens_q`` / ``cu_seq_lens_k``
  keyword arguments transformers passes to every layer (one source of truth for attention and the recurrences);

Example::

    cu, cu_list = packed_offsets({"cu_seq_lens_q": torch.tensor([0, 8, 24], dtype=torch.int32)})  # cu_list [0, 8, 24]
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..._pack import cu_seqlens_list
from ..._tensor_cache import derived

__all__: list[str] = []  # in-package helpers of cpscope.integrations.hf, not public API


def unsupported(what: str) -> ValueError:
    """The ``ValueError`` for an input the ``"cpscope"`` attention cannot honour (returned, for the caller to raise)."""
    return ValueError(f'attn_implementation="cpscope" cannot honour {what}')


def check_mask(attention_mask: Any) -> None:
    """``ValueError`` unless ``attention_mask`` is ``None`` or a 2-D mask of ones (padding and 4-D masks refused)."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise unsupported(f"an attention_mask of type {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise unsupported(
            f"a {attention_mask.dim()}-D attention_mask of shape {tuple(attention_mask.shape)} (only causal / "
            "document masking is supported: pass no mask, or pack documents via position_ids)"
        )
    # this very mask, unchanged, was checked before: no host sync per layer / per call (a refusal is not remembered)
    derived(attention_mask, ("hf-mask-no-padding",), lambda: _no_padding(attention_mask))


def _no_padding(attention_mask: torch.Tensor) -> bool:
    zeros = int((attention_mask == 0).sum())
    if zeros:
        raise unsupported(
            f"a 2-D attention_mask with {zeros} zeros (padding) of shape {tuple(attention_mask.shape)}: remove the "
            "padding or pack the sequences into one row with position_ids restarting at 0 (shard_batch computes "
            "the document offsets)"
        )
    return True


def packed_offsets(kwargs: dict[str, Any]) -> tuple[Any, Optional[list[int]]]:
    """The packed batch's global ``cu_seq_lens`` (as given) and their validated host copy; ``(None, None)`` if dense.

    Host copies are remembered per tensor: one sync per forward, none per layer.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    cu = cu_q if cu_q is not None else cu_k
    if cu is None:
        return None, None
    cu_list = cu_seqlens_list(cu, "cu_seq_lens_q" if cu is cu_q else "cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and cu_q is not cu_k:
        cu_k_list = cu_seqlens_list(cu_k, "cu_seq_lens_k")
        if cu_k_list != cu_list:
            raise unsupported(f"different cu_seq_lens_q {cu_list} and cu_seq_lens_k {cu_k_list}")
    return cu, cu_list
