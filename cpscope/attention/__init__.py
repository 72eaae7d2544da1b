"""Context-parallel attention over the active CP group.

:func:`context_parallel_attention` takes this rank's **zigzag** shards of q/k/v (see ``cpscope.zigzag_shard``) and
returns this rank's rows of full attention over the whole sequences — document-masked in ``thd``, causal or not,
with grouped-query attention — over one of four communication variants. Under CP1 it is plain local attention.

Modules: :mod:`.api` (validate once, prepare, dispatch), :mod:`.variants` (``comm=`` and the ``"auto"`` chooser),
:mod:`.ring` (the zigzag ring), :mod:`.allgather`, :mod:`.ulysses`, :mod:`.hierarchical` (one algorithm each),
:mod:`.blocks` (one block and its kernels), :mod:`.merge` (log-sum-exp merging), :mod:`.comm` (the exchange),
:mod:`.module` (the ``nn.Module``).

Example::

    with cpscope.runtime_cp(groups[2]):
        q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
"""
from .api import attention_with_scope, context_parallel_attention
from .module import ContextParallelAttention
from .variants import set_auto_chooser

__all__ = ["context_parallel_attention", "attention_with_scope", "ContextParallelAttention", "set_auto_chooser"]
