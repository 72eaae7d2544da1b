"""Hybrid CP for transformers' ``Trainer`` and TRL's ``SFTTrainer``: a few changed lines, the same training.

Put :class:`HybridCPMixin` in front of the trainer class (or use :class:`HybridCPTrainer`,
:class:`HybridCPSFTTrainer`, or :func:`hybrid_cp_trainer`)::

    import cpscope.integrations.hf.trainer as cpt

    trainer = cpt.HybridCPSFTTrainer(                       # was: SFTTrainer(
        model=model, args=SFTConfig(packing=True, ...), train_dataset=ds, processing_class=tok,
        hybrid_cp=cpt.HybridCP(capacity=8192),              # tokens one rank holds in a microbatch
    )
    trainer.train()                                         # torchrun / accelerate launch, as before

What each training step does on every rank (one ``training_step`` call = one accumulation micro-step):

1. the rank's flattened batch (documents back to back, ``position_ids`` restarting) is cut into documents with the
   targets transformers' loss would use, and the world's documents are all-gathered (ids and targets only);
2. :func:`cpscope.hybrid.plan_hybrid` gives every document a CP size and every rank its microbatches (the same
   plan on every rank); each microbatch is packed, padded per document to ``2·cp`` and zigzag-sharded;
3. :func:`cpscope.train.run_step` runs them under ``runtime_cp`` (document-masked ring attention through
   ``attn_implementation="cpscope"``, RoPE at global positions), each loss the summed cross-entropy over the
   trainer's **global** target count ``num_items_in_batch`` — so the world-sum of the gradients is the gradient
   one process would compute on the whole batch;
4. the gradients are synchronised once per optimizer step — after the last micro-step of the accumulation window
   — as a sum, for DDP or FSDP2 (:mod:`cpscope.train._sync`), whatever the number of microbatches of each rank.

The trainer calls :func:`cpscope.integrations.hf.enable_runtime_cp` on the model at construction: it is switched to
``attn_implementation="cpscope"`` (plain document-masked attention at CP1, so evaluation runs as before; switch back
with ``model.set_attn_implementation("sdpa")`` to generate) and, in a hybrid decoder (Qwen3.5, Qwen3-Next, Kimi
Linear, Nemotron-H, Bamba, Granite 4, Falcon-H1, LFM2), every gated DeltaNet, Kimi Delta Attention, Mamba2 and short
convolution layer is bound to the scope, each packed document starting from a zero state
(:attr:`HybridCPMixin.cp_bound_layers` names them). Unless ``HybridCP.cost`` is given, the planner's default cost
counts the quadratic attention work and the ring traffic of the attention layers only
(:meth:`cpscope.hybrid.CostModel.for_layer_mix`): the other layers cost linear time in the document length. Before
the first step a probe checks that the model's layers all attend through cpscope and that no document sees another; the trainer's
settings, the collator and ``capacity`` are checked at construction (:mod:`cpscope.integrations.hf._setup`). Each
logged step gets ``cp_tokens_per_second``, ``cp_step_seconds`` and, per CP size, ``cp{n}_microbatches`` and
``cp{n}_token_share``; :attr:`HybridCPMixin.cp_history` keeps every step's figures.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from ...groups import new_cp_groups
from ...hybrid import CostModel, LayerMix, cp_candidates, plan_hybrid
from ...train import allreduce_sum
from ...train import IGNORE_INDEX, GradientSync, LocalMicrobatch, gradient_sync, run_step
from ...sharding import zigzag_position_ids
from ._documents import (Documents, batch_documents, concat_documents, document_offsets, gather_documents,
                            local_microbatches)
from ._model_check import base_model, call_model, check_model_for_cp
from ._runtime import enable_runtime_cp
from ._setup import check_trainer

# HybridCPSFTTrainer (TRL imported on first use) resolves through the module __getattr__ below.
__all__ = ["HybridCP", "HybridCPMixin", "HybridCPTrainer", "default_cost", "hybrid_cp_trainer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridCP:
    """How the trainer plans hybrid CP.

    Attributes:
        capacity: tokens one rank holds in one microbatch (after padding, ``Σ padded length / cp``); a document
            longer than it runs at a larger CP size. ``None``: the largest batch any rank got this micro-step.
        max_cp: the largest CP size (e.g. the GPUs of a node); ``None``: the largest power of two dividing the world.
        cost: the planner's cost model (:class:`cpscope.hybrid.CostModel` or ``StepCost``); ``None``: its default,
            for a hybrid model with only its attention layers quadratic (:func:`default_cost`).
        pad_id: the input id of the padding that makes each document a multiple of ``2·cp`` (its targets are
            ignored; causal attention never lets a real token see it).
        check_model: run the document-isolation probe before the first step.

    Example::

        HybridCP(capacity=8192, max_cp=8, cost=CostModel.fit(lengths, cps, seconds))
    """

    capacity: Optional[int] = None
    max_cp: Optional[int] = None
    cost: Any = None
    pad_id: int = 0
    check_model: bool = True


def default_cost(model: torch.nn.Module) -> Optional[CostModel]:
    """The planner's default :class:`~cpscope.hybrid.CostModel` for ``model``: ``None`` (the planner's own default)
    for an attention-only model; for a hybrid one the same with the quadratic and ring terms of its attention layers
    only (:meth:`~cpscope.hybrid.CostModel.for_layer_mix`, the layer counts from its config's ``layer_types``).

    Example::

        default_cost(qwen3_next)      # CostModel(attn=6.25e-10, ...): a quarter of the layers attend
    """
    config = getattr(base_model(model), "config", None)
    try:
        mix = LayerMix.from_config(config)
    except ValueError as e:  # layer kinds the model check refuses with its own message
        logger.debug("hybrid CP: no layer mix for the default cost (%s)", e)
        return None
    return CostModel().for_layer_mix(mix) if mix.linear else None


class _WindowSync(GradientSync):
    """The trainer's accumulation window as one gradient-sync step: begin at its first micro-step, sync at its last.

    ``last`` is set before every micro-step (the trainer's ``sync_gradients``). Under FSDP2, accelerate's
    ``no_sync`` turns gradient sync back on when each non-last micro-step ends; it is turned off again at the start
    of the next one, so reduce-scatters run only in the window's last CP1 backward.
    """

    def __init__(self, inner: GradientSync) -> None:
        super().__init__(inner.model, inner.module, inner.dp_group)
        self.inner, self.last, self._open = inner, True, False

    @property  # type: ignore[override]
    def needs_backward(self) -> bool:
        return bool(self.inner.needs_backward and self.last)

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def begin_step(self) -> None:
        if not self._open:
            self.inner.begin_step()
            self._open = True
        elif self.inner.needs_backward:
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.set_requires_gradient_sync(False, recurse=False)

    def before_last_microbatch(self) -> None:
        if self.last:
            self.inner.before_last_microbatch()

    def end_step(self) -> None:
        if self.last:
            self._open = False
            self.inner.end_step()

    def abort_step(self) -> None:
        self._open = False
        self.inner.abort_step()


@dataclass
class _Runtime:
    model: torch.nn.Module
    sync: _WindowSync
    groups: dict
    world: int
    rank: int


def _forward(module: Any, mb: LocalMicrobatch, *, position_start: int = 0) -> torch.Tensor:
    """One microbatch through the transformers model under the active scope: local logits ``[T / cp, vocab]``."""
    pos = zigzag_position_ids(mb.cu_seqlens, device=mb.input_ids.device)  # global positions, per document
    if position_start:
        pos = pos + position_start
    return call_model(module, mb.input_ids, pos, mb.cu_seqlens, mb.max_seqlen)


class _StepClock(TrainerCallback):
    """Times each optimizer step (begin to end, optimizer included) for the trainer's hybrid-CP figures."""

    def __init__(self, trainer: "HybridCPMixin") -> None:
        self._trainer = weakref.ref(trainer)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._cp_clock = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._cp_close_step()


def _with_offsets(inputs: dict) -> dict:
    """A flattened batch with ``cu_seq_lens_q/k`` from its ``position_ids`` where the collator gave none (CP1)."""
    pos, ids = inputs.get("position_ids"), inputs.get("input_ids")
    if pos is None or ids is None or "cu_seq_lens_q" in inputs or ids.dim() != 2 or ids.shape[0] != 1:
        return inputs
    cu = document_offsets(pos)
    if len(cu) <= 2:
        return inputs
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    return {**inputs, "cu_seq_lens_q": cu_t, "cu_seq_lens_k": cu_t, "max_length_q": longest,
            "max_length_k": longest}


class HybridCPMixin:
    """Hybrid CP for a transformers ``Trainer`` subclass: put it first, ``class T(HybridCPMixin, SFTTrainer)``.

    Takes one extra keyword, ``hybrid_cp`` (:class:`HybridCP`). See the module docstring for what a step does.

    Raises:
        ValueError: at construction, a setting hybrid CP cannot honour (collator without document boundaries,
            another loss, DeepSpeed / fp16 scaler / accelerate CP, a capacity too small for ``max_length``, a model
            that cannot switch to cpscope's attention or has a token-mixing layer ``enable_runtime_cp`` cannot bind);
            before the first step, a model that mixes documents; at
            any step, on every rank, a batch without document boundaries or a document the plan cannot place.

    Example::

        class MyTrainer(HybridCPMixin, Trainer):
            pass
        MyTrainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorWithFlattening(),
                  hybrid_cp=HybridCP(capacity=4096)).train()
    """

    def __init__(self, *args: Any, hybrid_cp: Optional[HybridCP] = None, **kwargs: Any) -> None:
        self.hybrid_cp = hybrid_cp if hybrid_cp is not None else HybridCP()
        if not isinstance(self.hybrid_cp, HybridCP):
            raise ValueError(f"hybrid_cp must be a HybridCP, got {type(self.hybrid_cp).__name__}")
        super().__init__(*args, **kwargs)
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_trainer(self, capacity=self.hybrid_cp.capacity, max_cp=self.hybrid_cp.max_cp, world=world)
        # cpscope attention, and every linear-attention / state-space / short-convolution layer bound to the scope
        self.cp_bound_layers: list[str] = enable_runtime_cp(self.model)
        self._cp_cost = self.hybrid_cp.cost if self.hybrid_cp.cost is not None else default_cost(self.model)
        self._cp: Optional[_Runtime] = None
        self._cp_clock: Optional[float] = None
        self._cp_step: dict = {}
        self._cp_pending: list[dict] = []
        self.cp_history: list[dict] = []  # one dict per optimizer step: tokens, seconds, microbatches / tokens per CP
        self.add_callback(_StepClock(self))

    # -- runtime state, built at the first step (collective: CP groups; the model probe) ----------------------

    def _cp_runtime(self, model: torch.nn.Module) -> _Runtime:
        rt = self._cp
        if rt is not None and rt.model is model:
            return rt
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        # hybrid CP plans over the whole world: the gradients are summed over it (the trainer's own DP group)
        sync = gradient_sync(model, dp_group=dist.group.WORLD if dist.is_initialized() else None)
        dp = dist.get_world_size(sync.dp_group) if dist.is_initialized() else 1
        if dp != world:
            raise ValueError(f"hybrid CP plans over the whole world of {world} ranks, but the model's gradients "
                             f"are synchronised over {dp}; other parallelism dimensions are not supported")
        sizes = [int(s) for s in cp_candidates(world, self.hybrid_cp.max_cp)]
        groups = new_cp_groups(sizes) if world > 1 else {1: None}
        if self.hybrid_cp.check_model:
            check_model_for_cp(model, forward_module=sync.module)
        self._cp = rt = _Runtime(model, _WindowSync(sync), groups, world, rank)
        logger.info("hybrid CP: %d ranks, CP sizes %s, %s", world, sizes, type(sync).__name__)
        return rt

    @property
    def cp_sync(self) -> Optional[GradientSync]:
        """The gradient synchronisation the steps use (``DDPSync`` / ``FSDPSync`` / ``ManualSync``); ``None``
        before the first step."""
        return None if self._cp is None else self._cp.sync.inner

    # -- one micro-step ---------------------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """One accumulation micro-step of the world's batch with hybrid CP; returns the loss the trainer logs."""
        rt = self._cp_runtime(model)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        try:
            local: Any = batch_documents(inputs)
        except ValueError as e:  # raised on every rank after one all-gather: never a hang
            local = e
        per_rank = gather_documents(local, group=rt.sync.dp_group, device=rt.sync.device)
        docs = concat_documents(per_rank)
        plan = self._cp_plan(docs, max(p.num_tokens for p in per_rank), rt.world)
        mbs = local_microbatches(plan.microbatches_for_rank(rt.rank), docs, rt.groups, pad_id=self.hybrid_cp.pad_id,
                                 device=rt.sync.device)
        n = self._cp_num_targets(num_items_in_batch, docs, rt)
        rt.sync.last = bool(self.accelerator.gradient_state.sync_gradients)
        forward = functools.partial(_forward, position_start=docs.position_start)
        offload = getattr(self, "maybe_activation_offload_context", None) or contextlib.nullcontext()
        with offload:
            result = run_step(model, mbs, sync=rt.sync, num_targets=n, forward=forward, dp_group=rt.sync.dp_group)
        self._cp_record(plan, docs)
        # The trainer averages the logged loss over ranks: world × this rank's share gives the global mean.
        return (result.loss_sum * rt.world / n).to(device=self.args.device, dtype=torch.float32)

    def _cp_plan(self, docs: Documents, largest_batch: int, world: int) -> Any:
        if not docs.input_ids:
            raise ValueError("hybrid CP: the world's batch holds no document")
        capacity = self.hybrid_cp.capacity or max(largest_batch, 1)
        try:
            return plan_hybrid(docs.lengths, n_ranks=world, capacity=capacity, cost=self._cp_cost,
                               max_cp=self.hybrid_cp.max_cp)
        except ValueError as e:  # the same plan, hence the same error, on every rank
            raise ValueError(f"hybrid CP cannot plan this batch (documents of {max(docs.lengths)} tokens at most, "
                             f"capacity {capacity} tokens per rank, {world} ranks): {e}") from e

    def _cp_num_targets(self, num_items_in_batch: Any, docs: Documents, rt: _Runtime) -> int:
        """The loss denominator one process would use for the whole batch (see the module docstring)."""
        here = docs.num_targets(IGNORE_INDEX)
        if num_items_in_batch is None:  # per-micro-step mean, divided by the accumulation steps
            n = here * int(self.current_gradient_accumulation_steps)
        else:
            n_t = torch.as_tensor(num_items_in_batch).detach().sum()
            if not self.args.average_tokens_across_devices and rt.world > 1:
                n_t = allreduce_sum(n_t, group=rt.sync.dp_group, device=rt.sync.device)
            n = int(round(float(n_t)))
        if n <= 0:
            raise ValueError(f"hybrid CP: the accumulated batch has {n} target tokens; nothing to train on")
        if n < here:
            raise RuntimeError(f"hybrid CP: the trainer counted {n} target tokens for the accumulation window but "
                               f"this micro-step alone has {here}; the collator's labels disagree with the count")
        return n

    # -- figures ----------------------------------------------------------------------------------------------

    def _cp_record(self, plan: Any, docs: Documents) -> None:
        step = self._cp_step
        step["tokens"] = step.get("tokens", 0) + docs.num_tokens
        lengths = docs.lengths
        for mb in plan.microbatches:
            step.setdefault("microbatches", {}).setdefault(mb.cp, 0)
            step["microbatches"][mb.cp] += 1
            step.setdefault("tokens_by_cp", {}).setdefault(mb.cp, 0)
            step["tokens_by_cp"][mb.cp] += sum(lengths[i] for i in mb.seqs)

    def _cp_close_step(self) -> None:
        step, self._cp_step = self._cp_step, {}
        if not step:
            return
        step["seconds"] = time.perf_counter() - self._cp_clock if self._cp_clock is not None else float("nan")
        self.cp_history.append(step)
        self._cp_pending.append(step)

    def _cp_summary(self) -> dict[str, float]:
        steps, self._cp_pending = self._cp_pending, []
        tokens = sum(s["tokens"] for s in steps)
        seconds = sum(s["seconds"] for s in steps)
        out = {"cp_tokens_per_second": tokens / seconds if seconds > 0 else float("nan"),
               "cp_step_seconds": seconds / len(steps)}
        sizes = sorted({cp for s in steps for cp in s.get("microbatches", {})})
        for cp in sizes:
            out[f"cp{cp}_microbatches"] = sum(s["microbatches"].get(cp, 0) for s in steps) / len(steps)
            out[f"cp{cp}_token_share"] = sum(s["tokens_by_cp"].get(cp, 0) for s in steps) / max(tokens, 1)
        return out

    def log(self, logs: dict, *args: Any, **kwargs: Any) -> None:
        if self._cp_pending and "loss" in logs:
            logs = {**logs, **self._cp_summary()}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def prediction_step(self, model: torch.nn.Module, inputs: dict, *args: Any, **kwargs: Any) -> Any:
        """Evaluation at CP1 through cpscope's attention: document offsets added where the collator gave none."""
        return super().prediction_step(model, _with_offsets(inputs), *args, **kwargs)  # type: ignore[misc]


class HybridCPTrainer(HybridCPMixin, Trainer):
    """transformers' ``Trainer`` with hybrid CP (:class:`HybridCPMixin`); takes ``hybrid_cp=HybridCP(...)``."""


@functools.lru_cache(maxsize=None)
def hybrid_cp_trainer(cls: type) -> type:
    """``cls`` (a ``Trainer`` subclass) with :class:`HybridCPMixin` in front; cached per class.

    Example::

        DPOish = hybrid_cp_trainer(MySFTTrainer)
    """
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise ValueError(f"hybrid_cp_trainer needs a transformers Trainer subclass, got {cls!r}")
    if issubclass(cls, HybridCPMixin):
        return cls
    return type(f"HybridCP{cls.__name__}", (HybridCPMixin, cls), {"__module__": __name__,
                                                                  "__doc__": f"{cls.__name__} with hybrid CP."})


def __getattr__(name: str) -> Any:
    if name == "HybridCPSFTTrainer":  # TRL is imported only when this name is used
        from trl import SFTTrainer

        return hybrid_cp_trainer(SFTTrainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
