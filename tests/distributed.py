"""A pool of long-lived ``torch.distributed`` ranks for tests.

Starting a process and initialising a process group costs seconds; running every multi-rank test in fresh processes
would blow the suite's time budget on 2 cores. So each (world size, backend) gets one pool of worker processes,
started on first use and kept for the whole pytest session. ``run_ranks(n, fn, *args)`` runs the module-level
function ``fn(*args)`` on every rank of the ``n``-rank pool and returns the per-rank results. A failure on any
rank is re-raised in pytest with that rank's traceback, and the pool is restarted (a failed collective can leave
the others waiting), so one bad test cannot poison the next.

Each task runs in a fresh ``contextvars.Context`` with the build-time group reset, and the cpscope group cache is
kept (groups are created collectively once per pool, as in a real job).
"""
from __future__ import annotations

import atexit
import contextvars
import itertools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["run_ranks", "RankError", "shutdown_pools"]

_TASK_TIMEOUT_S = float(os.environ.get("CPSCOPE_TEST_TIMEOUT", "300"))


class RankError(AssertionError):
    """A task failed on one or more ranks; the message carries each failing rank's traceback."""


def _worker(rank: int, world: int, backend: str, init_file: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    import cpscope.backward_check as backward_check
    import cpscope.scope as scope_mod

    while True:
        item = tasks.get()
        if item is None:
            break
        tid, fn, args, kwargs = item
        try:
            result = contextvars.Context().run(fn, *args, **kwargs)
            results.put((tid, rank, True, result))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((tid, rank, False, traceback.format_exc()))
        finally:
            scope_mod.set_build_time_cp_group(None)
            backward_check.set_backward_read_check(True)  # back to the default (on) after every task
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class _Pool:
    def __init__(self, world: int, backend: str) -> None:
        self.world, self.backend = world, backend
        ctx = mp.get_context("spawn")
        fd, self.init_file = tempfile.mkstemp(prefix="cpscope_pg_")
        os.close(fd)
        os.unlink(self.init_file)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, backend, self.init_file, self.tasks[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.ids = itertools.count()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        tid = next(self.ids)
        for q in self.tasks:
            q.put((tid, fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            try:  # poll, so that a rank that died (e.g. aborted inside a collective) fails the task at once
                got_tid, rank, ok, value = self.results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if not dead and time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(self.world)) - set(out) - set(errors))
                why = f"ranks {dead} died" if dead else f"no result within {timeout:.0f}s"
                raise RankError(
                    f"{fn.__name__}: ranks {missing} gave no result ({why})"
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                ) from None
            if got_tid != tid:  # a straggler from an earlier, failed task
                continue
            (out if ok else errors)[rank] = value
        if errors:
            raise RankError(
                f"{fn.__name__} failed on ranks {sorted(errors)}:"
                + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            )
        return [out[r] for r in range(self.world)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                try:
                    q.put(None)
                except Exception:
                    pass
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        try:
            os.unlink(self.init_file)
        except OSError:
            pass


_POOLS: dict[tuple[int, str], _Pool] = {}


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo", timeout: float = _TASK_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size``-rank pool; return results in rank order.

    ``fn`` must be a module-level function (it is pickled by reference). Assert inside ``fn``: each rank checks
    its own slice against a full-sequence reference it computes itself.
    """
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool(world_size, backend)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        # A failed task may leave ranks blocked in a collective: start afresh next time.
        _POOLS.pop(key, None)
        pool.close(graceful=False)
        raise


def shutdown_pools() -> None:
    for key in list(_POOLS):
        _POOLS.pop(key).close()


atexit.register(shutdown_pools)
