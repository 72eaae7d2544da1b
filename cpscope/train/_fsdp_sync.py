"""FSDP2 (``fully_shard``) under hybrid CP: the :class:`FSDPSync` strategy and what it reads of FSDP2's state
(parameter groups, the mesh, the root modules). Public through :mod:`cpscope.train._sync`.

Example::

    sync = FSDPSync(fully_shard(model), dp_group=dist.group.WORLD)
    result = run_step(model, mbs, dp_group=dist.group.WORLD, sync=sync)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._sync_protocol import GradientSync, Group, same_ranks

__all__ = ["FSDPSync", "GROUP_SETTINGS", "fsdp_roots", "is_fsdp2", "mesh_group", "param_groups"]


def is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def param_groups(module: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one FSDP module (torch ≥ 2.13: a list; earlier: one or none)."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined]
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


# The FSDP2 settings a step changes (per parameter group) and restores afterwards.
GROUP_SETTINGS = ("reduce_grads", "all_reduce_grads", "reshard_after_backward", "post_forward_mesh_info",
                   "gradient_divide_factor", "force_sum_reduction_for_comms")


class FSDPSync(GradientSync):
    """FSDP2 (``fully_shard``) under hybrid CP: unshard once, accumulate without communication, reduce once.

    Per step, on every rank:

    1. ``begin_step``: every FSDP module gets ``set_requires_gradient_sync(False)``, ``set_reshard_after_forward(
       False)``, ``set_reshard_after_backward(False)``, a gradient divide factor of 1 with sum-only collectives
       (a SUM: the loss is already the global mean), and is ``unshard()``-ed — one all-gather per parameter
       group, in module order, the same on every rank. No forward or backward then communicates for FSDP: the
       parameters are already unsharded and the gradients accumulate unsharded (in ``reduce_dtype`` under a
       ``MixedPrecisionPolicy``).
    2. ``before_last_microbatch``: gradient sync back on, so the next backward reduce-scatters every parameter
       group once (FSDP's own reduce-scatter, overlapped with that backward). That backward is the rank's last
       microbatch when it is CP1; otherwise — a CP microbatch last, or no microbatch at all — :func:`run_step`
       runs one empty CP1 microbatch after the others (``needs_backward``). A reduce-scatter must never run inside a
       ring microbatch's backward: the ring's members for which that microbatch is not the last go on to the next
       layer's ring exchange, which waits for the rank blocked in the reduce-scatter — a deadlock that a schedule as
       simple as "rank 2 runs only the CP4 microbatch, rank 0 runs CP4 then CP2" produces.
    3. ``end_step``: every module ``reshard()``-ed (the sharded gradients are ready for the optimizer) and its own
       settings — ``reshard_after_forward`` / ``_backward``, gradient sync, divide factor — restored.

    Cost: the unsharded parameters (``param_dtype``) and unsharded gradients (``reduce_dtype``) of the whole model
    are held for the whole step, i.e. ``P · (param bytes + grad bytes)`` per rank instead of FSDP's per-layer
    working set — the price of ranks that run different numbers of microbatches without waiting for each other.
    Communication is the minimum: one all-gather and one reduce-scatter per parameter group per step.

    Only a one-dimensional mesh (plain FSDP, no HSDP) is supported, and every trainable parameter must be FSDP's
    (``fully_shard`` on the root too), else ``ValueError``.

    Example::

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:  # blocks get the fp32 RoPE table as an input: do not cast it to bf16
            fully_shard(block, mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
        fully_shard(model, mp_policy=policy)
        sync = FSDPSync(model, dp_group=dist.group.WORLD)      # the mesh's group: here the world
        result = run_step(model, mbs, dp_group=dist.group.WORLD, sync=sync)
    """

    needs_backward = True

    def __init__(self, model: nn.Module, *, dp_group: Group) -> None:
        root = getattr(model, "_orig_mod", model)  # torch.compile(model) wraps it
        fsdp = [m for m in root.modules() if is_fsdp2(m)]
        if not fsdp:
            raise ValueError(f"FSDPSync: {type(model).__name__} has no FSDP2 module (fully_shard was not applied)")
        from torch.distributed.tensor import DTensor

        plain = [n for n, p in root.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if plain:
            raise ValueError(
                f"FSDPSync: {len(plain)} trainable parameter(s) are not sharded by FSDP2 (e.g. {plain[:3]}), so no "
                f"reduce-scatter would sum their gradients; apply fully_shard to the root module too"
            )
        same_ranks(dp_group, mesh_group(fsdp), "the FSDP2 device mesh", "FSDPSync")
        super().__init__(model, model, dp_group)
        self._fsdp = fsdp
        self._roots = fsdp_roots(root)
        self._saved: Optional[list[tuple[Any, dict[str, Any]]]] = None

    def _save(self) -> None:
        saved = []
        for m in self._fsdp:
            state = m._get_fsdp_state()
            if hasattr(state, "_auto_reshard_after_forward"):  # set_reshard_after_forward clears it
                saved.append((state, {"_auto_reshard_after_forward": state._auto_reshard_after_forward}))
            for g in param_groups(m):
                saved.append((g, {k: getattr(g, k) for k in GROUP_SETTINGS if hasattr(g, k)}))
        self._saved = saved

    def _restore(self) -> None:
        for obj, values in self._saved or ():
            for k, v in values.items():
                setattr(obj, k, v)
        self._saved = None

    def begin_step(self) -> None:
        for m in self._roots:  # FSDP's root set-up (normally at the first forward) before changing its settings
            m._get_fsdp_state()._lazy_init()
        self._save()
        for m in self._fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            set_factor = getattr(m, "set_gradient_divide_factor", None) or m.set_reduce_scatter_divide_factor
            set_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # SUM without a PREMUL_SUM op (gloo has none)
                m.set_force_sum_reduction_for_comms(True)
        for m in self._fsdp:  # one all-gather per parameter group, in module order, on every rank
            m.unshard()

    def before_last_microbatch(self) -> None:
        for m in self._fsdp:
            m.set_requires_gradient_sync(True, recurse=False)

    def end_step(self) -> None:
        for m in self._fsdp:
            m.reshard()
        self._restore()

    def abort_step(self) -> None:
        try:
            for m in self._roots:
                if hasattr(m, "reset_iter_state"):
                    m.reset_iter_state()
            for m in self._fsdp:
                m.reshard()
        finally:
            self._restore()


def mesh_group(fsdp: list[nn.Module]) -> Group:
    """The one group every FSDP module is sharded over (``ValueError`` for HSDP's 2-D mesh or several groups)."""
    meshes = []
    for m in fsdp:
        for g in param_groups(m):
            mesh = g.mesh_info.mesh
            if mesh.ndim != 1:
                raise ValueError(
                    f"FSDPSync supports FSDP over a 1-D device mesh; {type(m).__name__} is sharded over a "
                    f"{mesh.ndim}-D mesh {tuple(mesh.shape)} (HSDP is not supported by the hybrid loop yet)"
                )
            meshes.append(mesh)
    ranks = {tuple(dist.get_process_group_ranks(mm.get_group())) for mm in meshes}
    if len(ranks) > 1:
        raise ValueError(f"FSDPSync: the FSDP modules are sharded over different groups of ranks {sorted(ranks)}")
    return meshes[0].get_group() if meshes else None


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP modules that no other FSDP module contains (FSDP's roots)."""
    roots: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if is_fsdp2(m) and not any(name == r or name.startswith(r + ".") or r == "" for r, _ in roots):
            roots.append((name, m))
    return [m for _, m in roots]
