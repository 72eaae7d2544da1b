"""Hybrid CP in transformers' ``Trainer`` and TRL's ``SFTTrainer``: the same training as one process without CP.

Every multi-rank test trains the example's tiny Llama (examples/sft_trl.py: a seeded config, no weights, fp32,
SGD) on 4 gloo ranks with :mod:`cpscope.integrations.hf_trainer` — TRL's packed rows planned into CP1 / CP2 / CP4
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
def _single(trainer: str, grad_accum: int) -> ex.SFTResult:
    """The reference: the plain trainer on one process (this one), no CP, the whole global batch per step."""
    return ex.train(_run(mode="single", trainer=trainer, grad_accum=grad_accum, **_sizes(trainer)))


def _sizes(trainer: str) -> dict:
    return {"batch": 6} if trainer == "trainer" else {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check_same_training(trainer: str, grad_accum: int = 1, **kw) -> list[ex.SFTResult]:
    run = _run(trainer=trainer, grad_accum=grad_accum, **_sizes(trainer), **kw)
    per_rank = run_ranks(4, _train_rank, run)
    ref = _single(trainer, grad_accum)
    res = per_rank[0]
    assert res.steps == ref.steps == STEPS and len(res.losses) == len(ref.losses) == STEPS
    for r in per_rank[1:]:  # every rank logged the same losses and holds the same weights
        assert r.losses == res.losses
        assert all(torch.equal(r.state[k], res.state[k]) for k in res.state)
    for step, (a, b) in enumerate(zip(res.losses, ref.losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    init = ex.make_model(run, len(ex.make_tokenizer())).state_dict()
    for k, w in ref.state.items():
        assert _rel(res.state[k], w) <= 1e-5, (k, _rel(res.state[k], w))
    assert max(_rel(ref.state[k], init[k]) for k in ref.state) > 1e-3  # training really moved the weights
    sizes = {cp for h in res.cp_history for cp in h["microbatches"]}
    assert sizes == {1, 2, 4}, sizes  # mixed CP1 / CP2 / CP4 microbatches
    assert len(res.cp_history) == STEPS and all(h["tokens"] > 0 and h["seconds"] > 0 for h in res.cp_history)
    return per_rank


def test_sft_packing_matches_one_process():
    per_rank = _check_same_training("sft")
    assert {r.sync for r in per_rank} == {"DDPSync"}  # accelerate wrapped the model in DDP


def test_sft_packing_with_gradient_checkpointing():
    per_rank = _check_same_training("sft", gradient_checkpointing=True)
    assert all(r.gradient_checkpointing for r in per_rank)


def test_sft_packing_with_gradient_accumulation():
    _check_same_training("sft", grad_accum=2)


def test_trainer_with_flattening_collator_matches_one_process():
    _check_same_training("trainer")


def test_sft_packing_fsdp2_with_gradient_accumulation():
    """accelerate's FSDP2 on CPU (fully_shard per decoder layer and the root), 2 micro-steps per optimizer step:
    the reduce-scatters run once, in the window's last CP1 backward, although accelerate's no_sync turns gradient
    sync back on after every micro-step."""
    per_rank = _check_same_training("sft", grad_accum=2, fsdp=True)
    assert {r.sync for r in per_rank} == {"FSDPSync"}
