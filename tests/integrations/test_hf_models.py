"""Today's decoders under ``attn_implementation="cpscope"`` at CP2 and CP4 vs. the same model's own eager attention
on one process: sliding windows (Mistral, Qwen3, Gemma 2/3, gpt-oss, alternating with full layers where the model
does), logit soft-capping (Gemma 2), attention sinks (gpt-oss) and multi-latent attention (DeepSeek-V3, v head dim
other than q/k's, with a MoE layer).

Every rank builds the same tiny random-weight model twice (float64; no weights downloaded) — one with cpscope's
attention, one with ``attn_implementation="eager"`` — runs the eager one itself on the full sequence, and checks its
local logits (cut with the test's own zigzag index math), the CP-group sum of its losses and the CP-group sum of the
gradients of **every** parameter. The windows (7 tokens) span several zigzag chunks at CP4 (4 tokens each) and are
shorter than every packed document, so they cut real attention; ``test_features_change_the_reference`` shows that
each feature changes the reference logits far beyond the tolerance (a feature dropped would fail).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from tests.attention._reference import zigzag_index  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

VOCAB, SEQ, WINDOW = 128, 32, 7
DOCS = [8, 16, 8]  # packed: every document divisible by 2*cp for cp <= 4, each longer than the window
TOL = dict(atol=2e-6, rtol=1e-5)  # eager softmaxes in fp32 (even for float64 models); cpscope in float64
_COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=2 * SEQ, attention_dropout=0.0)
_TWO_KINDS = ["sliding_attention", "full_attention"]


def _config(family: str):
    """A tiny config per family; ``_FEATURE_OFF`` names the keys that turn its attention features off."""
    c = dict(_COMMON)
    if family == "gpt_oss":  # sinks on every layer, sliding / full alternating, MoE
        return transformers.GptOssConfig(
            **c, head_dim=16, sliding_window=WINDOW, layer_types=_TWO_KINDS, num_local_experts=4,
            num_experts_per_tok=2, rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False,
                                                    "original_max_position_embeddings": SEQ})
    if family == "gemma2":  # softcap on every layer, sliding / full alternating
        return transformers.Gemma2Config(**c, head_dim=16, sliding_window=WINDOW, layer_types=_TWO_KINDS,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=8.0,
                                         query_pre_attn_scalar=8, initializer_range=0.2)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**c, head_dim=16, sliding_window=WINDOW, layer_types=_TWO_KINDS)
    if family == "mistral":  # one window for every layer
        return transformers.MistralConfig(**c, sliding_window=WINDOW)
    if family == "qwen3":  # layers >= max_window_layers slide: full then sliding
        return transformers.Qwen3Config(**c, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1)
    if family == "deepseek_v3":  # MLA: q/k head dim 16 + 8, v head dim 12; layer 0 dense, layer 1 MoE
        c["num_key_value_heads"] = c["num_attention_heads"]  # MLA expands k/v to every head
        return transformers.DeepseekV3Config(
            **c, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=32, n_shared_experts=1)
    raise AssertionError(family)


_CLASSES = {"gpt_oss": "GptOssForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
FAMILIES = tuple(_CLASSES)


def _build(family: str, implementation: str, config: Any = None):
    torch.manual_seed(0)
    cls = getattr(transformers, _CLASSES[family])
    # MoE experts in plain torch ops (the grouped-mm kernels take no float64)
    model = cls._from_config(copy.deepcopy(config or _config(family)), attn_implementation=implementation,
                             experts_implementation="eager")
    return model.double()


def _models(family: str):
    """(cpscope model, eager reference), float64, the same weights."""
    model, ref = _build(family, "cpscope"), _build(family, "eager")
    ref.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == "cpscope" and ref.config._attn_implementation == "eager"
    return model, ref


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1 if packed else 2, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, 5] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return batch


def _grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where none reached it, e.g. an expert no token was routed to)."""
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def _reference(ref, batch: dict[str, torch.Tensor], packed: bool):
    """Full-sequence logits, loss and gradients of the eager model, with the target shift done here. A packed row
    is run one document at a time (gpt-oss's eager masks ignore packed ``position_ids``: documents would mix)."""
    ref.zero_grad()
    ids, labels = batch["input_ids"], batch["labels"]
    spans = [(s, s + n) for s, n in zip(torch.cumsum(torch.tensor([0] + DOCS[:-1]), 0).tolist(), DOCS)] \
        if packed else [(0, SEQ)]
    logits = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in spans], 1)
    target = torch.full_like(labels, -100)
    for a, b in spans:  # a document's last token predicts nothing
        target[:, a:b - 1] = labels[:, a + 1:b]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), _grads(ref)


def _models_match_reference(size: int, cases: list[tuple[str, bool, str]]) -> list[str]:
    """Each ``(family, packed, comm)`` at CP``size``: logits, loss and all gradients equal the eager model's."""
    group = cpscope.new_cp_groups([size])[size]
    done = []
    for family, packed, comm in cases:
        model, ref = _models(family)
        batch = _batch(packed)
        ref_logits, ref_loss, ref_grads = _reference(ref, batch, packed)
        with cpscope.runtime_cp(group, comm=comm):
            out = model(**cphf.shard_batch(batch))
        out.loss.backward()
        where = f"{family}, {'packed' if packed else 'bshd'}, {comm}, CP{size}"
        idx = zigzag_index([0] + torch.cumsum(torch.tensor(DOCS), 0).tolist() if packed else [0, SEQ], size,
                           dist.get_rank(group))
        torch.testing.assert_close(out.logits, ref_logits[:, idx], **TOL, msg=lambda m: f"{where}: logits {m}")
        loss, grads = out.loss.detach().clone(), _grads(model)
        dist.all_reduce(loss, group=group)
        for g in grads.values():  # the gradient reduction over the CP ranks (as data parallelism does)
            dist.all_reduce(g, group=group)
        torch.testing.assert_close(loss.double(), ref_loss, **TOL, msg=lambda m: f"{where}: loss {m}")  # fp32 in HF
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], **TOL, msg=lambda m, n=name: f"{where}: {n} {m}")
        done.append(where)
    return done


# Every family in bshd; the windowed ones with sinks / softcapping also packed (thd). Comm variants vary per case.
_CASES_2 = [(f, False, c) for f, c in zip(FAMILIES, ["p2p", "all_gather", "a2a", "p2p", "a2a", "all_gather"])] + [
    ("gpt_oss", True, "p2p"), ("gemma2", True, "a2a"), ("mistral", True, "all_gather")]
_CASES_4 = [(f, False, c) for f, c in zip(FAMILIES, ["a2a", "p2p", "all_gather", "a2a+p2p:2", "p2p", "a2a"])] + [
    ("gpt_oss", True, "all_gather"), ("gemma2", True, "p2p"), ("mistral", True, "a2a")]


def test_models_match_eager_2_ranks():
    done = run_ranks(2, _models_match_reference, 2, _CASES_2, timeout=600)
    assert done[0] == done[1] and len(done[0]) == len(_CASES_2)


def test_models_match_eager_4_ranks():
    done = run_ranks(4, _models_match_reference, 4, _CASES_4, timeout=600)
    assert all(d == done[0] for d in done) and len(done[0]) == len(_CASES_4)


# ------------------------------------------------------------------------------------------------ CP1, no dist

_FEATURE_OFF = {  # the config change that removes each family's attention feature(s) from the eager reference
    "gpt_oss": [("sliding_window", SEQ)],  # sinks: zeroed below (their logit is a parameter)
    "gemma2": [("attn_logit_softcapping", None), ("sliding_window", SEQ)],
    "gemma3": [("sliding_window", SEQ)],
    "mistral": [("sliding_window", SEQ)],
    "qwen3": [("sliding_window", SEQ)],
}


def _logits(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits


@pytest.mark.parametrize("family", sorted(_FEATURE_OFF))
def test_features_change_the_reference(family):
    """Each feature matters in these configs: without it the eager logits move by far more than the tolerance."""
    batch = _batch(False)
    _, ref = _models(family)
    with torch.no_grad():
        base = _logits(ref, batch)
        for key, value in _FEATURE_OFF[family]:
            cfg = _config(family)
            setattr(cfg, key, value)
            off = _build(family, "eager", cfg)
            off.load_state_dict(ref.state_dict())
            assert (_logits(off, batch) - base).abs().max() > 1e3 * TOL["atol"], (family, key)
        if family == "gpt_oss":
            for layer in ref.model.layers:
                layer.self_attn.sinks.zero_().sub_(30.0)  # exp(-30): no sink
            assert (_logits(ref, batch) - base).abs().max() > 1e3 * TOL["atol"]


def test_trainer_model_check_accepts_the_models():
    """The hybrid-CP trainers' pre-flight check (switch to cpscope, every layer through it, a packed probe that
    must not mix documents) passes for each of these models built with eager attention."""
    from cpscope.integrations.hf._model_check import check_model_for_cp, use_cpscope_attention

    for family in FAMILIES:
        _, ref = _models(family)
        use_cpscope_attention(ref)
        check_model_for_cp(ref)
        assert ref.config._attn_implementation == "cpscope", family


def test_mla_value_head_dim_reaches_attention():
    """DeepSeek-V3's attention function gets v with its own head dim (not padded to q/k's)."""
    model, _ = _models("deepseek_v3")
    shapes = []
    real = cphf.context_parallel_attention

    def spy(q, k, v, **kw):
        shapes.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, **kw)

    cphf.context_parallel_attention = spy
    try:
        model(input_ids=torch.randint(0, VOCAB, (1, 8)), use_cache=False)
    finally:
        cphf.context_parallel_attention = real
    assert shapes == [(24, 24, 12)] * 2, shapes


def test_window_options():
    model, _ = _models("mistral")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16, dtype=torch.float64)
    kv = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"sliding_window to be None or an int >= 1.*got {bad!r}"):
            cphf.cpscope_attention_forward(attn, q, kv, kv, None, sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window=4 without a causal mask"):
        cphf.cpscope_attention_forward(attn, q, kv, kv, None, sliding_window=4, is_causal=False)
    full, _ = cphf.cpscope_attention_forward(attn, q, kv, kv, None, is_causal=False, sliding_window=8)  # covers
    assert full.shape == (1, 8, 4, 16)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        cphf.cpscope_attention_forward(attn, q, kv, kv, None, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \[4\]"):
        cphf.cpscope_attention_forward(attn, q, kv, kv, None, s_aux=torch.zeros(2, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ host syncs


def _windowed_attention_adds_no_host_sync(family: str, packed: bool) -> dict[str, list[str]]:
    """Host synchronisations counted per attention module (not per decoder layer: gpt-oss's eager MoE routing
    syncs in every layer by itself)."""
    from types import SimpleNamespace

    from tests.integrations.test_hf import _HostSyncCounter

    cfg = _config(family)
    cfg.num_hidden_layers = 4
    cfg.layer_types = _TWO_KINDS * 2  # sliding, full, sliding, full: the second of each kind must add nothing
    model = _build(family, "cpscope", cfg)
    attention = SimpleNamespace(model=SimpleNamespace(layers=[layer.self_attn for layer in model.model.layers]))
    group = cpscope.new_cp_groups([2])[2]
    with cpscope.runtime_cp(group):
        local = cphf.shard_batch(_batch(packed))
        with _HostSyncCounter(attention) as counter:
            model(**local)
    counter.counts.pop("CPU kernel (not counted)", None)
    later = {k: v for k, v in counter.counts.items() if k in ("layer 2", "layer 3")}
    assert later == {}, later  # attention after the first of each kind adds no host synchronisation
    return counter.counts


def test_windowed_attention_adds_no_host_sync_2_ranks():
    for family, packed in (("gpt_oss", True), ("gemma2", False)):
        counts = run_ranks(2, _windowed_attention_adds_no_host_sync, family, packed)
        assert all("layer 0" in c for c in counts)  # the counter sees the first attention's one-off work
