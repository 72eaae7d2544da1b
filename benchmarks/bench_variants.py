"""Communication variants side by side: cpscope ``p2p`` / ``all_gather`` / ``a2a`` (/ ``a2a+p2p``) beside TE's same
``cp_comm_type`` and PyTorch's ``context_parallel`` (all-gather and all-to-all rotation), one run, one process per GPU.

Timings (NCCL, every rank one GPU; ``a2a+p2p`` needs 4 or more GPUs: inner size 2 here)::

    torchrun --nproc_per_node=2 benchmarks/bench_variants.py --out OUT
    torchrun --nproc_per_node=4 benchmarks/bench_variants.py --out OUT --seqlens 65536

One GPU (checks, no timing): each variant's own kernels — the block shapes and varlen descriptors of a CP2 / CP4
run, on virtual ranks (threads, ``tests/attention/_virtual.py``) — and every ``comm`` at CP1, bf16 against a float64
reference (relative error <= 1e-2)::

    python benchmarks/bench_variants.py --one-gpu --out OUT

Shape: B=1, H=32, D=128, bf16, causal, forward + backward, median of 10 after 3 warm-ups (CUDA events, the method
of ``benchmarks/_te_baseline.py``); heads 32/32 (MHA) and 32/8 (GQA); THD: the 16 long-tail documents of
``bench_attention.py``. PyTorch's ``context_parallel`` runs MHA ``bshd`` only (SDPA); its ``"alltoall"`` rotation is
its ring with all-to-all as transport, so it sits beside cpscope's ``p2p``, its ``"allgather"`` beside
``all_gather``. Rank 0 prints a table and writes ``variants_bench.json`` (or ``variants_one_gpu.json``).

:func:`measure_variant` times one cpscope variant, :func:`measure_te` TE's, :func:`measure_torch_cp` PyTorch's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpscope  # noqa: E402
from cpscope.attention import context_parallel_attention  # noqa: E402
from _results import dump  # noqa: E402

D = 128
THD_LENS = [36864, 20480, 14336, 10240, 8192, 7168, 6144, 5120, 4096, 4096, 3072, 3072, 2048, 2048, 2048, 2048]
COMM_TO_TORCH = {"all_gather": "allgather", "p2p": "alltoall"}


def _median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    from _te_baseline import _median_ms as median

    return median(fn, iters=iters, warmup=warmup)


def _inputs(shape_q, shape_kv, dev, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
            for s in (shape_q, shape_kv, shape_kv)]


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _peak(fn) -> tuple[Any, float]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    res = fn()
    torch.cuda.synchronize()
    return res, torch.cuda.max_memory_allocated() / 2**30


def measure_variant(comm: str, *, group: Optional[dist.ProcessGroup], fmt: str = "bshd", seqlen: int = 0,
                    doc_lens: Optional[list[int]] = None, heads: int = 32, kv_heads: int = 8, iters: int = 10) -> float:
    """Median ms of cpscope's causal fwd+bwd with ``comm`` on this rank's share (``bshd`` of ``seqlen`` or ``thd``
    of ``doc_lens``); ``group`` None = CP1."""
    cp = 1 if group is None else group.size()
    dev = torch.device("cuda", torch.cuda.current_device())
    if fmt == "thd":
        cu = _cu(doc_lens)
        q, k, v = _inputs((cu[-1] // cp, heads, D), (cu[-1] // cp, kv_heads, D), dev)
        kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=dev)}
    else:
        q, k, v = _inputs((1, seqlen // cp, heads, D), (1, seqlen // cp, kv_heads, D), dev)
        kw = {}

    def step():
        o = context_parallel_attention(q, k, v, qkv_format=fmt, causal=True, comm=comm, group=group, **kw)
        o.backward(torch.ones_like(o))

    return _median_ms(step, iters)


def measure_te(comm: str, *, group: Optional[dist.ProcessGroup], fmt: str = "bshd", seqlen: int = 0,
               doc_lens: Optional[list[int]] = None, heads: int = 32, kv_heads: int = 8, iters: int = 10) -> float:
    """Median ms of TE ``DotProductAttention`` causal fwd+bwd with ``cp_comm_type=comm`` (``a2a+p2p``: the pair of
    groups of :func:`cpscope.attention._hierarchical.hierarchical_groups`, inner 2)."""
    from transformer_engine.pytorch import DotProductAttention

    cp = 1 if group is None else group.size()
    dev = torch.device("cuda", torch.cuda.current_device())
    attn = DotProductAttention(heads, D, num_gqa_groups=kv_heads, qkv_format=fmt,
                               attn_mask_type="padding_causal" if fmt == "thd" else "causal")
    if cp > 1:
        cp_group: Any = group
        if comm == "a2a+p2p":
            from cpscope.attention._hierarchical import hierarchical_groups

            cp_group = list(hierarchical_groups(group, 2))
        attn.set_context_parallel_group(cp_group, cpscope.group_ranks(group), cpscope.cp_stream(), comm)
    if fmt == "thd":
        cu_l = _cu(doc_lens)
        cu = torch.tensor(cu_l, dtype=torch.int32, device=dev)
        q, k, v = _inputs((cu_l[-1] // cp, heads, D), (cu_l[-1] // cp, kv_heads, D), dev)
        m = max(doc_lens)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=m,
                  max_seqlen_kv=m)
    else:
        q, k, v = _inputs((1, seqlen // cp, heads, D), (1, seqlen // cp, kv_heads, D), dev)
        kw = {}

    def step():
        o = attn(q, k, v, **kw)
        o.backward(torch.ones_like(o))

    return _median_ms(step, iters)


def measure_torch_cp(rotate: str, seqlen: int, heads: int = 32, iters: int = 10) -> float:
    """Median ms of PyTorch ``context_parallel`` (SDPA, MHA, ``[b, h, s, d]``) with ``set_rotate_method(rotate)``
    over the whole world; its own load-balanced sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, seqlen, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    result = None
    try:  # as the shared baseline: grads switched on inside; the exit raises for such buffers (harmless here)
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            for t in (q, k, v):
                t.requires_grad_(True)

            def step():
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(torch.ones_like(o))

            result = _median_ms(step, iters)
    except RuntimeError:
        if result is None:
            raise
    return result


def _try(fn) -> tuple[Optional[float], Optional[float], Optional[str]]:
    """(ms, peak GiB, error) — a variant a library does not support records its error instead of a number."""
    try:
        ms, peak = _peak(fn)
        return round(ms, 3), round(peak, 2), None
    except Exception as e:  # noqa: BLE001 - reported in the row
        torch.cuda.synchronize()
        return None, None, f"{type(e).__name__}: {e}"[:300]


def timings(args: argparse.Namespace) -> None:
    from _te_baseline import te_available  # before anything runs on the GPU (TE must share torch's cuDNN)

    te_ok = te_available() and not args.no_te
    from bench_attention import init_cp_world

    dev, rank, world, group = init_cp_world()
    if world > 2 and world % 2 == 0:  # a2a+p2p:2's sub-groups, made up front (attention only looks them up)
        cpscope.hierarchical_cp_groups(group, 2)
    variants = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if world >= 4 and world % 2 == 0 else [])
    cases = [("bshd", S, None, h_kv) for S in args.seqlens for h_kv in (32, 8)]
    if not args.no_thd:
        cases += [("thd", 0, THD_LENS, h_kv) for h_kv in (8, 32)]
    rows = []
    for fmt, S, lens, h_kv in cases:
        name = f"{fmt}-{S // 1024}k" if fmt != "thd" else "thd-128k-16docs"
        shape = dict(group=group, fmt=fmt, seqlen=S, doc_lens=lens, heads=32, kv_heads=h_kv)
        t0 = time.time()
        base = {}
        for comm in variants:
            mine = "a2a+p2p:2" if comm == "a2a+p2p" else comm  # the inner size TE gets too
            ms, peak, err = _try(lambda: measure_variant(mine, **shape))
            row = {"case": name, "heads": f"32/{h_kv}", "gpus": world, "comm": comm, "cpscope_ms": ms,
                   "cpscope_peak_gib": peak, "cpscope_error": err}
            base[comm] = ms
            if te_ok:
                te_ms, te_peak, te_err = _try(lambda: measure_te(comm, **shape))
                row.update(te_ms=te_ms, te_peak_gib=te_peak, te_error=te_err,
                           te_time_over_cpscope=te_ms and ms and round(te_ms / ms, 3))
            if fmt == "bshd" and h_kv == 32 and comm in COMM_TO_TORCH and not args.no_torch_cp:
                rot = COMM_TO_TORCH[comm]
                t_ms, t_peak, t_err = _try(lambda: measure_torch_cp(rot, S))
                row.update(torch_cp_rotate=rot, torch_cp_ms=t_ms, torch_cp_peak_gib=t_peak, torch_cp_error=t_err,
                           torch_cp_time_over_cpscope=t_ms and ms and round(t_ms / ms, 3))
            row["p2p_time_over_this"] = base.get("p2p") and ms and round(base["p2p"] / ms, 3)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
        if rank == 0:
            print(f"{name} 32/{h_kv}: {time.time() - t0:.1f}s", flush=True)
    if rank == 0:
        print("\n| case | heads | comm | cpscope ms | p2p / this | TE same comm ms (TE / cpscope) | "
              "torch CP ms (rotate) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            te = "-" if not te_ok else (f"{r['te_ms']} ({r['te_time_over_cpscope']})" if r["te_ms"] else "error")
            tcp = f"{r['torch_cp_ms']} ({r['torch_cp_rotate']})" if r.get("torch_cp_ms") else "-"
            mine = r["cpscope_ms"] if r["cpscope_ms"] is not None else "error"
            print(f"| {r['case']} | {r['heads']} | {r['comm']} | {mine} | {r['p2p_time_over_this'] or '-'} | {te} | "
                  f"{tcp} |")
        out = {"gpus": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "te": te_ok,
               "rows": rows}
        dump(out, os.path.join(args.out, args.json or "variants_bench.json"))
    dist.barrier()
    dist.destroy_process_group()


def one_gpu(args: argparse.Namespace) -> int:
    """Each variant's kernels on virtual CP2 / CP4 ranks and every comm at CP1, bf16 vs float64; returns failures."""
    from cpscope.attention._merge import merge_rows_, rows_add_
    from tests.attention._reference import reference_attention
    from tests.attention._virtual import check_virtual

    dev = torch.device(args.device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    # compile the fused kernels once on this thread before the virtual ranks' threads use them
    o, l = torch.zeros(4, 2, 8, device=dev), torch.zeros(2, 4, device=dev)
    merge_rows_(o, l, o.clone(), l.clone())
    rows_add_(o, torch.arange(4, device=dev), o.clone())
    seq = args.one_gpu_seq
    lens = [x * seq // 4096 for x in (512, 1536, 256, 1024, 768)]  # thd documents (seq tokens), each divisible by 8
    cases = [("bshd", True, (16, 16), 1), ("bshd", True, (16, 4), 1), ("bshd", False, (16, 16), 2),
             ("sbhd", True, (16, 4), 2), ("thd", True, (16, 4), 1), ("thd", True, (16, 16), 1),
             ("thd", False, (16, 4), 1)]
    results, failures = [], 0
    for variant in ("all_gather", "a2a"):
        for n in (2, 4):
            for fmt, causal, heads, batch in cases:
                key = f"{variant} cp{n} {fmt} {'causal' if causal else 'full'} {heads[0]}/{heads[1]} b{batch}"
                try:
                    errs = check_virtual(variant, n, fmt, causal=causal, heads=heads, lens=lens, seq=seq,
                                         batch=batch, d=D, device=dev, dtype=torch.bfloat16)
                    results.append({"case": key, "rel_err": {k: round(v, 5) for k, v in errs.items()}})
                except Exception as e:  # noqa: BLE001 - listed, counted
                    failures += 1
                    results.append({"case": key, "error": f"{type(e).__name__}: {e}"[:600]})
                print(json.dumps(results[-1]), flush=True)
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, seq, h, D, generator=g, dtype=torch.float64) for h in (16, 4, 4, 16)]
    ref_in = [x.clone().to(dev).requires_grad_(True) for x in full[:3]]
    ref = reference_attention(*(x[0] for x in ref_in), causal=True)[None]
    ref.backward(full[3].to(dev))
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p", "auto"):  # CP1: the public path of every comm
        loc = [x.detach().to(dev, torch.bfloat16).requires_grad_(True) for x in full[:3]]
        out = context_parallel_attention(*loc, qkv_format="bshd", causal=True, comm=comm, group=None)
        out.backward(full[3].to(dev, torch.bfloat16))
        errs = {name: ((got.double() - want).norm() / want.norm()).item()
                for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in loc)),
                                           (ref.detach(), *(x.grad for x in ref_in)))}
        ok = all(e <= 1e-2 for e in errs.values())
        failures += not ok
        results.append({"case": f"{comm} cp1 bshd causal 16/4", "rel_err": {k: round(v, 5) for k, v in errs.items()},
                        **({} if ok else {"error": "relative error > 1e-2"})})
        print(json.dumps(results[-1]), flush=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else str(dev)
    dump({"device": name, "torch": torch.__version__, "failures": failures, "results": results},
         os.path.join(args.out, args.json or "variants_one_gpu.json"))
    print(f"one-GPU check: {len(results) - failures} passed, {failures} failed", flush=True)
    return failures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one-gpu", action="store_true", help="checks on one GPU (virtual ranks), no timing")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536, 131072])
    ap.add_argument("--no-thd", action="store_true")
    ap.add_argument("--no-te", action="store_true")
    ap.add_argument("--no-torch-cp", action="store_true")
    ap.add_argument("--out", default=".")
    ap.add_argument("--json", default=None, help="file name under --out (default: variants_bench.json, "
                                                   "variants_one_gpu.json with --one-gpu)")
    ap.add_argument("--device", default="cuda", help="--one-gpu: the device (cpu: a dry run of the script)")
    ap.add_argument("--one-gpu-seq", type=int, default=4096, help="--one-gpu: tokens per sequence (multiple of 64)")
    args = ap.parse_args()
    if args.one_gpu:
        sys.exit(1 if one_gpu(args) else 0)
    timings(args)


if __name__ == "__main__":
    main()
