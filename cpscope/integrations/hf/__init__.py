"""Hugging Face transformers adapter: ``attn_implementation="cpscope"`` runs a decoder under the active CP scope.

Importing this module registers, under the name ``"cpscope"``:

* an attention function with transformers' ``AttentionInterface`` — :func:`cpscope_attention_forward`, which calls
  :func:`cpscope.context_parallel_attention` (ring attention over the active group; plain attention under CP1);
* a mask function with ``AttentionMaskInterface`` — :func:`cpscope_attention_mask`, so transformers builds no
  ``[b, 1, s, s]`` mask (causality and documents are handled by the ring), and a padding mask it cannot honour is
  refused with a ``ValueError`` instead of being dropped silently.

Inputs are sharded with :func:`shard_batch` (zigzag layout, for the active group; it lives in
:mod:`cpscope.integrations.hf._shard_batch`): every rank feeds the model its local tokens and their **global**
``position_ids``, so the model's own RoPE is right without changes. Packed batches (several documents in one row,
``position_ids`` restarting) get global ``cu_seq_lens_q/k`` and ``max_length_q/k`` computed from the full
``position_ids``; transformers forwards these keyword arguments to the attention function.

Labels: transformers' causal-LM loss shifts labels by one inside the loss. After sharding, a rank's tokens are not
contiguous, so the shift must happen on the full sequence, **before** sharding. :func:`shard_batch` returns
``shift_labels`` (already shifted, ``ignore_index`` at the end of every sequence / document, then sharded) and
``num_items_in_batch`` (the number of target tokens in the full batch): passed to the model, transformers' loss
then skips its own shift and each rank's loss is its share of the full-batch mean — sum it over the CP group for the
full loss; summing the gradients over the CP group (as data parallelism over the CP ranks does) gives the gradient
of the full-batch mean loss.

The per-layer attention options of today's decoders run under CP as in the model's own eager attention:
``sliding_window`` (Mistral, Qwen2/3, Gemma 2/3, gpt-oss: query ``i`` sees keys ``i - W < j <= i``), ``softcap``
(Gemma 2), ``s_aux`` (gpt-oss sinks, differentiable) and a v head dim other than q/k's (DeepSeek-V3's multi-latent
attention); see :mod:`cpscope.integrations.hf._options`.

Hybrid models (linear-attention, state-space or short-convolution layers: Qwen3.5, Qwen3-Next, Kimi Linear,
Nemotron-H, Bamba, Granite 4 hybrids, Falcon-H1, LFM2) need their token mixers bound to the scope: run under CP > 1
with only ``attn_implementation="cpscope"`` set, their first attention layer raises ``ValueError`` on every rank
(:mod:`cpscope.integrations.hf._mixers`).

Not supported (each raises ``ValueError``): padding masks with zeros, 4-D masks, KV caches / generation
(query and key lengths differ), a sliding window without a causal mask, attention dropout.

Activation checkpointing works as is: ``model.gradient_checkpointing_enable()`` /
``model.activation_checkpointing_enable()`` with any ``use_reentrant`` (and ``offload``, ``every_n_layers``). The
attention function reads the active scope when it runs, so the recompute in backward must re-enter the forward's
scope: importing this module wraps the checkpoint function transformers installs in every layer
(``PreTrainedModel._set_gradient_checkpointing``) with :class:`ScopedCheckpointFunction`, which — for models whose
``config._attn_implementation`` is ``"cpscope"`` at call time — captures the scope at each checkpointed layer call
and re-enters it in the recompute, like :func:`cpscope.checkpoint`. For a model set up another way (checkpointing
enabled before this import, a custom ``_set_gradient_checkpointing``), call :func:`enable_scoped_recompute` once.
Without either, the recompute raises :class:`cpscope.ScopeReadInBackwardError` on every rank, never a wrong number.

Host synchronisation: per forward, the checks that need host values (a 2-D mask's zeros, the ``position_ids``
layout, the ``cu_seq_lens`` offsets) run once per tensor — their results are remembered per tensor object and
in-place version — so layers after the first add no host synchronisation.

Example::

    import cpscope, cpscope.integrations.hf as cphf
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cpscope")
    with cpscope.runtime_cp(groups[2]):
        batch = cphf.shard_batch({"input_ids": ids, "labels": ids})
        loss = model(**batch).loss            # this rank's share of the full-batch mean loss
    loss.backward()                           # then all-reduce (sum) gradients over the CP group
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional

import torch

try:
    import transformers
    from transformers import AttentionInterface
except ImportError as e:  # transformers absent, or too old to have the attention registry
    raise ImportError(
        f"cpscope.integrations.hf needs transformers >= 5.4 ({e}); install it with: pip install 'cpscope[hf]'"
    ) from e
if tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2]) < (5, 4):
    # older releases call the mask function with other arguments: refuse at import rather than at the first forward
    raise ImportError(f"cpscope.integrations.hf needs transformers >= 5.4, found {transformers.__version__}; "
                      "install it with: pip install 'cpscope[hf]'")

from ... import _hooks
from ..._tensor_cache import derived
from ...attention import context_parallel_attention
from ...scope import CPScope, resolve_scope
from ...sharding import zigzag_positions
from . import _batch_scope as batch_scope
from ._shard_batch import shard_batch
from ._inputs import check_mask, packed_offsets, unsupported
from ._mixers import refuse_unbound_mixers
from ._options import attention_options, longest_sequence
from ._recompute import (
    ATTN_IMPLEMENTATION,
    ScopedCheckpointFunction,
    enable_scoped_recompute,
    install_checkpoint_wrapper,
)

try:  # transformers builds (or, for "cpscope", skips) the attention mask through this registry
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - older transformers
    raise ImportError(
        "cpscope.integrations.hf needs a transformers version with transformers.masking_utils.AttentionMaskInterface "
        f"(tested with 5.24); found transformers {getattr(__import__('transformers'), '__version__', '?')}"
    ) from e

__all__ = [
    "ScopedCheckpointFunction",
    "cpscope_attention_forward",
    "cpscope_attention_mask",
    "disable_runtime_cp",
    "enable_runtime_cp",
    "enable_scoped_recompute",
    "shard_batch",
]

logger = logging.getLogger(__name__)



def cpscope_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> None:
    """transformers mask function for ``"cpscope"``: builds no mask (``None``); refuses a padding mask.

    Raises:
        ValueError: ``attention_mask`` is given and has zeros (padding cannot be honoured by the ring).

    Example::

        cpscope_attention_mask(2, 8, 8, attention_mask=torch.ones(2, 8))    # None: the ring masks itself
        cpscope_attention_mask(2, 8, 8, attention_mask=torch.tensor([[1] * 6 + [0] * 2] * 2))  # ValueError
    """
    check_mask(attention_mask)
    return None


def _check_position_ids(position_ids: torch.Tensor, scope: CPScope, local_len: int) -> None:
    """Without document offsets, every row must be one sequence: its local zigzag positions (CP1: plus an offset).

    One host sync per ``position_ids`` tensor (and scope): every layer gets the same tensor, so layers after the
    first find the result remembered.
    """
    derived(position_ids, ("hf-zigzag-positions", scope.size, scope.rank, local_len),
            lambda: _zigzag_positions_or_raise(position_ids, scope, local_len))


def _zigzag_positions_or_raise(position_ids: torch.Tensor, scope: CPScope, local_len: int) -> bool:
    pid = position_ids.reshape(-1, position_ids.shape[-1])
    if pid.shape[-1] != local_len:
        raise ValueError(
            f"position_ids have {pid.shape[-1]} positions per row but the query holds {local_len} local tokens"
        )
    expected = zigzag_positions(local_len * scope.size, scope.size, scope.rank, device=position_ids.device)
    delta = pid - expected
    # Under CP > 1 the positions must match exactly: a check that passed on some ranks only (an offset that happens
    # to fit one rank's chunks) would leave the others waiting in the ring. Under CP1 an offset per row is fine.
    bad = delta != (delta[:, :1] if scope.size == 1 else 0)
    if bool(bad.any()):
        row, col = (int(i) for i in torch.nonzero(bad)[0])
        offset = int(delta[row, 0]) if scope.size == 1 else 0
        raise ValueError(
            f"position_ids are not one sequence per row in cpscope's zigzag layout (CP size {scope.size}, rank "
            f"{scope.rank}): row {row}, local token {col} has position {int(pid[row, col])}, expected "
            f"{int(expected[col]) + offset}. Packed documents need global cu_seq_lens_q/cu_seq_lens_k, and inputs "
            "must be sharded: use cpscope.integrations.hf.shard_batch"
        )
    return True


def _host_int(value: Any) -> Optional[int]:
    """``max_length_q/k`` as a Python int; a tensor is read once (remembered per tensor), not once per layer."""
    if value is None or not isinstance(value, torch.Tensor):
        return None if value is None else int(value)
    return derived(value, ("host-int",), lambda: int(value))


def _refuse_unsupported(query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float) -> None:
    """``ValueError`` for what the ring cannot honour: masks with padding / 4-D, dropout, KV caches."""
    if attention_mask is not None:
        check_mask(attention_mask)  # a 4-D mask or padding: refuse; an all-ones 2-D mask is harmless
    if dropout:
        raise unsupported(f"attention dropout={dropout} (set config.attention_dropout=0)")
    if query.shape[2] != key.shape[2]:
        if resolve_scope().size > 1:
            raise ValueError(
                "generation does not run under context parallelism: attention got a KV cache (query length "
                f"{query.shape[2]} != key length {key.shape[2]}) under CP > 1; generate outside every "
                "cpscope.runtime_cp scope, with another attn_implementation"
            )
        raise unsupported(
            f"query length {query.shape[2]} != key length {key.shape[2]} (KV cache / generation); use another "
            "attn_implementation for generation"
        )


def cpscope_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: cpscope ring attention over the active scope.

    ``query`` / ``key`` are ``[b, h, s_local, d]`` / ``[b, h_kv, s_local, d]``, ``value`` ``[b, h_kv, s_local, d_v]``
    (local zigzag tokens; ``d_v`` may differ from ``d``); the result is ``([b, s_local, h, d_v], None)``.
    ``sliding_window``, ``softcap`` and ``s_aux`` (sinks) in ``kwargs`` are honoured. With ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` (global document offsets, from :func:`shard_batch`) the batch is packed: ``b`` must be 1 and
    attention is masked per document.

    Raises:
        ValueError: see the module docstring (padding / 4-D masks, KV cache, a non-causal sliding window,
            dropout, mismatched packed offsets, unsharded or packed ``position_ids`` without offsets).

    Example::

        # transformers calls it for attn_implementation="cpscope"; directly, e.g. in a custom attention layer:
        with cpscope.runtime_cp(groups[2]):
            out, _ = cpscope_attention_forward(self, query, key, value, None, scaling=self.scaling)  # [b, s, h, d]
    """
    if torch.compiler.is_compiling():  # one eager island (one graph break): the scope read, checks and attention
        return _attention_forward_island(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                         **kwargs)
    scope = resolve_scope()  # read once, here in forward
    batch_scope.check(kwargs, scope)  # a batch sharded for another scope: ValueError on every rank
    refuse_unbound_mixers(module, scope.size)  # a hybrid model's unbound recurrences: raise on every rank
    if _hooks.hf_positions is not None:
        _hooks.hf_positions(module, query, scope, kwargs)
    _refuse_unsupported(query, key, attention_mask, dropout)
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    cu, cu_list = packed_offsets(kwargs)
    options = attention_options(kwargs, causal=causal, longest=longest_sequence(query.shape[2], scope.size, cu_list))
    if torch.is_autocast_enabled(query.device.type):  # like SDPA under autocast (RoPE leaves q/k in fp32)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, h, d]
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:  # the same tensor in every layer: checked (one sync) in the first only
            _check_position_ids(position_ids, scope, q.shape[1])
        out = context_parallel_attention(
            q, k, v, qkv_format="bshd", causal=causal, softmax_scale=scaling, group=scope.group, **options
        )
        return out, None
    if q.shape[0] != 1:
        raise unsupported(f"packed documents (cu_seq_lens) with batch size {q.shape[0]}; pack into one row")
    max_len = kwargs.get("max_length_q")
    if max_len is None:  # (not ``a or b``: a tensor's truth value would be a host sync)
        max_len = kwargs.get("max_length_k")
    out = context_parallel_attention(  # cu as given (int32 or int64): its validated host copy is reused
        q[0], k[0], v[0], qkv_format="thd", causal=causal, cu_seqlens=cu, max_seqlen=_host_int(max_len),
        softmax_scale=scaling, group=scope.group, **options,
    )  # [t, h, d]
    return out.unsqueeze(0), None


_attention_forward_island = torch.compiler.disable(cpscope_attention_forward)


install_checkpoint_wrapper()
batch_scope.install_generate_guard()
AttentionInterface.register(ATTN_IMPLEMENTATION, cpscope_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cpscope_attention_mask)

from ._runtime import disable_runtime_cp, enable_runtime_cp  # noqa: E402  (needs this module's helpers)
