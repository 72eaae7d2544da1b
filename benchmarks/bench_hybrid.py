"""Hybrid-CP benchmark.

Modes (one per run):

* ``--simulate`` (default) — part (a): the planner alone under the cost model, no process group. For 8, 64, 512
  and 4096 ranks (``--seqs-per-rank`` long-tail sequences per rank: 8192 at 4096 ranks), it plans with
  ``plan_hybrid``, ``plan_static`` and ``plan_greedy`` and reports the planning time of ``plan_hybrid`` (median
  of ``--repeats`` runs after a warm-up: wall clock and process CPU time, with the load average, since the host
  may be shared) and the planned makespans against the lower bound. Targets: planning 8192 sequences for 4096
  ranks < 50 ms; hybrid within 5 % of the lower bound; static / hybrid ≥ 1.3 at 64 ranks.

Usage::

    python benchmarks/bench_hybrid.py                       # = --simulate; JSON to docs/hybrid_planner_sim.json
    python benchmarks/bench_hybrid.py --simulate --ranks 64 512 --seeds 0 --out /tmp/sim.json

* ``--gpu`` — part (b), real GPT training steps on 2 GPUs (NCCL), hybrid vs static CP2 vs CP1-only DP
  (``benchmarks/_hybrid_gpu.py``)::

    torchrun --nproc_per_node=2 benchmarks/bench_hybrid.py --gpu --out docs/hybrid_gpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hybrid_gpu import add_gpu_arguments, run_gpu  # noqa: E402  (imports torch.distributed only)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpscope.hybrid import CostModel, long_tail_lengths, plan_greedy, plan_hybrid, plan_static  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                           "hybrid_planner_sim.json")


def _time_plan(lengths, n_ranks: int, capacity: int, cost: CostModel, repeats: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``plan_hybrid`` (after one warm-up call)."""
    plan_hybrid(lengths, n_ranks, capacity, cost)
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        plan_hybrid(lengths, n_ranks, capacity, cost)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def run_simulation(args: argparse.Namespace) -> dict[str, Any]:
    """Part (a): plan long-tail global batches under the cost model and compare with the baselines."""
    cost = CostModel(attn=args.attn, linear=args.linear, comm=args.comm, latency=args.latency)
    rows = []
    for n_ranks in args.ranks:
        for seed in args.seeds:
            lengths = long_tail_lengths(args.seqs_per_rank * n_ranks, seed=seed)
            hybrid = plan_hybrid(lengths, n_ranks, args.capacity, cost)
            static = plan_static(lengths, n_ranks, args.capacity, cost)
            greedy = plan_greedy(lengths, n_ranks, args.capacity, cost)
            wall_ms, cpu_ms = _time_plan(lengths, n_ranks, args.capacity, cost, args.repeats)
            hist: dict[int, int] = {}
            for c in hybrid.cp_sizes:
                hist[c] = hist.get(c, 0) + 1
            rows.append({
                "ranks": n_ranks, "seqs": int(lengths.size), "seed": seed, "tokens": int(lengths.sum()),
                "max_len": int(lengths.max()), "plan_ms": wall_ms, "plan_cpu_ms": cpu_ms,
                "hybrid": hybrid.makespan, "static": static.makespan, "greedy": greedy.makespan,
                "lower_bound": hybrid.lower_bound, "static_cp": static.cp_sizes[0],
                "hybrid_vs_lb": hybrid.makespan / hybrid.lower_bound,
                "static_vs_hybrid": static.makespan / hybrid.makespan,
                "greedy_vs_hybrid": greedy.makespan / hybrid.makespan,
                "hybrid_cp_histogram": {str(k): v for k, v in sorted(hist.items())},
                "hybrid_microbatches": len(hybrid.microbatches), "hybrid_padding_tokens": hybrid.padding_tokens,
            })
            print(_format_row(rows[-1]), flush=True)
    checks = _targets(rows)
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return {
        "mode": "simulate", "capacity": args.capacity, "seqs_per_rank": args.seqs_per_rank,
        "cost_model": {"attn": cost.attn, "linear": cost.linear, "comm": cost.comm, "latency": cost.latency},
        "distribution": "long_tail_lengths(n, seed) defaults: lognormal median 2048, sigma 1.5, [128, 131072], "
                        "multiples of 128",
        "timing": f"median of {args.repeats} runs after a warm-up; load average at start {os.getloadavg()}",
        "rows": rows, "targets": checks,
    }


HEADER = (f"{'ranks':>5} {'seqs':>5} {'seed':>4} {'plan ms':>8} {'cpu ms':>7} {'hybrid':>8} {'static':>8} "
          f"{'greedy':>8} {'lower b.':>8} {'hyb/LB':>7} {'stat/hyb':>8} {'greedy/hyb':>10}")


def _format_row(r: dict[str, Any]) -> str:
    return (f"{r['ranks']:>5} {r['seqs']:>5} {r['seed']:>4} {r['plan_ms']:>8.1f} {r['plan_cpu_ms']:>7.1f} "
            f"{r['hybrid']:>8.3f} {r['static']:>8.3f} {r['greedy']:>8.3f} {r['lower_bound']:>8.3f} "
            f"{r['hybrid_vs_lb']:>7.3f} {r['static_vs_hybrid']:>8.2f} {r['greedy_vs_hybrid']:>10.2f}")


def _targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    checks = {"hybrid makespan within 5% of the lower bound (every row)": all(r["hybrid_vs_lb"] <= 1.05 for r in rows)}
    at_64 = [r for r in rows if r["ranks"] == 64]
    if at_64:
        checks["static / hybrid >= 1.3 at 64 ranks (every seed)"] = all(r["static_vs_hybrid"] >= 1.3 for r in at_64)
    big = [r for r in rows if r["ranks"] == 4096 and r["seqs"] == 8192]
    if big:
        checks["planning 8192 sequences for 4096 ranks < 50 ms (median wall)"] = all(r["plan_ms"] < 50 for r in big)
    return checks


# Each mode: (flag help, runner). A GPU mode goes here as "gpu": (help, run_gpu) with its own options.
MODES: dict[str, tuple[str, Callable[[argparse.Namespace], dict[str, Any]]]] = {
    "simulate": ("planner simulation under the cost model (default)", run_simulation),
    "gpu": ("part (b): GPT steps on 2 GPUs, hybrid vs static CP2 vs CP1 DP", run_gpu),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    for name, (text, _) in MODES.items():
        mode.add_argument(f"--{name}", dest="mode", action="store_const", const=name, help=text)
    ap.set_defaults(mode="simulate")
    sim = ap.add_argument_group("simulate")
    sim.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    sim.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sim.add_argument("--seqs-per-rank", type=int, default=2)
    sim.add_argument("--capacity", type=int, default=16384, help="tokens per rank per microbatch")
    sim.add_argument("--repeats", type=int, default=9, help="timed runs of plan_hybrid per row")
    defaults = CostModel()
    for name in ("attn", "linear", "comm", "latency"):
        sim.add_argument(f"--{name}", type=float, default=getattr(defaults, name), help="cost-model coefficient")
    add_gpu_arguments(ap)
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON results path")
    args = ap.parse_args(argv)
    if args.mode == "simulate":
        print(HEADER)
    result = MODES[args.mode][1](args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
