"""Which CP scope a transformers batch was sharded for — and the refusals that follow (an error on every rank).

:func:`cpscope.integrations.hf.shard_batch` cuts a batch for one scope (group, size, rank). A model run under
another scope (or none) with that batch would rotate and attend with positions of the wrong layout: on some ranks
the positions even look valid (CP rank 1 of CP2 holds contiguous chunks), so a check of the data alone can pass on
one rank and fail on the other. Instead, :func:`mark` records, per tensor that travels to the attention function
unchanged (``position_ids``, ``cu_seq_lens_q`` / ``cu_seq_lens_k``), the scope it was cut for; :func:`check`
compares that record with the scope the attention function runs under. Every rank holds its own record of the
same scope, so every rank reaches the same verdict, before any collective.

:func:`install_generate_guard` makes ``generate()`` of a model with ``attn_implementation="cpscope"`` refuse to run
under CP > 1 (generation does not run under context parallelism).

Records refer to their tensors weakly (no tensor is kept alive) and to the scope, which refers to its group weakly.

Example::

    with cpscope.runtime_cp(groups[2]):
        batch = shard_batch({"input_ids": ids, "labels": ids})     # marked: cut for CP2, this rank
    model(**batch)          # ValueError on every rank: sharded for CP2, run under CP1
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...groups import group_ranks
from ...scope import CPScope, resolve_scope

__all__ = ["mark", "check", "cut_scope", "install_generate_guard", "MARKED_KEYS"]

# batch entries that reach transformers' attention function as the same tensor object
MARKED_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")

_CUT_FOR: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # tensor -> the CPScope it was sharded for


def _same(a: CPScope, b: CPScope) -> bool:
    return a.size == b.size and a.rank == b.rank and (a.size == 1 or a.group is b.group)


def _describe(scope: CPScope) -> str:
    if scope.size == 1:
        return "CP1"
    try:
        members = f" of the group {group_ranks(scope.group)}"
    except Exception:  # noqa: BLE001 - a destroyed group: its size and rank still say enough
        members = ""
    return f"CP{scope.size} (rank {scope.rank}{members})"


def mark(batch: dict[str, Any], scope: CPScope) -> None:
    """Record that the tensors of ``batch`` named in :data:`MARKED_KEYS` were sharded for ``scope``."""
    for name in MARKED_KEYS:
        t = batch.get(name)
        if isinstance(t, torch.Tensor):
            try:
                _CUT_FOR[t] = scope
            except TypeError:  # a tensor without weak references: not recorded
                pass


def cut_scope(t: Any) -> Optional[CPScope]:
    """The scope ``t`` was sharded for by ``shard_batch``, or ``None`` (not marked)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return _CUT_FOR.get(t)
    except TypeError:
        return None


def check(kwargs: dict[str, Any], scope: CPScope) -> None:
    """``ValueError`` when a marked tensor among the attention function's ``kwargs`` was sharded for another scope
    than ``scope`` (the one the model runs under)."""
    for name in MARKED_KEYS:
        cut = cut_scope(kwargs.get(name))
        if cut is not None and not _same(cut, scope):
            raise ValueError(
                f"the batch was sharded by shard_batch for {_describe(cut)} but the model runs under "
                f"{_describe(scope)} ({name} is the one shard_batch returned): call the model inside the same "
                "cpscope.runtime_cp scope as shard_batch (shard_batch(batch) and model(**batch) both inside "
                "`with cpscope.runtime_cp(group):`)"
            )


def refuse_generation(model: Any) -> None:
    """``ValueError`` when ``model`` uses cpscope attention and the active scope is CP > 1."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "cpscope":
        return
    scope = resolve_scope()
    if scope.size > 1:
        raise ValueError(
            f"generate() does not run under context parallelism: the active scope is {_describe(scope)}. "
            "Generation (a KV cache, one new token at a time) is not sharded across a CP group; call generate() "
            "outside every cpscope.runtime_cp scope (CP1), with attn_implementation set to another implementation "
            "(model.set_attn_implementation('sdpa'))"
        )


def install_generate_guard() -> None:
    """Wrap ``transformers.GenerationMixin.generate`` (once) with :func:`refuse_generation`."""
    from transformers import GenerationMixin

    original: Callable[..., Any] = GenerationMixin.generate
    if getattr(original, "_cpscope_guarded", False):
        return

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_generation(self)
        return original(self, *args, **kwargs)

    generate._cpscope_guarded = True  # type: ignore[attr-defined]
    GenerationMixin.generate = generate  # type: ignore[method-assign]
