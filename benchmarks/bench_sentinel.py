"""What ``cpscope.sentinel`` costs on the demo's training step: off vs ``every=100`` vs ``every=1``, in one run.

Usage:  python benchmarks/bench_sentinel.py [--steps 200] [--every1-stride 5] [--json PATH]

Spawns 4 gloo ranks (CPU) and trains the demo (``examples/train_hybrid.py``: hybrid plan with CP1 / CP2 / CP4
microbatches, the GQA GPT of ``examples/gpt.py``) three times side by side — three models with the same initial
weights on the same global batches — interleaved step by step: each global batch is run by the three back to back
(``every=1`` on every ``--every1-stride``-th batch only; the order rotates), so that the load of the machine hits all
three alike and each overhead is a mean of paired differences (same batch, adjacent in time). The ``every=100`` sentinel lives for the whole run,
so its per-group counters reach the 1 % sampling rate it has in a long job (its first microbatch of every group is
sampled too, which makes the figure pessimistic for a short run). Every step is timed between two barriers.

Reported: mean step time (wall) and CPU seconds (all ranks) per mode (whole step: plan, pack/shard, forward/backward, gradient all-reduce, optimizer;
and the train part alone), the paired overhead vs "off" with ±2 standard errors, and an estimate of the ``every=100`` overhead from its parts — the
unsampled hook cost (timed separately, per call) plus the sampled-microbatch cost (from ``every=1``) times the
sampled fraction — which is free of the run-to-run noise a loaded machine adds to the direct ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(1, str(ROOT))
from _results import dump  # noqa: E402

MODES = ("off", "every=100", "every=1")


def _hook_cost_us(number: int = 20000, repeats: int = 7) -> dict[str, float]:
    """Per-call cost (µs) of each hook when the sentinel is on but the microbatch is not sampled, minus off.

    Timed on the observer slots themselves, the way the core calls them (attention: a prepared call whose run does
    no work; RoPE: the slot call; a microbatch marker), so that the figure is not buried in the noise of the
    kernels they wrap. Min over ``repeats``. Off, each slot is one attribute read and a ``None`` check.
    """
    import timeit

    import cpscope
    from cpscope import _hooks
    from cpscope.attention._api import prepare_call
    from cpscope.scope import CP1

    q = torch.randn(8, 2, 8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    call = prepare_call(q, q, q, CP1, "thd", True, cu, None, None, None, None)
    pack_cu = call.pack.cu

    def run(c):  # the attention itself: no work
        return c.q

    def attention():  # what attention_with_scope does around a prepared call
        observer = _hooks.attention
        return run(call) if observer is None else observer(call, run)

    def rope():
        if _hooks.rope is not None:
            _hooks.rope(CP1, pack_cu, "thd", q)

    def marker():
        s = cpscope.sentinel.active()
        if s is not None:
            with s.microbatch(None):
                pass

    def best(fn):
        return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6

    off = {name: best(fn) for name, fn in (("attention", attention), ("rope", rope), ("microbatch", marker))}
    s = cpscope.sentinel(every=10**9)
    try:
        with s.microbatch(None):  # index 0: the one sampled microbatch; everything timed below is unsampled
            pass
        with s.microbatch(None):
            on = {"attention": best(attention), "rope": best(rope)}
        on["microbatch"] = best(marker)
    finally:
        s.stop()
    return {k: on[k] - off[k] for k in on}


def _run_rank(args: argparse.Namespace) -> None:
    import cpscope
    import train_hybrid as th
    from cpscope.train._loop import allreduce_gradients, global_num_targets, prepare_microbatches, run_microbatches

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = th.TrainConfig()  # the demo's defaults
    groups = cpscope.new_cp_groups([1, 2, 4])
    state = {}
    for mode in MODES:
        model = th.build_model(cfg, torch.device("cpu"))
        sentinel = None
        if mode != "off":
            sentinel = cpscope.sentinel(every=int(mode.split("=")[1]))
            sentinel.stop()  # switched on per block below
        state[mode] = {"model": model, "opt": th.build_optimizer(cfg, model), "sentinel": sentinel,
                       "total": [], "train": [], "cpu": [], "index": [], "mbs": 0}

    def one_step(mode: str, step: int) -> None:
        st = state[mode]
        s = st["sentinel"]
        if s is not None:
            s.start()
        try:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            docs = th.make_documents(cfg, step)
            plan = th.make_plan(cfg, [d.numel() for d in docs], world)
            mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
            n = global_num_targets(mbs, dp_group=dist.group.WORLD)
            t1 = time.perf_counter()
            st["opt"].zero_grad(set_to_none=True)
            run_microbatches(st["model"], mbs, num_targets=n, dp_group=dist.group.WORLD)
            allreduce_gradients(st["model"], dp_group=dist.group.WORLD)
            st["opt"].step()
            c2 = time.process_time()
            dist.barrier()
            t2 = time.perf_counter()
        finally:
            if s is not None:
                s.stop()
        st["total"].append(t2 - t0)
        st["cpu"].append(c2 - c0)
        st["train"].append(t2 - t1)
        st["index"].append(step)
        st["mbs"] += len(mbs)

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="steps", unit="step", file=sys.stderr)
    for step in range(args.steps):  # every mode runs the same global batch back to back; the order rotates
        order = MODES[step % 3:] + MODES[: step % 3]
        for mode in order:
            if mode != "every=1" or step % args.every1_stride == 0:
                one_step(mode, step)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    hooks = _hook_cost_us() if rank == 0 else None

    mine = {}
    for mode, st in state.items():
        s = st["sentinel"]
        summ = s.summary() if s is not None else None
        mine[mode] = {"total": st["total"], "train": st["train"], "cpu": st["cpu"], "index": st["index"],
                      "steps": len(st["total"]),
                      "mbs": st["mbs"],
                      "sampled": summ.sampled if summ else 0, "microbatches": summ.microbatches if summ else st["mbs"],
                      "mismatches": summ.mismatches if summ else 0, "checks": dict(summ.checks) if summ else {}}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        _report(args, gathered, hooks, cfg)


def _paired(r0: dict, mode: str, key: str) -> tuple[float, float]:
    """Mean (and standard error) of ``mode`` − off over the steps both ran (the same global batch, back to back)."""
    off = dict(zip(r0["off"]["index"], r0["off"][key]))
    diffs = [t - off[i] for i, t in zip(r0[mode]["index"], r0[mode][key]) if i in off]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs), se


def _report(args, gathered, hooks, cfg) -> None:
    r0 = gathered[0]  # step times are barrier-synchronised: the same on every rank
    mean = {m: statistics.fmean(r0[m]["total"]) for m in MODES}
    train = {m: statistics.fmean(r0[m]["train"]) for m in MODES}
    off_steps = r0["off"]["steps"]
    mbs_per_step = sum(g["off"]["mbs"] for g in gathered) / off_steps / len(gathered)  # per rank
    sampled_100 = sum(g["every=100"]["sampled"] for g in gathered)
    seen_100 = sum(g["every=100"]["microbatches"] for g in gathered)
    frac = sampled_100 / max(1, seen_100)
    paired = {m: _paired(r0, m, "total") for m in MODES[1:]}
    # CPU seconds of all ranks per step: what the sentinel adds in work, robust to the load of a shared machine
    cpu = {m: {"index": r0[m]["index"], "cpu": [sum(g[m]["cpu"][i] for g in gathered) for i in range(r0[m]["steps"])]}
           for m in MODES}
    mean_cpu = {m: statistics.fmean(cpu[m]["cpu"]) for m in MODES}
    paired_cpu = {m: _paired(cpu, m, "cpu") for m in MODES[1:]}
    paired_train = {m: _paired(r0, m, "train") for m in MODES[1:]}
    off_same = {m: statistics.fmean([t for i, t in zip(r0["off"]["index"], r0["off"]["total"])
                                     if i in set(r0[m]["index"])]) for m in MODES[1:]}
    # From the parts: a sampled microbatch costs (every=1 − off) / microbatches; in a long run 1 in 100 is sampled;
    # unsampled: the hooks (per layer and microbatch: 1 attention + 2 RoPE calls) and one marker per microbatch.
    per_mb_sampled = paired["every=1"][0] / mbs_per_step
    calls = mbs_per_step * cfg.n_layers
    unsampled = (hooks["attention"] * calls + hooks["rope"] * 2 * calls + hooks["microbatch"] * mbs_per_step) * 1e-6
    est_100 = (per_mb_sampled * mbs_per_step / 100 + unsampled) / mean["off"]
    est_run = (per_mb_sampled * mbs_per_step * frac + unsampled) / mean["off"]
    res = {
        "world": len(gathered),
        "demo": {"hidden": cfg.hidden, "layers": cfg.n_layers, "docs_per_step": cfg.docs_per_step},
        "steps": {m: r0[m]["steps"] for m in MODES},
        "mean_step_s": mean, "mean_train_s": train,
        "paired_overhead_step": {m: {"mean_s": d, "se_s": e, "ratio": d / off_same[m], "ratio_2se": 2 * e / off_same[m]}
                                 for m, (d, e) in paired.items()},
        "paired_overhead_train": {m: {"mean_s": d, "se_s": e} for m, (d, e) in paired_train.items()},
        "mean_cpu_s_all_ranks": mean_cpu,
        "paired_overhead_cpu": {m: {"mean_s": d, "se_s": e, "ratio": d / mean_cpu["off"],
                                    "ratio_2se": 2 * e / mean_cpu["off"]} for m, (d, e) in paired_cpu.items()},
        "microbatches_per_rank_step": mbs_per_step,
        "every100_sampled_fraction_this_run": frac,
        "hook_cost_unsampled_us": hooks,
        "estimate_every100_overhead_long_run": est_100,
        "estimate_every100_overhead_this_run": est_run,
        "sampled_microbatch_cost_s": per_mb_sampled,
        "mismatches": {m: sum(g[m]["mismatches"] for g in gathered) for m in MODES},
        "checks_every1_rank0": r0["every=1"]["checks"],
    }
    print(f"\nsentinel overhead on the demo step ({res['world']} gloo ranks, CPU; steps per mode {res['steps']}):")
    print(f"{'mode':>10} {'step ms':>9} {'train ms':>9} {'wall: paired overhead (±2 SE)':>32} {'CPU s':>7} "
          f"{'CPU: paired overhead (±2 SE)':>30}")
    for m in MODES:
        extra = extra_cpu = ""
        if m != "off":
            p = res["paired_overhead_step"][m]
            extra = f"{p['mean_s'] * 1e3:+8.1f} ms = {p['ratio']:+7.2%} ± {p['ratio_2se']:.2%}"
            c = res["paired_overhead_cpu"][m]
            extra_cpu = f"{c['mean_s']:+6.3f} s = {c['ratio']:+7.2%} ± {c['ratio_2se']:.2%}"
        print(f"{m:>10} {mean[m] * 1e3:9.1f} {train[m] * 1e3:9.1f} {extra:>32} {mean_cpu[m]:7.3f} {extra_cpu:>30}")
    print(f"every=100 sampled {sampled_100}/{seen_100} microbatches in this run ({frac:.1%}); unsampled hooks: "
          f"attention {hooks['attention']:.2f} µs, RoPE {hooks['rope']:.2f} µs per call, "
          f"{hooks['microbatch']:.2f} µs per microbatch; a sampled microbatch costs {per_mb_sampled * 1e3:.1f} ms")
    print(f"estimate from the parts: every=100 overhead {est_100:.3%} of the step in a long run "
          f"({est_run:.3%} at this run's sampled fraction); mismatches: {res['mismatches']}")
    if args.json:
        dump(res, args.json)
        print(f"wrote {args.json}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps of 'off' and of 'every=100' each")
    p.add_argument("--every1-stride", type=int, default=5, help="'every=1' runs every this many steps")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from _launch import launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch(_run_rank, 4, args, backend="gloo")


if __name__ == "__main__":
    main()
