"""What a sliding window saves under CP, on CPU: bytes sent and blocks computed per rank, against the halo bound.

Runs ``context_parallel_attention`` forward + backward on gloo ranks (``torchrun --nproc_per_node=CP``) for one
sequence of ``--tokens`` tokens with a causal ``--window`` (keys ``i - window .. i``), and counts what every rank
actually posts — ``isend`` bytes of ``batch_isend_irecv`` and the bytes of its collectives, wrapped in this process
(independent of cpscope's own counters) — per pass:

* ``p2p`` with the window: the halo exchange, real compute (banded CPU blocks), timed;
* for comparison, with the blocks stubbed (bytes do not depend on what the blocks compute): ``p2p`` without the
  window (the zigzag ring: what one pays when the window is not passed), ``all_gather`` and ``a2a`` with it.

The **halo lower bound** per rank and pass: every K/V row of another rank that one of this rank's queries may see
must reach it once (forward: K and V; backward: the same rows again and their dK/dV back), so a rank sends at
least the rows its peers' queries see of it — computed here from the zigzag chunks by interval arithmetic, not by
cpscope. The goal: p2p with a 256 window at 64k tokens, CP4, within 2x of the bound. Also printed: the (query
chunk, key chunk) pieces and the unmasked (query, key) pairs each rank computes (the plan's counters) against the
ring's ``2·cp + 1`` pieces and its causal pairs.

Example::

    torchrun --nproc_per_node=4 benchmarks/bench_window_comm.py --tokens 65536 --window 256 \\
        --out benchmarks/results/window_comm_cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: cpscope
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_util import env_info, init_world, log  # noqa: E402

import cpscope  # noqa: E402
from cpscope.attention import _exchange as comm  # noqa: E402
from cpscope.attention._kernels import acc_dtype, exact  # noqa: E402

# ---------------------------------------------------------------------------------------------- byte counting


class Tally:
    """Bytes this rank posts per phase, counted at the torch.distributed calls the variants make."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.sent: dict[str, int] = {"forward": 0, "backward": 0}

    def add(self, nbytes: int) -> None:
        self.sent[self.phase] += nbytes


@contextlib.contextmanager
def counting(tally: Tally) -> Iterator[None]:
    """Count the bytes every point-to-point send and collective of this rank posts (what leaves the rank: an
    all-gather sends its input to each peer, a reduce-scatter and an all-to-all the peers' parts)."""
    world = dist.get_world_size()
    saved = (dist.batch_isend_irecv, comm._ALL_GATHER, comm._REDUCE_SCATTER, dist.all_to_all_single)

    def p2p(ops):
        tally.add(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
        return saved[0](ops)

    def gather(out, x, **kw):
        tally.add(x.numel() * x.element_size() * (world - 1))
        return saved[1](out, x, **kw)

    def scatter(out, x, **kw):
        tally.add(x.numel() * x.element_size() * (world - 1) // world)
        return saved[2](out, x, **kw)

    def a2a(out, x, **kw):
        tally.add(x.numel() * x.element_size() * (world - 1) // world)
        return saved[3](out, x, **kw)

    dist.batch_isend_irecv, comm._ALL_GATHER, comm._REDUCE_SCATTER, dist.all_to_all_single = p2p, gather, scatter, a2a
    try:
        yield
    finally:
        dist.batch_isend_irecv, comm._ALL_GATHER, comm._REDUCE_SCATTER, dist.all_to_all_single = saved


@contextlib.contextmanager
def stubbed_blocks() -> Iterator[None]:
    """CPU blocks that return zeros of the right shapes (for byte counts of variants too slow to compute here)."""
    saved = exact.forward, exact.backward

    def forward(q, k, v, scale, causal, vl, *features, **kw):
        dt = acc_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = torch.zeros((q.shape[1], q.shape[0]) if vl is not None else (q.shape[0], q.shape[2], q.shape[1]),
                          dtype=dt)
        return out, lse

    def backward(dout, q, k, v, out, lse, scale, causal, vl, *features, **kw):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    exact.forward, exact.backward = forward, backward  # the router looks them up per block
    try:
        yield
    finally:
        exact.forward, exact.backward = saved


# ---------------------------------------------------------------------------------------------- the bound


def needed_rows(n: int, cp: int, reader: int, owner: int, window: int) -> int:
    """Rows of ``owner``'s local K/V that ``reader``'s queries may see (one sequence of ``n`` tokens, causal
    window): interval arithmetic on the zigzag chunks (chunks ``r`` and ``2cp-1-r`` of ``c = n / 2cp`` tokens)."""
    if reader == owner:
        return 0
    c = n // (2 * cp)
    seen = [(max(0, x * c - window), (x + 1) * c) for x in (reader, 2 * cp - 1 - reader)]  # keys each chunk sees
    total = 0
    for y in (owner, 2 * cp - 1 - owner):
        covered = set()
        for a, b in seen:
            lo, hi = max(a, y * c), min(b, (y + 1) * c)
            covered.update(range(lo, hi))
        total += len(covered)
    return total


def bound(n: int, cp: int, rank: int, window: int, row_bytes: int) -> dict[str, int]:
    """The halo lower bound of one rank's sent bytes per pass (``row_bytes``: one K row plus one V row)."""
    rows = sum(needed_rows(n, cp, t, rank, window) for t in range(cp))
    return {"rows": rows, "forward": rows * row_bytes, "backward": 2 * rows * row_bytes}


# ---------------------------------------------------------------------------------------------- one run


def run(args: argparse.Namespace, group: Any, comm_name: str, window: Any, tally: Tally,
        stub: bool) -> dict[str, Any]:
    rank, cp = dist.get_rank(), dist.get_world_size()
    n, h, hk, d = args.tokens, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(rank)
    local = n // cp
    q, k, v = (torch.randn(local, x, d, generator=g).requires_grad_(True) for x in (h, hk, hk))
    cu = torch.tensor([0, n], dtype=torch.int32)
    ctx = stubbed_blocks() if stub else contextlib.nullcontext()
    with ctx, counting(tally), cpscope.runtime_cp(group):
        tally.phase, tally.sent = "forward", {"forward": 0, "backward": 0}
        dist.barrier()
        t0 = time.perf_counter()
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu, comm=comm_name,
                                                 window=window)
        t1 = time.perf_counter()
        tally.phase = "backward"
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
    row = {"variant": comm_name, "window": window, "stubbed_blocks": stub, "sent_bytes": dict(tally.sent)}
    if not stub:
        row.update(forward_s=round(t1 - t0, 3), backward_s=round(t2 - t1, 3),
                   finite=bool(torch.isfinite(out).all() and torch.isfinite(q.grad).all()))
    return row


def plan_counters(n: int, cp: int, rank: int, window: int) -> dict[str, int]:
    from cpscope._pack import pack_for
    from cpscope.attention._halo_plan import HaloGeometry

    c = HaloGeometry(pack_for([0, n], cp, rank), torch.device("cpu"), (window, 0), True).counters()
    chunk = n // (2 * cp)
    c["ring_pieces"] = 2 * cp + 1
    c["ring_pairs"] = chunk * (chunk + 1) + chunk * chunk * (2 * cp - 1)  # the ring's causal pairs per rank
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--window", type=int, default=256, help="causal window: keys i - window .. i")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--out", default=None, help="JSON file (rank 0 writes it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, rank, cp, group = init_world("cpu")
    row_bytes = 2 * args.kv_heads * args.head_dim * 4  # a K row plus a V row, fp32
    w = (args.window, 0)
    tally = Tally()
    rows = [run(args, group, "p2p", w, tally, stub=False), run(args, group, "p2p", None, tally, stub=True),
            run(args, group, "all_gather", w, tally, stub=True), run(args, group, "a2a", w, tally, stub=True)]
    mine = {"rank": rank, "bound": bound(args.tokens, cp, rank, args.window, row_bytes),
            "plan": plan_counters(args.tokens, cp, rank, args.window), "runs": rows}
    every = [None] * cp
    dist.all_gather_object(every, mine)
    if rank == 0:
        report(args, cp, every)
    dist.destroy_process_group()


def report(args: argparse.Namespace, cp: int, every: list[dict[str, Any]]) -> None:
    lines = [f"CP{cp}, {args.tokens} tokens, causal window {args.window}, heads {args.heads}/{args.kv_heads} x "
             f"{args.head_dim}, fp32 (bytes per pass sent by each rank)"]
    for r in every:
        b, halo = r["bound"], r["runs"][0]
        ratio = {p: halo["sent_bytes"][p] / b[p] if b[p] else float("nan") for p in ("forward", "backward")}
        r["ratio_to_bound"] = ratio
        others = ", ".join(f"{x['variant']}{'+window' if x['window'] else ''} {x['sent_bytes']['forward']:,}"
                           for x in r["runs"][1:])
        pl = r["plan"]
        lines.append(
            f"rank {r['rank']}: p2p+window sends {halo['sent_bytes']['forward']:,} B forward / "
            f"{halo['sent_bytes']['backward']:,} B backward; bound {b['forward']:,} / {b['backward']:,} "
            f"({b['rows']} rows) -> {ratio['forward']:.2f}x / {ratio['backward']:.2f}x; forward of the others: "
            f"{others}; pieces {pl['pieces']} of the ring's {pl['ring_pieces']}, pairs {pl['pairs']:,} of "
            f"{pl['ring_pairs']:,}; p2p+window {halo['forward_s']} s fwd, {halo['backward_s']} s bwd")
    for line in lines:
        log.info(line)
    if args.out:
        cmd = f"torchrun --nproc_per_node={cp} benchmarks/bench_window_comm.py " + " ".join(sys.argv[1:])
        with open(args.out, "w") as f:
            json.dump({"command": cmd, "summary": lines, "ranks": every, "env": env_info(torch.device("cpu"))}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
