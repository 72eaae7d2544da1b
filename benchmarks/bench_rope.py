"""Time cpscope's RoPE paths (eager torch, torch.compile, TE fused when importable), forward + backward.

Usage::

    python benchmarks/bench_rope.py                       # CPU: eager vs compiled
    python benchmarks/bench_rope.py --device cuda --seq 32768 --cp 4 --format thd

Each path runs on one simulated CP rank (RoPE needs no communication), so no process group is needed.
"""
from __future__ import annotations

import argparse
import time

import torch

from cpscope.rope import apply_rotary_pos_emb, rotary_freqs
from cpscope.scope import CPScope


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(impl: str, args: argparse.Namespace) -> float:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    local = args.seq // args.cp
    if args.format == "bshd":
        shape = (args.batch, local, args.heads, args.dim)
    elif args.format == "sbhd":
        shape = (local, args.batch, args.heads, args.dim)
    else:
        shape = (local * args.batch, args.heads, args.dim)
    cu = [i * args.seq for i in range(args.batch + 1)] if args.format == "thd" else None
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, device=device, dtype=dtype)
    freqs = rotary_freqs(args.rot_dim or args.dim, args.seq, device=device)
    scope = CPScope(object(), args.cp, args.rank) if args.cp > 1 else CPScope(None, 1, 0)

    def step() -> None:
        if impl == "floor":  # two plain copies: the memory traffic any fwd+bwd must at least move
            x.detach().clone(), g.clone()
            return
        with scope.bind():
            y = apply_rotary_pos_emb(x, freqs, qkv_format=args.format, cu_seqlens=cu, impl=impl)
        y.backward(g)

    for _ in range(args.warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / args.iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--format", default="bshd", choices=["bshd", "sbhd", "thd"])
    p.add_argument("--seq", type=int, default=4096, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rot-dim", type=int, default=0, help="0 = head dim")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--impls", default="floor,eager,compiled,te")
    args = p.parse_args()
    print(f"RoPE fwd+bwd, {args.format} global seq {args.seq}, cp {args.cp}, {args.heads}x{args.dim}, {args.dtype}, "
          f"{args.device}")
    for impl in args.impls.split(","):
        try:
            ms = bench(impl, args)
            print(f"  {impl:9s} {ms:9.3f} ms/iter")
        except Exception as e:  # noqa: BLE001 - report and go on (e.g. TE not installed)
            print(f"  {impl:9s} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100]}")


if __name__ == "__main__":
    main()
