"""Cost of a runtime_cp scope: enter + current_cp_group() + exit, as a ratio to a bare ContextVar set/reset.

Usage:  python benchmarks/bench_scope.py [--repeats 15] [--number 200000] [--json PATH]

Spawns 2 gloo ranks (a real CP2 group needs them); rank 0 times, in the same process and interleaved:
  * floor  — a minimal context manager that does ``token = var.set(v)`` / ``var.reset(token)``, plus ``var.get()``
  * cp2    — ``with runtime_cp(group_of_2): current_cp_group()``
  * none   — ``with runtime_cp(None): current_cp_group()``
  * reuse  — the same ``runtime_cp`` object entered repeatedly (decorator-like reuse)
Reports ns per iteration (median of the repeats) and the ratio to the floor. Target: ≤ 2x.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import timeit
from contextvars import ContextVar

import torch.distributed as dist
import torch.multiprocessing as mp

_VAR: ContextVar = ContextVar("bare", default=None)


class _Bare:
    """The floor: the least a ContextVar-based scope can do."""

    __slots__ = ("_v", "_t")

    def __init__(self, v):
        self._v = v

    def __enter__(self):
        self._t = _VAR.set(self._v)
        return self._v

    def __exit__(self, *exc):
        _VAR.reset(self._t)


def _measure(args, group):
    import cpscope

    runtime_cp, current = cpscope.runtime_cp, cpscope.current_cp_group
    reuse = runtime_cp(group)

    def floor():
        with _Bare(group):
            _VAR.get()

    def cp2():
        with runtime_cp(group):
            current()

    def none():
        with runtime_cp(None):
            current()

    def reused():
        with reuse:
            current()

    cases = {"floor": floor, "cp2": cp2, "none": none, "reuse_cp2": reused}
    samples = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleave so drift hits every case alike
        for name, fn in cases.items():
            t = timeit.timeit(fn, number=args.number)
            samples[name].append(t / args.number * 1e9)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "ns_per_iter": {k: round(v, 1) for k, v in med.items()},
        "ratio_to_floor": {k: round(v / med["floor"], 3) for k, v in med.items() if k != "floor"},
        "repeats": args.repeats,
        "number": args.number,
    }


def _worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import cpscope

    group = cpscope.new_cp_groups([2])[2]
    if rank == 0:
        result = _measure(args, group)
        print(json.dumps(result, indent=1))
        print(f"{'case':<12}{'ns/iter':>10}{'x floor':>10}")
        for k, v in result["ns_per_iter"].items():
            print(f"{k:<12}{v:>10.1f}{result['ratio_to_floor'].get(k, 1.0):>10.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--number", type=int, default=200_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
