"""Hybrid decoders (gated DeltaNet, Mamba2, short convolutions) in cpscope's ``Trainer`` and TRL ``SFTTrainer``.

The trainer binds the model itself (:func:`cpscope.integrations.hf.enable_runtime_cp`): nothing but the trainer
class changes against a plain script. Each test trains a tiny random-weight hybrid of ``_hybrid_models`` cut to one
attention layer and one of the model's own mixers (Nemotron-H: and its MLP block; float64, SGD without momentum, no
clipping) for two optimizer steps on 2 gloo ranks, documents planned into CP1 and CP2 microbatches — long documents
alone at CP2 (each rank's zigzag chunks hand the mixer's state on), short ones packed several to a CP1 microbatch
(each starts from a zero state); a spy on the trainer's step asserts both happened — and compares with one-process
references built from the very batches the ranks' collators produced: the model run on every document alone, the
next-token cross-entropy (float64) summed over the world's batch and divided by its target count, then
``w -= lr · grad`` by hand. Compared: the logged loss of every step, every parameter's gradient at every step
(before the optimizer), the final weights. Two references:

* **the model's own layers** (eager attention, its own recurrences, nothing of cpscope). Tolerance ``OWN_TOL``:
  these recurrences compute in fp32 even in a float64 model (transformers' ``torch_chunk_gated_delta_rule`` and
  Mamba2 ``torch_forward`` cast to fp32), and the gradients of gated DeltaNet's gate parameters (``A_log``,
  ``dt_bias``) are sums over every token with heavy cancellation: the same model bound by cpscope at CP1 in fp32
  against float64 differs by 2e-5 there (and the model's own layers against cpscope's at CP1, one process, by up to
  7e-5 on Qwen3-Next), so 2e-4 relative to each tensor's largest entry; the loss 2e-6.
* **the model bound by cpscope at CP1** (no CP; cpscope's recurrences in float64): gradients and weights
  ``BOUND_TOL`` = 1e-6 relative. The same layers on both sides, but the models round to fp32 in places even in
  float64 (RMSNorms ``.to(torch.float32)``, eager attention's softmax, RoPE tables), so the float64 summation-order
  differences between the CP2 and CP1 paths surface as fp32 rounding (measured: up to 4e-7).
  The logged loss is accumulated by the trainer in an fp32 tensor: 2e-6 for both.

A state not handed from one rank's chunk to the next, or handed across a document boundary, is off by orders of
magnitude more (``test_hf_hybrid.py``'s deliberate breaks). Measured on these runs: zero states entering every
rank's chunks move the gradients by 0.3 to 1.9 relative; LFM2's convolution run across the packed documents of a
CP1 microbatch, by 0.28 (the other mixers' leaks across documents fail the trainer's own pre-step probe first).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from tests.distributed import run_ranks  # noqa: E402
from tests.integrations._hybrid_models import VOCAB, build, tiny_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import sft_trl as ex  # noqa: E402

WORLD = 2
STEPS = 2
LR = 0.05
CAPACITY = 16  # tokens per rank per microbatch: documents longer than 16 tokens run at CP2
LOSS_TOL = 2e-6  # the trainer's logged loss: an fp32 accumulator
OWN_TOL = 2e-4  # against the model's own (fp32) recurrences, see the module docstring
BOUND_TOL = 1e-6  # against the model bound at CP1 (the models' own fp32 casts), see the module docstring
MODELS = ("qwen3_5", "nemotron_h", "lfm2")  # gated DeltaNet, Mamba2, LFM2 short convolution


# One attention layer and one mixer (Nemotron-H: its MLP block too), the mixer after the attention where that keeps
# the tolerances: what the equality needs — the mixer's state handed between the ranks' zigzag chunks and reset at
# every packed document, forward and backward — with one mixer layer less per step than the shared configs. (Gated
# DeltaNet first, on the embeddings, gets gate gradients of ~1e-6 with cancellation: its own fp32 recurrence would
# need a looser OWN_TOL; Nemotron-H's Mamba2 after the attention, a looser BOUND_TOL.)
_LAYERS = {"qwen3_5": dict(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2),
           "nemotron_h": dict(layers_block_type=["mamba", "attention", "mlp"], num_hidden_layers=3),
           "lfm2": dict(layer_types=["full_attention", "conv"], num_hidden_layers=2),
           "bamba": dict(num_hidden_layers=2, attn_layer_indices=[0])}


def _model(model_type: str) -> torch.nn.Module:
    """The trained model: the tiny ``model_type`` of ``_hybrid_models`` with the layers of ``_LAYERS`` (float64,
    seeded: the same weights on every call)."""
    config = tiny_config(model_type)
    return build(model_type, "eager", config=type(config)(**{**config.to_dict(), **_LAYERS[model_type]}))


# The plain Trainer's documents (2 steps x 2 ranks x 3): short ones that the planner packs several to a CP1
# microbatch, long ones (> CAPACITY) that run at CP2; the random sampler deals them to the steps.
TRAINER_LENGTHS = (3, 4, 5, 5, 6, 7, 9, 12, 17, 19, 22, 24)


def _args(out: str, per_device: int) -> dict[str, Any]:
    from transformers import TrainingArguments

    ckpt = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    return {"output_dir": out, "max_steps": STEPS, "per_device_train_batch_size": per_device, "learning_rate": LR,
            "optim": "sgd", "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
            "max_grad_norm": 0.0, "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True,
            "seed": 0, "data_seed": 0, "disable_tqdm": True, "dataloader_num_workers": 0, "bf16": False, ckpt: False}


def _build_trainer(kind: str, model_type: str, out: str) -> Any:
    """cpscope's hybrid-CP trainer for ``kind`` ("trainer": Trainer + DataCollatorWithFlattening; "sft": TRL's
    SFTTrainer(packing=True)) on the tiny ``model_type``; documents of 3 to 28 tokens."""
    import datasets

    import cpscope.integrations.hf.trainer as cpt

    model = _model(model_type)  # float64, the same seeded weights as the reference's
    hybrid_cp = cpt.HybridCP(capacity=CAPACITY, cost=ex.CPU_COST)
    if kind == "trainer":
        from transformers import DataCollatorWithFlattening, TrainingArguments

        gen = torch.Generator().manual_seed(5)
        ids = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in TRAINER_LENGTHS]
        return cpt.HybridCPTrainer(model=model, args=TrainingArguments(**_args(out, 3)),
                                   train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
                                   data_collator=DataCollatorWithFlattening(), hybrid_cp=hybrid_cp)
    from trl import SFTConfig

    texts = ex.make_texts(ex.SFTRun(n_docs=16, median_len=16, max_length=28))  # + eos: at most 28 tokens
    return cpt.HybridCPSFTTrainer(
        model=model, args=SFTConfig(packing=True, max_length=32, dataset_text_field="text", **_args(out, 1)),
        train_dataset=datasets.Dataset.from_dict({"text": texts}), processing_class=ex.make_tokenizer(),
        hybrid_cp=hybrid_cp)


def _train_rank(kind: str, model_type: str) -> dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainerCallback

    import cpscope.integrations.hf.trainer as cpt

    AcceleratorState._reset_state()  # a pool rank builds many trainers
    GradientState._reset_state()
    grads: list[dict[str, torch.Tensor]] = []

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    with ex.accelerate_env(), tempfile.TemporaryDirectory() as out:
        trainer = _build_trainer(kind, model_type, out)
        trainer.add_callback(Grads())
        batches: list[dict[str, torch.Tensor]] = []
        step = trainer.training_step

        def recording_step(model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
            batches.append({k: inputs[k].detach().cpu().clone() for k in ("input_ids", "labels", "position_ids")})
            return step(model, inputs, num_items_in_batch)

        trainer.training_step = recording_step
        microbatches: list[tuple[int, int]] = []  # (cp, documents) of every microbatch this rank ran
        run_step = cpt.run_step

        def spy(model: Any, mbs: Any, **kw: Any) -> Any:
            mbs = list(mbs)
            microbatches.extend((mb.cp, len(mb.seqs)) for mb in mbs)
            return run_step(model, mbs, **kw)

        cpt.run_step = spy
        try:
            trainer.train()
        finally:
            cpt.run_step = run_step  # the pool rank lives on
        return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "grads": grads,
                "state": ex.full_state(trainer.model), "history": list(trainer.cp_history), "batches": batches,
                "bound": list(trainer.cp_bound_layers), "microbatches": microbatches}


def _documents(batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(ids, next-token targets)`` of every document of a flattened row, targets as transformers' loss shifts
    the labels over the whole row; the test's own cut at every position that is not the previous one plus one."""
    ids, labels, pos = (batch[k].reshape(-1) for k in ("input_ids", "labels", "position_ids"))
    targets = torch.cat([labels[1:], labels.new_full((1,), -100)])
    starts = [0] + [i for i in range(1, pos.numel()) if int(pos[i]) != int(pos[i - 1]) + 1] + [pos.numel()]
    return [(ids[a:b], targets[a:b]) for a, b in zip(starts[:-1], starts[1:])]


def _reference(model_type: str, steps: list[list[dict[str, torch.Tensor]]], bound: bool) -> dict[str, Any]:
    """One process, every document alone: the model's own layers, or (``bound``) the model bound at CP1."""
    model = _model(model_type)
    if bound:
        import cpscope.integrations.hf as cphf

        cphf.enable_runtime_cp(model)  # no scope bound: CP1
    losses, grads = [], []
    for batches in steps:  # the world's batch of one optimizer step: every rank's rows
        docs = [d for b in batches for d in _documents(b)]
        n = sum(int((t != -100).sum()) for _, t in docs)
        model.zero_grad()
        total = sum(torch.nn.functional.cross_entropy(model(input_ids=ids[None], use_cache=False).logits[0].double(),
                                                      t, ignore_index=-100, reduction="sum") for ids, t in docs)
        loss = total / n
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return {"losses": losses, "grads": grads, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check_same_training(kind: str, model_type: str) -> None:
    per_rank = run_ranks(WORLD, _train_rank, kind, model_type, timeout=900)
    res = per_rank[0]
    assert any(name.endswith(("linear_attn", "mixer", "mamba", "conv")) for name in res["bound"]), res["bound"]
    assert per_rank[1]["losses"] == res["losses"] and len(res["losses"]) == STEPS
    sizes = {cp for h in res["history"] for cp in h["microbatches"]}
    assert sizes == {1, 2}, sizes  # mixed CP1 / CP2 microbatches
    ran = [mb for r in per_rank for mb in r["microbatches"]]
    assert any(cp == 2 for cp, _ in ran) and any(cp == 1 and n >= 2 for cp, n in ran), ran  # packed CP1 too
    steps = [[r["batches"][s] for r in per_rank] for s in range(STEPS)]  # grad_accum 1: one batch per step
    for s in range(STEPS):
        for k in res["grads"][s]:
            assert torch.equal(per_rank[1]["grads"][s][k], res["grads"][s][k]), k  # synchronised gradients
    init = _model(model_type).state_dict()
    for bound, tol in ((True, BOUND_TOL), (False, OWN_TOL)):
        ref = _reference(model_type, steps, bound)
        for s in range(STEPS):
            assert abs(res["losses"][s] - ref["losses"][s]) <= LOSS_TOL * abs(ref["losses"][s]), (bound, s, res, ref)
            assert set(res["grads"][s]) == set(ref["grads"][s])
            worst = max((_rel(res["grads"][s][k], g), k) for k, g in ref["grads"][s].items())
            assert worst[0] <= tol, (bound, s, worst)
        assert max(_rel(ref["state"][k], init[k]) for k in init) > 1e-3  # training moved the weights
        worst = max((_rel(res["state"][k], w), k) for k, w in ref["state"].items())
        assert worst[0] <= tol, (bound, worst)


@pytest.mark.parametrize("model_type", MODELS)
def test_trainer_trains_hybrid_models_like_one_process(model_type):
    _check_same_training("trainer", model_type)


@pytest.mark.parametrize("model_type", ("qwen3_5", "bamba"))  # (MoE models: TRL turns on aux losses)
def test_sft_trainer_packing_trains_hybrid_models_like_one_process(model_type):
    pytest.importorskip("trl")
    _check_same_training("sft", model_type)


def test_default_cost_counts_only_attention_layers_quadratic():
    from cpscope.hybrid import CostModel
    from cpscope.integrations.hf.trainer import default_cost

    qwen = default_cost(build("qwen3_5"))  # one attention layer of three
    base = CostModel()
    assert qwen is not None and qwen.attn == pytest.approx(base.attn / 3) and qwen.comm == pytest.approx(base.comm / 3)
    assert (qwen.linear, qwen.latency) == (base.linear, base.latency)
    nemotron = default_cost(build("nemotron_h"))  # mamba, attention, mlp, mamba: one of four blocks attends
    assert nemotron is not None and nemotron.attn == pytest.approx(base.attn / 4)
    llama = ex.make_model(ex.SFTRun(), 32)
    assert default_cost(llama) is None  # attention only: the planner's own default


def test_model_check_accepts_bound_hybrids_and_refuses_unbound_ones():
    """The trainer's pre-step probe: every hybrid type passes once bound (Nemotron-H's MLP blocks and Falcon-H1's
    attention + Mamba2 blocks included), and an unbound one is refused with the call that fixes it."""
    import cpscope.integrations.hf as cphf
    from cpscope.integrations.hf._model_check import check_model_for_cp
    from tests.integrations._hybrid_models import MODEL_TYPES

    for model_type in MODEL_TYPES:
        model = build(model_type, "cpscope")
        with pytest.raises(ValueError, match="enable_runtime_cp"):
            check_model_for_cp(model)
        cphf.enable_runtime_cp(model)
        check_model_for_cp(model)
        cphf.disable_runtime_cp(model)
        with pytest.raises(ValueError, match=r"but only 0 token mixers bound"):
            check_model_for_cp(model)
