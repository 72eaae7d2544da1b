"""Real megatron-core 0.19.2 + TransformerEngine under :func:`enable_runtime_cp` on GPUs (``@pytest.mark.gpu``).

* 1 GPU — the TE-spec ``GPTModel`` built with CP1, converted: every ``TEDotProductAttention`` is bound per call (CP1:
  ``cp_group=None``, no stream) and gets its build-time settings back after the call, also after an exception;
  logits and gradients equal the unconverted model's (Megatron's own TE ``thd`` path at CP1), with unfused and fused
  (``apply_rope_fusion``) RoPE.
* 2 GPUs — the same model built with CP1 runs CP2, CP1, CP2 ``thd`` microbatches: each rank's logits equal the
  unconverted CP1 model's on the full microbatch cut with cpscope's zigzag, gradients summed over the CP2 group equal
  the CP1 gradients (bf16: relative error ≤ 2e-2); during a CP2 call the TE modules hold the CP2 group, its global
  ranks and :func:`cpscope.cp_stream` (0.19.2 never created a stream: static CP1), restored after. The local spec
  (cpscope's ring as core attention, CUDA kernels) is checked the same way against Megatron's own local attention.

Run on the GPU machine (TE from ``../shared/tools/te-gpu/``, megatron-core from ``.whl/``)::

    python -m pip install --no-deps .whl/megatron_core-0.19.2-*.whl
    python -m pytest -q tests/integrations/test_megatron_core_gpu.py
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpscope
from tests.distributed import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

VOCAB = 128
DOCS = [128, 64]  # thd documents, each divisible by 2*cp
REL = 2e-2


def _needs_te() -> None:
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("TransformerEngine is not installed")


def _init(seed: int = 1234) -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, context_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


def _build(spec: str, *, rope_fusion: bool = False, seed: int = 0) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
        kv_channels=64, bf16=True, params_dtype=torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
        apply_rope_fusion=rope_fusion, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    layer = get_gpt_layer_with_transformer_engine_spec() if spec == "te" else get_gpt_layer_local_spec()
    model = GPTModel(cfg, layer, vocab_size=VOCAB, max_sequence_length=512, position_embedding_type="rope").cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).to(p.dtype) * 0.05)
    return model


def _psp(cu: torch.Tensor, group: Any = None, local: Any = None) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    m = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m,
                           cp_group=group, local_cp_size=local)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _te_modules(model: Any) -> list[Any]:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return [m for m in model.modules() if isinstance(m, TEDotProductAttention)]


class _te_forward_raises:
    """Make TransformerEngine's DotProductAttention.forward raise (inside the adapter's per-call binding)."""

    def __enter__(self) -> None:
        import transformer_engine.pytorch as te

        self.cls, self.saved = te.DotProductAttention, te.DotProductAttention.forward

        def boom(*args: Any, **kwargs: Any) -> Any:
            raise KeyError("planted")

        self.cls.forward = boom

    def __exit__(self, *exc: Any) -> None:
        self.cls.forward = self.saved


def _settings(m: Any) -> tuple:
    return (m.cp_group, m.cp_global_ranks, m.cp_stream, m.cp_comm_type)


def _reference(ref: Any, spec: str, ids: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unconverted model at CP1: TE spec through Megatron's own thd path; local spec per document (bshd + mask)."""
    target = torch.roll(ids, -1)
    if spec == "te":
        logits = ref(ids[None], None, None, packed_seq_params=_psp(cu, local=1))[0]
    else:
        parts = []
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            mask = torch.triu(torch.ones(b - a, b - a, dtype=torch.bool, device=ids.device), 1)[None, None]
            parts.append(ref(ids[None, a:b], torch.arange(b - a, device=ids.device)[None], mask)[0])
        logits = torch.cat(parts)
    F.cross_entropy(logits.float(), target, reduction="sum").backward()
    return logits.detach(), target


# ------------------------------------------------------------------------------------------------ rank functions


def _one_gpu_te_binding(rope_fusion: bool) -> None:
    from cpscope.integrations.megatron import enable_runtime_cp

    _init()
    dev = torch.device("cuda", torch.cuda.current_device())
    model, ref = _build("te", rope_fusion=rope_fusion), _build("te", rope_fusion=rope_fusion)
    te_mods = _te_modules(model)
    assert te_mods
    built = [_settings(m) for m in te_mods]
    names = enable_runtime_cp(model)
    assert sum(n.endswith("core_attention") for n in names) == len(te_mods)
    seen: list[tuple] = []
    for m in te_mods:  # record what each forward binds
        orig = m.set_context_parallel_group

        def spy(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            seen.append(args[:3])
            return _orig(*args, **kwargs)

        m.set_context_parallel_group = spy
    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    ids = torch.randint(0, VOCAB, (sum(DOCS),), device=dev, generator=torch.Generator(device=dev).manual_seed(3))
    want, target = _reference(ref, "te", ids, cu)
    for psp in (_psp(cu, local=1), _psp(cu)):  # CP1 named, CP1 by naming nothing
        model.zero_grad(set_to_none=True)
        seen.clear()
        logits = model(ids[None], None, None, packed_seq_params=psp)[0]
        F.cross_entropy(logits.float(), target, reduction="sum").backward()
        assert _rel(logits, want) < 1e-3
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert _rel(p.grad, q.grad) < 1e-2, n
        assert seen and all(s == (None, None, None) for s in seen), seen[:4]  # bound CP1, restored to CP1
        assert [_settings(m) for m in te_mods] == built
    # an exception inside TE's forward: build-time settings back (bind and restore both happened)
    seen.clear()
    with _te_forward_raises():
        with pytest.raises(KeyError, match="planted"):
            model(ids[None], None, None, packed_seq_params=_psp(cu, local=1))
    assert len(seen) == 2 and [_settings(m) for m in te_mods] == built
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    assert TEDotProductAttention.cp_stream is None  # static CP1: Megatron made none; cpscope's comes lazily
    assert isinstance(cpscope.cp_stream(dev), torch.cuda.Stream)


def _two_gpu_parity(spec: str, rope_fusion: bool) -> None:
    from cpscope.integrations.megatron import enable_runtime_cp

    _init()
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    groups = cpscope.new_cp_groups([1, 2])
    g2 = groups[2]
    model, ref = _build(spec, rope_fusion=rope_fusion), _build(spec, rope_fusion=rope_fusion)
    te_mods = _te_modules(model) if spec == "te" else []
    built = [_settings(m) for m in te_mods]
    enable_runtime_cp(model)
    seen: list[tuple] = []
    if te_mods:  # record what the first TE module is bound to: (cp_group, cp_global_ranks, cp_stream)
        real_set = te_mods[0].set_context_parallel_group

        def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append(args[:3])
            return real_set(*args, **kwargs)

        te_mods[0].set_context_parallel_group = spy
    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    for step, cp in enumerate((2, 1, 2)):
        ids = torch.randint(0, VOCAB, (sum(DOCS),), device=dev, generator=torch.Generator(device=dev).manual_seed(10 + step))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        want, target = _reference(ref, spec, ids, cu)
        group = g2 if cp == 2 else None
        local = cpscope.zigzag_shard(ids, seq_dim=0, cu_seqlens=cu, group=group)
        local_target = cpscope.zigzag_shard(target, seq_dim=0, cu_seqlens=cu, group=group)
        seen.clear()
        logits = model(local[None], None, None, packed_seq_params=_psp(cu, group=group, local=cp))[0]
        F.cross_entropy(logits.float(), local_target, reduction="sum").backward()
        assert _rel(logits, cpscope.zigzag_shard(want, seq_dim=0, cu_seqlens=cu, group=group)) < REL, (step, rank)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            grad = p.grad.float().clone()
            if cp == 2:
                dist.all_reduce(grad, group=g2)
            assert _rel(grad, q.grad) < REL, (step, n)
        if te_mods:
            if cp == 2:
                assert seen[0][0] is g2 and list(seen[0][1]) == cpscope.group_ranks(g2)
                assert seen[0][2] is cpscope.cp_stream(dev)
            else:
                assert seen[0] == (None, None, None)
            assert [_settings(m) for m in te_mods] == built  # CP1 after CP2 is CP1: nothing left bound
    if te_mods:  # an exception inside TE during a CP2 call: the build-time (CP1) settings come back
        local = cpscope.zigzag_shard(ids, seq_dim=0, cu_seqlens=cu, group=g2)
        seen.clear()
        with _te_forward_raises(), pytest.raises(KeyError, match="planted"):
            model(local[None], None, None, packed_seq_params=_psp(cu, group=g2, local=2))
        assert seen[0][0] is g2 and len(seen) == 2 and [_settings(m) for m in te_mods] == built


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("rope_fusion", [False, True])
def test_te_spec_cp1_binding_and_restore_one_gpu(rope_fusion):
    _needs_te()
    run_ranks(1, _one_gpu_te_binding, rope_fusion, backend="nccl")


@pytest.mark.parametrize("spec,rope_fusion", [("te", False), ("te", True), ("local", False)])
def test_cp2_parity_two_gpus(spec, rope_fusion):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if spec == "te":
        _needs_te()
    run_ranks(2, _two_gpu_parity, spec, rope_fusion, backend="nccl")
