"""transformers decoder, forward + backward tokens/s: ``attn_implementation="sdpa"`` vs ``"cpscope"``, same run.

One GPU (CP1: both implementations on the same weights and batch)::

    python benchmarks/bench_hf.py --out OUT

Two GPUs (adds cpscope CP2 on the same global batch, sharded with ``cpscope.integrations.hf.shard_batch``; the
single-GPU ``sdpa`` and cpscope CP1 rows run on every rank beside it)::

    torchrun --nproc_per_node=2 benchmarks/bench_hf.py --out OUT

Crash test on CPU (tiny model, float32)::

    python benchmarks/bench_hf.py --device cpu --dry-run --out /tmp/x

Model (default): a Llama-shaped decoder (``--family llama``; ``qwen2`` and ``mistral`` also work), hidden 2048,
16 heads × 128, k/v heads ``--kv-heads`` (default 4, and 16 for reference), 4 layers, intermediate 5632, vocabulary
32000, random weights, bf16, batch 1 of ``--tokens`` (default 16384 and 4096) random token ids, ``labels = input_ids``.
A step is ``model.zero_grad(set_to_none=True)``, ``loss = model(**batch).loss``, ``loss.backward()``; the batch is
prepared once, outside the timed step (``shard_batch`` for cpscope). Median of CUDA-event timings after warm-up
(``_bench_util.Timer``). Under CP2 the gradient all-reduce over the CP group is **not** timed (a data-parallel job
does it anyway); tokens/s counts the global batch.

CUDA: the host synchronisations of one forward of each (``torch.cuda.set_sync_debug_mode("warn")``) are counted.
Check (always, unless ``--no-check``): cpscope's loss vs sdpa's on the same weights and batch (CP2: the sum of the
ranks' losses, each rank's share of the full-batch mean), relative difference ≤ 1e-2, and the relative difference
of all parameter gradients (CP2: summed over the group), reported (limit 5e-2 in bf16, flagged beyond). Results:
``hf_bench.json`` and a table (rank 0).
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_util import (  # noqa: E402
    Timer, attempt, barrier, count_syncs, env_info, fmt, init_world, kernel_profile, rel_err, write_json,
)

log = logging.getLogger("cpscope.bench")
LOSS_TOL, GRAD_TOL = 1e-2, 5e-2


def _config(transformers: Any, args, kv_heads: int, tokens: int):
    common = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                  num_key_value_heads=kv_heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
                  max_position_embeddings=max(tokens, 4096), attention_dropout=0.0)
    if args.family == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    if args.family == "mistral":  # its default sliding window would refuse long sequences: cover the sequence
        return transformers.MistralConfig(sliding_window=tokens, **common), transformers.MistralForCausalLM
    return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM


def _models(transformers: Any, args, kv_heads: int, tokens: int, dev, dtype):
    """(sdpa model, cpscope model) with identical weights, in train mode, on ``dev``."""
    cfg, cls = _config(transformers, args, kv_heads, tokens)
    torch.manual_seed(0)
    def build(impl: str):
        try:
            return cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            return cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, torch_dtype=dtype)

    with torch.device(dev):  # built on the device: random init of ~0.3 B parameters on the host is slow
        ref, mine = build("sdpa"), build("cpscope")
    mine.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa" and mine.config._attn_implementation == "cpscope"
    ref.train()
    mine.train()
    return ref, mine


def _forward(model, batch: dict, group: Any = None, bind: bool = False) -> torch.Tensor:
    import cpscope

    if bind:
        with cpscope.runtime_cp(group):
            return model(**batch).loss
    return model(**batch).loss


def _step(model, batch: dict, group: Any = None, bind: bool = False):
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = _forward(model, batch, group, bind)
        loss.backward()
        return loss

    step.batch = batch
    return step


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters() if p.grad is not None])


def run_config(args, ctx: dict, kv_heads: int, tokens: int) -> dict:
    import transformers

    import cpscope.integrations.hf as cphf

    dev, dtype, group, world, timer = ctx["dev"], ctx["dtype"], ctx["group"], ctx["world"], ctx["timer"]
    row: dict = {"family": args.family, "hidden": args.hidden, "heads": args.heads, "kv_heads": kv_heads,
                 "layers": args.layers, "tokens": tokens * args.batch, "gpus": world}
    t0 = time.time()
    ref, mine = _models(transformers, args, kv_heads, tokens, dev, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, tokens), generator=g).to(dev)
    full = {"input_ids": ids, "labels": ids, "use_cache": False}
    steps = {"sdpa": _step(ref, full), "cpscope_cp1": _step(mine, cphf.shard_batch(dict(full), group=None))}
    if world > 1:
        steps["cpscope_cp"] = _step(mine, cphf.shard_batch(dict(full), group=group), group, bind=True)
    kernels: dict = {}
    for name, step in steps.items():
        def go(step=step, name=name):
            ms = timer.median_ms(step)
            if args.kernels:
                kernels[name] = attempt(row, f"kernels_{name}", lambda: kernel_profile(step, dev))
            return round(ms, 3)

        row[f"{name}_ms"] = attempt(row, name, go)
        if row[f"{name}_ms"]:
            row[f"{name}_tok_s"] = round(tokens * args.batch / (row[f"{name}_ms"] / 1e3))
    if kernels:
        row["kernels"] = kernels
    if dev.type == "cuda":  # host synchronisations in one forward (the adapter should add none per layer)
        fwd = {"sdpa": (ref, full, False), "cpscope_cp1": (mine, steps["cpscope_cp1"].batch, False)}
        if "cpscope_cp" in steps:
            fwd["cpscope_cp"] = (mine, steps["cpscope_cp"].batch, True)
        for name, (model, batch, bind) in fwd.items():
            row[f"{name}_syncs_fwd"] = attempt(row, f"syncs_{name}", lambda: count_syncs(
                lambda: _forward(model, batch, group if bind else None, bind)))
    if row.get("sdpa_ms") and row.get("cpscope_cp1_ms"):
        row["cp1_vs_sdpa"] = round(row["cpscope_cp1_ms"] / row["sdpa_ms"], 3)
    if row.get("sdpa_ms") and row.get("cpscope_cp_ms"):
        row["cp_speedup"] = round(row["sdpa_ms"] / row["cpscope_cp_ms"], 3)
        if row.get("cpscope_cp1_ms"):
            row["cp_speedup_own_cp1"] = round(row["cpscope_cp1_ms"] / row["cpscope_cp_ms"], 3)
    if not args.no_check:
        row["check"] = attempt(row, "check", lambda: _check(steps, ref, mine, group, world))
    ref = mine = steps = None  # free the models before the next configuration
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    row["wall_s"] = round(time.time() - t0, 1)
    return row


def _check(steps: dict, ref, mine, group, world: int) -> dict:
    """Losses and gradients of cpscope (CP1, and CP summed over the group) vs sdpa on the same weights and batch."""
    want_loss = steps["sdpa"]().detach().float()
    want_grad = _grads(ref)
    res: dict = {"sdpa_loss": round(float(want_loss), 6)}
    for name in ("cpscope_cp1", "cpscope_cp"):
        if name not in steps:
            continue
        loss = steps[name]().detach().float()
        grad = _grads(mine)
        if name == "cpscope_cp":
            dist.all_reduce(loss, group=group)
            dist.all_reduce(grad, group=group)
        res[f"{name}_loss"] = round(float(loss), 6)
        res[f"{name}_loss_rel"] = float(abs(loss - want_loss) / want_loss.abs().clamp_min(1e-30))
        res[f"{name}_grad_rel"] = rel_err(grad, want_grad)
        res[f"{name}_ok"] = res[f"{name}_loss_rel"] <= LOSS_TOL and res[f"{name}_grad_rel"] <= GRAD_TOL
    return res


def print_table(out: dict) -> None:
    world = out["gpus"]
    print(f"\n## transformers {out['args']['family']} decoder, fwd+bwd, {out['env'].get('device', 'cpu')}: "
          "time ratio cpscope / sdpa (< 1: cpscope faster)")
    hdr = "| heads q/kv | tokens | sdpa ms (tok/s) | cpscope CP1 ms (tok/s) | CP1/sdpa |"
    if world > 1:
        hdr += f" cpscope CP{world} ms (tok/s) | x over sdpa | x over own CP1 |"
    print(hdr + " loss rel diff (CP1 / CP) | grad rel diff (CP1 / CP) | host syncs per forward sdpa / CP1 / CP |")
    print("|" + " --- |" * (hdr.count("|") - 1 + 3))
    for r in out["rows"]:
        c = r.get("check") or {}
        line = (f"| {r['heads']}/{r['kv_heads']} | {r['tokens']} | {fmt(r.get('sdpa_ms'))} "
                f"({r.get('sdpa_tok_s', '-')}) | {fmt(r.get('cpscope_cp1_ms'))} ({r.get('cpscope_cp1_tok_s', '-')}) | "
                f"{fmt(r.get('cp1_vs_sdpa'))} |")
        if world > 1:
            line += (f" {fmt(r.get('cpscope_cp_ms'))} ({r.get('cpscope_cp_tok_s', '-')}) | {fmt(r.get('cp_speedup'))}"
                     f" | {fmt(r.get('cp_speedup_own_cp1'))} |")
        lr = [c.get(f"{n}_loss_rel") for n in ("cpscope_cp1", "cpscope_cp")]
        gr = [c.get(f"{n}_grad_rel") for n in ("cpscope_cp1", "cpscope_cp")]
        ok = [c.get(f"{n}_ok") for n in ("cpscope_cp1", "cpscope_cp")]
        flag = "" if all(o is not False for o in ok) and c else " FAIL" if c else " (no check)"
        line += (f" {' / '.join('-' if x is None else f'{x:.1e}' for x in lr)} | "
                 f"{' / '.join('-' if x is None else f'{x:.1e}' for x in gr)}{flag} | "
                 f"{' / '.join(str(r.get(f'{n}_syncs_fwd', '-')) for n in ('sdpa', 'cpscope_cp1', 'cpscope_cp'))} |")
        print(line)
    for r in out["rows"]:
        for k, v in (r.get("errors") or {}).items():
            print(f"error: {r['kv_heads']} kv heads, {r['tokens']} tokens, {k}: {v.splitlines()[0][:200]}")
        if r.get("kernels"):
            print(f"kernels ({r['kv_heads']} kv heads, {r['tokens']} tokens):",
                  {k: (v or {}).get("main") for k, v in r["kernels"].items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dry-run", action="store_true", help="tiny model (crash test; numbers meaningless)")
    ap.add_argument("--family", default="llama", choices=["llama", "qwen2", "mistral"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kernels", action="store_true", help="profile one step of each: attention kernel classes")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=2.5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--json", default="hf_bench.json", help="file name under --out")
    args = ap.parse_args()
    if args.dry_run:
        args.hidden, args.heads, args.kv_heads, args.layers = 64, 4, [2, 4], 2
        args.intermediate, args.vocab, args.tokens, args.iters, args.warmup = 96, 128, [64, 32], 2, 1
    dev, rank, world, group = init_world(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the CPU mode is a crash test; one thread keeps shared machines usable
    out: dict = {"gpus": world, "env": env_info(dev), "args": vars(args), "dtype": str(dtype), "rows": []}
    try:
        import transformers

        out["env"]["transformers"] = transformers.__version__
    except ImportError as e:
        log.error("transformers is not importable (%s): nothing to measure", e)
        out["error"] = f"transformers not importable: {e}"
        if rank == 0:
            write_json(out, args.out, args.json)
        return
    ctx = {"dev": dev, "dtype": dtype, "group": group, "world": world,
           "timer": Timer(dev, iters=args.iters, warmup=args.warmup, budget_s=args.budget_s)}
    for kv in args.kv_heads:
        for tokens in args.tokens:
            rec: dict = {"kv_heads": kv, "tokens": tokens * args.batch, "heads": args.heads}
            row = attempt(rec, "config", lambda: run_config(args, ctx, kv, tokens)) or rec
            out["rows"].append(row)
            if rank == 0:
                log.info("row %s", {k: v for k, v in row.items() if k != "kernels"})
                write_json(out, args.out, args.json)
            barrier()
    if rank == 0:
        path = write_json(out, args.out, args.json)
        print_table(out)
        print("wrote", path)
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
