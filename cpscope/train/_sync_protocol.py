"""The protocol of a gradient synchronisation strategy (:class:`GradientSync`), the hooks the hybrid-CP loop calls
on every rank once per step; the strategies themselves are in :mod:`cpscope.train._sync` (their public home, which
re-exports this class).

Example::

    class MySync(GradientSync):
        def end_step(self) -> None:            # after the last backward, on every rank
            allreduce_gradients(self.module, dp_group=self.dp_group)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..groups import group_ranks
from ._collectives import check_dp_group

__all__ = ["Group", "GradientSync", "same_ranks"]

Group = Optional[dist.ProcessGroup]


def same_ranks(dp_group: Group, theirs: Group, what: str, where: str) -> None:
    """``ValueError`` unless the wrapper's own group ``theirs`` has the members of ``dp_group``."""
    mine, other = group_ranks(dp_group), group_ranks(theirs)
    if sorted(mine) != sorted(other):
        raise ValueError(f"{where}: dp_group has global ranks {mine} but {what} reduces over ranks {other}; pass the "
                         f"data-parallel group the wrapper was built with (dist.group.WORLD when it is the world)")


class GradientSync:
    """How one step's gradients are synchronised; the loop calls the hooks on every rank, once per step.

    Attributes:
        model: what the user passed (the wrapper).
        module: what the microbatches' ``forward`` is called on (DDP: its ``.module``).
        dp_group: the data-parallel group the loss is normalised over and the gradients summed over, always
            named (:mod:`cpscope.train._collectives`): ``dist.group.WORLD`` for the world, ``None`` for this rank
            alone.
        needs_backward: the sync happens inside a backward, so a rank without microbatches runs an empty one.
    """

    needs_backward: bool = False

    def __init__(self, model: nn.Module, module: nn.Module, dp_group: Group) -> None:
        self.model, self.module = model, module
        self.dp_group = check_dp_group(dp_group, type(self).__name__)

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters (where counts and losses are reduced)."""
        for p in self.module.parameters():
            return p.device  # FSDP2's DTensor parameters report their local device
        return torch.device("cpu")

    def begin_step(self) -> None:
        """Before the first forward of the step (collectives allowed: every rank calls it)."""

    def before_last_microbatch(self) -> None:
        """Before the forward of the step's last microbatch (the empty one on a rank without microbatches)."""

    def end_step(self) -> None:
        """After the last backward (collectives allowed: every rank calls it)."""

    def abort_step(self) -> None:
        """A microbatch raised: undo what :meth:`begin_step` changed, without collectives (best effort)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__})"
