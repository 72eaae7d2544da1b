"""megatron-core 0.19.2's sliding windows (``window_size``, ``window_attn_skip_freq``) and softmax offsets
(``softmax_type`` "learnable" / "off-by-one": one sink logit per head) under :func:`enable_runtime_cp` at CP2 (local
spec, gloo CPU ranks) equal the *unmodified* Megatron model run without CP; multi-latent attention is refused.

The reference runs Megatron's own local attention (its sliding-window mask, its ``SoftmaxOne``) on each document
alone. CPU shims (test-side only, as in ``test_megatron_core``): Megatron builds its window mask and its fixed
softmax offset on ``"cuda"``; the reference runs under a function mode that makes those factory calls CPU ones.
"""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import cpscope
from tests.distributed import run_ranks
from tests.integrations.test_megatron_core import (VOCAB, _assert_close, _build, _grads, _init_megatron,
                                                   _megatron_available, _psp, _reference_cpu_shims)

pytestmark = pytest.mark.skipif(not _megatron_available(), reason="megatron-core 0.19.2 (with triton) is not installed")

LENGTHS = [12, 8, 16]  # every document divisible by 2*cp = 4 and longer than the window
WINDOWED = dict(window_size=(4, 0), window_attn_skip_freq=2)  # layer 1 slides (5 keys), layer 2 is full


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """``device="cuda"`` in tensor factory calls made inside Megatron's code → ``"cpu"`` (a CPU-only host)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def _reference_shims():
    with _reference_cpu_shims(), _CudaFactoriesOnCpu():
        yield


def _pair(**overrides: Any) -> tuple[Any, Any]:
    """(model to convert, unmodified reference): float64, the same weights (built where Megatron wants CUDA)."""
    with _reference_cpu_shims():
        return _build(torch.float64, **overrides), _build(torch.float64, **overrides)


def _reference_loss(ref: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ CE over the documents, each run alone through the unmodified model (bshd, its own masks); backward."""
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    with _reference_shims():
        for n in LENGTHS:
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]  # True = masked (Megatron)
            logits = ref(tokens[None, start:start + n], torch.arange(n)[None], mask)[0]  # [n, V]
            loss = F.cross_entropy(logits, targets[start:start + n], ignore_index=-100, reduction="sum")
            loss.backward()
            total = total + loss.detach()
            start += n
    return total


def _documents() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=g)
    targets = torch.full_like(tokens, -100)
    cu = [0]
    for n in LENGTHS:
        a = cu[-1]
        targets[a:a + n - 1] = tokens[a + 1:a + n]
        cu.append(a + n)
    return tokens, targets, torch.tensor(cu, dtype=torch.int32)


def _packed_cp2_equals_reference(overrides: dict[str, Any]) -> float:
    """thd at CP2 (the microbatch names its group): loss and every gradient equal the unmodified model's."""
    from cpscope.integrations.megatron import enable_runtime_cp

    _init_megatron()
    g2 = cpscope.new_cp_groups([1, 2])[2]
    model, ref = _pair(**overrides)
    enable_runtime_cp(model)
    tokens, targets, cu = _documents()
    local, local_targets = (cpscope.zigzag_shard(t, seq_dim=0, cu_seqlens=cu, group=g2) for t in (tokens, targets))
    logits = model(local[None], None, None, packed_seq_params=_psp(cu, group=g2, local=2))[0]  # [t/2, V]
    loss = F.cross_entropy(logits, local_targets, ignore_index=-100, reduction="sum")
    loss.backward()  # outside every scope
    grads = _grads(model)
    total = loss.detach().clone()
    for t in [total, *grads.values()]:
        dist.all_reduce(t, group=g2)
    ref_loss = _reference_loss(ref, tokens, targets)
    assert abs(float(total - ref_loss)) <= 1e-9 * float(ref_loss), (float(total), float(ref_loss))
    _assert_close(grads, _grads(ref), 1e-9, f"{overrides} gradients")
    return float(total)


def _dense_cp2_equals_reference(overrides: dict[str, Any]) -> None:
    """sbhd under ``runtime_cp(CP2)`` (no PackedSeqParams): logits equal the unmodified model's, cut per rank."""
    from cpscope.integrations.megatron import enable_runtime_cp

    _init_megatron()
    g2 = cpscope.new_cp_groups([1, 2])[2]
    model, ref = _pair(**overrides)
    enable_runtime_cp(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))  # [b, s]
    with torch.no_grad():
        with _reference_shims():
            mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
            full = ref(ids, torch.arange(16)[None].expand(2, -1), mask)  # [b, s, V]
        with cpscope.runtime_cp(g2):
            got = model(cpscope.zigzag_shard(ids, seq_dim=1), None, None)
        want = cpscope.zigzag_shard(full, seq_dim=1, group=g2)
        assert float((got - want).abs().max()) < 1e-9


def _windows_and_offsets_2_ranks() -> list[float]:
    out = [_packed_cp2_equals_reference({**WINDOWED, "softmax_type": "learnable"}),
           _packed_cp2_equals_reference({"window_size": (6, 0)})]
    _dense_cp2_equals_reference({**WINDOWED, "softmax_type": "off-by-one"})
    return out


def test_windows_and_softmax_offsets_at_cp2_equal_the_unmodified_model():
    losses = run_ranks(2, _windows_and_offsets_2_ranks, timeout=300)
    assert losses[0] == losses[1]


def _features_change_the_reference() -> None:
    """The window and the offset each change the reference loss by far more than the tolerance (1e-9 relative):
    a ring that ignored them would fail."""
    _init_megatron()
    tokens, targets, _ = _documents()
    losses = {}
    for name, overrides in {"plain": {}, "window": WINDOWED, "offset": {"softmax_type": "learnable"}}.items():
        _, ref = _pair(**overrides)
        losses[name] = float(_reference_loss(ref, tokens, targets))
    assert abs(losses["window"] - losses["plain"]) > 1e-5 * losses["plain"], losses  # 1e4 x the tolerance
    assert abs(losses["offset"] - losses["plain"]) > 1e-5 * losses["plain"], losses  # 1e4 x the tolerance


def _refusals() -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from cpscope.integrations.megatron import enable_runtime_cp

    _init_megatron()
    model, _ = _pair(window_size=(4, 2))
    with pytest.raises(ValueError, match=r"window_size=\(4, 2\) with a causal mask .*use window_size=\(left, 0\)"):
        enable_runtime_cp(model)
    # Multi-latent attention: the local spec of 0.19.2 cannot build it at all ...
    config = MLATransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="rope")
    with _reference_cpu_shims(), pytest.raises(TypeError, match="unexpected keyword argument 'k_channels'"):
        GPTModel(config, get_gpt_layer_local_spec(multi_latent_attention=True), vocab_size=VOCAB,
                 max_sequence_length=64, position_embedding_type="rope")
    # ... and a model that has it (the TE spec, where TE is installed) is refused by name.
    model, _ = _pair()
    model.config.multi_latent_attention = True  # the flag enable_runtime_cp reads
    with pytest.raises(ValueError, match=r"multi_latent_attention=True \(MLA's own CP RoPE path"):
        enable_runtime_cp(model)


def _single_rank_checks() -> None:
    _features_change_the_reference()
    _refusals()


def test_features_change_the_reference_and_refusals():
    run_ranks(2, _single_rank_checks, timeout=300)
