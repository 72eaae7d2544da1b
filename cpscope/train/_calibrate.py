"""Calibration: time every communication variant over the job's CP groups and fit the per-call cost model.

:func:`calibrate` is collective (every rank of the job calls it with the same arguments). For every CP size of
``groups`` (each rank in its own block; all blocks of a size run at once, as in a hybrid step), every k/v-head
count, microbatch size and document split, and every variant allowed at that shape, it times forward +
backward of ``cpscope.context_parallel_attention(..., comm=variant)`` on random ``thd`` inputs (``warmup``
untimed calls, then ``repeats`` timed ones, each started together after a world-wide synchronisation). The
timings are reduced over the whole world by **max** (a collective call takes as long as its slowest member),
the median over repeats is taken, and :meth:`CommCostModel.fit` turns them into coefficients — the same
numbers on every rank, so every rank gets the same model. CP1 (no group) is timed once as the ``"local"``
fit that every variant shares at ``cp = 1``.

The model is written to :func:`~cpscope.hybrid._comm_cost.cache_path` (by the ranks with ``LOCAL_RANK`` 0, or
global rank 0 when unset) and found again by :func:`~cpscope.train._auto.cached_cost` /
:func:`load_or_calibrate`.

Example (2 GPUs; see ``benchmarks/calibrate_comm.py`` for the command line)::

    groups = cpscope.new_cp_groups([1, 2])
    cost = calibrate(groups, heads=32, kv_heads=(32, 8), head_dim=128)       # seconds: docs/hybrid_planner.md
    step = StepCost(cost, heads=32, kv_heads=8, head_dim=128, layers=32, linear=2e-5)
    plan = plan_hybrid(lengths, n_ranks=2, capacity=65536, cost=step)        # mb.comm per microbatch
"""
from __future__ import annotations

import inspect
import logging
import os
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .._version import __version__
from .._variants import VARIANTS, check_variants
from ..hybrid import (LOCAL, CommCostModel, Sample, cache_key, cache_path, default_inner, dtype_name,
                     load_cached, variant_allowed)
from ._auto import calibration_device, device_name

__all__ = ["calibrate", "job_key", "load_or_calibrate"]

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., torch.Tensor]


def _default_attention() -> AttentionFn:
    from ..attention import context_parallel_attention

    if "comm" not in inspect.signature(context_parallel_attention).parameters:
        raise RuntimeError(
            "this cpscope's context_parallel_attention takes no comm= yet (the communication variants are not "
            "merged); calibrate needs them — or pass an attention= stand-in to exercise the machinery only")
    return context_parallel_attention


def job_key(cp_sizes: Iterable[int], device: Optional[torch.device] = None) -> dict[str, Any]:
    """The cache key of this job: device name, world size, CP sizes and the torch / cpscope versions."""
    device = calibration_device(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return cache_key(device=device_name(device), world_size=world, cp_sizes=cp_sizes,
                     torch_version=torch.__version__, cpscope_version=__version__)


def _power_of_two_sizes(world: int) -> list[int]:
    """Every power of two dividing ``world`` (the default CP sizes to calibrate)."""
    sizes, s = [], 1
    while world % s == 0 and s <= world:
        sizes.append(s)
        s *= 2
    return sizes


def _split_lengths(tokens: int, n_docs: int, step: int) -> tuple[int, ...]:
    """``n_docs`` document lengths, multiples of ``step``, summing to ``tokens`` rounded to a multiple of it."""
    units = max(n_docs, -(-tokens // step))
    base, extra = divmod(units, n_docs)
    return tuple(step * (base + (1 if i < extra else 0)) for i in range(n_docs))


def _configs(cp_sizes: Sequence[int], variants: Sequence[str], heads: int, kv_heads: Sequence[int],
             tokens: Sequence[int], docs: Sequence[int], inner: Optional[int], step: int) -> list[tuple]:
    out = []
    for cp in cp_sizes:
        for kv in kv_heads:
            for t in tokens:
                for n in docs:
                    lengths = _split_lengths(t, n, step)
                    names = [LOCAL] if cp == 1 else [v for v in variants
                                                     if variant_allowed(v, cp, heads, kv, inner)]
                    for v in names:  # a2a+p2p: the sub-group size it runs with, named
                        n = (inner or default_inner(cp, heads, kv)) if v == "a2a+p2p" else None
                        out.append((cp, kv, lengths, v, n))
    return out


def calibrate(
    groups: Optional[Mapping[int, Optional[dist.ProcessGroup]]] = None,
    *,
    variants: Sequence[str] = VARIANTS,
    heads: int = 32,
    kv_heads: Sequence[int] = (32, 8),
    head_dim: int = 128,
    tokens: Sequence[int] = (16384, 65536),
    docs: Sequence[int] = (1, 8),
    dtype: Any = None,
    device: Optional[torch.device] = None,
    causal: bool = True,
    inner: Optional[int] = None,
    warmup: int = 2,
    repeats: int = 5,
    attention: Optional[AttentionFn] = None,
    cache: bool = True,
    directory: Optional[str] = None,
    progress: bool = True,
) -> CommCostModel:
    """Time every variant over ``groups`` (default ``new_cp_groups`` of every power of two dividing the world)
    and fit the per-call cost model; collective, the same result on every rank.

    Args:
        groups: ``{cp: group}`` as :func:`cpscope.new_cp_groups` returns (size 1 → ``None``: timed as CP1).
        variants: the variants to time (each only where :func:`variant_allowed`).
        heads, kv_heads, head_dim: query heads, the k/v-head counts to time (several let the fit tell traffic
            from compute), head dim.
        tokens, docs: microbatch sizes (global tokens) and document counts per microbatch (``thd``; lengths
            rounded to multiples of ``2 · max cp``).
        dtype, device: default bf16 on CUDA, float32 on CPU; the current CUDA device under NCCL.
        inner: the all-to-all sub-group size of ``a2a+p2p`` (default: ``cpscope.attention``'s, the largest
            divisor ≤ 8 of cp and both head counts below cp); the variant is called as ``"a2a+p2p:N"``.
        warmup, repeats: untimed and timed calls per configuration.
        attention: the call to time, ``attention(q, k, v, comm=..., group=..., qkv_format="thd",
            cu_seqlens=..., causal=...)``; default ``cpscope.context_parallel_attention`` (which must take
            ``comm=``). A callable with a true ``stand_in`` attribute (the tests' ``ring_stand_in``, which runs the
            ring for every variant) is recorded as such in ``meta["stand_in"]``.
        cache: write the model to the cache (ranks with ``LOCAL_RANK`` 0); ``directory`` overrides its folder.

    Raises:
        ValueError: bad arguments (before any collective).
        RuntimeError: no ``comm=`` in ``context_parallel_attention`` and no ``attention`` given.
    """
    _check_arguments(variants, heads, kv_heads, tokens, docs, warmup, repeats)
    device = calibration_device(device)
    dt = getattr(torch, dtype_name(dtype if dtype is not None else
                                   (torch.bfloat16 if device.type == "cuda" else torch.float32)))
    fn = attention if attention is not None else _default_attention()
    groups = _resolve_groups(groups)
    cp_sizes = sorted(groups)
    configs = _configs(cp_sizes, variants, heads, kv_heads, tokens, docs, inner, 2 * max(cp_sizes))
    _hierarchical_up_front(groups, configs)
    timer = _Timer(device, warmup, repeats)
    rows, kept = _time_all(fn, groups, configs, _Shape(heads, head_dim, dt, device), timer, causal,
                           progress and dist.get_rank() == 0)
    timed = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX, group=dist.group.WORLD)  # the slowest rank's time, everywhere
    samples = [Sample(variant, dtype_name(dt), cp, lengths, heads, kv, head_dim, causal, sub, float(t))
               for (cp, kv, lengths, variant, sub), t in zip(kept, timed.median(dim=1).values.tolist())]
    key = job_key(cp_sizes, device)
    meta = {**key, "inner": inner, "stand_in": bool(getattr(fn, "stand_in", False)),
            "attention": getattr(fn, "__qualname__", repr(fn)), "backend": dist.get_backend(),
            "warmup": warmup, "repeats": repeats, "reduction": "max over ranks, median over repeats"}
    model = CommCostModel.fit(samples, meta)
    if cache:
        _save(model, key, directory, timer)
    return model


def _time_all(fn: AttentionFn, groups: Mapping[int, Optional[dist.ProcessGroup]], configs: list[tuple],
              shape: "_Shape", timer: "_Timer", causal: bool, progress: bool) -> tuple[list[list[float]], list[tuple]]:
    """Each configuration's timed calls (``rows``) and the configurations kept (the attention refused none)."""
    rows: list[list[float]] = []
    kept: list[tuple] = []
    for cp, kv, lengths, variant, sub in _progress(configs, progress):
        q, k, v, grad, cu = shape.inputs(cp, kv, lengths)
        comm = "p2p" if variant == LOCAL else variant if sub is None else f"{variant}:{sub}"

        def call() -> None:
            out = fn(q, k, v, comm=comm, group=groups[cp], qkv_format="thd", cu_seqlens=cu, causal=causal)
            torch.autograd.grad(out, (q, k, v), grad)

        try:
            rows.append(timer.time(call))
        except ValueError as err:  # raised on every rank alike, before any collective (the contract)
            logger.warning("calibrate: skipping %s at cp=%d, kv_heads=%d: %s", variant, cp, kv, err)
            continue
        kept.append((cp, kv, lengths, variant, sub))
    if not rows:
        raise RuntimeError("calibrate: every configuration was refused by the attention call")
    return rows, kept


def _hierarchical_up_front(groups: Mapping[int, Optional[dist.ProcessGroup]], configs: list[tuple]) -> None:
    """The ``a2a+p2p`` sub-groups the configurations time, made before the first timed call (attention never makes
    them); every rank has the same configurations, so every member makes the same ones, in the same order."""
    from ..groups import hierarchical_cp_groups

    for cp, sub in sorted({(cp, sub) for cp, _, _, variant, sub in configs if variant == "a2a+p2p" and sub}):
        if cp % sub == 0 and 1 < sub < cp:
            hierarchical_cp_groups(groups[cp], sub)


def _resolve_groups(groups: Optional[Mapping[int, Optional[dist.ProcessGroup]]]
                    ) -> Mapping[int, Optional[dist.ProcessGroup]]:
    """``groups``, checked (each ``groups[cp]`` has ``cp`` ranks); default every power-of-two size (collective)."""
    if groups is None:
        from ..groups import new_cp_groups

        groups = new_cp_groups(_power_of_two_sizes(dist.get_world_size()))
    for cp, group in groups.items():
        actual = 1 if group is None else dist.get_world_size(group)
        if actual != cp:
            raise ValueError(f"groups[{cp}] has {actual} ranks, not {cp}")
    return {int(cp): g for cp, g in groups.items()}


def _save(model: CommCostModel, key: Mapping[str, Any], directory: Optional[str], timer: "_Timer") -> None:
    """Write the model (ranks with ``LOCAL_RANK`` 0); no rank returns, and looks for the file, before it is written."""
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        logger.info("calibrate: wrote %s", model.save(cache_path(key, directory)))
    timer.barrier()


def _check_arguments(variants: Sequence[str], heads: int, kv_heads: Sequence[int], tokens: Sequence[int],
                     docs: Sequence[int], warmup: int, repeats: int) -> None:
    """``calibrate``'s argument checks (``ValueError`` before any collective)."""
    if not dist.is_initialized():
        raise ValueError("calibrate is collective: initialise torch.distributed first (gloo on CPU, NCCL on GPU)")
    if not check_variants(variants):  # ValueError naming the unknown ones
        raise ValueError(f"variants must be some of {VARIANTS}, got {list(variants)}")
    for name, values in (("kv_heads", kv_heads), ("tokens", tokens), ("docs", docs)):
        if not values or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in values):
            raise ValueError(f"{name} must be a non-empty list of ints ≥ 1, got {values!r}")
    if any(heads % kv for kv in kv_heads):
        raise ValueError(f"heads ({heads}) must be a multiple of every kv_heads value, got {list(kv_heads)}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup ≥ 0 and repeats ≥ 1, got warmup={warmup}, repeats={repeats}")


class _Shape:
    """Random ``thd`` inputs of one (cp, k/v heads, lengths), made on the device and reused by every variant."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.key: Optional[tuple] = None
        self.made: tuple = ()

    def _rand(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=self.gen, device=self.device, dtype=self.dtype)

    def inputs(self, cp: int, kv: int, lengths: tuple[int, ...]) -> tuple:
        """``(q, k, v, grad_out, cu_seqlens)``: the local ``[t/cp, h, d]`` tensors and the global offsets."""
        if self.key != (cp, kv, lengths):
            local = sum(lengths) // cp
            q, k, v = (self._rand(local, h, self.head_dim).requires_grad_() for h in (self.heads, kv, kv))
            cu = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
            self.key, self.made = (cp, kv, lengths), (q, k, v, self._rand(local, self.heads, self.head_dim), cu)
        return self.made


class _Timer:
    """Warm-up calls, then timed calls each started together on every rank (one world all-reduce before each)."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.flag = torch.zeros(1, device=device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        dist.all_reduce(self.flag, group=dist.group.WORLD)  # every block starts its timed call together
        self.sync()

    def time(self, call: Callable[[], None]) -> list[float]:
        """Seconds of each timed call (``ValueError`` from a warm-up call propagates before any barrier)."""
        for _ in range(self.warmup):
            call()
        times = []
        for _ in range(self.repeats):
            self.barrier()
            t0 = time.perf_counter()
            call()
            self.sync()
            times.append(time.perf_counter() - t0)
        return times


def load_or_calibrate(groups: Optional[Mapping[int, Optional[dist.ProcessGroup]]] = None, *,
                      directory: Optional[str] = None, **kwargs: Any) -> CommCostModel:
    """The cached calibration of this job if there is one (on every rank alike), else :func:`calibrate`.

    Collective either way: the ranks agree (by an all-reduce) on whether every one of them found the file, so
    no rank calibrates alone.

    Example::

        cost = load_or_calibrate(cpscope.new_cp_groups([1, 2, 4]), heads=32, kv_heads=(8,), head_dim=128)
    """
    sizes = sorted(groups) if groups is not None else _power_of_two_sizes(dist.get_world_size())
    device = calibration_device(kwargs.get("device"))
    found = load_cached(job_key(sizes, device), directory)
    have = torch.tensor([0 if found is None else 1], device=device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
    if int(have.item()) == 1:
        return found
    return calibrate(groups, directory=directory, **kwargs)


def _progress(items: list, enabled: bool) -> Iterable:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return items
    return tqdm(items, desc="calibrate", unit="config")
