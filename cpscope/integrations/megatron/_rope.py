"""Megatron's two RoPE consumers, following the microbatch's scope instead of the static ``pg_collection.cp``.

1. The **table**: ``RotaryEmbedding.forward`` builds the angle table and, in ``bshd`` / ``sbhd`` under CP > 1, keeps
   this rank's zigzag rows (``get_pos_emb_on_this_cp_rank``). In 0.19.2 it uses the group passed by ``GPTModel`` —
   ``packed_seq_params.cp_group``, else the static one —, sizes the table with the static
   ``config.context_parallel_size``, moves its ``inv_freq`` to ``torch.cuda.current_device()`` and selects rows
   through pinned memory (so it cannot run on a CPU-only machine). :class:`RotaryTableMixin` builds the same table
   (Megatron's own ``get_freqs_non_repeated``, TE's layout) on the device of the model's input (Megatron's rule —
   the current CUDA device — when it runs without an entry forward) and selects the rows with
   :func:`cpscope.zigzag_positions` for the scope bound by the entry forward.
2. The **application**: ``Attention.forward`` calls ``apply_rotary_pos_emb(..., cp_group=self.pg_collection.cp)``,
   the static group (the bug Megatron-LM PR #6821 fixes after 0.19.2): under ``thd`` a CP2 microbatch on a model
   built with CP1 fails in ``torch.split`` (unfused) or reads past the tensor (fused). :class:`AttentionRopeMixin`
   gives the attention module, for each call only, a process-group collection whose ``cp`` is the carried scope's
   group, and restores its own afterwards (also on exceptions). Megatron's own RoPE code (fused or unfused,
   ``mscale``, interleaved) then runs unchanged with the right CP size and rank.

Example::

    swap_class(module, AttentionRopeMixin)      # what enable_runtime_cp does (cpscope.integrations._swap)
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..._checks import check_rope_table_dtype
from ..._tensor_cache import owned
from ...scope import CPScope, capture_scope
from ...sharding import zigzag_positions
from .._swap import call_with_attributes, signature_without_self
from ._carrier import consumer_scope

__all__ = ["RotaryTableMixin", "AttentionRopeMixin", "SingleRankGroup"]


class SingleRankGroup:
    """Stands for a size-1 CP group where Megatron's RoPE needs a group object (``.size()`` / ``.rank()`` only).

    Used for a CP1 microbatch when no real size-1 group is at hand (``packed_seq_params.cp_group=None`` on a model
    whose static group is larger). It performs no collective; Megatron's RoPE only asks its size and rank.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "SingleRankGroup()"


class RotaryTableMixin:
    """``RotaryEmbedding.forward`` / ``get_rotary_seq_len`` for the scope bound by the entry forward."""

    _CACHE_SIZE = 32
    _cpscope_config_cp_size: int  # set by enable_runtime_cp: the static config.context_parallel_size

    def _cpscope_table(self, max_seq_len: int, offset: int) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # type: ignore[attr-defined]  # [S, rot/2]
        if self.rotary_interleaved:  # type: ignore[attr-defined]
            emb = freqs.repeat_interleave(2, dim=-1)  # a0 a0 a1 a1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # a0 a1 ... a0 a1 ...
        return emb[:, None, None, :]  # [S, 1, 1, rot_dim]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        """The angle table ``[S, 1, 1, rot_dim]``; in ``bshd`` / ``sbhd`` under CP > 1 only this rank's zigzag rows.

        ``cp_group`` (what ``GPTModel`` passes from ``packed_seq_params``) is ignored: the scope the entry forward
        resolved and bound is used, so a size-1 group, ``None`` and the enclosing scope all mean what they say.
        """
        scope = capture_scope()  # bound by the entry forward (this module is never recomputed: it is not in a layer)
        target = self.__dict__.get("_cpscope_device")  # the device of the model's input, set by the entry forward
        if target is None and self.inv_freq.device.type == "cpu" and torch.cuda.is_available():  # type: ignore[attr-defined]
            target = torch.device("cuda", torch.cuda.current_device())  # Megatron's get_emb rule
        if target is not None and self.inv_freq.device != target:  # type: ignore[attr-defined]
            self.inv_freq = self.inv_freq.to(target)  # type: ignore[attr-defined]
        cp = 1 if packed_seq else scope.size
        key = (max_seq_len, offset, cp, scope.rank if cp > 1 else 0, self.inv_freq.device)  # type: ignore[attr-defined]
        cache = owned(self, "_cpscope_tables")  # cpscope.clear_caches() empties it
        table = cache.get(key)
        if table is None:
            table = self._cpscope_table(max_seq_len, offset)
            if cp > 1:  # bshd / sbhd: this rank's zigzag rows (thd: the attention's RoPE picks them per document)
                table = table.index_select(0, zigzag_positions(max_seq_len, cp, scope.rank, device=table.device))
            if len(cache) >= self._CACHE_SIZE:
                cache.clear()
            cache[key] = table
        return table

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        """Megatron's length, with the runtime CP size instead of the static ``context_parallel_size`` when it
        derives the global length from the local input (``bshd`` / ``sbhd``)."""
        length = super().get_rotary_seq_len(*args, **kwargs)  # type: ignore[misc]
        psp = kwargs.get("packed_seq_params", args[4] if len(args) > 4 else None)
        if psp is not None:
            return length  # max_seqlen_q / kv: global already
        return length // self._cpscope_config_cp_size * capture_scope().size


class AttentionRopeMixin:
    """``Attention.forward`` whose RoPE sees the carried scope's group as ``pg_collection.cp`` for the call."""

    _cpscope_psp_index: Optional[int]  # position of packed_seq_params in forward's signature (after self)

    @classmethod
    def _cpscope_prepare(cls, base: type) -> dict[str, Any]:
        params = list(signature_without_self(base.forward).parameters)
        return {"_cpscope_psp_index": params.index("packed_seq_params") if "packed_seq_params" in params else None}

    def _cpscope_collection(self, scope: CPScope, static: Any) -> Any:
        cache = owned(self, "_cpscope_collections")  # (holds groups: cpscope.clear_caches() empties it)
        coll = cache.get(scope)
        if coll is None:
            coll = copy.copy(static)
            if scope.size > 1:
                coll.cp = scope.group
            else:
                cp = getattr(static, "cp", None)
                coll.cp = cp if cp is not None and cp.size() == 1 else SingleRankGroup()
            cache[scope] = coll
        return coll

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        idx = self._cpscope_psp_index
        psp = kwargs.get("packed_seq_params")
        if psp is None and idx is not None and idx < len(args):
            psp = args[idx]
        _check_tables(kwargs.get("rotary_pos_emb"))  # a bf16 table is refused before Megatron's RoPE runs
        scope = consumer_scope(psp)  # the carried scope: the same in forward and in recompute
        collection = self._cpscope_collection(scope, self.pg_collection)  # type: ignore[attr-defined]
        return call_with_attributes(self, {"pg_collection": collection}, super().forward, *args, **kwargs)  # type: ignore[misc]


def _check_tables(emb: Any) -> None:
    """``rotary_pos_emb`` as Megatron passes it (a table, a ``(q, k)`` pair of tables or ``None``): float32/64."""
    for t in emb if isinstance(emb, (tuple, list)) else (emb,):
        if isinstance(t, torch.Tensor):
            check_rope_table_dtype(t, "rotary_pos_emb")
