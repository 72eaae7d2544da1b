"""Train a small GPT with hybrid context parallelism: CP1, CP2 and CP4 microbatches in the same step.

Every step draws a global batch of documents with a long-tail length distribution; the planner
(:func:`cpscope.hybrid.plan_hybrid`) gives each document a CP size and each rank its ordered microbatches; the
loop (:mod:`cpscope.train`) packs, pads, shards and binds each microbatch's group
with ``runtime_cp``; the loss is normalised by the global number of targets and gradients are summed over the
data-parallel group (here the world, ``dp_group=dist.group.WORLD``), so every mode computes the same update as one
process training on the whole batch.

Each step is one :func:`cpscope.train.run_step`: the model may be a plain module (gradients summed by hand),
wrapped in ``DistributedDataParallel`` (``--ddp``) or sharded by FSDP2 (``--fsdp``); the ranks run different numbers
of microbatches (some none) and the gradients are synchronised once per step either way
(:func:`cpscope.train.gradient_sync`).

Run it (4 ranks, gloo on CPU; NCCL when at least 4 GPUs are visible)::

    python examples/train_hybrid.py                      # spawns 4 ranks itself
    torchrun --nproc_per_node=4 examples/train_hybrid.py
    python examples/train_hybrid.py --ddp                # the model wrapped in DistributedDataParallel
    python examples/train_hybrid.py --fsdp               # every block and the root sharded with fully_shard
    python examples/train_hybrid.py --fsdp --fsdp-mp bf16 --no-reshard-after-forward --checkpoint
    python examples/train_hybrid.py --mode static2       # every document at CP2 (2 groups of 2)
    python examples/train_hybrid.py --mode single        # one process, no CP, whole batch: the reference

Options: ``--mode hybrid|static2|static4|single``, ``--ddp`` / ``--fsdp`` (``--fsdp-mp none|bf16|fp32``,
``--no-reshard-after-forward``), ``--checkpoint``, ``--compile``, ``--steps``, ``--seed``, ``--save-weights PATH``
and the model / data sizes (``--help``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make `gpt` (next to this file) and `cpscope` importable
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cpscope  # noqa: E402
from cpscope.hybrid import CostModel, long_tail_lengths, padded_length, plan_hybrid, plan_static  # noqa: E402
from cpscope.train import LocalMicrobatch, prepare_microbatches, run_step  # noqa: E402
from cpscope.train import gradient_sync  # noqa: E402
from _launch import launch, rank_device  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

MODES = ("hybrid", "static2", "static4", "single")
WRAPS = ("none", "ddp", "fsdp")
# FSDP2 mixed precision: "bf16" is the usual policy (bf16 compute, fp32 reduction, fp32 master weights); "fp32" is the
# same policy one precision up (fp32 compute, fp64 reduction, fp64 master weights), exact enough to compare with
# fp32 training in one process.
FSDP_MP = {"none": None, "bf16": ("float32", "bfloat16", "float32"), "fp32": ("float64", "float32", "float64")}
WORLD = 4
# A cost model for the tiny CPU demo: per-token work dominates, ring steps cost a little. The plan's CP sizes are
# driven mostly by `capacity` (tokens per rank per microbatch): documents longer than it must be split.
DEMO_COST = CostModel(attn=2e-8, linear=1e-5, comm=2e-6, latency=2e-4)


@dataclass
class TrainConfig:
    mode: str = "hybrid"
    steps: int = 6
    seed: int = 0
    docs_per_step: int = 16
    median_len: int = 96
    sigma: float = 0.9
    min_len: int = 16
    max_len: int = 512
    capacity: int = 128  # tokens one rank holds in a microbatch (after padding, / cp)
    vocab_size: int = 256
    hidden: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2
    optimizer: str = "sgd"  # SGD + momentum 0.9; or "adamw"
    lr: float = 1.0
    dtype: str = "float32"
    wrap: str = "none"  # "ddp": DistributedDataParallel; "fsdp": FSDP2 (fully_shard on every block and the root)
    fsdp_mp: str = "none"  # FSDP2 MixedPrecisionPolicy: "none", "bf16" or "fp32" (see FSDP_MP)
    reshard_after_forward: bool = True  # FSDP2's setting (the hybrid step keeps parameters unsharded regardless)
    checkpoint: bool = False  # activation checkpointing of every block (cpscope.checkpoint)
    compile: bool = False  # torch.compile every block
    compile_backend: str = "inductor"
    lengths: Optional[tuple[tuple[int, ...], ...]] = None  # explicit document lengths, one tuple per step (cycled)


@dataclass
class TrainResult:
    losses: list[float]  # global per-token loss of every step (identical on every rank)
    tokens: int  # real tokens trained on (global, all steps)
    seconds: float  # wall time of the steps (no start-up)
    seen: list[list[dict[str, Any]]] = field(default_factory=list)  # per step: this rank's microbatches
    empty: list[int] = field(default_factory=list)  # per step: empty microbatches this rank ran (FSDP2, no work)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # final weights (CPU)


# ------------------------------------------------------------------------------------------------------------
# Data


def make_documents(cfg: TrainConfig, step: int) -> list[torch.Tensor]:
    """The global batch of ``step``: ``docs_per_step`` documents, identical on every rank (seeded).

    Lengths are long-tailed (clipped log-normal). Each document is an arithmetic progression modulo the vocabulary
    with a random start and stride and 5 % random tokens: predicting the next token needs the previous two,
    i.e. attention, so the loss falls as the model learns.
    """
    if cfg.lengths is not None:
        lengths = list(cfg.lengths[step % len(cfg.lengths)])
    else:
        lengths = long_tail_lengths(
            cfg.docs_per_step, seed=cfg.seed * 100_003 + step, median=cfg.median_len, sigma=cfg.sigma,
            min_len=cfg.min_len, max_len=cfg.max_len, granularity=1,
        ).tolist()
    g = torch.Generator().manual_seed(cfg.seed * 7_919 + step)
    docs = []
    for n in lengths:
        start = torch.randint(cfg.vocab_size, (1,), generator=g)
        stride = torch.randint(1, 8, (1,), generator=g)
        doc = (start + stride * torch.arange(n)) % cfg.vocab_size
        noise = torch.rand(n, generator=g) < 0.05
        doc[noise] = torch.randint(cfg.vocab_size, (int(noise.sum()),), generator=g)
        docs.append(doc)
    return docs


def make_plan(cfg: TrainConfig, lengths: list[int], world: int):
    """The plan of one step: hybrid (planner), static CP2 / CP4 (every document at that size), or single."""
    if cfg.mode == "hybrid":
        return plan_hybrid(lengths, n_ranks=world, capacity=cfg.capacity, cost=DEMO_COST)
    cp = {"static2": 2, "static4": 4, "single": 1}[cfg.mode]
    # Static CP must hold the longest document at its one CP size: raise the capacity to that if needed.
    need = int(padded_length(max(lengths), cp)) // cp
    return plan_static(lengths, n_ranks=world, capacity=max(cfg.capacity, need), cost=DEMO_COST, cp=cp)


def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    gcfg = GPTConfig(vocab_size=cfg.vocab_size, hidden=cfg.hidden, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads, checkpoint=cfg.checkpoint)
    dtype = cfg.dtype if cfg.wrap != "fsdp" or FSDP_MP[cfg.fsdp_mp] is None else FSDP_MP[cfg.fsdp_mp][0]
    return GPT(gcfg).to(device=device, dtype=getattr(torch, dtype))


def wrap_model(cfg: TrainConfig, model: GPT, device: torch.device) -> torch.nn.Module:
    """Compile the blocks (``cfg.compile``), then wrap: DDP, or FSDP2 on every block and the root (collective)."""
    if cfg.compile:
        for block in model.blocks:
            if cfg.checkpoint:  # checkpoint outside, compile inside: Dynamo does not trace the scope re-entry
                block._forward = torch.compile(block._forward, backend=cfg.compile_backend)
            else:
                block.compile(backend=cfg.compile_backend)  # in place: parameter names and FSDP hooks unchanged
    if cfg.wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = FSDP_MP[cfg.fsdp_mp]
        policy = (MixedPrecisionPolicy() if mp is None else
                  MixedPrecisionPolicy(param_dtype=getattr(torch, mp[1]), reduce_dtype=getattr(torch, mp[2])))
        # A block's floating inputs include the fp32 RoPE angle table: FSDP2 would cast it to param_dtype (bf16
        # angles are off by up to 128 rad at position 60k). The hidden states arrive in param_dtype anyway.
        block_policy = dataclasses.replace(policy, cast_forward_inputs=False)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
    elif cfg.wrap != "none":
        raise ValueError(f"wrap must be one of {WRAPS}, got {cfg.wrap!r}")
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as full CPU tensors (FSDP2's sharded parameters are gathered: collective)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    out = {}
    for k, v in inner.state_dict().items():
        if hasattr(v, "full_tensor"):  # DTensor
            v = v.full_tensor()
        out[k] = v.detach().to("cpu", copy=True)
    return out


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {cfg.optimizer!r}")


# ------------------------------------------------------------------------------------------------------------
# The training loop (one function for every mode; rank / world come from torch.distributed)


def train(cfg: TrainConfig, *, device: Optional[torch.device] = None, progress: bool = False) -> TrainResult:
    """Train ``cfg.steps`` steps on this rank; collective over the world when ``torch.distributed`` is set up.

    ``mode="single"`` must run on a world of one (or without ``torch.distributed``): one process, CP1, the whole
    batch. The other modes run on every rank of a 4-rank world.
    """
    if cfg.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if (cfg.mode == "single") != (world == 1):
        raise ValueError(f"mode={cfg.mode!r} needs {'1 rank' if cfg.mode == 'single' else 'a world of 4'}, "
                         f"got a world of {world}")
    if cfg.mode != "single" and world != WORLD:
        raise ValueError(f"mode={cfg.mode!r} uses CP1/CP2/CP4 groups over {WORLD} ranks, got a world of {world}")
    if cfg.wrap not in WRAPS or cfg.fsdp_mp not in FSDP_MP:
        raise ValueError(f"wrap must be one of {WRAPS} and fsdp_mp one of {tuple(FSDP_MP)}, got {cfg.wrap!r}, "
                         f"{cfg.fsdp_mp!r}")
    if cfg.wrap != "none" and not dist.is_initialized():
        raise ValueError(f"wrap={cfg.wrap!r} needs torch.distributed (a world of 1 is fine)")
    device = device or torch.device("cpu")
    groups = cpscope.new_cp_groups([1, 2, 4]) if world > 1 else {1: None}  # collective, once
    # The data-parallel group: the ranks holding different tokens — here every rank (no tensor parallelism); one
    # process without torch.distributed is None, this rank alone. Always named: None never means the world.
    dp_group = dist.group.WORLD if dist.is_initialized() else None
    model = wrap_model(cfg, build_model(cfg, device), device)
    opt = build_optimizer(cfg, model)
    sync = gradient_sync(model, dp_group=dp_group)  # ManualSync / DDPSync / FSDPSync: synchronised once per step

    seen_step: list[dict[str, Any]] = []
    empty_step = [0]

    def forward(m: GPT, mb: LocalMicrobatch) -> torch.Tensor:
        # What the scope really is inside the forward: what RoPE and attention read.
        if mb.seqs:
            seen_step.append({"cp": cpscope.cp_size(), "cp_rank": cpscope.cp_rank(), "docs": mb.seqs,
                              "local_tokens": int(mb.input_ids.numel())})
        else:  # the empty microbatch of a rank without work (FSDP2 reduce-scatters in a backward)
            empty_step[0] += 1
        return m(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)

    result = TrainResult(losses=[], tokens=0, seconds=0.0)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{cfg.mode} x{world}", unit="step", file=sys.stdout)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        docs = make_documents(cfg, step)
        plan = make_plan(cfg, [d.numel() for d in docs], world)
        mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups, device=device)
        opt.zero_grad(set_to_none=True)
        seen_step, empty_step[0] = [], 0
        # Loss / (real targets of the whole global batch); gradients summed over dp_group once, after the last
        # microbatch, whatever the wrapper.
        step_result = run_step(model, mbs, dp_group=dp_group, sync=sync, forward=forward)
        opt.step()
        loss = step_result.global_loss()
        result.losses.append(loss)
        result.tokens += sum(d.numel() for d in docs)
        result.seen.append(seen_step)
        result.empty.append(empty_step[0])
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", mbs=len(mbs))
            bar.update()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    result.state = full_state(model)
    return result


# ------------------------------------------------------------------------------------------------------------
# Reporting


def summarize(cfg: TrainConfig, results: list[TrainResult], backend: str) -> str:
    r0 = results[0]
    world = len(results)
    wrap = {"none": "plain module", "ddp": "DistributedDataParallel",
            "fsdp": f"FSDP2 (mixed precision {cfg.fsdp_mp}, reshard_after_forward={cfg.reshard_after_forward})"}
    extras = "".join(f", {name}" for name, on in (("checkpointed blocks", cfg.checkpoint),
                                                  ("compiled blocks", cfg.compile)) if on)
    lines = [
        f"mode={cfg.mode} ranks={world} backend={backend} steps={cfg.steps} model: {cfg.n_layers} layers, "
        f"hidden {cfg.hidden}, {cfg.n_heads} heads ({cfg.n_kv_heads or cfg.n_heads} kv), {cfg.optimizer}, "
        f"{wrap[cfg.wrap]}{extras}",
        "What each rank saw (CP size bound in forward, CP rank, documents, local tokens per microbatch):",
    ]
    for step in range(len(r0.losses)):
        lines.append(f"  step {step}:")
        for rank, res in enumerate(results):
            mbs = " ".join(f"CP{s['cp']}[r{s['cp_rank']}]{list(s['docs'])}:{s['local_tokens']}"
                           for s in res.seen[step])
            if res.empty and res.empty[step]:
                mbs += " (one empty microbatch)"
            lines.append(f"    rank {rank}: {mbs.strip() or '-'}")
    lines.append("step  loss      microbatches by CP size (counted once per group)")
    for step, loss in enumerate(r0.losses):
        counts: dict[int, int] = {}
        for res in results:
            for s in res.seen[step]:
                counts[s["cp"]] = counts.get(s["cp"], 0) + 1
        by_cp = ", ".join(f"CP{cp}: {n // cp}" for cp, n in sorted(counts.items(), reverse=True))
        lines.append(f"{step:>4}  {loss:.6f}  {by_cp}")
    secs = max(r.seconds for r in results)
    lines.append(f"tokens: {r0.tokens}  time: {secs:.2f} s  throughput: {r0.tokens / secs:,.0f} tokens/s  "
                 f"final loss: {r0.losses[-1]:.6f}")
    if not torch.cuda.is_available():
        lines.append(f"(CPU processes on {os.cpu_count()} shared cores: this run shows that the plan runs and that the "
                     "losses equal --mode single's; its tokens/s measure nothing about CP speed — GPU figures: "
                     "docs/benchmarks.md)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------
# Launching: torchrun, self-spawn, or one process


def _run_rank(cfg: TrainConfig, save: Optional[str]) -> None:
    """Body of every rank: train, gather what each rank saw, report on rank 0."""
    backend = dist.get_backend()
    res = train(cfg, device=rank_device(backend), progress=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dataclasses.replace(res, state={}))
    if dist.get_rank() == 0:
        print(summarize(cfg, gathered, backend), flush=True)
        if save:
            torch.save(res.state, save)
            print(f"saved final weights to {save}")


def parse_args(argv: Optional[list[str]] = None) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="hybrid")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--save-weights", metavar="PATH", default=None, help="torch.save the final state_dict (rank 0)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--docs-per-step", type=int, default=TrainConfig.docs_per_step)
    p.add_argument("--max-len", type=int, default=TrainConfig.max_len)
    p.add_argument("--capacity", type=int, default=TrainConfig.capacity, help="tokens per rank per microbatch")
    p.add_argument("--hidden", type=int, default=TrainConfig.hidden)
    p.add_argument("--layers", type=int, default=TrainConfig.n_layers)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=TrainConfig.optimizer)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    w = p.add_mutually_exclusive_group()
    w.add_argument("--ddp", action="store_true", help="wrap the model in DistributedDataParallel")
    w.add_argument("--fsdp", action="store_true", help="shard every block and the root with FSDP2 (fully_shard)")
    p.add_argument("--fsdp-mp", choices=tuple(FSDP_MP), default="none",
                   help="FSDP2 MixedPrecisionPolicy: bf16 = bf16 compute, fp32 reduce; fp32 = fp32 compute, fp64 "
                        "reduce and masters")
    p.add_argument("--no-reshard-after-forward", action="store_true", help="FSDP2 reshard_after_forward=False")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--compile", action="store_true", help="torch.compile every block")
    a = p.parse_args(argv)
    if (a.fsdp_mp != "none" or a.no_reshard_after_forward) and not a.fsdp:
        p.error("--fsdp-mp and --no-reshard-after-forward need --fsdp")
    cfg = TrainConfig(mode=a.mode, steps=a.steps, seed=a.seed, docs_per_step=a.docs_per_step, max_len=a.max_len,
                      capacity=a.capacity, hidden=a.hidden, n_layers=a.layers, optimizer=a.optimizer, lr=a.lr,
                      wrap="ddp" if a.ddp else "fsdp" if a.fsdp else "none", fsdp_mp=a.fsdp_mp,
                      reshard_after_forward=not a.no_reshard_after_forward, checkpoint=a.checkpoint,
                      compile=a.compile)
    return cfg, a


def main(argv: Optional[list[str]] = None) -> None:
    cfg, a = parse_args(argv)
    if cfg.mode == "single" and cfg.wrap != "none":
        raise SystemExit("--mode single is the reference without torch.distributed: drop --ddp / --fsdp")
    if cfg.mode == "single":  # the reference: one process, no torch.distributed, CP1, whole batch
        torch.set_num_threads(os.cpu_count() or 1)
        res = train(cfg, progress=True)
        print(summarize(cfg, [res], "none"))
        if a.save_weights:
            torch.save(res.state, a.save_weights)
            print(f"saved final weights to {a.save_weights}")
        return
    launch(_run_rank, WORLD, cfg, a.save_weights, backend=a.backend)  # torchrun's ranks, or spawn 4 here


if __name__ == "__main__":
    main()
