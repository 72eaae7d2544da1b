"""Megatron's hybrid-CP scheduler vs cpscope's planner, in simulation (pure CPU, no process group).

Both answer megatron-core 0.19.2's call ``get_groups_and_subsamples(sample_id_seqlens, config)``: Megatron's
``BalancedCPScheduler`` (``pipeline_parallel/hybrid_cp_schedule.py``, run as installed) and cpscope's
:class:`~cpscope.integrations.megatron.PlannerScheduler` (:func:`cpscope.hybrid.plan_hybrid` behind the same
interface). Each schedule is then executed by one simulator with the semantics of Megatron's hybrid-CP loop
(``hybrid_context_parallel_forward_backward``): group after group with a DP×CP barrier between groups; inside a group
every rank runs its samples in order, one sample per forward/backward step, and a sample starts when all the ranks
that list it (its CP group) are free. A sample of length ``L`` at CP size ``c`` costs ``CostModel.cost(L, c)`` (alone
in its step: attention ``∝ L²/c``, per-token work, ring traffic and per-step latency). For cpscope the native
makespan (its own loop: packed microbatches, no barriers) is reported as well.

Setup (as ``benchmarks/bench_hybrid.py``): ``long_tail_lengths(2·ranks, seed)``, ``max_seq_len_per_rank`` = 16384,
``CostModel()`` defaults, seeds 0–2; ``--attn-only`` repeats the comparison with a cost of ``L²/c`` alone — exactly
Megatron's own workload estimate — so the comparison does not depend on cpscope's cost terms.

Usage::

    python benchmarks/bench_megatron_scheduler.py --attn-only              # 8..4096 ranks, JSON to docs/
    python benchmarks/bench_megatron_scheduler.py --ranks 8 64 --seeds 0 --out /tmp/m.json
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpscope.hybrid import CostModel, long_tail_lengths  # noqa: E402
from cpscope.integrations.megatron import PlannerScheduler  # noqa: E402
from _results import RESULTS_DIR, dump  # noqa: E402

DEFAULT_OUT = os.path.join(RESULTS_DIR, "megatron_scheduler_simulation.json")

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(it: Any, **_: Any) -> Any:  # type: ignore[no-redef]
        return it


class _Group:
    """Stands for the DP×CP process group: the schedulers only ask its size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def simulate(id_groups: list[list[list[int]]], lengths: dict[int, int], cost: CostModel, n_ranks: int) -> float:
    """Makespan of a ``sample_id_groups`` schedule under Megatron's hybrid-CP loop semantics (see the docstring).

    Raises:
        RuntimeError: the schedule deadlocks inside a group (a sample waits for a rank that waits for another).
    """
    t = np.zeros(n_ranks)
    for g, per_rank in enumerate(id_groups):
        t[:] = t.max()  # barrier over the DP×CP group between groups
        holders: dict[int, list[int]] = {}
        for r, ids in enumerate(per_rank):
            for s in ids:
                holders.setdefault(s, []).append(r)
        head = [0] * n_ranks
        at_head: dict[int, int] = {}
        ready = []
        for r, ids in enumerate(per_rank):
            if ids:
                s = ids[0]
                at_head[s] = at_head.get(s, 0) + 1
                if at_head[s] == len(holders[s]):
                    ready.append(s)
        done = 0
        total = len(holders)
        while ready:
            s = ready.pop()
            members = holders[s]
            c = len(members)
            start = max(t[r] for r in members)
            end = start + float(cost.cost(lengths[s], c))
            done += 1
            for r in members:
                t[r] = end
                head[r] += 1
                ids = per_rank[r]
                if head[r] < len(ids):
                    nxt = ids[head[r]]
                    at_head[nxt] = at_head.get(nxt, 0) + 1
                    if at_head[nxt] == len(holders[nxt]):
                        ready.append(nxt)
        if done != total:
            raise RuntimeError(f"group {g}: the schedule deadlocks ({total - done} of {total} samples never start)")
    return float(t.max())


def _time(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    out = fn()  # warm-up (and the result)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return out, 1e3 * statistics.median(times) if times else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from cpscope.integrations.megatron import megatron_core_version

    models = {"default": CostModel()}
    if args.attn_only:
        models["attn_only"] = CostModel(attn=CostModel().attn, linear=0.0, comm=0.0, latency=0.0)
    rows = []
    for n in tqdm(args.ranks, desc="ranks"):
        for seed in args.seeds:
            lengths = long_tail_lengths(args.seqs_per_rank * n, seed=seed)
            pairs = [(i, int(x)) for i, x in enumerate(lengths)]
            by_id = dict(pairs)
            meg = BalancedCPScheduler(args.capacity, _Group(n))  # timed once: 10-40 s per call at 4096 ranks
            t0 = time.perf_counter()
            _, meg_ids = meg.get_groups_and_subsamples(pairs, None)
            meg_ms = 1e3 * (time.perf_counter() - t0)
            for name, cost in models.items():
                ours = PlannerScheduler(args.capacity, n, cost=cost)
                (_, cp_ids), cp_ms = _time(lambda: ours.get_groups_and_subsamples(pairs, None), args.repeats)
                plan = ours.last_plan
                row = {
                    "ranks": n, "seqs": len(pairs), "seed": seed, "cost": name,
                    "megatron_groups": len(meg_ids), "megatron_ms": meg_ms, "cpscope_ms": cp_ms,
                    "megatron": simulate(meg_ids, by_id, cost, n),
                    "cpscope_in_megatron_loop": simulate(cp_ids, by_id, cost, n),
                    "cpscope_native": plan.makespan, "lower_bound": plan.lower_bound,
                    "megatron_cp_histogram": _hist(meg_ids, n),
                    "cpscope_cp_histogram": _hist(cp_ids, n),
                }
                row["ratio"] = row["megatron"] / row["cpscope_in_megatron_loop"]
                row["ratio_native"] = row["megatron"] / row["cpscope_native"]
                rows.append(row)
                print(_fmt(row), flush=True)
    summary = []
    for name in models:
        for n in args.ranks:
            sel = [r for r in rows if r["ranks"] == n and r["cost"] == name]
            summary.append({
                "cost": name, "ranks": n,
                "geomean_ratio": _geomean([r["ratio"] for r in sel]),
                "geomean_ratio_native": _geomean([r["ratio_native"] for r in sel]),
                "megatron_ms_median": statistics.median(r["megatron_ms"] for r in sel),
                "cpscope_ms_median": statistics.median(r["cpscope_ms"] for r in sel),
            })
    print("\ncost       ranks  megatron/cpscope (geomean; same loop, native)  plan ms megatron  cpscope")
    for s in summary:
        print(f"{s['cost']:<10} {s['ranks']:>5}  {s['geomean_ratio']:>8.2f}x  {s['geomean_ratio_native']:>8.2f}x"
              f"            {s['megatron_ms_median']:>10.1f}  {s['cpscope_ms_median']:>7.1f}")
    return {
        "megatron_core": megatron_core_version(), "capacity": args.capacity, "seqs_per_rank": args.seqs_per_rank,
        "cost_models": {k: vars(v) if hasattr(v, "__dict__") else str(v) for k, v in models.items()},
        "distribution": "long_tail_lengths(n, seed) defaults",
        "timing": f"cpscope: median of {args.repeats} calls after a warm-up; Megatron: one call (a fresh scheduler); "
                  f"load average at start {os.getloadavg()}",
        "rows": rows, "summary": summary,
    }


def _hist(id_groups: list[list[list[int]]], n: int) -> dict[str, int]:
    count: dict[int, int] = {}
    for per_rank in id_groups:
        holders: dict[int, int] = {}
        for ids in per_rank:
            for s in ids:
                holders[s] = holders.get(s, 0) + 1
        for c in holders.values():
            count[c] = count.get(c, 0) + 1
    return {str(k): v for k, v in sorted(count.items())}


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _fmt(r: dict[str, Any]) -> str:
    return (f"{r['cost']:<9} ranks {r['ranks']:>5} seed {r['seed']}  megatron {r['megatron']:8.3f} "
            f"({r['megatron_groups']} groups, {r['megatron_ms']:8.1f} ms)  cpscope {r['cpscope_in_megatron_loop']:8.3f} "
            f"(native {r['cpscope_native']:.3f}, LB {r['lower_bound']:.3f}, {r['cpscope_ms']:.1f} ms)  "
            f"ratio {r['ratio']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024, 4096])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seqs-per-rank", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=16384, help="max_seq_len_per_rank (tokens)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls of cpscope's planner (median)")
    ap.add_argument("--attn-only", action="store_true", help="also compare under Megatron's own L²/c estimate")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    result = run(args)
    dump(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
