"""The hybrid planner with every divisor as a CP size vs powers of two only, and what the extra groups cost.

Usage::

    python benchmarks/bench_planner_sizes.py                                   # prints the tables
    python benchmarks/bench_planner_sizes.py --json benchmarks/results/planner_sizes.json
    python benchmarks/bench_planner_sizes.py --markdown benchmarks/results/planner_sizes.json   # tables of a run

Two parts, CPU only, one process:

planner
    For each world (8 … 4096 ranks, powers of two and not), mix (``long_tail``, ``sft``: the mixes of
    docs/hybrid_planner.md, 2 sequences per rank, capacity 16384 tokens, ``CostModel()``) and seed: the makespan of
    ``plan_hybrid`` over every divisor (the default) and over the powers of two only (``cp_sizes="pow2"``), both
    against the lower bound over every divisor (which bounds both), the CP sizes each used, which of the
    planner's candidates won where sizes straddle (``placement``: all sizes; ``chain``: the smallest-multiple
    chain; ``pow2``), and the planning time (median of ``--repeats`` calls after a warm-up: wall clock and
    process CPU time).
registry
    ``cpscope.new_cp_groups(sizes)`` for every divisor vs the powers of two, on the simulated dist layer
    (:class:`tests._sim.SimulatedLayer`: one rank of an N-rank job, calls counted, nothing sent) with the
    ``local`` (gloo / unbound NCCL) and ``split`` (NCCL bound to a device) methods: the group calls the rank makes,
    how many of them all ranks make in lockstep, the groups it ends up in, the blocks the job creates in all, and
    the registry's Python time per rank (median of ``--repeats``; the real creation adds the backend's own cost per
    call, see docs/groups.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's cpscope

WORLDS = (8, 12, 24, 64, 96, 384, 512, 3072, 4096)
CAPACITY = 16384


def _mixes() -> dict[str, Callable[[int, int], np.ndarray]]:
    from cpscope.hybrid import long_tail_lengths, sft_like_lengths

    return {"long_tail": lambda n, seed: long_tail_lengths(2 * n, seed=seed),
            "sft": lambda n, seed: sft_like_lengths(2 * n, seed=seed)}


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float, float]:
    out = fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return out, statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def _winner(plan: Any, lengths: np.ndarray, n: int) -> str:
    """Which candidate of plan_hybrid gave ``plan`` (where every divisor is allowed and the sizes straddle)."""
    from cpscope.hybrid import plan_hybrid
    from cpscope.hybrid._planner import _nested_subsets
    from cpscope.hybrid._problem import divisors, is_nested

    sizes = divisors(n)
    if is_nested(sizes):
        return "nested"
    for name, subset in zip(("chain", "pow2"), _nested_subsets(sizes)):
        if plan_hybrid(lengths, n, CAPACITY, cp_sizes=subset).microbatches == plan.microbatches:
            return name
    return "placement"


def planner_rows(worlds: tuple[int, ...], seeds: tuple[int, ...], repeats: int) -> list[dict]:
    from cpscope.hybrid import plan_hybrid

    rows = []
    for mix, make in _mixes().items():
        for n in worlds:
            for seed in seeds:
                lengths = make(n, seed)
                div, div_ms, div_cpu = _timed(lambda: plan_hybrid(lengths, n, CAPACITY), repeats)
                row = {"mix": mix, "ranks": n, "seqs": int(lengths.size), "seed": seed,
                       "long_docs": int((lengths >= 65536).sum()),
                       "divisors": {"makespan": div.makespan, "lower_bound": div.lower_bound,
                                    "sizes_used": list(div.sizes_used), "candidates": len(div.cp_candidates),
                                    "plan_ms": div_ms, "cpu_ms": div_cpu, "won": _winner(div, lengths, n)}}
                try:
                    pow2, p_ms, p_cpu = _timed(lambda: plan_hybrid(lengths, n, CAPACITY, cp_sizes="pow2"), repeats)
                    row["pow2"] = {"makespan": pow2.makespan, "lower_bound": pow2.lower_bound,
                                   "sizes_used": list(pow2.sizes_used), "plan_ms": p_ms, "cpu_ms": p_cpu}
                except ValueError as e:  # a document too long for the largest power of two dividing n
                    row["pow2"] = {"error": str(e).split(";")[0]}
                rows.append(row)
                _print_planner_row(row)
    return rows


def registry_rows(worlds: tuple[int, ...], repeats: int) -> list[dict]:
    import cpscope
    from cpscope.groups import _registry as G
    from tests._sim import SimulatedLayer
    from cpscope.hybrid._problem import divisors

    rows = []
    real = G._LAYER
    try:
        for n in worlds:
            rank = n // 2 + 1 if n > 2 else 0
            for name, sizes in (("divisors", divisors(n)), ("pow2", [d for d in divisors(n) if d & (d - 1) == 0])):
                for method in ("local", "split"):
                    times, cpu, rep = [], [], None
                    for _ in range(repeats + 1):
                        G._LAYER = SimulatedLayer(n, rank, split=method == "split", bound=method == "split")
                        G.clear_cp_group_cache()
                        t0, c0 = time.perf_counter(), time.process_time()
                        cpscope.new_cp_groups(sizes, method=method)
                        times.append(time.perf_counter() - t0)
                        cpu.append(time.process_time() - c0)
                        rep = G._LAST_REPORT
                    row = {"ranks": n, "sizes": name, "n_sizes": len(sizes), "method": method, "calls": rep.calls,
                           "lockstep": rep.lockstep, "groups_per_rank": rep.created,
                           "blocks_in_job": sum(n // s for s in sizes if s > 1),
                           "python_ms": statistics.median(times[1:]) * 1e3,
                           "python_cpu_ms": statistics.median(cpu[1:]) * 1e3}
                    rows.append(row)
                    print(f"registry {n:>5} {name:>8} {method:>5}: {row['n_sizes']:>2} sizes, calls {row['calls']:>3} "
                          f"(lockstep {row['lockstep']:>3}), groups/rank {row['groups_per_rank']:>3}, blocks in job "
                          f"{row['blocks_in_job']:>6}, {row['python_ms']:.2f} ms ({row['python_cpu_ms']:.2f} cpu)",
                          flush=True)
    finally:
        G._LAYER = real
        G.clear_cp_group_cache()
    return rows


def _print_planner_row(r: dict) -> None:
    d, p = r["divisors"], r["pow2"]
    pow2 = (f"pow2 {p['makespan']:.3f} ({p['makespan'] / d['lower_bound']:.3f}× LB)" if "makespan" in p
            else "pow2: does not fit")
    print(f"{r['mix']:>9} {r['ranks']:>5} s{r['seed']}: divisors {d['makespan']:.3f} ({d['makespan'] / d['lower_bound']:.3f}"
          f"× LB, {d['cpu_ms']:.1f} ms cpu, {d['won']}) {pow2}  used {d['sizes_used']}", flush=True)


def markdown(data: dict) -> str:
    out = ["| mix | ranks | seed | divisors | pow2 | LB (divisors) | divisors/LB | pow2/LB | pow2/divisors | "
           "won | sizes used (divisors) | plan ms (cpu) divisors | pow2 |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    for r in data["planner"]:
        d, p = r["divisors"], r["pow2"]
        lb = d["lower_bound"]
        if "makespan" in p:
            pc = (f"{p['makespan']:.3f} | {lb:.3f} | {d['makespan'] / lb:.3f} | {p['makespan'] / lb:.3f} | "
                  f"{p['makespan'] / d['makespan']:.2f}")
            p_ms = f"{p['plan_ms']:.1f} ({p['cpu_ms']:.1f})"
        else:
            pc, p_ms = f"— | {lb:.3f} | {d['makespan'] / lb:.3f} | — | —", "does not fit"
        out.append(f"| {r['mix']} | {r['ranks']} | {r['seed']} | {d['makespan']:.3f} | {pc} | {d['won']} | "
                   f"{','.join(map(str, d['sizes_used']))} | {d['plan_ms']:.1f} ({d['cpu_ms']:.1f}) | {p_ms} |")
    out += ["", "| ranks | sizes | method | CP sizes | calls per rank | lockstep | groups per rank | blocks in job | "
            "Python ms per rank (cpu) |", "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["registry"]:
        out.append(f"| {r['ranks']} | {r['sizes']} | {r['method']} | {r['n_sizes']} | {r['calls']} | {r['lockstep']} | "
                   f"{r['groups_per_rank']} | {r['blocks_in_job']} | {r['python_ms']:.2f} "
                   f"({r.get('python_cpu_ms', float('nan')):.2f}) |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", help="write the results (with the command) to this file")
    ap.add_argument("--markdown", help="print the tables of a results file and exit")
    args = ap.parse_args()
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    data = {"command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "host": {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                     "load_average_at_start": load},
            "capacity": CAPACITY, "cost": "CostModel()", "sequences_per_rank": 2,
            "planner": planner_rows(tuple(args.worlds), tuple(args.seeds), args.repeats),
            "registry": registry_rows(tuple(args.worlds), args.repeats)}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    print(markdown(data))


if __name__ == "__main__":
    main()
