"""Cost of the default agreement check (``cpscope.attention._agreement``) on an 8-layer training step, in one run.

An 8-layer Llama-like decoder (RMSNorm, GQA attention with cpscope RoPE and cpscope attention, SwiGLU MLP; bf16 on a
GPU) runs whole training steps — forward, backward, ``AdamW.step`` (whose pre-hook reads the deferred verdicts) —
at 4k and 32k tokens, with the check and without it (``agreement._ENABLED``, switched on every rank at the same
point), in interleaved rounds; the median step time of each and their ratio (target: <= 1.01x).

* ``torchrun --nproc-per-node N`` (N >= 2 GPUs): real CP over the world (NCCL), each rank holding tokens / N; the
  check runs where cpscope runs it, inside every attention call.
* one process (``python benchmarks/bench_agreement.py``, one GPU): a world of one cannot run CP, so each layer runs
  the check itself on its prepared CP1 call over the one-rank NCCL group (``check_call(call, group=world)``): the
  same host work, the same all-reduce kernel per layer and the same step-boundary read; only the all-reduce's
  latency between GPUs is missing (a 2·15 int64 all-reduce: microseconds on NVLink).
* ``--tiny``: CPU, gloo, tiny shapes (seconds; what ``tests/test_benchmarks_cpu.py`` runs).

Before timing, it checks correctness: the attention of the step's path (check on) equals a float64 reference of
this rank's rows, and with CP a deliberate disagreement (``comm`` differs per rank) raises ``RanksDisagreeError``
on every rank.

Example::

    python benchmarks/bench_agreement.py --tiny
    python benchmarks/bench_agreement.py --out benchmarks/results/agreement_h200.json          # one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_agreement.py --out benchmarks/results/agreement_h200x2.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cpscope  # noqa: E402
from cpscope.attention import _agreement as agreement, _api as api  # noqa: E402

logger = logging.getLogger("bench_agreement")


class _Attend:
    """The attention of every layer: cpscope's default path under CP; on one process, the prepared CP1 call with
    the check run over the one-rank group first (when the check is on)."""

    def __init__(self, world: int, group: Any) -> None:
        self.world, self.group = world, group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            return cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
        call = api.prepare_call(q, k, v, cpscope.resolve_scope(None), "bshd", True, None, None, None, None, None)
        if agreement._ENABLED:
            agreement.check_call(call, group=self.group)
        return api.run_call(call)


class _Layer(torch.nn.Module):
    """RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, attend: _Attend) -> None:
        super().__init__()
        self.h, self.g, self.d, self.attend = heads, kv_heads, hidden // heads, attend
        self.n1, self.n2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.d, bias=False)
        self.o = torch.nn.Linear(heads * self.d, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, self.h + 2 * self.g, self.d).split([self.h, self.g, self.g], 2)
        q = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="bshd")
        k = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="bshd")
        x = x + self.o(self.attend(q, k, v).reshape(b, s, -1))
        gate, up = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def _check_correctness(attend: _Attend, world: int, device: torch.device) -> dict[str, Any]:
    """The step's attention path (check on) against a float64 reference of this rank's rows; with CP, a
    deliberate disagreement raises on every rank."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 64 * world, 4, 16, generator=g, dtype=torch.float64) for _ in range(3)]  # [b, s, h, d]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=True).transpose(1, 2)
    dtype, tol = (torch.bfloat16, 3e-2) if device.type == "cuda" else (torch.float32, 1e-4)  # the step's kernels
    if world > 1:
        local = [cpscope.zigzag_shard(t, seq_dim=1).to(device, dtype) for t in full]
        want = cpscope.zigzag_shard(ref, seq_dim=1)
    else:
        local, want = [t.to(device, dtype) for t in full], ref
    err = (attend(*local).double().cpu() - want).abs().max().item()
    res: dict[str, Any] = {"max_abs_err_vs_float64": err, "tolerance": tol, "ok": err < tol}
    if world > 1:
        # a step boundary first: the agreed memory is forgotten, so every rank reads this call's verdict (a rank
        # repeating the call agreed just above while another changes its variant is the check's one limit:
        # docs/agreement.md)
        agreement.verify_agreement()
        try:
            cpscope.context_parallel_attention(*local, comm="p2p" if rank == 0 else "all_gather")
            res["disagreement"] = "no error"
        except cpscope.RanksDisagreeError as e:
            res["disagreement"] = str(e)[:200]
        res["ok"] = res["ok"] and "communication variant" in res["disagreement"]
    if not res["ok"]:
        raise SystemExit(f"correctness check failed: {res}")
    return res


def _timed(step: Callable[[], None], iters: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def _row(tokens: int, args: argparse.Namespace, dims: tuple, dtype: torch.dtype, device: torch.device,
         attend: _Attend, world: int) -> dict[str, Any]:
    hidden, heads, kv_heads, ffn = dims
    torch.manual_seed(0)
    model = torch.nn.ModuleList(_Layer(hidden, heads, kv_heads, ffn, attend) for _ in range(args.layers))
    model = model.to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    freqs = cpscope.rotary_freqs(hidden // heads, tokens, device=device)
    x = torch.randn(1, tokens // world, hidden, device=device, dtype=dtype)

    def step() -> None:
        h = x
        for layer in model:
            h = layer(h, freqs)
        h.float().pow(2).mean().backward()
        opt.step()  # its pre-hook reads the deferred verdicts (check on)
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False):  # warm-up, both ways
        agreement._ENABLED = on
        _timed(step, args.warmup, sync)
    for r in range(args.rounds):  # interleaved, alternating which goes first
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            dist.barrier()
            agreement._ENABLED = on
            times[on].append(_timed(step, args.iters, sync))
    agreement._ENABLED = True
    with_check, without = statistics.median(times[True]), statistics.median(times[False])
    return {"tokens": tokens, "local_tokens": tokens // world, "layers": args.layers, "step_ms_with_check": with_check,
            "step_ms_without_check": without, "ratio": with_check / without, "rounds_ms": {
                "with": times[True], "without": times[False]}}


def _check_alone(attend: _Attend, dims: tuple, tokens: int, world: int, dtype: torch.dtype, device: torch.device,
                 calls: int = 200) -> dict[str, float]:
    """Host time of the check alone on the step's attention shape (median of 5 rounds of ``calls`` calls): the first
    call of a kind (read on the host) and a repeated one (compared on the device)."""
    hidden, heads, kv_heads, _ = dims
    q = torch.randn(1, tokens // world, heads, hidden // heads, device=device, dtype=dtype)
    kv = torch.randn(1, tokens // world, kv_heads, hidden // heads, device=device, dtype=dtype)
    scope = cpscope.resolve_scope(attend.group if world > 1 else None)
    call = api.prepare_call(q, kv, kv, scope, "bshd", True, None, None, None, None, None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    agreement.verify_agreement()  # a fresh memory: the next call reads
    sync()
    t0 = time.perf_counter()
    agreement.check_call(call, group=attend.group)
    first = (time.perf_counter() - t0) * 1e6
    rounds = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            agreement.check_call(call, group=attend.group)
        rounds.append((time.perf_counter() - t0) / calls * 1e6)  # host time: the device work is asynchronous
    sync()
    t0 = time.perf_counter()
    agreement.verify_agreement()
    boundary = (time.perf_counter() - t0) * 1e6
    return {"first_call_us": first, "repeated_call_host_us": statistics.median(rounds), "step_boundary_read_us": boundary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny shapes (seconds)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="global tokens per step (default 4096 32768)")
    ap.add_argument("--iters", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds per mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the JSON results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gpu = torch.cuda.is_available() and not args.tiny
    if args.tiny:
        args.iters, args.rounds, args.warmup = min(args.iters, 2), min(args.rounds, 2), min(args.warmup, 1)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if gpu else "gloo")
    else:
        fd, init = tempfile.mkstemp(prefix="cpscope_bench_agree_")
        os.close(fd)
        os.unlink(init)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{init}", rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    group = dist.group.WORLD
    attend = _Attend(world, group)
    dims = (2048, 16, 4, 5632) if gpu else (64, 4, 2, 128)
    tokens = args.tokens or ([4096, 32768] if gpu else [32, 64])
    dtype = torch.bfloat16 if gpu else torch.float32
    scope = cpscope.runtime_cp(group if world > 1 else None)
    with scope:
        correct = _check_correctness(attend, world, device)
        rows = [_row(t, args, dims, dtype, device, attend, world) for t in tokens]
        alone = _check_alone(attend, dims, tokens[0], world, dtype, device)
    summary = {
        "command": " ".join(["torchrun", f"--nproc-per-node {world}"] if "RANK" in os.environ else ["python"])
        + " benchmarks/bench_agreement.py" + (" --tiny" if args.tiny else ""),
        "device": torch.cuda.get_device_name() if gpu else "cpu", "world": world,
        "mode": f"CP{world} (the check inside cpscope's attention)" if world > 1 else
                "one process: the check forced per layer over the one-rank group",
        "dims": {"hidden": dims[0], "heads": dims[1], "kv_heads": dims[2], "ffn": dims[3]}, "dtype": str(dtype),
        "correctness": correct, "rows": rows, "check_alone": alone}
    if rank == 0:
        for row in rows:
            logger.info("tokens %6d: step %.3f ms with the check, %.3f ms without: ratio %.4fx", row["tokens"],
                        row["step_ms_with_check"], row["step_ms_without_check"], row["ratio"])
        logger.info("%s", json.dumps(summary, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(summary, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
