"""cpscope.sentinel with transformers models: the ``position_ids`` the model (its own RoPE) receives are checked.

A packed GQA Llama under CP2 on 2 gloo ranks: cpscope's ``shard_batch`` passes (forward and gradients checked);
``position_ids`` computed with the build-time group (CP1: each document's local tokens numbered 0, 1, …) and a
foreign sharder (each rank a contiguous half of every document) are reported at layer 0 of the first sampled
microbatch, on every rank, before the ring runs.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

VOCAB = 128
DOCS = [8, 16, 8]


def _model():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="cpscope").float()


def _cut_contiguous(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    parts, a = [], 0
    for n in DOCS:
        half = n // cp
        parts.append(x[:, a + rank * half: a + (rank + 1) * half])
        a += n
    return torch.cat(parts, dim=1)


def _hf(case: str):
    groups = cpscope.new_cp_groups([1, 2])
    rank = dist.get_rank()
    model = _model()
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    with cpscope.sentinel(every=2) as s:
        with cpscope.runtime_cp(groups[2]), s.microbatch():
            batch = cphf.shard_batch({"input_ids": ids, "position_ids": pos, "labels": ids})
            if case == "build_time":  # the local tokens numbered as if there were no CP (CP1 positions)
                batch["position_ids"] = torch.cat([torch.arange(n // 2) for n in DOCS]).unsqueeze(0)
            elif case == "contiguous":  # a foreign sharder: contiguous halves of every document
                for key in ("input_ids", "position_ids", "labels", "shift_labels"):
                    full = {"input_ids": ids, "position_ids": pos, "labels": ids}.get(key)
                    if full is not None:
                        batch[key] = _cut_contiguous(full, 2, rank)
                batch.pop("shift_labels")
            try:
                out = model(**batch)
            except cpscope.SentinelError as e:
                return [(m.check, m.field, m.rank, m.microbatch, m.call) for m in e.mismatches], e.mismatches[0].message
        out.loss.backward()
    return [str(m) for m in s.reports], s.summary().checks


def test_shard_batch_passes_every_check():
    for reports, checks in run_ranks(2, _hf, "right"):
        assert reports == []
        assert checks["positions"] == 1 and checks["attention"] == 2 and checks["attention-grad"] == 2


@pytest.mark.parametrize("case", ["build_time", "contiguous"])
def test_wrong_position_ids_are_reported_at_layer_0_of_the_first_sampled_microbatch(case):
    for rank, (ms, message) in enumerate(run_ranks(2, _hf, case)):
        assert ms == [("positions", "position_ids (transformers)", rank, 0, 0)]
        assert "not the zigzag positions of the active CP2" in message and "differ, first at local token" in message
