"""What creating the CP group registry costs: every rank creating every block vs each rank its own blocks.

Usage::

    python benchmarks/bench_groups.py                          # 8 gloo ranks (spawned) + simulated 8 … 4096 ranks
    python benchmarks/bench_groups.py --repeats 11 --json benchmarks/results/group_creation.json
    torchrun --nproc_per_node=8 benchmarks/bench_groups.py --backend nccl   # NCCL bound to each GPU

Two parts, one run:

real
    ``world`` ranks; each repeat times ``new_cp_groups([1, 2, 4, …, world], method=m)`` for every method ``m``,
    interleaved, after ``clear_cp_group_cache()`` and a barrier, as the slowest rank sees it (groups are kept:
    destroying them would make the next locally named ones pad past the destroyed names). ``"global"`` is the
    previous registry's behaviour (every rank calls ``dist.new_group`` for every block of every size);
    ``"local"`` (gloo, NCCL not bound to a device) and ``"split"`` (NCCL bound: ``init_process_group(device_id=…)``)
    are what ``method="auto"`` picks. Each created group is checked with an ``all_reduce``. Reported per rank: the
    group calls it made, how many of them every rank had to make (*lockstep*: each a step of the whole job; under
    NCCL bound to a device each is a world-wide ``ncclCommSplit``), the process groups torch registered on it.
simulated
    The same registry code with its dist layer swapped for :class:`tests._sim.SimulatedLayer` (one rank
    of an N-rank job; calls are counted, nothing is sent), for N = 8 … 4096.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's cpscope
from _results import dump  # noqa: E402
log = logging.getLogger("bench_groups")


def _sizes(n: int) -> list[int]:
    return [2 ** i for i in range(n.bit_length()) if 2 ** i <= n and n % 2 ** i == 0]


def _methods(backend: str) -> list[str]:
    from cpscope.groups._registry import _LAYER

    after = "split" if _LAYER.can_split() else "local"
    return ["before", "global", after, "exchange only"]


def _before(sizes: list[int]) -> tuple[dict, tuple]:
    """The previous registry's way: every rank, every block of every size, in order."""
    world, me = dist.get_world_size(), dist.get_rank()
    out, calls, created = {}, 0, 0
    for s in sizes:
        if s == 1:
            out[1] = None
            continue
        for start in range(0, world, s):
            block = list(range(start, start + s))
            g = dist.new_group(block)
            calls += 1
            if me in block:
                out[s], created = g, created + 1
    return out, (calls, calls, created, 0)


def _one(method: str, sizes: list[int], device: torch.device) -> dict:
    import cpscope
    from cpscope.groups import _registry as G

    cpscope.clear_cp_group_cache()
    before = G._LAYER.local_name_count()
    dist.barrier()
    t0 = time.perf_counter()
    if method == "before":
        got, counts = _before(sizes)
    elif method == "exchange only":  # the registry's record exchange alone: one all_gather of 5 int64
        G._LAYER.all_gather_ints([0] * 5, None)
        got, counts = {}, (0, 0, 0, 0)
    else:
        got = cpscope.new_cp_groups(sizes, method=method)
        rep = G._LAST_REPORT
        counts = (rep.calls, rep.lockstep, rep.created, rep.placeholders)
    dt = time.perf_counter() - t0
    registered = G._LAYER.local_name_count() - before
    for s, g in got.items():  # every group works and has the right members
        if g is not None:
            t = torch.ones(1, device=device)
            dist.all_reduce(t, group=g)
            assert int(t.item()) == s, (method, s, t.item())
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (dt, *counts, registered))

    return {
        "seconds_max": max(o[0] for o in out), "seconds_rank0": out[0][0],
        "calls": sorted({o[1] for o in out}), "lockstep": sorted({o[2] for o in out}),
        "created": sorted({o[3] for o in out}), "placeholders": sorted({o[4] for o in out}),
        "registered": sorted({o[5] for o in out}),
    }


def real_run(repeats: int, backend: str, device: torch.device) -> dict:
    world = dist.get_world_size()
    sizes = _sizes(world)
    methods = _methods(backend)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for i in range(repeats):
        for m in (methods if i % 2 == 0 else methods[::-1]):  # interleaved, order alternating
            runs[m].append(_one(m, sizes, device))
    res = {}
    for m, rs in runs.items():
        res[m] = {k: rs[-1][k] for k in ("calls", "lockstep", "created", "placeholders", "registered")}
        res[m]["seconds_median"] = statistics.median(r["seconds_max"] for r in rs)
        res[m]["seconds_all"] = [round(r["seconds_max"], 5) for r in rs]
    base = res["before"]["seconds_median"]
    for m in methods:
        res[m]["time_vs_before"] = res[m]["seconds_median"] / base
    return {"world": world, "backend": backend, "sizes": sizes, "repeats": repeats, "methods": res}


def simulate(worlds: list[int], rank_of=lambda n: n // 2 + 1) -> list[dict]:
    import cpscope
    from cpscope.groups import _registry as G
    from tests._sim import SimulatedLayer

    rows = []
    real = G._LAYER
    try:
        for n in worlds:
            for method in ("global", "local", "split"):
                layer = SimulatedLayer(n, rank_of(n), split=method == "split", bound=method == "split")
                G._LAYER = layer
                G.clear_cp_group_cache()
                t0 = time.perf_counter()
                cpscope.new_cp_groups(_sizes(n), method=method)
                dt = time.perf_counter() - t0
                rep = G._LAST_REPORT
                rows.append({"ranks": n, "method": method, "calls": rep.calls, "lockstep": rep.lockstep,
                             "created": rep.created, "gathers": rep.gathers, "python_ms": round(dt * 1e3, 3)})
    finally:
        G._LAYER = real
        G.clear_cp_group_cache()
    return rows


class _ReplicatedGather:
    """The real torch layer, except that the record exchange returns this rank's record for every rank (the
    fake backend sends nothing)."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def all_gather(self, obj, group):
        return [obj] * (dist.get_world_size(group) if group is not None else dist.get_world_size())

    def all_gather_ints(self, values, group):
        return [list(values)] * (dist.get_world_size(group) if group is not None else dist.get_world_size())


def fake_torch(n: int, repeats: int) -> list[dict]:
    """torch's own Python path at ``n`` ranks in this one process: the ``fake`` backend (no communication) as
    rank ``n // 2 + 1``; ``before`` (every block) vs the registry's ``local`` method. Bookkeeping only."""
    import cpscope
    from cpscope.groups import _registry as G
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=n // 2 + 1, world_size=n)
    real = G._LAYER
    G._LAYER = _ReplicatedGather(real)
    rows = []
    try:
        times: dict[str, list[float]] = {"before": [], "local": []}
        for i in range(repeats):
            for m in (("before", "local") if i % 2 == 0 else ("local", "before")):
                cpscope.clear_cp_group_cache()
                t0 = time.perf_counter()
                _before(_sizes(n)) if m == "before" else cpscope.new_cp_groups(_sizes(n), method="local")
                times[m].append(time.perf_counter() - t0)
        for m, ts in times.items():
            rows.append({"ranks": n, "method": m, "ms_median": round(statistics.median(ts) * 1e3, 2),
                         "calls": n - 1 if m == "before" else len(_sizes(n)) - 1})
    finally:
        G._LAYER = real
        G.clear_cp_group_cache()
        dist.destroy_process_group()
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _main_rank(rank, world, args, out)


def _main_rank(rank: int, world: int, args: argparse.Namespace, out) -> None:
    kw = {}
    device = torch.device("cpu")
    if args.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        if not args.unbound:
            kw["device_id"] = device
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=timedelta(seconds=300), **kw)
    try:
        res = real_run(args.repeats, args.backend, device)
        if rank == 0:
            out["real"] = res
    finally:
        dist.destroy_process_group()


def _table_real(res: dict) -> str:
    lines = [f"real: {res['world']} {res['backend']} ranks, sizes {res['sizes']}, median of {res['repeats']}",
             "| method | creation (slowest rank) | vs before | group calls / rank | lockstep calls "
             "| groups registered / rank |",
             "| --- | --- | --- | --- | --- | --- |"]
    for m, r in res["methods"].items():
        lines.append(f"| {m} | {r['seconds_median'] * 1e3:.1f} ms | {r['time_vs_before']:.2f}x | {r['calls']} | "
                     f"{r['lockstep']} | {r['registered']} |")
    return "\n".join(lines)


def _table_sim(rows: list[dict]) -> str:
    lines = ["simulated (one rank of N; sizes 1, 2, 4, …, N)",
             "| ranks | method | group calls / rank | lockstep calls | groups created / rank | gathers | python |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['method']} | {r['calls']} | {r['lockstep']} | {r['created']} | "
                     f"{r['gathers']} | {r['python_ms']:.1f} ms |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=8, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--unbound", action="store_true", help="NCCL without device_id (lazy; 'local' instead of split)")
    p.add_argument("--simulate", default="8,64,512,4096", help="simulated world sizes ('' to skip)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("cpscope").setLevel(logging.WARNING)  # one line per creation otherwise
    result: dict = {}
    if "RANK" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _main_rank(rank, world, args, result)
        if rank != 0:
            return
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        ctx = torch.multiprocessing.get_context("spawn")
        manager = ctx.Manager()
        shared = manager.dict()
        torch.multiprocessing.start_processes(_worker, args=(args.world, port, args, shared), nprocs=args.world,
                                              start_method="spawn", join=True)
        result = dict(shared)
    if args.simulate:
        worlds = [int(n) for n in args.simulate.split(",")]
        result["simulated"] = simulate(worlds)
        result["fake_torch"] = fake_torch(max(worlds), args.repeats)
    fake = "\n".join(f"torch bookkeeping, fake backend, {r['ranks']} ranks, {r['method']}: {r['calls']} calls, "
                     f"{r['ms_median']} ms" for r in result.get("fake_torch", []))
    log.info("%s\n\n%s\n\n%s", _table_real(result["real"]), _table_sim(result.get("simulated", [])), fake)
    if args.json:
        dump(result, args.json)
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()
