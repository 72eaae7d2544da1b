"""Multi-token prediction (MTP) under runtime CP: every roll of an MTP forward follows the microbatch.

megatron-core 0.19.2's MTP shifts tokens one place left with ``roll_tensor``
(``transformer/multi_token_prediction.py``): the input ids and positions of each MTP layer
(``MultiTokenPredictionLayer._get_embeddings``, over the layer's ``cp_group``) and the labels and loss mask of each
MTP depth (``process_mtp_loss``, over ``GPTModel.pg_collection.cp``). Three things in it would be wrong under
runtime CP:

group
    The rolls exchange each document's boundary tokens with the neighbouring CP ranks of the *static* group; a CP2
    microbatch on a model built with CP1 would roll each rank's half on its own.
layout
    For packed (``thd``) batches ``_roll_tensor_packed_seq`` cuts documents at ``cu_seqlens_q // cp`` — the real
    offsets — while the tokens lie in the padded layout (``cu_seqlens_q_padded``) whenever documents are padded
    to a multiple of ``2·cp`` (cpscope pads every document so, CP1 included); and the padding tokens would be
    shifted into a document's last real positions and counted as MTP targets.
normalisation
    ``process_mtp_loss`` divides each depth's loss by the number of MTP targets the *rank* holds (the sum its roll
    returns): each rank's own mean, which is the microbatch's mean only when every rank holds as many targets.

:class:`MTPModelMixin` (on a ``GPTModel`` with an MTP block) binds, for the call of its ``_postprocess`` — where
the MTP block and ``process_mtp_loss`` run, in forward only — megatron's ``roll_tensor`` to a roll that uses the
carried scope's group (whatever group the caller passes), gives Megatron's packed roll the layout offsets, zeroes
the padding tokens before each roll (so a document's last positions receive 0 as without padding, and the padding
never becomes a target) and returns the count summed over the CP group. Each rank's MTP loss is then its targets'
summed loss over the *microbatch's* target count: the shares of the CP ranks add up to the MTP loss the unmodified
model computes for that microbatch without CP (Megatron's per-microbatch mean, times ``mtp_loss_scaling_factor /
mtp_num_layers`` and ``MTPLossAutoScaler``'s scale), and cpscope's summed gradients are that microbatch's
gradients. The MTP layers' ``cp_group`` and ``pg_collection`` are left as built. The value Megatron's tracker logs
per rank (``MTPLossLoggingHelper``) is that rank's share.

Refused (:func:`mtp_refusals`): ``calculate_per_token_loss`` (it rescales by the rank's own token count before the
roll, which this binding does not reach).

Example::

    enable_runtime_cp(mtp_model)   # a GPTModel built with mtp_block_spec and CP1: MTP follows each microbatch
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ...scope import CPScope
from .._swap import call_with_attributes
from ._carrier import consumer_scope
from ._moe import _thd_padding

__all__ = ["MTPModelMixin", "is_mtp_model", "mtp_refusals"]


def is_mtp_model(module: Any) -> bool:
    """Whether ``module`` is a megatron ``GPTModel`` that runs an MTP block (its last pipeline stage)."""
    from megatron.core.models.gpt import GPTModel

    return isinstance(module, GPTModel) and bool(getattr(module, "mtp_process", False))


def mtp_refusals(config: Any) -> list[str]:
    """What :func:`enable_runtime_cp` cannot cover in a model with MTP built with ``config`` (empty: supported)."""
    if not getattr(config, "mtp_num_layers", None):
        return []
    if getattr(config, "calculate_per_token_loss", False):
        return [f"mtp_num_layers={config.mtp_num_layers} with calculate_per_token_loss=True (Megatron rescales the "
                "MTP loss by each rank's own token count)"]
    return []


class MTPModelMixin:
    """A ``GPTModel`` whose MTP rolls run with the microbatch's group, layout and counts (module docstring)."""

    def _postprocess(self, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.transformer import multi_token_prediction as mtp_module

        psp = kwargs.get("packed_seq_params")
        scope = consumer_scope(psp)  # the carried scope (the entry forward resolved it)
        roll = scoped_roll(mtp_module.roll_tensor, scope, psp)
        return call_with_attributes(mtp_module, {"roll_tensor": roll}, super()._postprocess,  # type: ignore[misc]
                                    *args, **kwargs)


def scoped_roll(original: Callable[..., Any], scope: CPScope, psp: Any) -> Callable[..., Any]:
    """Megatron's ``roll_tensor`` for one microbatch: ``scope``'s group, the layout offsets of ``psp``, padding
    zeroed before the roll, the returned count summed over the CP group."""
    group = scope.group if scope.size > 1 else None
    view, is_pad = _layout_view(psp, scope)

    def roll(tensor: Optional[torch.Tensor], shifts: int = -1, dims: int = -1, cp_group: Any = None,
             packed_seq_params: Any = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        del cp_group  # the static group Megatron passes: the microbatch's runs instead
        if tensor is None:
            return None, None
        if is_pad is not None:
            if tensor.shape[-1] != is_pad.numel():
                raise ValueError(f"MTP under runtime CP: a tensor of {tensor.shape[-1]} local tokens, but the "
                                 f"microbatch's offsets give {is_pad.numel()} for CP{scope.size}")
            tensor = tensor.masked_fill(is_pad.to(tensor.device), 0)
        rolled, total = original(tensor, shifts=shifts, dims=dims, cp_group=group,
                                 packed_seq_params=None if packed_seq_params is None else view)
        if group is not None:
            total = total.clone()
            dist.all_reduce(total, group=group)  # the microbatch's count: every rank of the group rolls alike
        return rolled, total

    return roll


def _layout_view(psp: Any, scope: CPScope) -> tuple[Any, Optional[torch.Tensor]]:
    """``psp`` with ``cu_seqlens_q`` set to the layout offsets (Megatron's packed roll reads those), and this
    rank's padding tokens (``None``: no padding, or not ``thd``)."""
    if psp is None or getattr(psp, "qkv_format", None) != "thd" or getattr(psp, "cu_seqlens_q_padded", None) is None:
        return psp, None
    view = copy.copy(psp)
    view.cu_seqlens_q = psp.cu_seqlens_q_padded
    is_pad, _ = _thd_padding(psp, scope)
    return view, (is_pad if bool(is_pad.any()) else None)
