"""Hybrid CP + FSDP2 vs static CP2 + FSDP2: tokens/s of GPT training steps on the GPT benchmark batch, one run.

The model, batch and cost-model fit are those of the hybrid GPU benchmark (``benchmarks/_hybrid_gpu.py``: the
example GPT, 8 layers, hidden 2048, 16 heads of 128, vocab 32768; 40 long-tail documents, the longest 64k tokens;
capacity 64k tokens per rank per microbatch). Here the model is **sharded by FSDP2** (``fully_shard`` on every block
and the root; fp32 master weights, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` by default) and a
step is :func:`cpscope.train._loop.run_step` with :class:`cpscope.train._sync.FSDPSync`: one all-gather of every
parameter group at the start, forward + backward of every microbatch of the rank (each under ``runtime_cp``), one
reduce-scatter in the last CP1 backward (no optimizer step: it is the same in every mode). Modes, same model and
batch:

* ``hybrid``  — ``plan_hybrid`` picks CP1 or CP2 per document under the cost model fitted on this machine;
* ``static2`` — every document at CP2 (``plan_static(cp=2)``);
* ``dp``      — CP1 only (each document on one rank), when the longest document fits one rank.

Reported per mode: tokens/s (real tokens / median step time over ``--steps`` timed steps after one warm-up), the
step time, the exposed all-gather at the start of the step, peak memory, microbatches per rank; and hybrid's
speed-up over each other mode, as ratios from the same run.

Run::

    torchrun --nproc_per_node=2 benchmarks/bench_hybrid_fsdp.py --out OUT                      # 2 GPUs
    torchrun --nproc_per_node=1 benchmarks/bench_hybrid_fsdp.py --smoke --out /tmp/hfsdp_smoke  # 1 GPU, smoke
    python benchmarks/bench_hybrid_fsdp.py --smoke --world 2 --out /tmp/hfsdp_smoke             # CPU, 2 gloo ranks

``--smoke`` is the tiny model and batch, one timed step: it checks that everything runs end to end (on a world of 1
there is no CP2 group: every mode is CP1 and the static mode is ``static1``). Writes ``hybrid_fsdp.json`` (``--json``)
into ``--out`` (rank 0; default ``benchmarks/results``), with the command that made it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(2, _ROOT)

import cpscope  # noqa: E402
from cpscope.hybrid import CostModel, plan_hybrid, plan_static  # noqa: E402
from cpscope.train._loop import global_num_targets, prepare_microbatches, run_step  # noqa: E402
from cpscope.train._sync import FSDPSync  # noqa: E402
from _hybrid_gpu import FULL, TINY, _batch, _fit_cost, _sync  # noqa: E402  (the GPT benchmark batch and fit)
from gpt import GPT, GPTConfig  # noqa: E402
from _results import RESULTS_DIR, dump  # noqa: E402

__all__ = ["run", "main"]

logger = logging.getLogger("bench_hybrid_fsdp")


class _TimedFSDPSync(FSDPSync):
    """FSDPSync that also times its exposed part: the all-gather of every parameter group at the step's start."""

    unshard_s = 0.0

    def begin_step(self) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        super().begin_step()
        _sync(self.device)
        self.unshard_s = time.perf_counter() - t0


def _build(c: dict[str, Any], device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)  # the same weights on every rank and in every mode
    model = GPT(GPTConfig(vocab_size=c["vocab"], hidden=c["hidden"], n_layers=c["layers"], n_heads=c["heads"]))
    return model.to(device=device, dtype=dtype)


def _shard(model: GPT, device: torch.device, mp: str, reshard_after_forward: bool) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16"
              else MixedPrecisionPolicy())
    # Blocks get the fp32 RoPE angle table as an input: FSDP2 must not cast it to bf16 (angles off by up to 128 rad
    # at position 60k); their hidden states arrive in bf16 from the root's embedding anyway.
    block_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def _run_mode(name: str, plan: Any, model: GPT, sync: _TimedFSDPSync, docs: list[torch.Tensor], groups: dict,
              device: torch.device, steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups, device=device)
    n_targets = global_num_targets(mbs, dp_group=sync.dp_group, device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step_times, unshard = [], []
    for step in range(steps + 1):  # step 0: warm-up
        model.zero_grad(set_to_none=True)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        run_step(model, mbs, dp_group=sync.dp_group, sync=sync, num_targets=n_targets)
        _sync(device)
        wall = torch.tensor([time.perf_counter() - t0, sync.unshard_s], dtype=torch.float64, device=device)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        if step:
            step_times.append(float(wall[0]))
            unshard.append(float(wall[1]))
    empties = int(not mbs or mbs[-1].cp != 1)  # run_step adds an empty CP1 microbatch for the reduce-scatter
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    mine = {"microbatches": [(mb.cp, len(mb.seqs), int(mb.input_ids.numel())) for mb in mbs],
            "empty_microbatches": empties, "peak_gib": peak}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    tokens = sum(d.numel() for d in docs)
    step_s = statistics.median(step_times)
    hist: dict[str, int] = {}
    for cp in plan.cp_sizes:
        hist[str(cp)] = hist.get(str(cp), 0) + 1
    return {"mode": name, "tokens": tokens, "step_s": step_s, "step_times_s": step_times,
            "tokens_per_s": tokens / step_s, "unshard_s": statistics.median(unshard),
            "planned_makespan_s": plan.makespan, "docs_per_cp": hist, "per_rank": per_rank}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark on this rank (collective over the world); returns the results, writes JSON on rank 0."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world > 2:
        raise ValueError(f"bench_hybrid_fsdp compares CP1/CP2 plans on 1 (smoke) or 2 ranks, got a world of {world}")
    c = dict(TINY if args.smoke else FULL)
    if args.seqs:
        c["n_seqs"] = args.seqs
    if args.capacity:
        c["capacity"] = args.capacity
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    mp = args.mp if device.type == "cuda" else "none"  # bf16 attention kernels are the GPU's; CPU smoke in fp32
    compute_dtype = torch.bfloat16 if mp == "bf16" else torch.float32
    sizes = [1, 2] if world == 2 else [1]
    groups = cpscope.new_cp_groups(sizes)
    lengths, docs = _batch(c, args.seed, c["n_seqs"])
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    t0 = time.perf_counter()
    if args.no_fit or world == 1:  # a world of 1 has no CP2 group to time
        cost, samples = CostModel(), []
    else:  # on an unsharded copy in the compute dtype: the microbatches' compute is the same under FSDP2
        plain = _build(c, device, compute_dtype)
        cost, samples = _fit_cost(plain, c, groups, device)
        del plain
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fit_s = time.perf_counter() - t0
    log(f"cost model ({'fitted in %.1f s' % fit_s if samples else 'defaults'}): {cost}")

    model = _shard(_build(c, device, torch.float32), device, mp, not args.no_reshard_after_forward)
    sync = _TimedFSDPSync(model, dp_group=dist.group.WORLD)
    static_cp = min(2, world)
    plans = {"hybrid": plan_hybrid(lengths, world, c["capacity"], cost),
             f"static{static_cp}": plan_static(lengths, world, c["capacity"], cost, cp=static_cp)}
    try:
        plans["dp"] = plan_static(lengths, world, c["capacity"], cost, cp=1)
    except ValueError as e:  # the longest document does not fit one rank's capacity
        log(f"dp: skipped ({e})")
    results = {}
    for name, plan in plans.items():
        results[name] = r = _run_mode(name, plan, model, sync, docs, groups, device, args.steps)
        log(f"{name:>8}: {r['tokens_per_s']:>12,.0f} tokens/s  step {r['step_s']:.3f} s  (all-gather at start "
            f"{r['unshard_s'] * 1e3:.1f} ms)  planned {r['planned_makespan_s']:.3f} s  docs per CP "
            f"{r['docs_per_cp']}  peak {max(p['peak_gib'] for p in r['per_rank']):.1f} GiB  microbatches per rank "
            f"{[len(p['microbatches']) for p in r['per_rank']]}")
    speedups = {f"hybrid/{k}": results["hybrid"]["tokens_per_s"] / v["tokens_per_s"]
                for k, v in results.items() if k != "hybrid"}
    for k, v in speedups.items():
        log(f"{k}: {v:.3f}x")
    out = {
        "benchmark": "bench_hybrid_fsdp", "smoke": bool(args.smoke), "world": world, "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "config": c, "mixed_precision": mp,
        "reshard_after_forward": not args.no_reshard_after_forward, "static_cp": static_cp,
        "lengths": lengths, "tokens": sum(lengths),
        "cost_model": {"attn": cost.attn, "linear": cost.linear, "comm": cost.comm, "latency": cost.latency},
        "fit_samples_L_cp_s": samples, "results": results, "speedups": speedups,
    }
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        path = dump(out, os.path.join(args.out, args.json))
        log(f"wrote {path}")
    return out


def _rank_entry(args: argparse.Namespace) -> None:
    run(args)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR, help="output directory")
    ap.add_argument("--json", default="hybrid_fsdp.json", help="file name under --out")
    ap.add_argument("--smoke", action="store_true", help="tiny model and batch, one timed step (end-to-end check)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode after 1 warm-up (default 3; 1 "
                                                           "with --smoke)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seqs", type=int, default=None, help="documents in the global batch")
    ap.add_argument("--capacity", type=int, default=None, help="tokens per rank per microbatch (memory limit)")
    ap.add_argument("--mp", choices=("bf16", "none"), default="bf16",
                    help="FSDP2 MixedPrecisionPolicy on GPU (bf16 compute, fp32 reduce, fp32 masters)")
    ap.add_argument("--no-reshard-after-forward", action="store_true")
    ap.add_argument("--no-fit", action="store_true", help="plan with CostModel() defaults instead of fitting")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks to spawn without torchrun (default: 1 with --smoke, else 2)")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.smoke else 3
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from _launch import launch  # examples/_launch.py: torchrun's ranks, or spawn them here

    launch(_rank_entry, args.world or (1 if args.smoke else 2), args)


if __name__ == "__main__":
    main()
