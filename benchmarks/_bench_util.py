"""Shared pieces of the attention, transformers and host-time benchmarks (``bench_attention.py``, ``bench_hf.py``,
``bench_host.py``).

* :func:`init_world` — one process (CP1, no process group) or ``torchrun`` (NCCL on CUDA, gloo on CPU);
* :class:`Timer` — medians of a step: CUDA events on CUDA (``perf_counter`` on CPU), warm-up first, the number of
  timed iterations cut so that one measurement stays within a time budget (agreed across ranks: a collective step
  must run the same number of times everywhere);
* :func:`attempt` — run one measurement, log and record any exception, return ``None``: one failing row never
  loses the others;
* :func:`kernel_profile` — the GPU kernels of one call (torch.profiler chrome trace), classified ``cudnn`` /
  ``flash`` / ``mem_efficient`` / ``other``, with their times;
* :func:`zigzag_rows` — this rank's full-tensor rows in the zigzag layout (independent of cpscope's own index
  math: a benchmark's parity check must not reuse what it checks);
* :func:`rel_err`, :func:`env_info`, :func:`write_json`.

Example::

    dev, rank, world, group = init_world("cuda")
    timer = Timer(dev, iters=10, warmup=3, budget_s=3.0)
    ms = attempt(row, "sdpa_ms", lambda: timer.median_ms(step))
"""
from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["init_world", "setup_logging", "sync", "barrier", "agree_max", "Timer", "attempt", "kernel_profile",
           "classify_kernel", "count_syncs", "zigzag_rows", "rel_err", "env_info", "write_json", "fmt", "log"]

log = logging.getLogger("cpscope.bench")


def setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere; one line per record, with the rank."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[r{rank} %(asctime)s] %(message)s", datefmt="%H:%M:%S")


def init_world(device: str, timeout_s: float = 600.0) -> tuple[torch.device, int, int, Optional[Any]]:
    """``(device, rank, world, group)``: under ``torchrun`` (``WORLD_SIZE`` > 1) a process group over the whole world
    (NCCL on CUDA, gloo on CPU), its cpscope CP group and CP stream; otherwise world 1 and ``group=None`` (CP1).

    ``timeout_s`` bounds every collective, so a rank that failed cannot leave the others waiting forever."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    group = None
    if world > 1:
        import cpscope

        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
        group = cpscope.new_cp_groups([world])[world]
        cpscope.cp_stream()
    setup_logging(rank)
    return dev, rank, world, group


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def agree_max(x: float, dev: torch.device) -> float:
    """The maximum of ``x`` over all ranks (``x`` itself without a process group)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=dev if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class Timer:
    """Median milliseconds of ``step()``: ``warmup`` calls, then up to ``iters`` timed calls.

    On CUDA every call is bracketed by CUDA events (device time of the call, host idle excluded only where the GPU
    never waits for the host) and synchronised; on CPU ``time.perf_counter``. The first warm-up call is timed on the
    host (synchronised): when ``iters`` calls would exceed ``budget_s``, fewer are timed (never fewer than
    ``min_iters``). Under a process group the ranks agree on that count and meet at a barrier before timing.
    """

    def __init__(self, dev: torch.device, *, iters: int = 10, warmup: int = 3, budget_s: float = 3.0,
                 min_iters: int = 5) -> None:
        self.dev, self.iters, self.warmup, self.budget_s, self.min_iters = dev, iters, warmup, budget_s, min_iters

    def median_ms(self, step: Callable[[], Any]) -> float:
        return self.stats(step)["median_ms"]

    def stats(self, step: Callable[[], Any]) -> dict:
        """``{"median_ms", "min_ms", "iters"}`` of ``step``."""
        dev = self.dev
        sync(dev)
        t0 = time.perf_counter()
        step()
        sync(dev)
        first = agree_max(time.perf_counter() - t0, dev)
        for _ in range(self.warmup - 1):
            step()
        n = self.iters
        if first * n > self.budget_s:
            n = max(self.min_iters, int(self.budget_s / max(first, 1e-9)))
        n = int(agree_max(float(min(n, self.iters)), dev))
        sync(dev)
        barrier()
        times = []
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(n):
                start.record()
                step()
                end.record()
                torch.cuda.synchronize(dev)
                times.append(start.elapsed_time(end))
        else:
            for _ in range(n):
                t = time.perf_counter()
                step()
                times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        return {"median_ms": times[len(times) // 2], "min_ms": times[0], "iters": n}


def attempt(record: dict, key: str, fn: Callable[[], Any], *, errors_key: str = "errors") -> Any:
    """``fn()``, or ``None`` after logging the exception and storing its text under ``record[errors_key][key]``.

    CUDA memory is released after a failure (an out-of-memory row must not starve the next one)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a benchmark row that fails is reported, the others still run
        msg = f"{type(e).__name__}: {e}"
        log.warning("%s failed: %s", key, msg.splitlines()[0][:300] if msg else msg)
        log.debug("%s", traceback.format_exc())
        record.setdefault(errors_key, {})[key] = msg[:1500]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return None


# -------------------------------------------------------------------------------------------------------- kernels


def classify_kernel(name: str) -> Optional[str]:
    """Which attention implementation a GPU kernel belongs to, from its name; ``None`` for non-attention kernels.

    cuDNN's fused attention kernels are named ``cudnn_generated_fort_native_sdpa_sm90_flash_…`` (hence ``cudnn``
    is tested before ``flash``); PyTorch's bundled flash-attention-2 kernels ``pytorch_flash::flash_fwd_kernel…`` /
    ``flash_bwd_…``; the memory-efficient (CUTLASS) kernels ``fmha_cutlass…``."""
    n = name.lower()
    if "cudnn" in n or "fort_native" in n or "sdpa_sm" in n:
        return "cudnn"
    if "flash" in n:
        return "flash"
    if "fmha" in n or "efficient_attention" in n or ("cutlass" in n and "attention" in n):
        return "mem_efficient"
    if "attention" in n or "attn" in n:
        return "other_attention"
    return None


def kernel_profile(fn: Callable[[], Any], dev: torch.device) -> dict:
    """Profile one call of ``fn`` (after it ran at least once): attention kernels by class.

    Returns ``{"classes": {class: {"us": total µs, "count": n}}, "main": the class with the most time (or None),
    "top": [(µs, class, name[:120]) of the 6 longest attention kernels], "all_gpu_us": µs of all GPU kernels}``.
    On CPU: ``{"main": "cpu", "classes": {}}`` (no kernels to classify).
    """
    if dev.type != "cuda":
        fn()
        return {"main": "cpu", "classes": {}, "top": [], "all_gpu_us": None}
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    classes: dict = {}
    top, total = [], 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        dur = float(e.get("dur", 0.0))
        total += dur
        c = classify_kernel(e.get("name", ""))
        if c is None:
            continue
        slot = classes.setdefault(c, {"us": 0.0, "count": 0})
        slot["us"] += dur
        slot["count"] += 1
        top.append((round(dur, 1), c, e.get("name", "")[:120]))
    top.sort(reverse=True)
    for slot in classes.values():
        slot["us"] = round(slot["us"], 1)
    main = max(classes, key=lambda c: classes[c]["us"]) if classes else None
    return {"main": main, "classes": classes, "top": top[:6], "all_gpu_us": round(total, 1)}


def count_syncs(fn: Callable[[], Any]) -> Optional[int]:
    """How many synchronising CUDA calls ``fn()`` makes (``torch.cuda.set_sync_debug_mode("warn")``); ``None``
    without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


# ------------------------------------------------------------------------------------------------------ numerics


def zigzag_rows(cu: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Full-tensor indices of rank ``rank``'s tokens: per sequence/document, chunk ``rank`` then ``2cp-1-rank``.

    Written here on purpose (not cpscope's ``zigzag_indices``): the parity check must not share the code it checks.
    """
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(a + chunk * c, a + (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64 (``inf`` for NaN/inf in ``a``)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------------- output


def env_info(dev: torch.device) -> dict:
    info: dict = {"torch": torch.__version__, "python": platform.python_version(), "device_type": dev.type,
                  "host": platform.node(),
                  "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
                  "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if dev.type == "cuda":
        info["device"] = torch.cuda.get_device_name(dev)
        try:
            info["cudnn"] = torch.backends.cudnn.version()
        except RuntimeError as e:  # shadowed by another cuDNN (see _te_baseline.te_available)
            info["cudnn"] = f"error: {e}"
    try:
        import subprocess

        here = os.path.dirname(os.path.abspath(__file__))
        info["commit"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git on the machine: fine
        info["commit"] = None
    return info


def write_json(obj: Any, dirname: str, name: str) -> str:
    """``obj`` as JSON at ``dirname/name``, with the command that made it (:func:`_results.dump`)."""
    from _results import dump

    return dump(obj, os.path.join(dirname, name))


def fmt(x: Any, nd: int = 3) -> str:
    """A table cell: ``-`` for None, rounded floats."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)
