"""Hybrid CP in transformers' ``Trainer`` and TRL's ``SFTTrainer``: the same training as one process without CP.

Every multi-rank test trains the example's tiny Llama (examples/sft_trl.py: a seeded config, no weights, fp32,
SGD) on 4 gloo ranks with :mod:`cpscope.integrations.hf.trainer` — TRL's packed rows planned into CP1 / CP2 / CP4
microbatches every step — and compares the logged losses and the final weights with the **plain** trainer on one
process (SDPA attention, no cpscope code in its path) fed the same global batches: 4× the rows per device.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import cpscope  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import sft_trl as ex  # noqa: E402

STEPS = 3


def _run(**kw) -> ex.SFTRun:
    return ex.SFTRun(steps=STEPS, **kw)


def _train_rank(run: ex.SFTRun):
    from accelerate.state import AcceleratorState, GradientState

    # A pool rank builds many trainers: accelerate's process-wide state (DDP or FSDP2, ...) must start afresh.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    cpscope.set_backward_read_check(True)  # backward never reads the active scope
    return ex.train(run)


@functools.lru_cache(maxsize=None)
def _single(trainer: str, grad_accum: int, model: str, lora: bool = False) -> ex.SFTResult:
    """The reference: the plain trainer on one process (this one), no CP, the whole global batch per step."""
    return ex.train(_run(mode="single", trainer=trainer, grad_accum=grad_accum, model=model, lora=lora,
                         **_sizes(trainer)))


def _sizes(trainer: str) -> dict:
    return {"batch": 6} if trainer == "trainer" else {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check_same_training(trainer: str, grad_accum: int = 1, model: str = "llama", **kw) -> list[ex.SFTResult]:
    run = _run(trainer=trainer, grad_accum=grad_accum, model=model, **_sizes(trainer), **kw)
    per_rank = run_ranks(4, _train_rank, run)
    ref = _single(trainer, grad_accum, model, kw.get("lora", False))
    res = per_rank[0]
    assert res.steps == ref.steps == STEPS and len(res.losses) == len(ref.losses) == STEPS
    for r in per_rank[1:]:  # every rank logged the same losses and holds the same weights
        assert r.losses == res.losses
        assert all(torch.equal(r.state[k], res.state[k]) for k in res.state)
    for step, (a, b) in enumerate(zip(res.losses, ref.losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    for k, w in ref.state.items():
        assert _rel(res.state[k], w) <= 1e-5, (k, _rel(res.state[k], w))
    if kw.get("lora"):  # the adapters' B matrices start at zero
        assert max(float(w.abs().max()) for k, w in ref.state.items() if "lora_B" in k) > 1e-3
    else:
        init = ex.make_model(run, len(ex.make_tokenizer())).state_dict()
        assert max(_rel(ref.state[k], init[k]) for k in ref.state) > 1e-3  # training really moved the weights
    sizes = {cp for h in res.cp_history for cp in h["microbatches"]}
    assert sizes == {1, 2, 4}, sizes  # mixed CP1 / CP2 / CP4 microbatches
    assert len(res.cp_history) == STEPS and all(h["tokens"] > 0 and h["seconds"] > 0 for h in res.cp_history)
    return per_rank


def test_sft_packing_matches_one_process():
    per_rank = _check_same_training("sft")
    assert {r.sync for r in per_rank} == {"DDPSync"}  # accelerate wrapped the model in DDP
    assert not any(r.gradient_checkpointing for r in per_rank)  # TRL's default (on) was turned off


def test_sft_packing_with_gradient_checkpointing():
    per_rank = _check_same_training("sft", gradient_checkpointing=True)
    assert all(r.gradient_checkpointing for r in per_rank)


def test_sft_packing_with_lora_adapters():
    pytest.importorskip("peft")
    _check_same_training("sft", lora=True)


def test_sft_packing_with_gradient_accumulation():
    _check_same_training("sft", grad_accum=2)


def test_trainer_with_flattening_collator_matches_one_process():
    _check_same_training("trainer", model="qwen3")  # Qwen3: q/k norms, explicit head_dim


def test_sft_packing_fsdp2_with_gradient_accumulation():
    """FSDP2 on CPU (transformers' own sharding at load time, ``DistributedConfig(fsdp_size=4)``: fully_shard per
    decoder layer and the root; accelerate's FSDP plugin falls back to DDP on CPU), 2 micro-steps per optimizer step:
    the reduce-scatters run once, in the window's last CP1 backward, although accelerate's no_sync turns gradient
    sync back on after every micro-step."""
    distributed = pytest.importorskip("transformers.distributed")
    if "fsdp_size" not in getattr(distributed.DistributedConfig, "__dataclass_fields__", {}):
        pytest.skip("this transformers has no FSDP2 loading (DistributedConfig(fsdp_size=...))")
    per_rank = _check_same_training("sft", grad_accum=2, fsdp=True)
    assert {r.sync for r in per_rank} == {"FSDPSync"}


# ------------------------------------------------------------------------------------------------------------
# Packed rows under CP without document masking (what accelerate's CP hook does) vs cpscope, on the same data

_ROW_CAUSAL = "row_causal_cp"  # attention over the whole sharded row with is_causal=True, the mask dropped


def _row_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """accelerate's CP hook for SDPA: every mask replaced by ``is_causal=True``, the ring run over the whole row."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, h, d]
    return cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True, softmax_scale=scaling), None


def _register_row_causal() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_ROW_CAUSAL, _row_causal_attention)
    AttentionMaskInterface.register(_ROW_CAUSAL, lambda *args, **kwargs: None)


@functools.lru_cache(maxsize=1)
def _packed_batch() -> dict:
    """The first batch TRL's SFTTrainer(packing=True) feeds one process: one flattened row of documents."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        trainer = ex.build_trainer(_run(mode="single"), out)
        batch = next(iter(trainer.get_train_dataloader()))
    from cpscope.integrations.hf._documents import document_offsets

    cut = max(c for c in document_offsets(batch["position_ids"]) if c <= 512)  # whole documents, <= 512 tokens
    return {k: batch[k][:, :cut] for k in ("input_ids", "labels", "position_ids")}


def _changed(local: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position: the logits differ from the reference by more than 1e-6 of its largest logit (float64)."""
    return (local - ref).abs().amax(-1) > 1e-6 * ref.abs().max()


def _cpscope_logits(model, batch: dict, group, rank: int):
    """cpscope's hybrid-CP path for one CP4 microbatch of all the row's documents: logits of the real tokens, and
    their indices in the row."""
    from cpscope.hybrid import Microbatch
    from cpscope.integrations.hf import trainer as hf_trainer
    from cpscope.integrations.hf._documents import batch_documents, local_microbatches

    docs = batch_documents(batch)
    planned = Microbatch(cp=4, block=0, seqs=tuple(range(len(docs.lengths))), tokens_per_rank=0, cost=0.0)
    (mb,) = local_microbatches([planned], docs, {4: group})
    with cpscope.runtime_cp(group):
        logits = hf_trainer._forward(model, mb)  # [T_padded / 4, vocab]
    cu_p, cu = mb.cu_seqlens.tolist(), mb.cu_seqlens_real.tolist()
    rows, keep = [], []
    for i, p in enumerate(cpscope.zigzag_indices(cu_p, cp=4, rank=rank).tolist()):
        d = max(j for j in range(len(cu_p) - 1) if cu_p[j] <= p)
        if p - cu_p[d] < cu[d + 1] - cu[d]:  # a real token, not padding
            rows.append(cu[d] + p - cu_p[d])
            keep.append(i)
    return logits[keep], torch.tensor(rows)


def _cross_document(batch: dict):
    import cpscope.integrations.hf as cphf
    from cpscope.integrations.hf._documents import document_offsets

    _register_row_causal()
    group = cpscope.new_cp_groups([4])[4]
    rank = cpscope.scope.scope_for(group).rank
    run = _run()
    model = ex.make_model(run, len(ex.make_tokenizer())).double().eval()  # float64, SDPA
    ids, pos = batch["input_ids"], batch["position_ids"]
    cu = document_offsets(pos)
    with torch.no_grad():
        # the reference: one process, transformers' own document mask from the restarting position_ids
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        first_alone = model(input_ids=ids[:, : cu[1]], position_ids=pos[:, : cu[1]], use_cache=False).logits[0]
        assert (first_alone - ref[: cu[1]]).abs().max() <= 1e-9 * ref.abs().max()  # the reference is per document
        # accelerate's CP: the row padded and zigzag-sharded as one sequence, position_ids sharded with it, SDPA's
        # mask dropped for is_causal=True — run here by cpscope's ring over the whole row
        pad = -ids.shape[1] % 8
        ids_p = torch.cat([ids, ids.new_zeros(1, pad)], 1)
        pos_p = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(pad)[None]], 1)
        idx = cpscope.zigzag_indices(ids_p.shape[1], cp=4, rank=rank)
        real = idx < ids.shape[1]
        with cpscope.runtime_cp(group):
            model.set_attn_implementation(_ROW_CAUSAL)
            leaky = model(input_ids=ids_p[:, idx], position_ids=pos_p[:, idx], use_cache=False).logits[0]
            model.set_attn_implementation(cphf.ATTN_IMPLEMENTATION)
            with pytest.raises(ValueError, match="position_ids are not one sequence per row"):
                model(input_ids=ids_p[:, idx], position_ids=pos_p[:, idx], use_cache=False)  # cpscope refuses it
        local, ours = _cpscope_logits(model, batch, group, rank)  # each document zigzag-sharded on its own
    changed = _changed(leaky[real], ref[idx[real]])
    in_first = idx[real] < cu[1]
    counts = torch.tensor([float(changed[~in_first].sum()), float((~in_first).sum()), float(changed[in_first].sum()),
                           float(in_first.sum())], dtype=torch.float64)
    err = float((local - ref[ours]).abs().max() / ref.abs().max())
    counts = torch.cat([counts, torch.tensor([float(_changed(local, ref[ours]).sum()), float(ours.numel())],
                                             dtype=torch.float64)])
    torch.distributed.all_reduce(counts, group=group)
    return counts.tolist(), err, len(cu) - 1


def test_packed_rows_under_cp_without_document_masks_see_other_documents():
    """The cross-document failure of CP without cpscope, measured on TRL's own packed row, and cpscope's run.

    Sharding the packed row as one sequence and running causal attention over it (accelerate's CP hook for SDPA)
    changes the logits of every position after the first document: they attend to the documents before them.
    The first document's positions are unchanged (they see nothing else under a causal mask), which shows the
    emulation is the right one. cpscope (documents zigzag-sharded on their own, document-masked ring) changes none.
    """
    per_rank = run_ranks(4, _cross_document, _packed_batch())
    (later_changed, later, first_changed, first, ours_changed, ours), err, docs = per_rank[0]
    assert docs >= 4 and later > 0 and first > 0
    assert first_changed == 0  # the first document is untouched by the missing mask
    assert later_changed / later >= 0.99, (later_changed, later)  # the others see other documents
    assert ours == later + first and ours_changed == 0
    assert max(e for _, e, _ in per_rank) <= 1e-10
