"""Host time per layer of a packed (``thd``) microbatch: RoPE on q and k, then attention forward.

What one layer does::

    q = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu)
    k = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="thd", cu_seqlens=cu)
    o = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)   # q, k, v require grad

for packs of ``--docs`` documents (default 16, 256, 4096) of equal length filling ``--tokens`` (default 131072:
4096 × 32, 256 × 512, 16 × 8192), with ``cu`` an int32 tensor on the device (as TE / Megatron / transformers pass
it). Every layer of one microbatch sees the same ``cu`` tensor; a new microbatch brings a new one.

How host time is separated from device time:

* **CUDA, busy GPU** (the figure to read): before each timed layer a ``torch.cuda._sleep`` kernel of
  ``--sleep-ms`` is enqueued, then ``time.perf_counter`` brackets the Python call, then ``stream.query()`` tells
  whether the GPU is still busy. If it is, the host never waited for the GPU during the call: the time is pure host
  work (Python, validation, planning, kernel launches). If it is not, the call synchronised (its time includes the
  wait) and the sample is marked invalid (``valid`` < 100%).
* **CUDA, idle GPU**: the same call after ``torch.cuda.synchronize()``; a synchronisation inside then costs only the
  device time of this layer's own earlier kernels. Used for the first layer of each pack (which may read ``cu`` to
  the host once, by design) and as a cross-check.
* **syncs**: ``torch.cuda.set_sync_debug_mode("warn")`` counts synchronising calls in a first and a later layer.
* **CPU** (``--device cpu``): everything is host time, so the attention block kernels (``cpscope.attention._kernels.exact.forward``, an
  exact-math kernel that builds a ``t × t`` mask — device work, and infeasible at 131k tokens) are replaced by a
  stub returning zeros of the right shapes (``--no-stub`` keeps them). RoPE's and the merges' elementwise work stays;
  heads default to 1 × 8 so it is small, and the **floor** row measures it.
* **floor** (CP1): a plain-PyTorch layer with everything per-pack precomputed (RoPE angles gathered once per pack;
  one ``varlen_attn`` call on CUDA, the stub on CPU): the least host time this layer can take in eager PyTorch.

CP sizes: CP1 (``group=None``); CP2 on one process (``--cp2 fake``, default when not under torchrun): rank 0 of a
2-rank world of torch's *fake* process group (``torch.testing._internal.distributed.fake_pg``: collectives complete
at once and move no data — cpscope's host work and launches are real, NCCL's own host cost is not included, the
received K/V are left uninitialised); under ``torchrun --nproc_per_node=2`` a real CP2 group (NCCL / gloo).

Usage::

    python benchmarks/bench_host.py --out OUT                                   # one GPU: CP1 + CP2 (fake)
    torchrun --nproc_per_node=2 benchmarks/bench_host.py --out OUT              # two GPUs: CP1 + real CP2
    python benchmarks/bench_host.py --device cpu --out OUT                      # CPU: CP1 + CP2 (fake)
    torchrun --nproc_per_node=2 benchmarks/bench_host.py --device cpu --out OUT # CPU: CP1 + gloo CP2
    python benchmarks/bench_host.py --device cpu --dry-run --out /tmp/x        # crash test

Target: a 4096-document pack ≤ 0.3 ms host time per layer. Results: ``host_bench[_<tag>].json`` (or ``--json``).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_util import attempt, count_syncs, env_info, init_world, setup_logging, sync, write_json  # noqa: E402

log = logging.getLogger("cpscope.bench")
TARGET_MS = 0.3


# ------------------------------------------------------------------------------------------------- the layer


def _pack(ndocs: int, tokens: int, variant: int, cp: int) -> list[int]:
    """``ndocs`` equal documents filling ``tokens``; ``variant`` > 0 moves 8 tokens (4 for documents of ≤ 8) between
    two documents, so every microbatch is a new pack (no cache keyed on the offsets' values can hit) of the same
    size and shape class."""
    n = tokens // ndocs
    lens = [n] * ndocs
    step = 8 if n > 8 else 4
    if variant and ndocs > 1 and n > step:
        i, j = variant % ndocs, (variant * 7 + 1) % ndocs
        if i == j:
            j = (i + 1) % ndocs
        lens[i] += step
        lens[j] -= step
    assert all(x % (2 * cp) == 0 and x > 0 for x in lens), lens
    return lens


def _cu(lens: list[int], dev) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=dev)


class Problem:
    def __init__(self, args, dev, cp: int) -> None:
        self.args, self.dev, self.cp = args, dev, cp
        local = args.tokens // cp
        g = torch.Generator(device=dev).manual_seed(0)
        mk = lambda h: torch.randn(local, h, args.dim, device=dev, dtype=args.dtype, generator=g)  # noqa: E731
        self.q, self.k, self.v = (mk(h).requires_grad_(True) for h in (args.heads, args.kv_heads, args.kv_heads))
        from cpscope.rope import rotary_freqs

        self.freqs = rotary_freqs(args.dim, args.tokens, device=dev)

    def cpscope_layer(self, cu: torch.Tensor, group: Any) -> Callable[[], torch.Tensor]:
        import cpscope

        q, k, v, freqs = self.q, self.k, self.v, self.freqs

        def layer() -> torch.Tensor:
            qr = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu, group=group)
            kr = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="thd", cu_seqlens=cu, group=group)
            return cpscope.context_parallel_attention(qr, kr, v, qkv_format="thd", cu_seqlens=cu, group=group)

        return layer

    def floor_layer(self, lens: list[int]) -> Callable[[], torch.Tensor]:
        """Plain PyTorch, CP1, per-pack work done here once: RoPE angles by position, host offsets, one kernel."""
        cu = _cu(lens, self.dev)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.dev)
        ang = self.freqs.reshape(self.freqs.shape[0], -1).index_select(0, pos)[:, None, :]  # [t, 1, d]
        cos, sin = ang.cos().to(self.args.dtype), ang.sin().to(self.args.dtype)
        q, k, v, m = self.q, self.k, self.v, max(lens)
        half = q.shape[-1] // 2

        def rope(x):
            rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * cos + rot * sin

        if self.dev.type == "cuda":
            from bench_attention import _varlen_api

            call, how = _varlen_api()
            if call is None:
                raise RuntimeError(how)
            if how == "expand" and q.shape[1] != k.shape[1]:
                g = q.shape[1] // k.shape[1]
                k, v = (t.detach().repeat_interleave(g, 1).requires_grad_(True) for t in (k, v))

            def attn(a, b, c):
                return call(a, b, c, cu, cu, m, m)
        else:
            def attn(a, b, c):  # the CPU stub's cost: one output allocation
                return torch.zeros_like(a)

        def layer() -> torch.Tensor:
            return attn(rope(q), rope(k), v)

        return layer


# ------------------------------------------------------------------------------------------------ CPU stub


def install_cpu_stub() -> list[int]:
    """Replace the CPU block kernel by zeros of the right shapes; returns the call counter."""
    from cpscope.attention._kernels import exact

    if not hasattr(exact, "forward"):
        raise RuntimeError("cpscope.attention._kernels.exact.forward not found: cannot stub the CPU kernel (refusing "
                           "to run the exact-math kernel, which builds a t x t mask, at this size)")
    calls = [0]

    def stub(q, k, v, scale, causal, vl, window=None, softcap=None):
        calls[0] += 1
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        if vl is not None:  # [t, h, d] -> lse [h, t]
            return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=dt)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=dt)

    exact.forward = stub  # the router looks it up per block
    return calls


# --------------------------------------------------------------------------------------------------- timing


class Sleeper:
    """``torch.cuda._sleep`` calibrated to milliseconds on this GPU."""

    def __init__(self, dev) -> None:
        self.dev = dev
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # warm
        sync(dev)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        sync(dev)
        self.cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-6)

    def __call__(self, ms: float) -> None:
        torch.cuda._sleep(int(self.cycles_per_ms * ms))


def measure(args, dev, make_layer: Callable[[int], Callable[[], Any]], sleeper: Optional[Sleeper]) -> dict:
    """Host ms of the first layer of a fresh pack and of later layers (same pack), medians over ``--packs``."""
    cuda = dev.type == "cuda"
    for w in range(2):  # warm-up: graph caches, allocator, lazy imports
        layer = make_layer(10_000 + w)
        for _ in range(2):
            layer()
    sync(dev)
    first, nxt, nxt_idle, valid = [], [], [], []
    res: dict = {}
    if cuda:
        res["syncs_first"] = count_syncs(make_layer(20_000))
        lay = make_layer(20_001)
        lay()
        sync(dev)
        res["syncs_next"] = count_syncs(lay)
        sync(dev)
    for r in range(args.packs):
        layer = make_layer(r + 1)
        sync(dev)
        t0 = time.perf_counter()
        layer()
        first.append((time.perf_counter() - t0) * 1e3)
        for _ in range(args.layers - 1):
            if cuda:
                sleeper(args.sleep_ms)
            t0 = time.perf_counter()
            layer()
            t = (time.perf_counter() - t0) * 1e3
            busy = (not torch.cuda.current_stream(dev).query()) if cuda else True
            nxt.append(t)
            valid.append(busy)
        sync(dev)
        t0 = time.perf_counter()
        layer()
        nxt_idle.append((time.perf_counter() - t0) * 1e3)
        sync(dev)
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    good = [t for t, ok in zip(nxt, valid) if ok]
    res.update(first_ms=med(first), next_ms=med(good) if good else None, next_all_ms=med(nxt),
               next_valid_pct=round(100 * sum(valid) / max(len(valid), 1), 1), next_idle_ms=med(nxt_idle),
               samples=len(nxt), first_min_ms=round(min(first), 4), next_min_ms=round(min(nxt), 4) if nxt else None)
    if res["next_ms"] is not None and res["first_ms"] is not None:
        res["fwd_80_layers_ms"] = round(res["first_ms"] + 79 * res["next_ms"], 2)
    return res


def _cprofile(layer: Callable[[], Any], dev, n: int = 20, top: int = 18) -> list[str]:
    """cProfile of ``n`` later layers (after one first layer): the ``top`` functions by own time, one line each."""
    import cProfile
    import pstats

    layer()
    sync(dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        layer()
    prof.disable()
    sync(dev)
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # (file, line, fn) -> (cc, nc, tt, ct)
    return [f"{tt / n * 1e3:.4f} ms own, {ct / n * 1e3:.4f} ms cum, {nc // n} calls/layer: "
            f"{os.path.basename(fn[0])}:{fn[1]}({fn[2]})" for fn, (cc, nc, tt, ct, _) in rows]


# ----------------------------------------------------------------------------------------------------- main


def _fake_cp2_group() -> Any:
    """A 2-rank world of torch's fake process group, this process rank 0; its cpscope CP group of size 2."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpscope

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    return cpscope.new_cp_groups([2])[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes (crash test)")
    ap.add_argument("--docs", type=int, nargs="+", default=[16, 256, 4096])
    ap.add_argument("--tokens", type=int, default=131072, help="tokens per pack (global)")
    ap.add_argument("--heads", type=int, default=None, help="q heads (default: 32 on CUDA, 1 on CPU)")
    ap.add_argument("--kv-heads", type=int, default=None, help="k/v heads (default: 8 on CUDA, 1 on CPU)")
    ap.add_argument("--dim", type=int, default=None, help="head dim (default: 128 on CUDA, 8 on CPU)")
    ap.add_argument("--layers", type=int, default=8, help="layer calls per pack (the first one is reported apart)")
    ap.add_argument("--packs", type=int, default=5, help="fresh packs per case")
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="GPU busy kernel before each later layer")
    ap.add_argument("--cp2", default="auto", choices=["auto", "fake", "off"],
                    help="one process: CP2 rows on torch's fake process group (auto: on unless under torchrun)")
    ap.add_argument("--no-stub", action="store_true", help="CPU: keep the real block kernels")
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--cprofile", type=int, default=0, metavar="DOCS",
                    help="also cProfile 20 later layers of the DOCS-document pack (CP1 and CP2), top functions")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("--json", default=None, help="file name under --out (default: host_bench[_TAG].json)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.heads = args.heads or (32 if cuda else 1)
    args.kv_heads = args.kv_heads or (8 if cuda else 1)
    args.dim = args.dim or (128 if cuda else 8)
    if args.dry_run:
        args.docs, args.tokens, args.layers, args.packs = [4, 64], 2048, 3, 2
        args.heads, args.kv_heads, args.dim = (4, 2, 16) if cuda else (2, 1, 8)
    args.dtype = torch.bfloat16 if cuda else torch.float32
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dev, rank, world, real_group = init_world(args.device)
        groups = {"cp1": None, f"cp{world}": real_group}
    else:
        setup_logging(0)
        rank = 0
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        groups = {"cp1": None}
        if args.cp2 in ("auto", "fake"):
            rec: dict = {}
            g = attempt(rec, "fake_pg", _fake_cp2_group)
            if g is not None:
                groups["cp2-fake"] = g
            else:
                log.warning("CP2 (fake process group) rows off: %s", rec.get("errors"))
    if not cuda:
        torch.set_num_threads(1)
    out: dict = {"env": env_info(dev), "args": {k: str(v) for k, v in vars(args).items()}, "rows": [],
                 "method": "CUDA: busy-GPU host time (see docstring); CPU: perf_counter with stubbed block kernels"
                           if not args.no_stub else "CPU: perf_counter, real block kernels"}
    try:
        from cpscope.rope import _api as _rope

        out["env"]["rope_impl"] = "te" if (cuda and _rope._te_apply()) else "torch"
    except Exception:  # noqa: BLE001
        pass
    calls = install_cpu_stub() if not cuda and not args.no_stub else None
    sleeper = Sleeper(dev) if cuda else None
    if calls is not None:  # the stub must be what runs: a tiny call first
        import cpscope

        q = torch.randn(8, 1, 8, requires_grad=True)
        cpscope.context_parallel_attention(q, q, q, qkv_format="thd", cu_seqlens=[0, 8], group=None)
        if not calls[0]:
            raise RuntimeError("the CPU kernel stub was not called: refusing to time the real CPU kernel")
    for mode, group in groups.items():
        cp = 1 if group is None else group.size()
        prob = attempt({}, "inputs", lambda: Problem(args, dev, cp))
        for nd in args.docs:
            row: dict = {"mode": mode, "docs": nd, "tokens_per_doc": args.tokens // nd, "tokens": args.tokens,
                         "heads": f"{args.heads}/{args.kv_heads}x{args.dim}"}
            if prob is None:
                row["errors"] = {"inputs": "could not build inputs"}
                out["rows"].append(row)
                continue

            def make(variant: int, nd=nd, cp=cp, group=group):
                return prob.cpscope_layer(_cu(_pack(nd, args.tokens, variant, cp), dev), group)

            res = attempt(row, "cpscope", lambda: measure(args, dev, make, sleeper))
            if res:
                row.update(res)
            if mode == "cp1" and not args.no_floor:
                fl = attempt(row, "floor", lambda: measure(
                    args, dev, lambda v, nd=nd: prob.floor_layer(_pack(nd, args.tokens, v, 1)), sleeper))
                if fl:
                    row["floor_first_ms"], row["floor_next_ms"] = fl["first_ms"], fl["next_ms"]
                    row["floor_next_valid_pct"] = fl["next_valid_pct"]
            if row.get("next_ms") is not None:
                row["meets_target"] = row["next_ms"] <= TARGET_MS
            if args.cprofile == nd:
                row["cprofile_top"] = attempt(row, "cprofile", lambda: _cprofile(make(30_000), dev))
            out["rows"].append(row)
            if rank == 0:
                log.info("row %s", row)
        prob = None  # free the inputs before the next mode
        if cuda:
            torch.cuda.empty_cache()
    out["env"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    if rank == 0:
        name = args.json or f"host_bench{'_' + args.tag if args.tag else ''}.json"
        path = write_json(out, args.out, name)
        print_table(out, cuda)
        print("wrote", path)
    if dist.is_initialized():
        if world > 1:
            dist.barrier()
        dist.destroy_process_group()


def print_table(out: dict, cuda: bool) -> None:
    e = out["env"]
    print(f"\n## Host time per layer (RoPE q, k + attention forward), {e.get('device', 'CPU')}, torch {e['torch']}, "
          f"load {e.get('loadavg')} → {e.get('loadavg_end')}; target ≤ {TARGET_MS} ms (4096 documents)")
    col = ("later layers ms, median / min (busy GPU, valid %) | later, idle GPU ms" if cuda
           else "later layers ms, median / min | one more ms")
    print(f"| CP | docs × tokens | first layer ms, median / min | {col} | syncs first/later | floor first/later ms "
          "| 80-layer forward ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for r in out["rows"]:
        valid = f" ({r.get('next_valid_pct')}%)" if cuda and r.get("next_valid_pct") is not None else ""
        nxt = r.get("next_ms") if r.get("next_ms") is not None else r.get("next_all_ms")
        print(f"| {r['mode']} | {r['docs']} × {r['tokens_per_doc']} | {f(r.get('first_ms'))} / "
              f"{f(r.get('first_min_ms'))} | {f(nxt)} / {f(r.get('next_min_ms'))}{valid} | "
              f"{f(r.get('next_idle_ms'))} | {r.get('syncs_first', '-')}/{r.get('syncs_next', '-')} | "
              f"{f(r.get('floor_first_ms'))}/{f(r.get('floor_next_ms'))} | {r.get('fwd_80_layers_ms', '-')} |")
    for r in out["rows"]:
        for k, v in (r.get("errors") or {}).items():
            print(f"error: {r['mode']} {r['docs']} docs, {k}: {v.splitlines()[0][:200]}")
    for r in out["rows"]:
        if r.get("cprofile_top"):
            print(f"\ncProfile, {r['mode']}, {r['docs']} documents, per later layer (profiler overhead included):")
            print("\n".join("  " + line for line in r["cprofile_top"]))


if __name__ == "__main__":
    main()
