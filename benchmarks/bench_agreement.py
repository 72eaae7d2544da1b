"""Cost of the default agreement check (cpscope.attention.agreement): per attention call, and against a training step.

Runs 2 processes over gloo (the check's transport on CPU and in the one-GPU setting; on NCCL jobs initialised with
``"cpu:gloo,cuda:nccl"`` it is the same host-only all-reduce). In one run it measures:

1. ``per_call``: the host time of one CP2 attention call (tiny shapes, CPU) with the check and without it (the check
   replaced by a no-op on both ranks at the same point), interleaved rounds, median of rounds; and the check alone
   (``check_agreement`` on a prepared call).
2. GPU mode (default when CUDA is present): the check alone on a prepared CP2 call of **CUDA** bf16 q/k/v of an
   8-layer Llama-like step's attention shape (the digest stays on the host), and an 8-layer Llama-like GQA bf16
   training step (forward + backward + SGD step) at CP1 on rank 0 (rank 1 idle at a barrier) at 4k and 32k tokens;
   the fraction = 8 x the check's time per call / the CP1 step time. One GPU cannot run CP2 over gloo without a
   host-staging shim for point-to-point (gloo moves CUDA tensors only for broadcast / all-reduce), so the CP2 step
   itself is not timed here.

The attention call of (1) is also checked against CP1 attention of the full sequence (correctness).

Example::

    python benchmarks/bench_agreement.py --tiny                 # CPU, seconds
    python benchmarks/bench_agreement.py --out benchmarks/results/agreement_h100.json    # GPU
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

logger = logging.getLogger("bench_agreement")


def _median_us(fn, n: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def _per_call(group, n: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    import cpscope
    import cpscope.attention.api as api
    from cpscope.attention.agreement import check_agreement

    cp, r = group.size(), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 32, 4, 16, generator=g) for _ in range(3)]  # [b, s, h, d]
    loc = [cpscope.zigzag_shard(t, seq_dim=1, group=group) for t in full]
    out = cpscope.context_parallel_attention(*loc, group=group)
    ref = cpscope.zigzag_shard(cpscope.context_parallel_attention(*full, group=None), seq_dim=1, group=group)
    err = (out - ref).abs().max().item()
    assert err < 1e-5, err

    def call() -> None:
        cpscope.context_parallel_attention(*loc, group=group)

    real = api.check_agreement
    with_check, without = [], []
    for _ in range(rounds):  # interleaved: the same machine state for both
        dist.barrier(group)
        with_check.append(_median_us(call, n, 1))
        api.check_agreement = lambda c: None  # both ranks, at the same point
        dist.barrier(group)
        without.append(_median_us(call, n, 1))
        api.check_agreement = real
    prepared = api.prepare_call(*loc, cpscope.resolve_scope(group), "bshd", True, None, None, None, None, None)
    dist.barrier(group)
    alone = _median_us(lambda: check_agreement(prepared), n, rounds)
    w, wo = statistics.median(with_check), statistics.median(without)
    return {"cp": cp, "rank": r, "max_abs_err_vs_cp1": err, "call_with_check_us": w, "call_without_check_us": wo,
            "check_overhead_us": w - wo, "ratio": w / wo, "check_alone_us": alone}


class _Layer(torch.nn.Module):
    """A Llama-like decoder layer: RMSNorm, GQA attention with RoPE (cpscope), RMSNorm, SwiGLU MLP."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.h, self.g, self.d = heads, kv_heads, hidden // heads
        self.n1, self.n2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.d, bias=False)
        self.o = torch.nn.Linear(heads * self.d, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        import cpscope

        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, self.h + 2 * self.g, self.d).split([self.h, self.g, self.g], 2)
        q = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="bshd")
        k = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="bshd")
        a = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
        x = x + self.o(a.reshape(b, s, -1))
        gate, up = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


def _step_ms(tokens: int, layers: int, dims: tuple, dtype: torch.dtype, device: torch.device, iters: int) -> float:
    import cpscope

    hidden, heads, kv_heads, ffn = dims
    torch.manual_seed(0)
    model = torch.nn.ModuleList(_Layer(hidden, heads, kv_heads, ffn) for _ in range(layers)).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    freqs = cpscope.rotary_freqs(hidden // heads, tokens, device=device)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)

    def step() -> None:
        h = x
        for layer in model:
            h = layer(h, freqs)
        h.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _check_on_device(group, dims: tuple, tokens: int, n: int, rounds: int) -> float:
    """The check alone on a prepared CP2 call of CUDA bf16 q/k/v (the attention shape of the step)."""
    import cpscope
    import cpscope.attention.api as api
    from cpscope.attention.agreement import check_agreement

    hidden, heads, kv_heads, _ = dims
    d, s = hidden // heads, tokens // group.size()
    dev = torch.device("cuda", torch.cuda.current_device())
    q = torch.randn(1, s, heads, d, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, s, kv_heads, d, device=dev, dtype=torch.bfloat16)
    call = api.prepare_call(q, kv, kv, cpscope.resolve_scope(group), "bshd", True, None, None, None, None, None)
    return _median_us(lambda: check_agreement(call), n, rounds)


def _worker(rank: int, world: int, init: str, args: argparse.Namespace, out: Any) -> None:
    import torch.distributed as dist

    import cpscope

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # both processes share the one GPU
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    group = cpscope.new_cp_groups([world])[world]
    res: dict[str, Any] = {"per_call": _per_call(group, args.calls, args.rounds)}
    gpu = torch.cuda.is_available() and not args.tiny
    dims = (2048, 16, 4, 5632) if gpu else (64, 4, 2, 128)
    sizes = [4096, 32768] if gpu else [256, 1024]
    dtype = torch.bfloat16 if gpu else torch.float32
    device = torch.device("cuda" if gpu else "cpu")
    rows = []
    for tokens in sizes:
        if gpu:
            check_us = _check_on_device(group, dims, tokens, args.calls, args.rounds)
        else:
            check_us = res["per_call"]["check_alone_us"]
        dist.barrier()
        step = _step_ms(tokens, args.layers, dims, dtype, device, args.iters) if rank == 0 else None
        dist.barrier()
        if rank == 0:
            frac = args.layers * check_us / (step * 1e3)
            rows.append({"tokens": tokens, "layers": args.layers, "dims": dims, "dtype": str(dtype),
                         "device": torch.cuda.get_device_name() if gpu else "cpu", "cp1_step_ms": step,
                         "check_per_call_us": check_us, "check_per_step_us": args.layers * check_us,
                         "fraction_of_cp1_step": frac, "step_ratio_bound": 1 + frac})
    res["steps"] = rows
    out.put((rank, res))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU only, small shapes (seconds)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timing round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10, help="timed training steps per size")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    args = ap.parse_args()
    if args.tiny:
        args.calls, args.rounds, args.iters = min(args.calls, 50), min(args.rounds, 5), min(args.iters, 3)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fd, init = tempfile.mkstemp(prefix="cpscope_bench_agree_")
    os.close(fd)
    os.unlink(init)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, init, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    summary = {"command": "python benchmarks/bench_agreement.py" + (" --tiny" if args.tiny else ""),
               "per_call_rank0": results[0]["per_call"], "per_call_rank1": results[1]["per_call"],
               "steps": results[0]["steps"]}
    text = json.dumps(summary, indent=2)
    logger.info("%s", text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
