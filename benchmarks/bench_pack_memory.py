"""Memory of cpscope's per-pack caches over a long run: N distinct packs, each used like one microbatch.

    python benchmarks/bench_pack_memory.py [--packs 1000] [--tokens 65536] [--cp 2]

Each step makes a fresh global ``cu_seqlens`` tensor (a long-tail pack of ``--tokens`` tokens), then does what RoPE,
sharding and ring attention derive from it on CP rank 0 of ``--cp``: the zigzag index and positions of the local
tokens and the ring's per-pack geometry (offsets, halves, document split). Prints the process RSS before, every
100 packs and at the end. Runs on the CPU without a process group; works on this commit and on older ones that
cached by ``cu_seqlens`` tuples (for a before/after figure).
"""
from __future__ import annotations

import argparse
import gc
import os
import random

import torch


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pack_lengths(rng: random.Random, tokens: int, unit: int) -> list[int]:
    lens, left = [], tokens
    while left > 0:
        n = min(left, unit * max(1, int(rng.paretovariate(1.2) * 4)))
        lens.append(n)
        left -= n
    return lens


def step(cu: torch.Tensor, cp: int) -> None:
    import cpscope

    cpscope.zigzag_indices(cu, cp, 0)
    cpscope.zigzag_positions(cu, cp, 0)
    from cpscope._pack import pack_for
    from cpscope.attention._ring_plan import plan_for_pack

    plan_for_pack(pack_for(cu, cp, 0), torch.device("cpu"), causal=True, scale=1.0)  # cached on the pack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packs", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--cp", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    unit = 2 * args.cp
    gc.collect()
    base = rss_mib()
    print(f"start: RSS {base:.0f} MiB")
    for i in range(1, args.packs + 1):
        lens = pack_lengths(rng, args.tokens, unit * 64)
        cu = torch.tensor([0] + [sum(lens[: j + 1]) for j in range(len(lens))], dtype=torch.int32)
        step(cu, args.cp)
        del cu
        if i % 100 == 0:
            gc.collect()
            print(f"after {i:5d} packs: RSS {rss_mib():.0f} MiB (+{rss_mib() - base:.0f})", flush=True)


if __name__ == "__main__":
    main()
