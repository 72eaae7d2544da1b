"""megatron-core adapter: runtime (hybrid) CP in a model built with a static CP size, plus the data-side bridges.

Model side (needs megatron-core, :data:`SUPPORTED_MEGATRON_CORE`; imported only when called):

* :func:`enable_runtime_cp` — one call: every CP consumer of a megatron-core model (RoPE table and application,
  core attention: cpscope's ring for the local spec, TE bound per call with a lazily created CP stream) follows the
  group each microbatch names in ``PackedSeqParams.cp_group`` / ``local_cp_size``, or the enclosing
  :func:`cpscope.runtime_cp`. :func:`disable_runtime_cp` undoes it.

``PackedSeqParams`` side (any object with those attributes; Megatron is not imported):

* :func:`packed_seq_scope` (decorator / ``.bind``), :func:`scope_from_packed_seq_params`,
  :func:`read_packed_seq_params` — a ``PackedSeqParams`` as a cpscope scope.

Data side (no Megatron import):

* :mod:`~cpscope.integrations.megatron._data` — a Megatron ``thd`` batch (``tokens`` / ``labels`` / ``loss_mask`` /
  ``cu_seqlens``, ``get_batch_on_this_cp_rank``'s conventions) into cpscope's hybrid loop and back:
  :func:`documents_from_batch`, :func:`prepare_megatron_microbatches`, :func:`megatron_forward`,
  :func:`shard_batch`.
* :mod:`~cpscope.integrations.megatron._scheduler` — :class:`PlannerScheduler`, cpscope's planner behind the interface
  of Megatron's ``BalancedCPScheduler`` (``get_groups_and_subsamples``).

Example::

    from cpscope.integrations.megatron import enable_runtime_cp
    enable_runtime_cp(model)                      # a GPTModel built with context_parallel_size=1
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m,
                          cp_group=groups[2], local_cp_size=2)
    logits = model(tokens_local, None, None, packed_seq_params=psp)   # this microbatch runs CP2
"""
from ._packed_seq_params import PackedSeqInfo, packed_seq_scope, read_packed_seq_params, scope_from_packed_seq_params
from ._runtime import disable_runtime_cp, enable_runtime_cp
from ._version import SUPPORTED_MEGATRON_CORE, megatron_core_version
from ._data import (
    Document,
    MegatronMicrobatch,
    documents_from_batch,
    megatron_forward,
    prepare_megatron_microbatch,
    prepare_megatron_microbatches,
    shard_batch,
)
from ._scheduler import PlannerScheduler

# the user's names; SUPPORTED_MEGATRON_CORE, megatron_core_version, Document, MegatronMicrobatch, PackedSeqInfo and
# prepare_megatron_microbatch stay importable from here (the types the calls above return, the version pin)
__all__ = [
    "enable_runtime_cp",
    "disable_runtime_cp",
    "PlannerScheduler",
    "documents_from_batch",
    "prepare_megatron_microbatches",
    "megatron_forward",
    "shard_batch",
    "packed_seq_scope",
    "read_packed_seq_params",
    "scope_from_packed_seq_params",
]
