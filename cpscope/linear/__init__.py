"""Recurrences that are affine in their state, under the active CP scope, on the zigzag layout.

Gated DeltaNet and Kimi Delta Attention (:func:`gated_delta_rule`), Mamba2's chunked scan (:func:`mamba2_scan`) and
causal short convolutions (:func:`causal_conv1d`) take this rank's **local zigzag shards** (the ``zigzag_shard`` cut
that attention uses) and return the matching rows of the recurrence over the whole sequences — packed documents
(``cu_seqlens``, global offsets) each starting from a zero state. Under CP1 (``group=None`` or a size-1 group) they
are the plain recurrences; any CP size works.

How: each recurrence is affine in its state over a run of tokens, ``S_out = A · S_in + b``. Every rank summarises
each of its two zigzag chunks as ``(A, b)`` (in fp32 or wider), the summaries are all-gathered once, and each chunk's
incoming state is the composition of the chunks before it in global order (:mod:`cpscope.linear._summaries`); for a
short convolution the "state" is the last ``W − 1`` inputs, a halo. No layout conversion, no all-to-all of
activations.

* :mod:`~cpscope.linear._delta_rule` — :func:`gated_delta_rule` (GDN's scalar gate, KDA's per-channel gate);
* :mod:`~cpscope.linear._mamba2` — :func:`mamba2_scan` (SSD);
* :mod:`~cpscope.linear._short_conv` — :func:`causal_conv1d`;
* :mod:`~cpscope.linear._kernels` — the local kernels behind one interface (flash-linear-attention's Triton chunk
  functions on CUDA where installed, the torch chunk code otherwise);
* :mod:`~cpscope.linear._summaries` — the affine summary algebra; :mod:`~cpscope.linear._exchange` — the all-gather;
  :mod:`~cpscope.linear._pieces` — where the local pieces sit in the global sequences.

Example::

    import cpscope
    from cpscope.linear import gated_delta_rule
    with cpscope.runtime_cp(groups[2]):
        shard = lambda t: cpscope.zigzag_shard(t, seq_dim=1, cu_seqlens=cu)
        o = gated_delta_rule(*(shard(t) for t in (q, k, v, g, beta)), cu_seqlens=cu, use_qk_l2norm=True)
"""
from ._delta_rule import gated_delta_rule
from ._mamba2 import mamba2_scan
from ._short_conv import causal_conv1d

__all__ = ["gated_delta_rule", "mamba2_scan", "causal_conv1d"]
