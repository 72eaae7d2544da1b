"""What a transformers ``Trainer`` (or TRL ``SFTTrainer``) must look like for hybrid CP — checked at construction.

Each check raises ``ValueError`` naming the setting and the fix, before any step runs:

* the collator must produce flattened batches with document boundaries (:func:`check_collator`);
* the loss must be the trainer's own causal-LM cross-entropy (no label smoothing, ``compute_loss_func``,
  overridden ``compute_loss``, TRL ``loss_type`` other than ``"nll"`` or MoE auxiliary loss): hybrid CP computes it
  per microbatch itself, normalised by the trainer's global target count;
* no other parallelism or backward path the step bypasses (DeepSpeed, ``DataParallel``, fp16's gradient scaler,
  accelerate's own context / sequence / tensor parallelism);
* the longest document the trainer can produce (TRL's ``max_length`` with packing) must fit the plan's
  ``capacity × max_cp`` (:func:`check_capacity`).

Example::

    check_trainer(trainer, capacity=4096, max_cp=4, world=4)
"""
from __future__ import annotations

from typing import Any, Optional

from ...hybrid import cp_candidates, padded_length

__all__ = ["check_collator", "check_trainer", "check_capacity"]

# Loss code paths hybrid CP replaces with its own per-microbatch cross-entropy: the trainers' own compute_loss.
_OWN_COMPUTE_LOSS = ("transformers.trainer", "trl.trainer.sft_trainer")
# Collators that pad rows (no document boundaries): refused by name.
_PADDING_COLLATORS = ("DataCollatorForLanguageModeling", "DataCollatorWithPadding", "DataCollatorForSeq2Seq",
                      "DataCollatorForVisionLanguageModeling", "default_data_collator", "DefaultDataCollator")


def check_collator(collator: Any) -> None:
    """Refuse a collator that pads rows instead of flattening documents with their boundaries.

    Accepted: transformers' ``DataCollatorWithFlattening`` (with ``return_position_ids``), TRL's
    ``DataCollatorForLanguageModeling`` with ``padding_free=True`` (what ``packing=True`` selects). Unknown
    collators are checked on every batch (:func:`cpscope.integrations.hf._documents.batch_documents`).

    Example::

        check_collator(DataCollatorWithFlattening())          # fine
        check_collator(DataCollatorForLanguageModeling(tok, mlm=False))   # ValueError
    """
    name = getattr(collator, "__name__", None) or type(collator).__name__
    if name == "DataCollatorWithFlattening":
        if not getattr(collator, "return_position_ids", True):
            raise ValueError("hybrid CP: DataCollatorWithFlattening(return_position_ids=False) drops the document "
                             "boundaries; keep return_position_ids=True")
        return
    if hasattr(collator, "padding_free"):  # TRL's language-modeling collator
        if not collator.padding_free:
            raise ValueError(
                f"hybrid CP: {name}(padding_free=False) pads rows and marks no document boundaries; use "
                f"SFTConfig(packing=True) (packing_strategy 'bfd') or padding_free=True"
            )
        return
    if name in _PADDING_COLLATORS:
        raise ValueError(
            f"hybrid CP: the data collator {name} pads rows and marks no document boundaries, so documents packed "
            f"in a row would attend across each other; use transformers' DataCollatorWithFlattening, or TRL's "
            f"SFTTrainer with packing=True"
        )


def check_capacity(max_length: Optional[int], capacity: Optional[int], max_cp: Optional[int], world: int) -> None:
    """Refuse a capacity with which the planner could not place a document of ``max_length`` tokens.

    Example::

        check_capacity(8192, capacity=1024, max_cp=4, world=4)   # ValueError: 8192 > 4 × 1024
    """
    if capacity is None:
        return
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"hybrid CP: capacity must be a positive int (tokens per rank per microbatch), got "
                         f"{capacity!r}")
    if max_length is None:
        return
    top = int(cp_candidates(world, max_cp)[-1])
    need = int(padded_length(int(max_length), top))
    if need > capacity * top:
        raise ValueError(
            f"hybrid CP: a document of max_length={max_length} tokens ({need} padded for CP{top}) does not fit "
            f"capacity={capacity} tokens per rank at the largest CP size {top} of {world} ranks (max_cp={max_cp}); "
            f"raise capacity to at least {-(-need // top)} or lower max_length"
        )


def _check_loss(trainer: Any) -> None:
    args = trainer.args
    if getattr(args, "label_smoothing_factor", 0.0):
        raise ValueError(f"hybrid CP computes the plain cross-entropy; label_smoothing_factor="
                         f"{args.label_smoothing_factor} is not supported")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError("hybrid CP computes the loss per microbatch itself; a compute_loss_func is not supported")
    if getattr(args, "loss_type", "nll") not in ("nll", None):
        raise ValueError(f"hybrid CP computes the negative log-likelihood; TRL loss_type={args.loss_type!r} is "
                         f"not supported")
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError("hybrid CP does not add MoE router auxiliary losses (output_router_logits=True)")
    own = getattr(type(trainer).compute_loss, "__module__", "")
    if own not in _OWN_COMPUTE_LOSS:
        raise ValueError(
            f"hybrid CP: {type(trainer).__name__}.compute_loss is overridden (in {own}); the hybrid step computes "
            f"the causal-LM loss per microbatch itself and would skip it"
        )


def _check_parallelism(trainer: Any) -> None:
    args, acc = trainer.args, trainer.accelerator
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("hybrid CP does not support DeepSpeed (its engine owns the backward); use DDP or FSDP2")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"hybrid CP needs one device per process (n_gpu={args.n_gpu} means DataParallel); "
                         f"launch with torchrun or accelerate launch")
    if getattr(acc, "scaler", None) is not None:
        raise ValueError("hybrid CP does not support fp16 with a gradient scaler; use bf16 or fp32")
    pc = getattr(acc, "parallelism_config", None)
    for what in ("cp", "sp", "tp"):
        if pc is not None and getattr(pc, f"{what}_enabled", False):
            raise ValueError(f"hybrid CP replaces accelerate's parallelism_config {what}_size="
                             f"{getattr(pc, f'{what}_size', '?')}; set it to 1")


def check_trainer(trainer: Any, *, capacity: Optional[int], max_cp: Optional[int], world: int) -> None:
    """All the construction-time checks of the module docstring, on a built trainer."""
    _check_parallelism(trainer)
    _check_loss(trainer)
    check_collator(trainer.data_collator)
    args = trainer.args
    max_length = getattr(args, "max_length", None) if getattr(args, "packing", False) else None
    check_capacity(max_length, capacity, max_cp, world)
