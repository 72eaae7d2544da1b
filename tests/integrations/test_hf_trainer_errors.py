"""Bad input to the hybrid-CP trainer raises a clear ValueError before any step, never cross-document attention.

Most checks run in this process (a world of one: the checks are the same); a batch refused on one rank of four
raises on every rank after one small all-gather.
"""
from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import cpscope.integrations.hf.trainer as cpt  # noqa: E402
from cpscope.integrations.hf._documents import batch_documents, gather_documents  # noqa: E402
from cpscope.integrations.hf._model_check import check_model_for_cp, use_cpscope_attention  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import sft_trl as ex  # noqa: E402

RUN = ex.SFTRun(steps=1)


def _model():
    model = ex.make_model(RUN, len(ex.make_tokenizer()))
    use_cpscope_attention(model)
    return model


def _plain_trainer(out: str, collator=None, cls=cpt.HybridCPTrainer, **hybrid):
    import datasets
    from transformers import DataCollatorWithFlattening, TrainingArguments

    tok = ex.make_tokenizer()
    ids = [tok(t + tok.eos_token)["input_ids"] for t in ex.make_texts(RUN)[:16]]
    args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    return cls(model=ex.make_model(RUN, len(tok)), args=args,
               train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
               data_collator=collator or DataCollatorWithFlattening(), hybrid_cp=cpt.HybridCP(**hybrid))


# -- batches ---------------------------------------------------------------------------------------------------


def _flat(lengths, start=0):
    ids = torch.arange(sum(lengths))[None] % 20 + 3
    pos = torch.cat([torch.arange(n) + start for n in lengths])[None]
    labels = ids.clone()
    labels[pos == start] = -100  # what the flattening collators do
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def test_documents_and_targets_are_the_trainers_own():
    docs = batch_documents(_flat([3, 2]))
    assert docs.lengths == [3, 2]
    # ForCausalLMLoss: labels shifted by one over the whole row, ignore_index at the end
    assert [t.tolist() for t in docs.targets] == [[4, 5, -100], [7, -100]]
    shift = torch.tensor([[9, 9, 9, 9, 9]])
    assert [t.tolist() for t in batch_documents({**_flat([3, 2]), "shift_labels": shift}).targets] == [[9] * 3, [9] * 2]


@pytest.mark.parametrize("change, match", [
    (lambda b: b.pop("position_ids"), "no position_ids"),
    (lambda b: b.update(input_ids=b["input_ids"].expand(2, -1)), "padded batch of rows"),
    (lambda b: b.update(attention_mask=torch.tensor([[1, 1, 1, 1, 0]])), "padding zeros"),
    (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 5], dtype=torch.int32)), "disagrees with the documents"),
    (lambda b: b.update(token_type_ids=torch.zeros(1, 5, 3)), "does not know how to shard"),
    (lambda b: b.update(position_ids=torch.tensor([[0, 1, 2, 5, 6]])), "document 1 starts at position 5"),
    (lambda b: (b.pop("labels"), None), "no labels"),
])
def test_batches_without_document_boundaries_are_refused(change, match):
    batch = _flat([3, 2])
    change(batch)
    with pytest.raises(ValueError, match=match):
        batch_documents(batch)


def _refused_on_one_rank():
    import torch.distributed as dist

    rank = dist.get_rank()
    local = ValueError("rank 2's own reason") if rank == 2 else batch_documents(_flat([4, 4]))
    with pytest.raises(ValueError) as info:
        gather_documents(local)
    return str(info.value)


def test_a_batch_refused_on_one_rank_raises_on_every_rank():
    messages = run_ranks(4, _refused_on_one_rank)
    assert messages[2] == "rank 2's own reason"
    assert all("rank(s) [2] was refused" in m for r, m in enumerate(messages) if r != 2)


# -- collators, settings, capacity -------------------------------------------------------------------------------


def test_collator_without_document_boundaries_is_refused():
    from transformers import DataCollatorForLanguageModeling

    with tempfile.TemporaryDirectory() as out, pytest.raises(ValueError, match="marks no document boundaries"):
        _plain_trainer(out, collator=DataCollatorForLanguageModeling(ex.make_tokenizer(), mlm=False))


def _sft(packing: bool, **hybrid):
    import datasets
    from trl import SFTConfig

    config = SFTConfig(output_dir="unused", packing=packing, max_length=128, report_to=[], use_cpu=True, bf16=False)
    return cpt.HybridCPSFTTrainer(model=ex.make_model(RUN, len(ex.make_tokenizer())), args=config,
                                  train_dataset=datasets.Dataset.from_dict({"text": ex.make_texts(RUN)[:8]}),
                                  processing_class=ex.make_tokenizer(), hybrid_cp=cpt.HybridCP(**hybrid))


def test_sft_without_packing_is_refused():
    with pytest.raises(ValueError, match="padding_free=False"):
        _sft(packing=False)


def test_capacity_too_small_for_max_length_is_refused_at_construction():
    with pytest.raises(ValueError, match="does not fit capacity=16"):
        _sft(packing=True, capacity=16)


def test_lengths_the_plan_cannot_place_raise_before_the_first_step():
    with tempfile.TemporaryDirectory() as out:
        trainer = _plain_trainer(out, capacity=4)
        before = copy.deepcopy(trainer.model.state_dict())
        with pytest.raises(ValueError, match="cannot plan this batch"):
            trainer.train()
        assert trainer.state.global_step == 0
        assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_a_loss_the_hybrid_step_would_skip_is_refused():
    class OwnLoss(cpt.HybridCPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with tempfile.TemporaryDirectory() as out, pytest.raises(ValueError, match="compute_loss is overridden"):
        _plain_trainer(out, cls=OwnLoss)


# -- models ------------------------------------------------------------------------------------------------------


class _CumulativeMix(torch.nn.Module):
    """An MLP that also adds a running mean over the sequence: it mixes documents outside attention."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[None, :, None]
        return self.mlp(x) + x.cumsum(1) / steps


def test_a_model_that_mixes_documents_is_refused_before_the_first_step():
    model = _model()
    check_model_for_cp(model)  # the plain model passes
    model.model.layers[0].mlp = _CumulativeMix(model.model.layers[0].mlp)
    with pytest.raises(ValueError, match="mixes documents"):
        check_model_for_cp(model)
    with tempfile.TemporaryDirectory() as out:
        trainer = _plain_trainer(out)
        trainer.model.model.layers[0].mlp = _CumulativeMix(trainer.model.model.layers[0].mlp)
        with pytest.raises(ValueError, match="mixes documents"):
            trainer.train()
        assert trainer.state.global_step == 0


def test_a_layer_whose_attention_bypasses_cpscope_is_refused():
    model = _model()
    attn = model.model.layers[1].self_attn
    attn.config = copy.copy(attn.config)
    attn.config._attn_implementation = "sdpa"  # this layer runs its own attention on the zigzag shards
    with pytest.raises(ValueError, match="only 1 of its 2 layers ran attention"):
        check_model_for_cp(model)


def test_layers_that_are_not_attention_are_refused():
    model = _model()
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        check_model_for_cp(model)
