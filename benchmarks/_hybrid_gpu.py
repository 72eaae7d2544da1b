"""bench_hybrid part (b): tokens/s of real GPT training steps — hybrid CP vs static CP2 vs CP1-only DP, one run.

Two ranks (2 GPUs, NCCL). Model: the example GPT (``examples/gpt.py``): 8 layers, hidden 2048, 16 heads of 128,
bf16, packed ``thd``, RoPE + cpscope ring attention. Batch: long-tail document lengths
(``long_tail_lengths``: log-normal, median 2048) with the longest set to 64k tokens. Each mode runs the same
batch and model:

* ``hybrid``  — ``plan_hybrid`` chooses CP1 or CP2 per document under a cost model **fitted on this machine**
  (single documents timed at CP1 and CP2 first, ``CostModel.fit``);
* ``static2`` — every document at CP2 (``plan_static(cp=2)``);
* ``dp``      — CP1 only: data parallel, each document on one GPU (``plan_static(cp=1)``), when the longest fits.

A step is forward + backward of every microbatch of the rank (each under ``runtime_cp``) and the gradient
all-reduce; no optimizer (identical in every mode). Reported: tokens/s (real tokens / median step time), the
per-rank busy time split by CP size (synchronised after each microbatch), the plan's predicted makespan, peak memory.

Run::

    torchrun --nproc_per_node=2 benchmarks/_hybrid_gpu.py --out OUT                    # 2 GPUs
    python benchmarks/_hybrid_gpu.py --tiny --out /tmp/hybrid_tiny                   # CPU check: 2 gloo ranks

Writes ``hybrid_gpu.json`` and ``hybrid_gpu.png`` (matplotlib, when importable; ``--gpu-name`` changes the stem) into
``--out`` (default ``benchmarks/results``), the JSON with the command that made it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
sys.path.insert(1, _ROOT)

import cpscope  # noqa: E402
from cpscope.hybrid import CostModel, long_tail_lengths, plan_hybrid, plan_static  # noqa: E402
from cpscope.train._loop import (  # noqa: E402
    allreduce_gradients,
    global_num_targets,
    prepare_microbatch,
    prepare_microbatches,
    run_microbatches,
)
from gpt import GPT, GPTConfig  # noqa: E402
from _results import RESULTS_DIR, dump  # noqa: E402

__all__ = ["add_gpu_arguments", "run_gpu", "main"]

FULL = dict(layers=8, hidden=2048, heads=16, vocab=32768, dtype="bfloat16", n_seqs=40, median=2048, sigma=1.5,
            min_len=256, max_len=65536, granularity=128, capacity=65536, fit_lengths=[2048, 8192, 24576, 65536])
TINY = dict(layers=2, hidden=64, heads=4, vocab=256, dtype="float32", n_seqs=16, median=64, sigma=1.2,
            min_len=16, max_len=1024, granularity=8, capacity=1024, fit_lengths=[64, 256, 1024])


def add_gpu_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("gpu (part b)")
    g.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU / gloo logic check)")
    g.add_argument("--gpu-steps", type=int, default=3, help="timed steps per mode (after 1 warm-up step)")
    g.add_argument("--gpu-seed", type=int, default=0)
    g.add_argument("--gpu-seqs", type=int, default=None, help="documents in the global batch")
    g.add_argument("--gpu-capacity", type=int, default=None, help="tokens per rank per microbatch (memory limit)")
    g.add_argument("--gpu-out", default=None, help="directory for the JSON / PNG (default: --out)")
    g.add_argument("--gpu-name", default="hybrid_gpu", help="file name stem of the JSON / PNG")
    g.add_argument("--no-fit", action="store_true", help="plan with CostModel() defaults instead of fitting")


# ------------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(c: dict[str, Any], seed: int, n_seqs: int) -> tuple[list[int], list[torch.Tensor]]:
    lengths = long_tail_lengths(n_seqs, seed=seed, median=c["median"], sigma=c["sigma"], min_len=c["min_len"],
                                max_len=c["max_len"], granularity=c["granularity"])
    lengths[int(lengths.argmax())] = c["max_len"]  # the batch always holds one document of the maximum length
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(c["vocab"], (int(n),), generator=g) for n in lengths]
    return [int(n) for n in lengths], docs


def _time_mb(model: GPT, mbs: list, n_targets: int, device: torch.device) -> list[tuple[int, float]]:
    """Forward + backward of each microbatch, synchronised after each: [(cp, seconds)]."""
    out = []
    for mb in mbs:
        t0 = time.perf_counter()
        run_microbatches(model, [mb], num_targets=n_targets, dp_group=dist.group.WORLD)
        _sync(device)
        out.append((mb.cp, time.perf_counter() - t0))
    return out


def _fit_cost(model: GPT, c: dict[str, Any], groups: dict, device: torch.device, repeats: int = 2) -> tuple[CostModel, list]:
    """Time single documents at CP1 and CP2 (per-rank seconds) and fit the planner's cost model to them."""
    samples = []
    g = torch.Generator().manual_seed(123)
    for L in c["fit_lengths"]:
        doc = torch.randint(c["vocab"], (L,), generator=g)
        for cp in (1, 2):
            mb = prepare_microbatch([doc], cp=cp, group=groups[cp], device=device)
            times = []
            for i in range(repeats + 1):  # first run: warm-up
                dist.barrier()
                t = _time_mb(model, [mb], max(mb.num_targets, 1), device)[0][1]
                if i:
                    times.append(t)
            model.zero_grad(set_to_none=True)
            t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            samples.append((L, cp, float(t.item())))
    L, cps, secs = zip(*samples)
    return CostModel.fit(list(L), list(cps), list(secs)), samples


def _run_mode(name: str, plan: Any, model: GPT, docs: list[torch.Tensor], groups: dict, device: torch.device,
              steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups, device=device)
    n_targets = global_num_targets(mbs, dp_group=dist.group.WORLD, device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step_times, breakdowns = [], []
    oom = False
    for step in range(steps + 1):  # step 0: warm-up
        model.zero_grad(set_to_none=True)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        try:
            per_mb = _time_mb(model, mbs, n_targets, device)
        except torch.cuda.OutOfMemoryError:  # CP1 microbatches only: no collective is left waiting
            per_mb, oom = [], True
        flag = torch.tensor([int(oom)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            return {"mode": name, "oom": True}
        busy = time.perf_counter() - t0
        allreduce_gradients(model, dp_group=dist.group.WORLD)
        _sync(device)
        wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        if step:
            step_times.append(float(wall.item()))
            by_cp: dict[str, float] = {}
            for cp, s in per_mb:
                by_cp[str(cp)] = by_cp.get(str(cp), 0.0) + s
            breakdowns.append({"busy_s": busy, "by_cp_s": by_cp})
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    mine = {"busy_s": statistics.median(b["busy_s"] for b in breakdowns),
            "by_cp_s": {k: statistics.median(b["by_cp_s"].get(k, 0.0) for b in breakdowns)
                        for k in breakdowns[0]["by_cp_s"]},
            "microbatches": [(mb.cp, len(mb.seqs), int(mb.input_ids.numel())) for mb in mbs], "peak_gib": peak}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    tokens = sum(d.numel() for d in docs)
    step_s = statistics.median(step_times)
    hist: dict[str, int] = {}
    for cp in plan.cp_sizes:
        hist[str(cp)] = hist.get(str(cp), 0) + 1
    return {"mode": name, "oom": False, "tokens": tokens, "step_s": step_s, "step_times_s": step_times,
            "tokens_per_s": tokens / step_s, "planned_makespan_s": plan.makespan, "docs_per_cp": hist,
            "per_rank": per_rank}


def _init_from_torchrun() -> None:
    """``init_process_group`` from torchrun's environment: NCCL with one GPU per rank, else gloo."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]):
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """Part (b). Collective over a world of 2 (torchrun); returns the results on every rank, writes on rank 0."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError("run_gpu needs torch.distributed: launch with torchrun --nproc_per_node=2")
        _init_from_torchrun()
    if dist.get_world_size() != 2:
        raise ValueError(f"the hybrid GPU benchmark compares CP1/CP2 plans on 2 ranks, got a world of "
                         f"{dist.get_world_size()}")
    c = dict(TINY if args.tiny else FULL)
    if args.gpu_seqs:
        c["n_seqs"] = args.gpu_seqs
    if args.gpu_capacity:
        c["capacity"] = args.gpu_capacity
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rank = dist.get_rank()
    groups = cpscope.new_cp_groups([1, 2])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=c["vocab"], hidden=c["hidden"], n_layers=c["layers"], n_heads=c["heads"]))
    if device.type == "cuda" and c["dtype"] == "float32":  # flash kernels: half precision only
        c["dtype"] = "bfloat16"
    model = model.to(device=device, dtype=getattr(torch, c["dtype"]))
    lengths, docs = _batch(c, args.gpu_seed, c["n_seqs"])
    t0 = time.perf_counter()
    if args.no_fit:
        cost, samples = CostModel(), []
    else:
        cost, samples = _fit_cost(model, c, groups, device)
    fit_s = time.perf_counter() - t0
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    log(f"cost model ({'fitted in %.1f s' % fit_s if samples else 'defaults'}): {cost}")

    plans = {"hybrid": plan_hybrid(lengths, 2, c["capacity"], cost),
             "static2": plan_static(lengths, 2, c["capacity"], cost, cp=2)}
    try:
        plans["dp"] = plan_static(lengths, 2, c["capacity"], cost, cp=1)
    except ValueError as e:  # the longest document does not fit one rank's capacity
        log(f"dp: skipped ({e})")
    results = {}
    for name, plan in plans.items():
        results[name] = _run_mode(name, plan, model, docs, groups, device, args.gpu_steps)
        r = results[name]
        log(f"{name:>8}: OOM" if r["oom"] else
            f"{name:>8}: {r['tokens_per_s']:>12,.0f} tokens/s  step {r['step_s']:.3f} s  planned "
            f"{r['planned_makespan_s']:.3f} s  docs per CP {r['docs_per_cp']}  busy per rank "
            f"{[round(p['busy_s'], 3) for p in r['per_rank']]}")
    ok = {k: v for k, v in results.items() if not v["oom"]}
    speedups = {f"hybrid/{k}": ok["hybrid"]["tokens_per_s"] / v["tokens_per_s"] for k, v in ok.items()
                if k != "hybrid" and "hybrid" in ok}
    for k, v in speedups.items():
        log(f"{k}: {v:.3f}x")
    out = {
        "mode": "gpu", "tiny": bool(args.tiny), "world": 2, "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "config": c, "lengths": lengths, "tokens": sum(lengths),
        "cost_model": {"attn": cost.attn, "linear": cost.linear, "comm": cost.comm, "latency": cost.latency},
        "fit_samples_L_cp_s": samples, "results": results, "speedups": speedups,
    }
    out_dir = args.gpu_out or getattr(args, "out", None)
    if rank == 0 and out_dir:
        if out_dir.endswith(".json"):
            out_dir = os.path.dirname(out_dir) or "."
        os.makedirs(out_dir, exist_ok=True)
        stem = getattr(args, "gpu_name", None) or "hybrid_gpu"
        dump(out, os.path.join(out_dir, stem + ".json"))
        _plot(out, os.path.join(out_dir, stem + ".png"))
        log(f"wrote {out_dir}/{stem}.json")
    return out


def _plot(out: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot", flush=True)
        return
    res = {k: v for k, v in out["results"].items() if not v["oom"]}
    names = list(res)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.bar(names, [res[n]["tokens_per_s"] / 1e3 for n in names], color=["tab:green", "tab:blue", "tab:orange"][: len(names)])
    a1.set_ylabel("thousand tokens / s")
    c = out["config"]
    a1.set_title(f"GPT {c['layers']}L h{c['hidden']} {c['dtype']}, {out['tokens']:,} tokens, max {c['max_len']:,}")
    for i, n in enumerate(names):
        a1.text(i, res[n]["tokens_per_s"] / 1e3, f"{res[n]['tokens_per_s'] / 1e3:.1f}k", ha="center", va="bottom")
    colors = {"1": "tab:gray", "2": "tab:purple"}
    x, labels = 0, []
    for n in names:
        for r, pr in enumerate(res[n]["per_rank"]):
            bottom = 0.0
            for cp, s in sorted(pr["by_cp_s"].items()):
                a2.bar(x, s, bottom=bottom, color=colors.get(cp, "tab:red"),
                       label=f"CP{cp} microbatches" if f"CP{cp} microbatches" not in labels else None)
                labels.append(f"CP{cp} microbatches")
                bottom += s
            x += 1
        a2.hlines(res[n]["step_s"], x - 2.4, x - 0.6, colors="k", linestyles="dashed")
        x += 0.5
    ticks = [i + j * 2.5 for j in range(len(names)) for i in range(2)]
    a2.set_xticks(ticks, [f"{n}\nr{r}" for n in names for r in range(2)])
    a2.set_ylabel("seconds per step (dashed: step incl. all-reduce)")
    a2.set_title("busy time per rank by CP size")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def _rank_entry(args: argparse.Namespace) -> None:
    run_gpu(args)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR, help="output directory")
    add_gpu_arguments(ap)
    args = ap.parse_args(argv)
    from _launch import launch  # examples/_launch.py: torchrun's ranks, or spawn 2 here

    launch(_rank_entry, 2, args)


if __name__ == "__main__":
    main()
