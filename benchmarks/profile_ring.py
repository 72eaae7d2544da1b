"""Where the time of one CP ring-attention step goes: a kernel timeline per rank from the PyTorch profiler.

Launch on 2 GPUs (after a few warm-up steps, ONE forward+backward step is profiled; ranks synchronise before and
after it, so the trace holds exactly that step)::

    torchrun --nproc_per_node=2 benchmarks/profile_ring.py --cases bshd-16384 thd --out OUT

For each case and rank it prints the GPU span of the step, the busy time per stream, the union of busy time over
all streams, the idle gaps on the compute stream and the kernels in order (start, duration, stream, name), and
with ``--traces`` writes the chrome trace (gzipped) to OUT. ``python benchmarks/profile_ring.py --analyze trace.json.gz`` reprints
the summary from a saved trace. Knob: ``--varlen-kernel`` picks the thd block kernel (default: the library's choice).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

H, D = 32, 128


def _short(name: str) -> str:
    for key in ("cudnn", "flash", "nccl", "elementwise", "reduce", "index", "cat", "copy", "fill", "Memcpy",
                "Memset", "scatter", "gather"):
        if key.lower() in name.lower():
            return f"{key}:{name[:70]}"
    return name[:80]


def analyze(events: list, label: str, gap_us: float = 15.0, show: int = 200) -> dict:
    """Summary of GPU activity in a chrome trace's events (kernels, memcpy, memset)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print(f"[{label}] no GPU events")
        return {}
    gpu.sort(key=lambda e: e["ts"])
    t0 = gpu[0]["ts"]
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    per_stream = defaultdict(float)
    count = defaultdict(int)
    for e in gpu:
        s = e.get("args", {}).get("stream", -1)
        per_stream[s] += e["dur"]
        count[s] += 1
    # union of busy intervals over all streams
    busy, cur_s, cur_e = 0.0, None, None
    for e in gpu:
        s, t = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    busy += cur_e - cur_s
    compute = max(per_stream, key=lambda k: per_stream[k])
    comp = [e for e in gpu if e.get("args", {}).get("stream", -1) == compute]
    gaps = []
    for a, b in zip(comp, comp[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > gap_us:
            gaps.append((round(a["ts"] + a["dur"] - t0), round(g), _short(a["name"]), _short(b["name"])))
    by_name = defaultdict(float)
    for e in comp:
        by_name[_short(e["name"])] += e["dur"]
    res = {"span_us": round(t1 - t0), "busy_union_us": round(busy), "compute_stream": compute,
           "per_stream_us": {str(k): round(v) for k, v in per_stream.items()},
           "per_stream_count": {str(k): v for k, v in count.items()},
           "compute_gaps": gaps, "compute_top": sorted(((round(v), k) for k, v in by_name.items()), reverse=True)[:12]}
    print(f"\n[{label}] GPU span {res['span_us']} us, busy (union) {res['busy_union_us']} us, compute stream "
          f"{compute}; per stream us {res['per_stream_us']} (kernels {res['per_stream_count']})")
    print(f"[{label}] compute-stream gaps > {gap_us} us (at, gap, after, before): {gaps}")
    print(f"[{label}] compute-stream time by kernel: {res['compute_top']}")
    for e in gpu[:show]:
        print(f"  {e['ts'] - t0:9.0f} {e['dur']:8.0f}  s{e.get('args', {}).get('stream', '?')}  {_short(e['name'])}")
    return res


def _host_vs_device(case, rank, q, k, v, kw, group, attn, n: int = 20) -> None:
    """Median host time to *launch* forward / backward vs GPU time between events around them (no profiler).

    If launching takes about as long as the GPU work, the step is host-bound and the GPU idles between kernels."""
    import time

    import torch
    import torch.distributed as dist

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    hf, hb, gf, gb = [], [], [], []
    for _ in range(n):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        ev[0].record()
        o = attn(q, k, v, causal=True, group=group, **kw)
        t1 = time.perf_counter()
        ev[1].record()
        o.backward(torch.ones_like(o))
        t2 = time.perf_counter()
        ev[2].record()
        torch.cuda.synchronize()
        hf.append((t1 - t0) * 1e3)
        hb.append((t2 - t1) * 1e3)
        gf.append(ev[0].elapsed_time(ev[1]))
        gb.append(ev[1].elapsed_time(ev[2]))
    med = lambda x: sorted(x)[len(x) // 2]  # noqa: E731
    print(f"[{case} rank {rank}] host launch fwd {med(hf):.3f} ms / bwd {med(hb):.3f} ms; GPU fwd {med(gf):.3f} ms"
          f" / bwd {med(gb):.3f} ms (median of {n}, ranks aligned by a barrier each step)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["bshd-16384", "thd"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--varlen-kernel", default="auto", choices=["auto", "flash", "cudnn"])
    ap.add_argument("--analyze", help="reprint the summary of a saved trace (.json or .json.gz) and exit")
    ap.add_argument("--traces", action="store_true", help="also write each rank's chrome trace (gzipped) to --out")
    ap.add_argument("--show", type=int, default=200, help="kernels listed per rank")
    args = ap.parse_args()
    if args.analyze:
        op = gzip.open if args.analyze.endswith(".gz") else open
        with op(args.analyze, "rt") as f:
            analyze(json.load(f)["traceEvents"], os.path.basename(args.analyze), show=args.show)
        return

    import torch
    import torch.distributed as dist

    from bench_attention import THD_LENS, init_cp_world
    from cpscope.attention import context_parallel_attention
    from cpscope.attention._policy import KernelPolicy, set_kernel_policy

    dev, rank, world, group = init_cp_world()
    set_kernel_policy(KernelPolicy(varlen=args.varlen_kernel))
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    for case in args.cases:
        g = torch.Generator(device=dev).manual_seed(0)
        if case == "thd":
            cu = [0]
            for n in THD_LENS:
                cu.append(cu[-1] + n)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
            shape, kw = (cu[-1] // world, H, D), {"qkv_format": "thd", "cu_seqlens": cu_t}
        else:
            S = int(case.split("-")[1])
            shape, kw = (1, S // world, H, D), {"qkv_format": "bshd"}
        q, k, v = [torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
                   for _ in range(3)]

        def step():
            o = context_parallel_attention(q, k, v, causal=True, group=group, **kw)
            o.backward(torch.ones_like(o))

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        _host_vs_device(case, rank, q, k, v, kw, group, context_parallel_attention)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        dist.barrier()
        path = os.path.join("/tmp", f"trace_{case}_r{rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if args.traces:
            tag = "" if args.varlen_kernel == "auto" else "-" + args.varlen_kernel
            with gzip.open(os.path.join(args.out, f"trace_{case}{tag}_r{rank}.json.gz"), "wt") as f:
                json.dump({"traceEvents": events}, f)
        # ranks print in turn
        for r in range(world):
            if r == rank:
                summary[case] = analyze(events, f"{case} rank {rank}", show=args.show)
                sys.stdout.flush()
            dist.barrier()
        del q, k, v
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
