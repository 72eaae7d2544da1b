"""A hybrid model (linear-attention, state-space or short-convolution layers) that only sets
``attn_implementation="cpscope"`` — its token mixers not bound by ``enable_runtime_cp`` — raises the same
``ValueError`` on every rank under CP > 1 instead of giving wrong logits; at CP1 it runs as before.

The models are the tiny random-weight configs of ``_hybrid_models`` (transformers 5.25, no download).
``test_unbound_model_would_be_wrong_2_ranks`` shows what the refusal prevents: with the check switched off the CP2
logits differ from the model's own at CP1 by far more than any tolerance.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from cpscope.integrations.hf import _mixers as mixers  # noqa: E402
from tests.attention._reference import zigzag_index  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.integrations._hybrid_models import MODEL_TYPES, VOCAB, build, tiny_config  # noqa: E402

SEQ = 16


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))


def _unbound_models_refuse(model_types: tuple[str, ...]) -> list[str]:
    """Every model under CP2 raises ``ValueError`` before any output; returns the messages."""
    group = cpscope.new_cp_groups([2])[2]
    messages = []
    for model_type in model_types:
        model = build(model_type, "cpscope")
        ids = _ids()
        with cpscope.runtime_cp(group):
            batch = cphf.shard_batch({"input_ids": ids, "labels": ids})
            with pytest.raises(ValueError, match="enable_runtime_cp") as err:
                model(**batch)
        assert "not bound to the CP scope" in str(err.value) and "CP2" in str(err.value), err.value
        messages.append(f"{model_type}: {err.value}")
    return messages


def test_unbound_hybrid_models_refuse_on_every_rank_2_ranks():
    messages = run_ranks(2, _unbound_models_refuse, MODEL_TYPES, timeout=600)
    assert messages[0] == messages[1] and len(messages[0]) == len(MODEL_TYPES)


def test_unbound_hybrid_models_run_at_cp1():
    """Without CP (no scope, or CP1) the refusal stays silent: the model's own layers are right there."""
    ids = _ids()
    for model_type in MODEL_TYPES:
        model = build(model_type, "cpscope")
        ref = build(model_type, "eager")
        with torch.no_grad():
            expected = ref(input_ids=ids, use_cache=False).logits
            with cpscope.runtime_cp(None):
                got = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(got, expected, msg=model_type)


def test_mixer_layer_types():
    for model_type in MODEL_TYPES:
        assert mixers.mixer_layer_types(tiny_config(model_type)), model_type
    attention_only = transformers.Lfm2Config(num_hidden_layers=2)  # LFM2 without conv layers
    assert mixers.mixer_layer_types(attention_only) == []
    assert mixers.mixer_layer_types(transformers.LlamaConfig()) == []
    assert mixers.mixer_layer_types(transformers.NemotronHConfig(layers_block_type=["attention", "mlp", "moe"])) == []
    mixers.refuse_unbound_mixers(torch.nn.Linear(1, 1), 2)  # no config: nothing to say


def _unbound_model_would_be_wrong() -> float:
    """The refusal off (a stand-in that always passes): CP2 logits vs the same model's at CP1, relative."""
    group = cpscope.new_cp_groups([2])[2]
    model = build("qwen3_next", "cpscope")
    ids = _ids()
    with torch.no_grad():
        with cpscope.runtime_cp(None):
            full = model(input_ids=ids, use_cache=False).logits
        original = cphf.refuse_unbound_mixers
        cphf.refuse_unbound_mixers = lambda *a, **k: None
        try:
            with cpscope.runtime_cp(group):
                local = model(**cphf.shard_batch({"input_ids": ids})).logits
        finally:
            cphf.refuse_unbound_mixers = original
    idx = zigzag_index([0, SEQ], 2, torch.distributed.get_rank(group))
    return float((local - full[:, idx]).abs().max() / full.abs().max())


def test_unbound_model_would_be_wrong_2_ranks():
    errors = run_ranks(2, _unbound_model_would_be_wrong)
    assert max(errors) > 1e-2, errors  # what the refusal prevents: wrong by percents, silently
