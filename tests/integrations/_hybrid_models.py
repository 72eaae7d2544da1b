"""Tiny random-weight hybrid decoders of transformers 5.25 (no download): two token-mixing layers of the model's
own kind (gated DeltaNet, Kimi Delta Attention, Mamba2 or LFM2's short convolution) around one attention layer.

Shared by the hybrid tests (``test_hf_hybrid*.py``). Every config is as small as the model allows: hidden 32, two
heads; Mamba2 chunk sizes (4 tokens) shorter than the documents, so a scan crosses several chunks per rank.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
               num_hidden_layers=3, max_position_embeddings=256, attention_dropout=0.0, tie_word_embeddings=False)
_LAYERS = ["linear_attention", "full_attention", "linear_attention"]
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=4)

MODEL_TYPES = ("qwen3_5", "qwen3_next", "kimi_linear", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "lfm2")
_CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
            "kimi_linear": "KimiLinearForCausalLM", "nemotron_h": "NemotronHForCausalLM",
            "bamba": "BambaForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM",
            "falcon_h1": "FalconH1ForCausalLM", "lfm2": "Lfm2ForCausalLM"}


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type`` (one of :data:`MODEL_TYPES`)."""
    import transformers as tf

    c = dict(_COMMON)
    linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, head_dim=16, layer_types=_LAYERS)
    if model_type == "qwen3_5":
        return tf.Qwen3_5TextConfig(**c, **linear)
    if model_type == "qwen3_next":
        return tf.Qwen3NextConfig(**c, **linear, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16)
    if model_type == "kimi_linear":
        c["num_key_value_heads"] = c["num_attention_heads"]
        return tf.KimiLinearConfig(**c, layer_types=_LAYERS, linear_head_dim=8, linear_num_heads=2,
                                   linear_conv_kernel_dim=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=16, mlp_layer_types=["dense"] * 3, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2)
    if model_type == "nemotron_h":
        c.pop("num_hidden_layers")
        return tf.NemotronHConfig(**c, layers_block_type=["mamba", "attention", "mlp", "mamba"], head_dim=16,
                                  ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4,
                                  chunk_size=4)
    if model_type == "bamba":
        c.pop("num_hidden_layers")
        return tf.BambaConfig(**c, num_hidden_layers=3, attn_layer_indices=[1], **_MAMBA)
    if model_type == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**c, layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
                                         num_experts_per_tok=2, shared_intermediate_size=16, **_MAMBA)
    if model_type == "falcon_h1":
        return tf.FalconH1Config(**c, mamba_d_ssm=64, mamba_rms_norm=True, **_MAMBA)
    if model_type == "lfm2":
        return tf.Lfm2Config(**c, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3)
    raise AssertionError(model_type)


def build(model_type: str, attn_implementation: str = "eager", *, config: Any = None, seed: int = 0,
          dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A tiny ``model_type`` decoder with seeded random weights, in ``dtype``."""
    import transformers as tf

    torch.manual_seed(seed)
    cls = getattr(tf, _CLASSES[model_type])
    model = cls._from_config(copy.deepcopy(config or tiny_config(model_type)), attn_implementation=attn_implementation,
                             experts_implementation="eager")
    return model.to(dtype)
