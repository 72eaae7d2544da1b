"""Ring-attention benchmark: single-GPU SDPA vs PyTorch ``context_parallel`` vs cpscope, same run.

Launch on 2 GPUs::

    torchrun --nproc_per_node=2 benchmarks/bench_attention.py --baseline path/to/torch_cp_baseline.py \
        --check --out results/

``--baseline`` points at the shared baseline script (``measure_single``, ``measure_torch_cp``, ``median_ms``),
imported by path. ``--check`` first runs the GPU parity checks of ``tests/attention/test_gpu.py``.
Shape: B=1, H=32, D=128, bf16, causal, forward + backward. THD: 128k tokens in 16 long-tail documents.
Rank 0 prints a table and writes ``attention_bench.json`` (and ``attention_bench.png`` when matplotlib exists).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpscope  # noqa: E402
from cpscope.attention import context_parallel_attention  # noqa: E402

H, D = 32, 128
# 16 long-tail documents, 131072 tokens, longest 36864; every length divisible by 2*cp for cp <= 8
THD_LENS = [36864, 20480, 14336, 10240, 8192, 7168, 6144, 5120, 4096, 4096, 3072, 3072, 2048, 2048, 2048, 2048]


def _load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("_torch_cp_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _peak(fn):
    """(result, peak GiB allocated during fn) on this rank."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    res = fn()
    torch.cuda.synchronize()
    return res, torch.cuda.max_memory_allocated() / 2**30


def _inputs(shape, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True) for _ in range(3)]


def measure_cpscope(base, S, group, dev, backward=True):
    cp = 1 if group is None else group.size()
    q, k, v = _inputs((1, S // cp, H, D), dev)

    def step():
        o = context_parallel_attention(q, k, v, qkv_format="bshd", causal=True, group=group)
        if backward:
            o.backward(torch.ones_like(o))

    return base.median_ms(step)


def measure_thd(base, group, dev, kernel=None):
    """THD fwd+bwd; ``kernel`` forces the packed-block kernel ("flash" / "cudnn"), default: the library's choice."""
    if kernel is not None:
        from cpscope.attention import blocks

        old = blocks._VARLEN_KERNEL
        blocks._VARLEN_KERNEL = kernel
        try:
            return measure_thd(base, group, dev)
        finally:
            blocks._VARLEN_KERNEL = old
    cp = 1 if group is None else group.size()
    cu = [0]
    for n in THD_LENS:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    q, k, v = _inputs((cu[-1] // cp, H, D), dev)

    def step():
        o = context_parallel_attention(q, k, v, qkv_format="thd", causal=True, cu_seqlens=cu_t, group=group)
        o.backward(torch.ones_like(o))

    return base.median_ms(step)


def init_cp_world():
    """NCCL process group under torchrun, this rank's GPU, one CP group over the whole world, its cp_stream created.

    Returns ``(device, rank, world, group)``."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    dev = torch.device("cuda", torch.cuda.current_device())
    rank, world = dist.get_rank(), dist.get_world_size()
    group = cpscope.new_cp_groups([world])[world]
    cpscope.cp_stream()
    return dev, rank, world, group


def _write(out: dict, dirname: str) -> None:
    os.makedirs(dirname, exist_ok=True)
    with open(os.path.join(dirname, "attention_bench.json"), "w") as f:
        json.dump(out, f, indent=1)


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [r["case"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.27 for i in x], [r.get("torch_cp_speedup") or 0 for r in rows], 0.27, label="torch context_parallel")
    ax.bar([i for i in x], [r.get("te_speedup") or 0 for r in rows], 0.27, label="TransformerEngine p2p")
    ax.bar([i + 0.27 for i in x], [r["cpscope_speedup"] for r in rows], 0.27, label="cpscope ring")
    ax.axhline(rows[0]["gpus"], ls="--", c="k", lw=1, label="ideal")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("speedup vs 1 GPU")
    ax.set_title("causal fwd+bwd, H=32 D=128 bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="path to torch_cp_baseline.py")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536, 131072])
    ap.add_argument("--check", action="store_true", help="run GPU parity checks first")
    ap.add_argument("--no-thd", action="store_true")
    ap.add_argument("--no-torch-cp", action="store_true")
    ap.add_argument("--no-te", action="store_true", help="skip TransformerEngine even where it is installed")
    ap.add_argument("--out", default=".")
    ap.add_argument("--compare-routes", type=int, default=0, metavar="S",
                    help="also time bshd at length S with the flash vs the cuDNN dense kernels (CP1 and CP)")
    args = ap.parse_args()
    # TE is imported before anything runs on the GPU (see _te_baseline.te_available for the cuDNN it must share).
    from _te_baseline import te_available

    te_ok = te_available() and not args.no_te
    base = _load_baseline(args.baseline)
    dev, rank, world, group = init_cp_world()
    try:
        cudnn_version = torch.backends.cudnn.version()
    except RuntimeError as e:  # shadowed by another cuDNN (see _te_baseline.te_available): baselines are suspect
        cudnn_version = f"error: {e}"
    out: dict = {"gpus": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cudnn": cudnn_version}
    if rank == 0:
        print("cuDNN", out["cudnn"], flush=True)
    if args.check:
        from tests.attention.test_gpu import gpu_parity

        parity = {}
        for fmt in ("bshd", "thd"):
            for causal in (True, False):
                for h_kv in (32, 8):
                    key = f"{fmt}-{'causal' if causal else 'full'}-h32/{h_kv}"
                    try:
                        parity[key] = gpu_parity(fmt, causal, h=32, h_kv=h_kv, seq=8192)
                    except Exception as e:  # keep going: the timings are still worth having
                        parity[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                    if rank == 0:
                        print("parity", key, parity[key], flush=True)
        out["parity_rel_err"] = parity
        if "error" in parity["bshd-causal-h32/32"]:  # keep the timing run useful: fall back to flash kernels
            from cpscope.attention import blocks

            blocks._USE_CUDNN = False
            out["cudnn_fallback"] = True
            if rank == 0:
                print("cuDNN path failed parity; timing with flash kernels", flush=True)
    from _te_baseline import measure_te_bshd, measure_te_thd  # benchmarks/ is on sys.path

    use_te = te_ok
    out["te"] = use_te
    if rank == 0:
        print("TransformerEngine baseline:", "on" if use_te else "off (not installed)", flush=True)
    rows = []
    cases = [(f"{S // 1024}k", S) for S in args.seqlens] + ([] if args.no_thd else [("thd-128k", None)])
    for name, S in cases:
        t0 = time.time()
        if S is not None:
            single, mem_single = _peak(lambda: base.measure_single(S))
            torch_cp, mem_tcp = (None, None) if args.no_torch_cp else _peak(lambda: base.measure_torch_cp(S))
            mine, mem_mine = _peak(lambda: measure_cpscope(base, S, group, dev))
        else:  # the baseline: single-GPU varlen flash; beside it cpscope's own CP1 (cuDNN where available)
            single, mem_single = _peak(lambda: measure_thd(base, None, dev, kernel="flash"))
            torch_cp = mem_tcp = None
            own_cp1 = measure_thd(base, None, dev)
            mine, mem_mine = _peak(lambda: measure_thd(base, group, dev))
        te_single = te_cp = mem_te = None
        if use_te:
            if S is not None:
                te_single = measure_te_bshd(S, None)
                te_cp, mem_te = _peak(lambda: measure_te_bshd(S, group))
            else:
                te_single = measure_te_thd(THD_LENS, None)
                te_cp, mem_te = _peak(lambda: measure_te_thd(THD_LENS, group))
        row = {
            "case": name, "gpus": world, "single_ms": round(single, 3), "torch_cp_ms": torch_cp and round(torch_cp, 3),
            "cpscope_ms": round(mine, 3), "cpscope_speedup": round(single / mine, 3),
            "torch_cp_speedup": torch_cp and round(single / torch_cp, 3),
            "cpscope_pct_ideal": round(100 * single / mine / world, 1),
            "peak_gib_single": round(mem_single, 2), "peak_gib_torch_cp": mem_tcp and round(mem_tcp, 2),
            "peak_gib_cpscope": round(mem_mine, 2), "mem_ratio": round(mem_mine / mem_single, 3),
            "te_single_ms": te_single and round(te_single, 3), "te_cp_ms": te_cp and round(te_cp, 3),
            "te_speedup": te_cp and round(te_single / te_cp, 3), "peak_gib_te_cp": mem_te and round(mem_te, 2),
            "cpscope_vs_te_time": te_cp and round(te_cp / mine, 3),
            "wall_s": round(time.time() - t0, 1),
        }
        if S is None:
            from cpscope.attention import blocks

            row["varlen_kernel"] = "cudnn" if blocks._varlen_on_cudnn(torch.empty(0, device=dev)) else "flash"
            row["cpscope_cp1_ms"] = round(own_cp1, 3)
            row["cpscope_speedup_vs_own_cp1"] = round(own_cp1 / mine, 3)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    out["rows"] = rows
    if args.compare_routes:
        from cpscope.attention import blocks

        S, routes = args.compare_routes, {}
        for name, flag in (("flash", False), ("cudnn", True)):
            blocks._USE_CUDNN = flag
            routes[name] = {
                "cp1_fwd_bwd_ms": measure_cpscope(base, S, None, dev),
                "cp1_fwd_ms": measure_cpscope(base, S, None, dev, backward=False),
                "cp_fwd_bwd_ms": measure_cpscope(base, S, group, dev),
                "cp_fwd_ms": measure_cpscope(base, S, group, dev, backward=False),
            }
            if rank == 0:
                print("kernels", S, name, json.dumps(routes[name]), flush=True)
        blocks._USE_CUDNN = True
        out["kernels"] = {"seqlen": S, **routes}
    if rank == 0:
        print("\n| case | 1 GPU ms | torch CP ms (x) | TE 1 GPU ms | TE CP ms (x) | cpscope ms (x) | % ideal | "
              "TE/cpscope time | peak GiB 1/torch/TE/cpscope |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            tcp = f"{r['torch_cp_ms']} ({r['torch_cp_speedup']}x)" if r["torch_cp_ms"] else "-"
            te = f"{r['te_cp_ms']} ({r['te_speedup']}x)" if r["te_cp_ms"] else "-"
            print(f"| {r['case']} | {r['single_ms']} | {tcp} | {r['te_single_ms'] or '-'} | {te} | "
                  f"{r['cpscope_ms']} ({r['cpscope_speedup']}x) | {r['cpscope_pct_ideal']} | "
                  f"{r['cpscope_vs_te_time'] or '-'} | {r['peak_gib_single']}/{r['peak_gib_torch_cp'] or '-'}/"
                  f"{r['peak_gib_te_cp'] or '-'}/{r['peak_gib_cpscope']} |")
        for r in rows:
            if "cpscope_cp1_ms" in r:
                print(f"{r['case']}: packed blocks on {r['varlen_kernel']}; cpscope CP1 {r['cpscope_cp1_ms']} ms, "
                      f"CP{r['gpus']} {r['cpscope_ms']} ms = {r['cpscope_speedup_vs_own_cp1']}x over its own CP1, "
                      f"{r['cpscope_speedup']}x over single-GPU varlen flash")
        _write(out, args.out)
        _plot(rows, os.path.join(args.out, "attention_bench.png"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
