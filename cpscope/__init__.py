"""cpscope — runtime (hybrid / dynamic) context parallelism for PyTorch.

The main API:

* :func:`runtime_cp` — ``with runtime_cp(group):`` binds the CP group for this microbatch (context manager and
  decorator, ContextVar-based: restored on exit or exception, isolated per thread / asyncio task).
* :func:`current_cp_group`, :func:`cp_size`, :func:`cp_rank` — what is active; :func:`set_build_time_cp_group`
  sets the static group used outside every scope; :func:`capture_scope` snapshots the scope for later re-entry.
* Reading the scope inside an autograd backward that did not re-enter a captured scope raises
  :class:`ScopeReadInBackwardError` (on by default; expert opt-out: :func:`set_backward_read_check`,
  :class:`allow_scope_reads_in_backward`).
* :func:`new_cp_groups` — a registry of pre-built CP groups (``{1: None, 2: group, 4: group}``);
  :func:`cp_stream` — the lazily created auxiliary CUDA stream.
* :func:`zigzag_shard` / :func:`zigzag_unshard`, :func:`apply_rotary_pos_emb`, :func:`context_parallel_attention`
  — sharding, RoPE and ring attention that read the active group (or take ``group=``; ``None`` means CP1);
  :func:`zigzag_positions` (also named :func:`zigzag_position_ids`) and :func:`zigzag_indices` — the index math.
* :func:`clear_caches` — drop every cache cpscope keeps (per-pack metadata, host copies of offsets, cuDNN graphs);
  tensors cpscope returns never alias a cache.
* :func:`checkpoint` — activation checkpointing whose recompute re-enters the scope captured in forward;
  :func:`scoped` / :func:`scope_context_fn` plug the same into other checkpointing schemes (module
  :mod:`cpscope.recompute`); :class:`MicrobatchScope` carries a microbatch's scope through 1F1B / interleaved
  schedules.
* :mod:`cpscope.hybrid` — the hybrid-CP planner; :mod:`cpscope.train` — its microbatch loop and gradient sync;
  :mod:`cpscope.integrations` — HF transformers,
  TransformerEngine and Megatron adapters (optional dependencies, imported only when used).

Example::

    import cpscope
    groups = cpscope.new_cp_groups([1, 2, 4])
    with cpscope.runtime_cp(groups[2]):
        q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
        q = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="bshd")
        k = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="bshd")
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
"""
from ._tensor_cache import clear_caches
from .backward_check import (
    ScopeReadInBackwardError,
    allow_scope_reads_in_backward,
    backward_read_check_enabled,
    set_backward_read_check,
)
from .groups import clear_cp_group_cache, group_ranks, hierarchical_cp_groups, new_cp_groups
from .scope import (
    CPScope,
    build_time_cp,
    build_time_cp_group,
    build_time_scope,
    capture_scope,
    cp_rank,
    cp_size,
    current_cp_group,
    resolve_scope,
    runtime_cp,
    runtime_scope_or,
    set_build_time_cp_group,
)
from .streams import cp_stream
from .sharding import (
    PaddedPackedBatch,
    pad_packed_batch,
    pad_to_cp_multiple,
    zigzag_indices,
    zigzag_position_ids,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from .rope import RotaryEmbedding, apply_rotary_pos_emb, rotary_freqs
from .attention import ContextParallelAttention, RanksDisagreeError, context_parallel_attention, verify_agreement
from .recompute import checkpoint, scope_context_fn, scoped
from .microbatch import MicrobatchScope
from ._sentinel import SentinelError, sentinel

__all__ = [
    "CPScope",
    "ContextParallelAttention",
    "MicrobatchScope",
    "checkpoint",
    "scope_context_fn",
    "scoped",
    "PaddedPackedBatch",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "context_parallel_attention",
    "pad_packed_batch",
    "pad_to_cp_multiple",
    "rotary_freqs",
    "zigzag_indices",
    "zigzag_position_ids",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_unshard",
    "ScopeReadInBackwardError",
    "allow_scope_reads_in_backward",
    "backward_read_check_enabled",
    "build_time_cp",
    "build_time_cp_group",
    "build_time_scope",
    "capture_scope",
    "clear_caches",
    "clear_cp_group_cache",
    "cp_rank",
    "cp_size",
    "cp_stream",
    "current_cp_group",
    "group_ranks",
    "hierarchical_cp_groups",
    "new_cp_groups",
    "resolve_scope",
    "runtime_cp",
    "runtime_scope_or",
    "set_backward_read_check",
    "set_build_time_cp_group",
    "sentinel",
    "SentinelError",
    "RanksDisagreeError",
    "verify_agreement",
]

from ._version import __version__  # noqa: E402

