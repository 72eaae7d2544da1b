"""transformers misuse is an error on every rank (issue 33, items 7 and 8).

* a batch sharded by ``shard_batch`` inside a CP2 scope and the model run outside it (or under another scope):
  before, rank 0 raised (its zigzag positions are not contiguous) and rank 1 silently returned a loss;
* ``generate()`` under CP2: the message says that generation does not run under context parallelism.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

VOCAB, SEQ = 64, 16


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="cpscope")


def _ids():
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))


def _outcome(fn):
    """``"ok"`` or the ValueError's message: what this rank saw."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "ok"


def _sharded_in_scope_run_outside(packed: bool):
    groups = cpscope.new_cp_groups([2])
    model = _model()
    ids = _ids()
    batch = {"input_ids": ids, "labels": ids}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
    with cpscope.runtime_cp(groups[2]):
        local = cphf.shard_batch(batch)
    outside = _outcome(lambda: model(**local))                       # CP1: the batch was cut for CP2
    with cpscope.runtime_cp(groups[2]):
        cp1_batch = cphf.shard_batch(batch, group=None)               # cut for CP1 ...
        inside_other = _outcome(lambda: model(**cp1_batch))           # ... run under CP2
        ok = _outcome(lambda: model(**local))                         # the right use still runs
    return outside, inside_other, ok


@pytest.mark.parametrize("packed", [False, True])
def test_batch_sharded_in_one_scope_run_in_another_raises_on_every_rank(packed):
    results = run_ranks(2, _sharded_in_scope_run_outside, packed, timeout=120)
    for outside, inside_other, ok in results:
        assert "sharded by shard_batch for CP2" in outside and "runs under CP1" in outside, outside
        assert "sharded by shard_batch for CP1" in inside_other and "runs under CP2" in inside_other, inside_other
        assert ok == "ok"


def _generate_under_cp2():
    groups = cpscope.new_cp_groups([2])
    model = _model()
    with cpscope.runtime_cp(groups[2]):
        msg = _outcome(lambda: model.generate(_ids()[:, :4], max_new_tokens=2, do_sample=False))
    return msg


def test_generate_under_cp2_says_generation_does_not_run_under_cp():
    for msg in run_ranks(2, _generate_under_cp2, timeout=120):
        assert "generate() does not run under context parallelism" in msg, msg
        assert "shard_batch" not in msg
