"""One GPU: cuDNN packed blocks (cpscope.attention._kernels.cudnn_thd) vs the flash varlen blocks, numerics and speed.

    python benchmarks/check_cudnn_thd.py        # needs nvidia-cudnn-frontend importable as `cudnn`

Numerics: out, lse, dq, dk, dv of both kernels on the same packed inputs (causal/full, MHA/GQA, contiguous and
head-sliced inputs, q shorter than k/v as in the ring's half blocks), relative error ||a-b||/||b|| against a
float32 math reference. Speed: one block over the 128k-token long-tail packing of bench_attention (forward,
backward), CUDA events, median of 10.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpscope.attention._kernels import Varlen, block_backward, block_forward, cudnn_frontend, cudnn_thd  # noqa: E402
from cpscope.attention._policy import use_kernel_policy  # noqa: E402


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ref(q, k, v, cu_q, cu_k, causal, scale):
    """float32 math per sequence: out [t, h, d], lse [h, t]."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b, c, e in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        qq, kk, vv = q[a:b].float(), k[c:e].float().repeat_interleave(g, 1), v[c:e].float().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if causal:
            n_q, n_k = b - a, e - c
            i = torch.arange(n_q, device=q.device)[:, None]
            j = torch.arange(n_k, device=q.device)[None, :]
            s = s.masked_fill(j - n_k > i - n_q, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def run_block(kernel, q, k, v, dout, vl, causal, scale):
    with use_kernel_policy(varlen=kernel):
        o, lse = block_forward(q, k, v, scale=scale, causal=causal, varlen=vl)
        g = block_backward(dout, q, k, v, o, lse, scale=scale, causal=causal, varlen=vl)
    return o, lse, g


def numerics():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    d, scale = 128, 128 ** -0.5
    worst = 0.0
    cases = []
    for causal in (True, False):
        for h, h_kv in ((32, 32), (32, 8)):
            for shape in ("equal", "q_half", "kv_half", "heads_view"):
                if causal and shape in ("q_half", "kv_half"):
                    continue
                cases.append((causal, h, h_kv, shape))
    for causal, h, h_kv, shape in cases:
        lens = [512, 1536, 256, 1024, 768]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cu_q, cu_k = list(cu), list(cu)
        if shape == "q_half":
            cu_q = [x // 2 for x in cu]
        if shape == "kv_half":
            cu_k = [x // 2 for x in cu]
        hh, hk = (2 * h, 2 * h_kv) if shape == "heads_view" else (h, h_kv)
        mk = lambda t, n: torch.randn(t, n, d, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
        q, k, v, dout = mk(cu_q[-1], hh), mk(cu_k[-1], hk), mk(cu_k[-1], hk), mk(cu_q[-1], hh)
        if shape == "heads_view":  # strided head slices, as the ring's head-split diagonal passes them
            q, dout, k, v = q[:, :h], dout[:, :h], k[:, :h_kv], v[:, :h_kv]
        t = lambda c: torch.tensor(c, dtype=torch.int32, device=dev)  # noqa: E731
        vl = Varlen(t(cu_q), t(cu_k), max(b - a for a, b in zip(cu_q[:-1], cu_q[1:])),
                    max(b - a for a, b in zip(cu_k[:-1], cu_k[1:])))
        if cu_q == cu_k:
            vl = Varlen(vl.cu_q, vl.cu_q, vl.max_q, vl.max_k)
        qr, kr, vr = (x.detach().clone().float().requires_grad_(True) for x in (q, k, v))
        o_ref, lse_ref = ref(qr, kr, vr, cu_q, cu_k, causal, scale)
        o_ref.backward(dout.float())
        res = {}
        for kernel in ("flash", "cudnn"):
            try:
                o, lse, g = run_block(kernel, q, k, v, dout, vl, causal, scale)
                torch.cuda.synchronize()
                res[kernel] = {"out": rel(o, o_ref), "lse": rel(lse, lse_ref), "dq": rel(g[0], qr.grad),
                               "dk": rel(g[1], kr.grad), "dv": rel(g[2], vr.grad)}
                if kernel == "cudnn":
                    worst = max(worst, *res[kernel].values())
            except Exception as e:  # noqa: BLE001
                res[kernel] = f"{type(e).__name__}: {e}"[:600]
                worst = float("inf") if kernel == "cudnn" else worst
        print(f"causal={causal} h={h}/{h_kv} {shape}: " + " | ".join(
            f"{kk}: " + (", ".join(f"{n} {x:.1e}" for n, x in r.items()) if isinstance(r, dict) else r)
            for kk, r in res.items()), flush=True)
    print(f"worst cuDNN relative error {worst:.2e}", flush=True)
    return worst


def speed():
    from bench_attention import THD_LENS

    dev = torch.device("cuda")
    h, d, scale = 32, 128, 128 ** -0.5
    cu = [0]
    for n in THD_LENS:
        cu.append(cu[-1] + n)
    cu = [x // 2 for x in cu]  # a CP2 rank's diagonal block
    t = torch.tensor(cu, dtype=torch.int32, device=dev)
    m = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    vl = Varlen(t, t, m, m, tuple(cu), tuple(cu))
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(cu[-1], h, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))

    from _te_baseline import _median_ms as med  # CUDA events, median of 10 after 3 warm-ups

    for kernel in ("flash", "cudnn"):
        with use_kernel_policy(varlen=kernel):
            o, lse = block_forward(q, k, v, scale=scale, causal=True, varlen=vl)
            f = med(lambda: block_forward(q, k, v, scale=scale, causal=True, varlen=vl))
            b = med(lambda: block_backward(dout, q, k, v, o, lse, scale=scale, causal=True, varlen=vl))
        print(f"speed {kernel}: diagonal block of a CP2 rank (64k tokens, 16 docs, causal): forward {f:.2f} ms, "
              f"backward {b:.2f} ms", flush=True)


def build_and_bucket():
    """Host cost of a graph build vs a cached call; and whether empty padding sequences (batch bucketing) give the
    same results."""
    import time

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    cu = (0, 512, 2048, 2304, 3328, 4096)  # 5 sequences -> bucket 8
    t = torch.tensor(cu, dtype=torch.int32, device=dev)
    vl = Varlen(t, t, 1536, 1536, cu, cu)
    q, k, v, dout = (torch.randn(cu[-1], 32, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    res = {}
    for bucket in (False, True):
        cudnn_frontend.clear_cache()
        with use_kernel_policy(bucket_batch=bucket):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o, lse = cudnn_thd.forward(q, k, v, vl, scale=0.088, causal=True)
            g = cudnn_thd.backward(dout, q, k, v, o, lse, vl, scale=0.088, causal=True)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            o, lse = cudnn_thd.forward(q, k, v, vl, scale=0.088, causal=True)
            g = cudnn_thd.backward(dout, q, k, v, o, lse, vl, scale=0.088, causal=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        res[bucket] = (o, lse, *g)
        print(f"bucket_batch={bucket}: first fwd+bwd (graph builds) {1e3 * (t1 - t0):.1f} ms, cached "
              f"{1e3 * (t2 - t1):.2f} ms", flush=True)
    errs = [rel(a, b) for a, b in zip(res[True], res[False])]
    print("batch bucketing vs exact, relative differences (out, lse, dq, dk, dv):", [f"{e:.1e}" for e in errs],
          flush=True)
    cudnn_frontend.clear_cache()


if __name__ == "__main__":
    print("cuDNN frontend available:", cudnn_frontend.available(torch.device("cuda")), flush=True)
    worst = numerics()
    if worst < 2e-2:
        build_and_bucket()
        speed()
