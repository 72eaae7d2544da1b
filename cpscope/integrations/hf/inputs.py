"""The per-call input checks shared by the ``"cpscope"`` attention function and the bound token mixers.

* :func:`_check_mask` — a 2-D all-ones mask is harmless; padding zeros or a 4-D mask raise ``ValueError``;
* :func:`_packed_offsets` — a packed batch's global document offsets from the ``cu_seq_lens_q`` / ``cu_seq_lens_k``
  keyword arguments transformers passes to every layer (one source of truth for attention and the recurrences);
* :class:`_PerTensor` — host-side results remembered per tensor, so layers after the first add no host sync.

Example::

    cu, cu_list = _packed_offsets({"cu_seq_lens_q": torch.tensor([0, 8, 24], dtype=torch.int32)})  # cu_list [0, 8, 24]
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..._pack import cu_seqlens_list

__all__: list[str] = []


def _unsupported(what: str) -> ValueError:
    return ValueError(f'attn_implementation="cpscope" cannot honour {what}')


class _PerTensor:
    """Host-side check results remembered per tensor object, its in-place version and a key (one sync per tensor).

    Keyed by ``id`` with an identity check through a weak reference, whose callback drops the entry when the
    tensor dies (a ``WeakKeyDictionary`` would compare tensors with ``==``). Inference-mode tensors have no version
    counter and are never remembered.
    """

    __slots__ = ("_hits",)
    MISS: Any = object()

    def __init__(self) -> None:
        self._hits: dict[int, tuple[weakref.ref, int, Any, Any]] = {}

    def get(self, t: torch.Tensor, key: Any) -> Any:
        hit = self._hits.get(id(t))
        if hit is None or hit[0]() is not t or hit[2] != key:
            return self.MISS
        try:
            return hit[3] if hit[1] == t._version else self.MISS
        except RuntimeError:  # inference tensor
            return self.MISS

    def put(self, t: torch.Tensor, key: Any, value: Any) -> None:
        try:
            version = t._version
            ident = id(t)
            ref = weakref.ref(t, lambda r, ident=ident: self._forget(ident, r))
        except (RuntimeError, TypeError):  # inference tensor / no weak references: not remembered
            return
        self._hits[ident] = (ref, version, key, value)

    def _forget(self, ident: int, ref: weakref.ref) -> None:
        hit = self._hits.get(ident)
        if hit is not None and hit[0] is ref:
            self._hits.pop(ident, None)


_CHECKED_MASKS = _PerTensor()  # 2-D masks found free of zeros


def _check_mask(attention_mask: Any) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise _unsupported(f"an attention_mask of type {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise _unsupported(
            f"a {attention_mask.dim()}-D attention_mask of shape {tuple(attention_mask.shape)} (only causal / "
            "document masking is supported: pass no mask, or pack documents via position_ids)"
        )
    if _CHECKED_MASKS.get(attention_mask, None) is not _PerTensor.MISS:
        return  # this very mask (same version) was checked before: no host sync per layer / per call
    zeros = int((attention_mask == 0).sum())
    if zeros:
        raise _unsupported(
            f"a 2-D attention_mask with {zeros} zeros (padding) of shape {tuple(attention_mask.shape)}: remove the "
            "padding or pack the sequences into one row with position_ids restarting at 0 (shard_batch computes "
            "the document offsets)"
        )
    _CHECKED_MASKS.put(attention_mask, None, True)


def _packed_offsets(kwargs: dict[str, Any]) -> tuple[Any, Optional[list[int]]]:
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
            raise _unsupported(f"different cu_seq_lens_q {cu_list} and cu_seq_lens_k {cu_k_list}")
    return cu, cu_list
