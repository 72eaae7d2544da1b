"""What the registry's groups for tensor parallelism beside runtime CP cost: groups per rank, calls, seconds.

Usage::

    python benchmarks/bench_tp_cp_groups.py                    # 8 gloo ranks (spawned, TP2) + simulated 64 … 4096
    python benchmarks/bench_tp_cp_groups.py --repeats 5 --json benchmarks/results/tp_cp_groups.json
    torchrun --nproc_per_node=8 benchmarks/bench_tp_cp_groups.py --backend nccl --tp 2

real
    ``world`` ranks; each repeat times ``new_tp_cp_groups(every divisor of world / tp, tp_size=tp)`` after
    ``clear_cp_group_cache()`` and a barrier, as the slowest rank sees it; every group is checked with an
    ``all_reduce``. Per rank: the groups created (CP, ``[tp, cp]``, ``[tp, dp, cp]``), the group calls.
simulated
    The same code on :class:`tests._sim.SimulatedLayer` (one rank of an N-rank job, nothing sent):
    N = 64 … 4096 at TP 8, every divisor of N / 8 as a CP size; ``local`` (gloo) and ``split`` (NCCL bound).
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

log = logging.getLogger("bench_tp_cp_groups")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _real(tp: int, repeats: int) -> dict:
    from cpscope.groups import clear_cp_group_cache, new_tp_cp_groups
    from cpscope.groups import _registry as G

    world = dist.get_world_size()
    sizes = _divisors(world // tp)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    seconds, created, calls = [], None, None
    for _ in range(repeats):
        clear_cp_group_cache()
        dist.barrier()
        t0 = time.perf_counter()
        got = new_tp_cp_groups(sizes, tp_size=tp)
        t = torch.tensor([time.perf_counter() - t0], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds.append(float(t))
        rep = G._LAST_REPORT
        created, calls = rep.created, rep.calls
        for g in got.values():  # each group communicates
            for group in {id(x): x for x in g if x is not None}.values():
                x = torch.ones(1, device=dev)
                dist.all_reduce(x, group=group)
                assert int(x) == group.size()
    counts = [None] * world
    dist.all_gather_object(counts, (created, calls))
    return {"world": world, "tp": tp, "sizes": sizes, "repeats": repeats,
            "backend": str(dist.get_backend()), "seconds_median": statistics.median(seconds), "seconds": seconds,
            "groups_created_per_rank": sorted({c for c, _ in counts}), "calls_per_rank": sorted({c for _, c in counts})}


def simulate(worlds: list[int], tp: int) -> list[dict]:
    from cpscope.groups import _registry as G
    from tests._sim import SimulatedLayer
    from cpscope.groups._tp_cp import new_tp_cp_groups, plan_tp_cp_blocks

    rows, real = [], G._LAYER
    try:
        for n in worlds:
            sizes = _divisors(n // tp)
            plan = plan_tp_cp_blocks(sizes, tp, None, world=n)
            blocks = len({b for s in sizes for b in plan.cp[s] + plan.tp_cp[s] + (plan.domain,) if len(b) > 1})
            for method in ("local", "split"):
                G._LAYER = SimulatedLayer(n, n // 2 + 1, split=method == "split", bound=method == "split")
                G.clear_cp_group_cache()
                t0 = time.perf_counter()
                new_tp_cp_groups(sizes, tp_size=tp, method=method)
                dt = time.perf_counter() - t0
                rep = G._LAST_REPORT
                rows.append({"ranks": n, "tp": tp, "cp_sizes": len(sizes), "method": method,
                             "groups_in_job": blocks, "created_per_rank": rep.created, "calls_per_rank": rep.calls,
                             "lockstep": rep.lockstep, "gathers": rep.gathers, "python_ms": round(dt * 1e3, 3)})
    finally:
        G._LAYER = real
        G.clear_cp_group_cache()
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, shared: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        out = _real(args.tp, args.repeats)
        if rank == 0:
            shared["real"] = out
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=8, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--simulate", default="64,512,4096", help="simulated world sizes ('' to skip)")
    p.add_argument("--sim-tp", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("cpscope").setLevel(logging.WARNING)
    result: dict = {}
    if "RANK" in os.environ:  # torchrun
        rank = int(os.environ["RANK"])
        if args.backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
        result["real"] = _real(args.tp, args.repeats)
        dist.destroy_process_group()
        if rank != 0:
            return
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        ctx = torch.multiprocessing.get_context("spawn")
        shared = ctx.Manager().dict()
        torch.multiprocessing.start_processes(_worker, args=(args.world, port, args, shared), nprocs=args.world,
                                              start_method="spawn", join=True)
        result = dict(shared)
    if args.simulate:
        result["simulated"] = simulate([int(n) for n in args.simulate.split(",")], args.sim_tp)
    r = result["real"]
    log.info("real: %d ranks, TP%d, CP sizes %s: %s groups created per rank, %s calls, %.1f ms (median of %d)",
             r["world"], r["tp"], r["sizes"], r["groups_created_per_rank"], r["calls_per_rank"],
             r["seconds_median"] * 1e3, r["repeats"])
    for row in result.get("simulated", []):
        log.info("simulated %(ranks)5d ranks TP%(tp)d, %(cp_sizes)2d CP sizes, %(method)5s: %(groups_in_job)6d groups "
                 "in the job, %(created_per_rank)2d created per rank, %(calls_per_rank)2d calls, %(lockstep)2d lockstep, "
                 "%(python_ms).1f ms", row)
    if args.json:
        dump(result, args.json)
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()
