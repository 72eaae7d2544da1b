"""The planner knows that linear-attention, state-space and short-convolution layers cost linear time.

Pure tests (no process group): the layer counts read from transformers configs, the cost formulas against hand
counts, the planner's direction (a hybrid model's long documents need a smaller CP size than an attention-only
model's) and the ``plan`` command's ``--linear-layers`` / ``--attention-layers`` / ``--hf-config``.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cpscope.cli import parser
from cpscope.cli._plan import build
from cpscope.cli._shape import PRESETS, Assumptions, Hardware, ModelShape, analytic_cost
from cpscope.hybrid import CostModel, LayerMix, plan_hybrid

QWEN3_NEXT_JSON = {  # the fields of Qwen3-Next-80B-A3B's config.json that the shape reads
    "model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936, "intermediate_size": 5120,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "full_attention_interval": 4,
}


def test_layer_mix_from_layer_types_and_configs():
    assert LayerMix.from_layer_types(["linear_attention", "linear_attention", "linear_attention",
                                      "full_attention"]) == LayerMix(attention=1, linear=3, layers=4)
    # Nemotron-H: Mamba2, attention and MLP blocks; Falcon-H1: attention and Mamba2 in every block
    assert LayerMix.from_config({"layers_block_type": ["mamba", "attention", "mlp", "mamba", "moe"]}) == \
        LayerMix(attention=1, linear=2, layers=5)
    assert LayerMix.from_layer_types(["hybrid"] * 3) == LayerMix(attention=3, linear=3, layers=3)
    assert LayerMix.from_config(QWEN3_NEXT_JSON) == LayerMix(attention=12, linear=36, layers=48)
    assert LayerMix.from_config({"num_hidden_layers": 6, "attn_layer_indices": [2, 5]}) == LayerMix(2, 4, 6)  # Bamba
    assert LayerMix.from_config({"num_hidden_layers": 32}) == LayerMix(32, 0, 32)  # an attention-only decoder
    assert LayerMix.from_config({"text_config": {"layer_types": ["conv", "full_attention"]}}) == LayerMix(1, 1, 2)
    with pytest.raises(ValueError, match=r"\['lightning'\]"):
        LayerMix.from_layer_types(["full_attention", "lightning"])
    with pytest.raises(ValueError, match="num_hidden_layers=None"):
        LayerMix.from_config({})
    with pytest.raises(ValueError, match=r"attn_layer_indices \[7\]"):
        LayerMix.from_config({"num_hidden_layers": 6, "attn_layer_indices": [7]})
    with pytest.raises(ValueError, match="layers=2"):
        LayerMix(attention=3, linear=0, layers=2)


def test_layer_mix_of_transformers_hybrid_configs():
    pytest.importorskip("transformers")
    from tests.integrations._hybrid_models import MODEL_TYPES, tiny_config

    expected = {"nemotron_h": LayerMix(1, 2, 4), "falcon_h1": LayerMix(3, 3, 3)}
    for model_type in MODEL_TYPES:
        assert LayerMix.from_config(tiny_config(model_type)) == expected.get(model_type, LayerMix(1, 2, 3)), \
            model_type
    import transformers

    qwen = transformers.Qwen3NextConfig(num_hidden_layers=8)  # transformers' own layer_types: 3 linear : 1 full
    assert LayerMix.from_config(qwen) == LayerMix(attention=2, linear=6, layers=8)


def test_cost_for_layer_mix_against_a_hand_count():
    cost = CostModel(attn=4e-9, linear=1e-4, comm=2e-6, latency=1e-3)
    hybrid = cost.for_layer_mix(LayerMix(attention=1, linear=3, layers=4))
    # L = 1000 at CP2: padded 1000; per rank 1000 · (attn/4 · 1000 + linear + comm/4 · (2 − 1)) / 2, + latency
    hand = 1000 * (1e-9 * 1000 + 1e-4 + 5e-7 * 1) / 2 + 1e-3
    assert float(hybrid.cost(1000, 2)) == pytest.approx(hand, rel=1e-12)
    # at CP1 nothing is exchanged: the quadratic term is a quarter of the attention-only model's
    assert float(cost.cost(998, 1) - hybrid.cost(998, 1)) == pytest.approx(0.75 * 4e-9 * 998 ** 2, rel=1e-12)
    assert cost.for_layer_mix(LayerMix(attention=4, linear=0, layers=4)) == cost


def test_analytic_cost_of_a_hybrid_shape_against_a_hand_count():
    shape = ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128, vocab=100,
                       linear_layers=3)
    hw = Hardware("test", peak_flops=1e12, memory=1e9, nvlink=1e11, network=1e10)
    a = Assumptions(attn_efficiency=0.5, linear_efficiency=0.25, exposed_comm=0.2, ring_step_ms=3.0, exchange_ms=0.5)
    cost = analytic_cost(shape, hw, gpus_per_node=8, assume=a)
    # one attention layer: Lp²/2 · 4 · 4 heads · 16 · 3.5 (fwd + bwd) FLOPs per Lp², at half the peak
    assert cost.attn == pytest.approx(0.5 * 4 * 4 * 16 * 3.5 * 1 / 0.5e12, rel=1e-12)
    # matmuls: per layer q/k/v 64·(4 + 2·2)·16 + o 4·16·64 + MLP 3·64·128 = 36864 parameters; LM head 100·64;
    # the 3 linear-time layers' chunked recurrence: 2 · 4 · 16 · (2·64 + 3·16) FLOPs forward, · 3.5 fwd + bwd
    matmul = 6 * (4 * (64 * 8 * 16 + 4 * 16 * 64 + 3 * 64 * 128) + 100 * 64)
    recurrence = 3 * 2 * 4 * 16 * (2 * 64 + 3 * 16) * 3.5
    assert cost.linear == pytest.approx((matmul + recurrence) / 0.25e12, rel=1e-12)
    # ring K/V of the one attention layer: 3 · 2 · 2 kv heads · 16 · 2 bytes per token, 20 % exposed
    assert cost.comm == pytest.approx(0.2 * 3 * 2 * 2 * 16 * 2 / 1e11, rel=1e-12)
    assert cost.comm_inter == pytest.approx(0.2 * 3 * 2 * 2 * 16 * 2 / 1e10, rel=1e-12)
    assert cost.latency == pytest.approx((3.0 * 1 + 0.5 * 3) * 1e-3, rel=1e-12)
    # the attention-only model of the same shape: 4 attention layers, no recurrence, 4 ring steps
    full = analytic_cost(replace(shape, linear_layers=0), hw, gpus_per_node=8, assume=a)
    assert full.attn == pytest.approx(4 * cost.attn) and full.comm == pytest.approx(4 * cost.comm)
    assert full.linear == pytest.approx(matmul / 0.25e12) and full.latency == pytest.approx(12e-3)
    with pytest.raises(ValueError, match=r"linear_layers must be an int in \[0, layers=4\], got 5"):
        replace(shape, linear_layers=5)


def test_model_shape_from_a_transformers_config():
    shape = ModelShape.from_hf_config(QWEN3_NEXT_JSON)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == \
        (48, 2048, 16, 2, 256, 151936)
    assert shape.ffn_hidden == 10 * 512 + 512  # the active experts and the shared one
    assert shape.layer_mix() == LayerMix(attention=12, linear=36, layers=48)
    with pytest.raises(ValueError, match="hidden_size must be an int ≥ 1, got None"):
        ModelShape.from_hf_config({"num_hidden_layers": 2})


def _longest_cp(plan, lengths) -> int:
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    return next(mb.cp for mb in plan.microbatches if longest in mb.seqs)


def _cp1_tokens(plan, lengths) -> int:
    return sum(lengths[i] for mb in plan.microbatches if mb.cp == 1 for i in mb.seqs)


@pytest.mark.parametrize("n_ranks,cp_full,cp_hybrid", [(2, 2, 1), (4, 4, 2)])
def test_a_hybrid_models_plan_splits_long_documents_less(n_ranks, cp_full, cp_hybrid):
    """One 64k document among 2k ones: its quadratic attention makes the attention-only model split it for balance;
    with three linear-time layers per attention layer it runs at a smaller CP size, more tokens at CP1, and the
    step is predicted shorter."""
    lengths = [65536] + [2048] * 44
    full = CostModel()
    hybrid = full.for_layer_mix(LayerMix(attention=1, linear=3, layers=4))
    plans = [plan_hybrid(lengths, n_ranks=n_ranks, capacity=65536, cost=c) for c in (full, hybrid)]
    assert [_longest_cp(p, lengths) for p in plans] == [cp_full, cp_hybrid]
    assert _cp1_tokens(plans[1], lengths) >= _cp1_tokens(plans[0], lengths)
    assert plans[1].makespan < plans[0].makespan


def _plan_json(tmp_path, *extra: str) -> dict:
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in [65536] + [2048] * 44))
    args = parser().parse_args(["plan", "--lengths", str(path), "--no-shuffle", "--steps", "1", "--gpus-per-node",
                                "2", "--capacity", "65536", "--docs-per-step", "45", "--json", *extra])
    return json.loads(json.dumps(build(args)))


def test_plan_command_linear_layers(tmp_path):
    full = _plan_json(tmp_path, "--preset", "llama3-8b")
    hybrid = _plan_json(tmp_path, "--preset", "llama3-8b", "--linear-layers", "24")
    assert (hybrid["model"]["linear_layers"], hybrid["model"]["attention_layers"]) == (24, 8)
    assert (full["model"]["linear_layers"], full["model"]["attention_layers"]) == (0, 32)
    assert hybrid["cost_model"]["attn"] == pytest.approx(full["cost_model"]["attn"] / 4)

    def cp_tokens(result: dict) -> dict:
        return {mb["cp"]: mb["tokens"] for mb in result["steps"][0]["microbatches"]}

    assert cp_tokens(full).get(1, 0) < cp_tokens(hybrid).get(1, 0) == 65536 + 44 * 2048  # all at CP1
    assert hybrid["steps"][0]["hybrid_makespan_s"] < full["steps"][0]["hybrid_makespan_s"]
    both = _plan_json(tmp_path, "--preset", "llama3-8b", "--linear-layers", "32", "--attention-layers", "32")
    assert both["model"]["attention_layers"] == 32 and both["cost_model"]["attn"] == full["cost_model"]["attn"]
    with pytest.raises(ValueError, match="linear_layers must be an int in"):
        _plan_json(tmp_path, "--preset", "llama3-8b", "--linear-layers", "33")


def test_plan_command_hf_config(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(QWEN3_NEXT_JSON))
    result = _plan_json(tmp_path, "--hf-config", str(tmp_path / "model"))
    assert (result["model"]["layers"], result["model"]["linear_layers"], result["model"]["attention_layers"]) == \
        (48, 36, 12)
    assert "transformers config" in result["model"]["from"]
    with pytest.raises(ValueError, match="no such file"):
        _plan_json(tmp_path, "--hf-config", str(tmp_path / "missing.json"))
    assert PRESETS["llama3-8b"].layer_mix() == LayerMix(32, 0, 32)
