"""Context-parallel attention over the active CP group.

:func:`context_parallel_attention` takes this rank's **zigzag** shards of q/k/v (see ``cpscope.zigzag_shard``) and
returns this rank's rows of full attention over the whole sequences — document-masked in ``thd``, causal or not,
with grouped-query attention, sliding windows, attention sinks, softcapping and a v head dim of its own — over one
of four communication variants. Under CP1 it is plain local attention.

Modules, top down: :mod:`.api` (validate once, prepare the call, run it), :mod:`.module` (the ``nn.Module``),
:mod:`.variants` (``comm=`` and the ``"auto"`` chooser), one algorithm each — :mod:`.ring` (the zigzag ring; its
plan of blocks and rows per step in :mod:`.ring_plan`), :mod:`.allgather`, :mod:`.ulysses`, :mod:`.hierarchical` —
the windowed form of ``p2p`` / ``all_gather`` — :mod:`.halo` over :mod:`.halo_plan` (which blocks a window leaves,
which K/V rows each rank needs from whom) — and their pieces: :mod:`.kernels` (one block and its kernels, chosen by
one router; steered by :mod:`.policy`),
:mod:`.merge` (log-sum-exp merging), :mod:`.comm` (the exchange between ranks), :mod:`.layout` (the packed form of
the collective variants), :mod:`._inputs` (validation), :mod:`.agreement` (the ranks of a group agree on each
call before any exchange: :class:`RanksDisagreeError` on every rank instead of a hang or wrong rows).

Example::

    with cpscope.runtime_cp(groups[2]):
        q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
"""
from .agreement import RanksDisagreeError, verify_agreement
from .api import attention_with_scope, context_parallel_attention
from .module import ContextParallelAttention
from .variants import set_auto_chooser

__all__ = ["context_parallel_attention", "attention_with_scope", "ContextParallelAttention", "set_auto_chooser",
           "RanksDisagreeError", "verify_agreement"]
