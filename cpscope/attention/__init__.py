"""Context-parallel attention over the active CP group.

:func:`context_parallel_attention` takes this rank's **zigzag** shards of q/k/v (see ``cpscope.zigzag_shard``) and
returns this rank's rows of full attention over the whole sequences — document-masked in ``thd``, causal or not,
with grouped-query attention, sliding windows, attention sinks, softcapping and a v head dim of its own — over one
of four communication variants. Under CP1 it is plain local attention.

The public names are this package's ``__all__``: the call and the module, the ``"auto"`` hook, the agreement check,
and the kernel policy with what the router chose (``routing_table``, ``fallbacks``). Everything else lives in
private modules, top down: :mod:`._api` (validate once, prepare the call, run it), :mod:`._module` (the
``nn.Module``), :mod:`._dispatch` (``comm=`` and the ``"auto"`` chooser), one algorithm each — :mod:`._ring` (the
zigzag ring; its plan of blocks and rows per step in :mod:`._ring_plan`), :mod:`._allgather`, :mod:`._ulysses`,
:mod:`._hierarchical` — the windowed form of ``p2p`` / ``all_gather`` — :mod:`._halo` over :mod:`._halo_plan` (which
blocks a window leaves, which K/V rows each rank needs from whom) — and their pieces: :mod:`._kernels` (one block and
its kernels, chosen by one router; steered by :mod:`._policy`), :mod:`._merge` (log-sum-exp merging), :mod:`._exchange`
(the exchange between ranks), :mod:`._layout` (the packed form of the collective variants), :mod:`._inputs`
(validation), :mod:`._agreement` (the ranks of a group agree on each call before any exchange:
:class:`RanksDisagreeError` on every rank instead of a hang or wrong rows).

Example::

    with cpscope.runtime_cp(groups[2]):
        q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
"""
from ._agreement import RanksDisagreeError, verify_agreement
from ._api import attention_with_scope, context_parallel_attention
from ._kernels import fallbacks, routing_table
from ._module import ContextParallelAttention
from ._policy import KernelPolicy, kernel_policy, set_kernel_policy, use_kernel_policy
from ._dispatch import set_auto_chooser

__all__ = ["context_parallel_attention", "attention_with_scope", "ContextParallelAttention", "set_auto_chooser",
           "RanksDisagreeError", "verify_agreement", "KernelPolicy", "kernel_policy", "set_kernel_policy",
           "use_kernel_policy", "routing_table", "fallbacks"]

# For cpscope's other rooms (the sentinel, the TE integration): importable here, not part of ``__all__``.
from . import _api as api_module  # noqa: E402
from ._agreement import STAND_DOWN, check_call, raise_differ  # noqa: E402
from ._api import AttentionCall  # noqa: E402
from ._dispatch import te_binding  # noqa: E402
