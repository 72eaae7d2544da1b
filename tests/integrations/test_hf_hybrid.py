"""Hybrid decoders bound by ``cpscope.integrations.hf.enable_runtime_cp`` under CP: each of the eight model types of
transformers 5.25 with gated DeltaNet, Kimi Delta Attention, Mamba2 or short-convolution layers, at CP2 and CP4 and
in jobs mixing CP sizes, gives the logits, loss and gradient of every parameter of the model at CP1 with packed
documents isolated.

Two steps of reference (tiny random-weight models of ``_hybrid_models``, float64):

1. ``test_bound_model_at_cp1_is_the_model`` (one process): the bound model at CP1 equals the model's own layers —
   on an unpacked row, and on a packed row against the model run on each document alone. Tolerance 1e-6 relative:
   the models' own recurrences compute in fp32 even in a float64 model (``torch_chunk_gated_delta_rule``,
   ``mamba2_chunk_scan`` and ``chunk_kda`` cast to fp32), and their packed path cannot keep documents apart without
   flash-linear-attention's kernels, hence one document at a time.
2. The CP tests (2 and 4 gloo ranks): every rank runs the bound model at CP1 on the full batch (the float64
   reference, documents isolated by step 1) and at CP``n`` on its zigzag shard, and checks its local logits (cut with
   the test's own zigzag index math), the CP-group sum of its losses and the CP-group sum of every gradient.
   Tolerances: logits 1e-9 (Nemotron-H: 1e-6, its ``lm_head`` output is cast to fp32); loss and gradients 1e-6 —
   transformers' causal-LM loss upcasts the logits to fp32, so the loss and the gradient flowing back from it carry
   fp32 rounding.

``test_breaks_fail_by_orders_of_magnitude_2_ranks`` breaks the binding on purpose — the recurrent state not handed
from one rank's chunks to the next (each rank runs its shard as if alone), or handed across a packed document's
boundary (the offsets dropped) — and checks that the error exceeds the tolerance by more than 1000 times.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from cpscope.integrations.hf import _bound_layers as bound_layers  # noqa: E402
from tests.attention._reference import zigzag_index  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.integrations._hybrid_models import MODEL_TYPES, VOCAB, build  # noqa: E402

SEQ = 32
DOCS = [8, 16, 8]  # every document divisible by 2*cp for cp <= 4; Mamba2 chunks (4 tokens) inside each
LOGITS_TOL = 1e-9
FP32_TOL = 1e-6  # fp32 somewhere on the path: transformers' loss, Nemotron-H's logits, the models' own recurrences


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, 3] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return batch


def _cu(packed: bool) -> list[int]:
    return [0] + torch.cumsum(torch.tensor(DOCS), 0).tolist() if packed else [0, SEQ]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def _run(model: torch.nn.Module, batch: dict[str, torch.Tensor], group: Any) -> tuple[torch.Tensor, ...]:
    """Local logits, loss and gradients of one microbatch under ``group`` (losses / gradients summed over it)."""
    model.zero_grad()
    with cpscope.runtime_cp(group):
        out = model(**cphf.shard_batch(batch))
    out.loss.backward()
    loss, grads = out.loss.detach().clone(), _grads(model)
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():  # the gradient reduction over the CP ranks (as data parallelism does)
            dist.all_reduce(g, group=group)
    return out.logits.detach(), loss, grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _errors(model_type: str, model: torch.nn.Module, packed: bool, sizes: tuple[int, ...],
            groups: dict[int, Any]) -> list[dict[str, float]]:
    """Per microbatch of CP ``sizes``: relative errors of logits, loss and the worst gradient vs the CP1 run."""
    batch = _batch(packed)
    ref_logits, ref_loss, ref_grads = _run(model, batch, None)
    out = []
    for size in sizes:  # one job, microbatches of different CP sizes on the same model
        group = groups[size]
        logits, loss, grads = _run(model, batch, group)
        rank = dist.get_rank(group) if group is not None else 0
        idx = zigzag_index(_cu(packed), size, rank)
        out.append({"logits": _relative(logits, ref_logits[:, idx]), "loss": _relative(loss, ref_loss),
                    "grads": max(_relative(g, ref_grads[n]) if ref_grads[n].abs().max() > 0 else float(g.abs().max())
                                 for n, g in grads.items())})
    return out


def _logits_tol(model_type: str) -> float:
    return FP32_TOL if model_type == "nemotron_h" else LOGITS_TOL


def _check(model_type: str, errors: dict[str, float], where: str) -> None:
    assert errors["logits"] <= _logits_tol(model_type), (where, errors)
    assert errors["loss"] <= FP32_TOL and errors["grads"] <= FP32_TOL, (where, errors)


def _models_match_cp1(model_types: tuple[str, ...], sizes: tuple[int, ...]) -> list[str]:
    groups = cpscope.new_cp_groups(sorted({s for s in sizes if s > 1}))
    groups[1] = None
    done = []
    for model_type in model_types:
        model = build(model_type)
        bound = cphf.enable_runtime_cp(model)
        assert bound, model_type
        for packed in (False, True):
            for size, errors in zip(sizes, _errors(model_type, model, packed, sizes, groups)):
                where = f"{model_type}, {'packed' if packed else 'bshd'}, CP{size} of {sizes}"
                _check(model_type, errors, where)
                done.append(where)
    return done


def test_models_match_cp1_2_ranks():
    """CP2, then CP1, then CP2 microbatches on the same bound model (one job mixing CP sizes)."""
    done = run_ranks(2, _models_match_cp1, MODEL_TYPES, (2, 1, 2), timeout=900)
    assert done[0] == done[1] and len(done[0]) == len(MODEL_TYPES) * 2 * 3


def test_models_match_cp1_4_ranks():
    """CP4, then CP2 (two groups of two ranks)."""
    done = run_ranks(4, _models_match_cp1, MODEL_TYPES, (4, 2), timeout=900)
    assert all(d == done[0] for d in done) and len(done[0]) == len(MODEL_TYPES) * 2 * 2


# ------------------------------------------------------------------------------------- deliberate breaks

def _break(kind: str):
    """A broken binding: ``"state"`` — every rank runs its shard alone (no state handed between ranks' chunks);
    ``"boundary"`` — packed offsets dropped (the state flows from one document into the next)."""
    def wrap(core):
        def broken(*args: Any, group: Any = None, cu_seqlens: Optional[Any] = None, **kwargs: Any):
            if kind == "state":
                return core(*args, group=None, cu_seqlens=None, **kwargs)  # shards as if whole rows
            return core(*args, group=group, cu_seqlens=None, **kwargs)
        return broken
    return wrap


def _broken_errors(model_types: tuple[str, ...]) -> list[float]:
    groups = cpscope.new_cp_groups([2])
    out = []
    for model_type in model_types:
        model = build(model_type)
        cphf.enable_runtime_cp(model)
        for kind, packed in (("state", False), ("boundary", True)):
            saved = {n: getattr(bound_layers, n) for n in ("gated_delta_rule", "mamba2_scan", "causal_conv1d")}
            batch = _batch(packed)
            ref_logits = _run(model, batch, None)[0]
            for name, core in saved.items():
                setattr(bound_layers, name, _break(kind)(core))
            try:
                with torch.no_grad(), cpscope.runtime_cp(groups[2]):
                    logits = model(**cphf.shard_batch(batch)).logits
            finally:
                for name, core in saved.items():
                    setattr(bound_layers, name, core)
            idx = zigzag_index(_cu(packed), 2, dist.get_rank(groups[2]))
            out.append(_relative(logits, ref_logits[:, idx]))
    return out


def test_breaks_fail_by_orders_of_magnitude_2_ranks():
    errors = run_ranks(2, _broken_errors, MODEL_TYPES, timeout=900)
    worst = [max(e[i] for e in errors) for i in range(len(errors[0]))]  # over the ranks (rank 0 may be exact)
    cases = [(m, k) for m in MODEL_TYPES for k in ("state", "boundary")]
    ratios = {f"{m}:{k}": w / _logits_tol(m) for (m, k), w in zip(cases, worst)}
    assert min(ratios.values()) > 1e3, ratios  # LFM2's 3-tap convolution moves the least: ~1e5 x its tolerance


# ------------------------------------------------------------------------------------- CP1, one process

def test_bound_model_at_cp1_is_the_model():
    for model_type in MODEL_TYPES:
        ref = build(model_type)
        model = build(model_type)
        cphf.enable_runtime_cp(model)
        ids = _batch(False)["input_ids"]
        with torch.no_grad():
            own = ref(input_ids=ids, use_cache=False).logits
            bound = model(input_ids=ids, use_cache=False).logits
            assert _relative(bound, own) <= FP32_TOL, model_type
            spans = list(zip(_cu(True)[:-1], _cu(True)[1:]))
            alone = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in spans], 1)
            packed = model(**cphf.shard_batch(_batch(True), group=None)).logits
            assert _relative(packed, alone) <= FP32_TOL, model_type
