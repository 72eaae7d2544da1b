"""One-GPU probe for issue #14's kernel choices (run once, early; its findings are in benchmarks/attention_notes.md).

    python3 benchmarks/probe_gqa.py --out $OUT

Checks and times, B=1, H=32, D=128, bf16, causal fwd+bwd (CUDA-event medians):
  A. dense GQA (8 and 4 k/v heads): SDPA(enable_gqa) vs aten cuDNN attention called with un-expanded K/V vs aten
     flash (cpscope's route until now) — parity vs an fp32 reference with expanded K/V, then time at 16k / 64k;
  B. the ring's remote block shapes (kv_front: all Q vs front half of K/V; q_back: back half of Q vs all K/V) on cuDNN
     with GQA, non-causal, parity;
  C. sbhd inputs as strided [b, s, h, d] views on cuDNN: parity and time vs contiguous bshd;
  D. padded non-causal thd at CP1 (a padding-only document, zero-length key sequences) through cpscope on both
     varlen kernels: NaN check and parity;
  E. host time per layer (RoPE q, k + attention forward) for packs of 16 / 256 / 4096 documents at CP1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch
import torch.nn.functional as F

aten = torch.ops.aten
RESULTS: dict = {}


def med(fn, iters=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def qkv(S, H, Hk, D=128, B=1, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return mk(H), mk(Hk), mk(Hk), mk(H)


def ref_attn(q, k, v, causal):  # [b, h, s, d] fp32 with expanded k/v
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)


def cudnn_fwd_bwd(q, k, v, do, causal):
    res = aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, causal, False, scale=None)
    out, lse = res[0], res[1]
    g = aten._scaled_dot_product_cudnn_attention_backward.default(
        do, q, k, v, out, lse, res[6], res[7], None, res[2], res[3], q.shape[2], k.shape[2], 0.0, causal, scale=None)
    return out, g


def flash_fwd_bwd(q, k, v, do, causal):
    res = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal, False, scale=None)
    out, lse = res[0], res[1]
    g = aten._scaled_dot_product_flash_attention_backward.default(
        do, q, k, v, out, lse, res[2], res[3], q.shape[2], k.shape[2], 0.0, causal, res[6], res[7], scale=None)
    return out, g


def sdpa_fwd_bwd(q, k, v, do, causal):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(do)
    return out, (q.grad, k.grad, v.grad)


def part_a():
    rows = []
    for hk in (8, 4, 32):
        q, k, v, do = qkv(2048, 32, hk)
        ref_q, ref_k, ref_v = (t.float().requires_grad_(True) for t in (q, k, v))
        ref = ref_attn(ref_q, ref_k, ref_v, True)
        ref.backward(do.float())
        for name, fn in (("cudnn", cudnn_fwd_bwd), ("flash", flash_fwd_bwd), ("sdpa", sdpa_fwd_bwd)):
            try:
                out, g = fn(q, k, v, do, True)
                errs = [rel(out, ref), rel(g[0], ref_q.grad), rel(g[1], ref_k.grad), rel(g[2], ref_v.grad)]
                rows.append({"hk": hk, "kernel": name, "parity": max(errs), "dk_shape": list(g[1].shape)})
            except Exception as e:  # noqa: BLE001
                rows.append({"hk": hk, "kernel": name, "error": repr(e)[:300]})
    for S in (16384, 65536):
        for hk in (8, 4):
            q, k, v, do = qkv(S, 32, hk)
            row = {"S": S, "hk": hk}
            for name, fn in (("cudnn", cudnn_fwd_bwd), ("flash", flash_fwd_bwd), ("sdpa", sdpa_fwd_bwd)):
                try:
                    row[name] = med(lambda: fn(q, k, v, do, True), iters=5 if S > 20000 else 10)
                except Exception as e:  # noqa: BLE001
                    row[name] = repr(e)[:200]
            rows.append(row)
            print("A", row, flush=True)
    RESULTS["A"] = rows


def part_b():
    rows = []
    S = 4096
    for hk in (8, 1):
        q, k, v, do = qkv(S, 32, hk)
        c = S // 2
        cases = {"kv_front": (q, k[:, :, :c], v[:, :, :c], do), "q_back": (q[:, :, c:], k, v, do[:, :, c:])}
        for kind, (qq, kk, vv, dd) in cases.items():
            rq, rk, rv = (t.float().requires_grad_(True) for t in (qq, kk, vv))
            ref = ref_attn(rq, rk, rv, False)
            ref.backward(dd.float())
            try:
                out, g = cudnn_fwd_bwd(qq, kk, vv, dd, False)
                rows.append({"hk": hk, "kind": kind, "parity": max(rel(out, ref), rel(g[0], rq.grad),
                                                                      rel(g[1], rk.grad), rel(g[2], rv.grad)),
                             "ms_cudnn": med(lambda: cudnn_fwd_bwd(qq, kk, vv, dd, False)),
                             "ms_flash": med(lambda: flash_fwd_bwd(qq, kk, vv, dd, False))})
            except Exception as e:  # noqa: BLE001
                rows.append({"hk": hk, "kind": kind, "error": repr(e)[:300]})
            print("B", rows[-1], flush=True)
    RESULTS["B"] = rows


def part_c():
    rows = []
    S = 16384
    for hk in (32, 8):
        g = torch.Generator(device="cuda").manual_seed(1)
        mk = lambda h: torch.randn(S, 1, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, do = mk(32), mk(hk), mk(hk), mk(32)  # sbhd contiguous
        views = [t.transpose(0, 1).transpose(1, 2) for t in (q, k, v, do)]  # [b, h, s, d] views of sbhd memory
        conts = [t.transpose(0, 1).contiguous().transpose(1, 2) for t in (q, k, v, do)]  # bshd memory
        try:
            o1, g1 = cudnn_fwd_bwd(*views, True)
            o2, g2 = cudnn_fwd_bwd(*conts, True)
            rows.append({"hk": hk, "same": max(rel(o1, o2), *(rel(a, b) for a, b in zip(g1, g2))),
                         "out_stride": list(o1.stride()), "dq_stride": list(g1[0].stride()),
                         "ms_sbhd_view": med(lambda: cudnn_fwd_bwd(*views, True)),
                         "ms_bshd": med(lambda: cudnn_fwd_bwd(*conts, True))})
        except Exception as e:  # noqa: BLE001
            rows.append({"hk": hk, "error": repr(e)[:300]})
        print("C", rows[-1], flush=True)
    RESULTS["C"] = rows


def part_d():
    import cpscope
    from cpscope.attention import blocks

    rows = []
    real = [100, 0, 37, 256]  # the second document is padding only
    lay = [128, 64, 64, 256]
    cu_r = torch.tensor([0] + [sum(real[:i + 1]) for i in range(4)], dtype=torch.int32)
    cu_l = torch.tensor([0] + [sum(lay[:i + 1]) for i in range(4)], dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(2)
    T = sum(lay)
    q = torch.randn(T, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(T, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    for kernel in ("cudnn", "flash"):
        for causal in (False, True):
            try:
                blocks._VARLEN_KERNEL = kernel
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                out = cpscope.context_parallel_attention(qq, kk, vv, qkv_format="thd", causal=causal, cu_seqlens=cu_r,
                                                         cu_seqlens_padded=cu_l, group=None)
                out.backward(do)
                # reference on the real tokens only (fp32)
                errs, start = [], 0
                for n, L in zip(real, lay):
                    if n:
                        sl = slice(start, start + n)
                        rq, rk, rv = (t[sl].float().transpose(0, 1)[None].requires_grad_(True) for t in (q, k, v))
                        ref = ref_attn(rq, rk, rv, causal)
                        ref.backward(do[sl].float().transpose(0, 1)[None])
                        errs += [rel(out[sl].transpose(0, 1)[None], ref), rel(qq.grad[sl].transpose(0, 1)[None],
                                 rq.grad), rel(kk.grad[sl].transpose(0, 1)[None], rk.grad)]
                    pad = slice(start + n, start + L)
                    errs += [out[pad].float().abs().max().item() if L > n else 0.0]
                    start += L
                rows.append({"kernel": kernel, "causal": causal, "worst": max(errs),
                             "finite": bool(torch.isfinite(qq.grad).all() and torch.isfinite(kk.grad).all())})
            except Exception as e:  # noqa: BLE001
                rows.append({"kernel": kernel, "causal": causal, "error": traceback.format_exc()[-600:]})
            print("D", rows[-1], flush=True)
    blocks._VARLEN_KERNEL = "auto"
    RESULTS["D"] = rows


def part_e():
    import cpscope

    rows = []
    total = 4096 * 32
    for docs in (16, 256, 4096):
        n = total // docs
        cu = torch.arange(0, total + 1, n, dtype=torch.int32)
        q = torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, 1, 64, device="cuda", dtype=torch.bfloat16)
        freqs = cpscope.rotary_freqs(64, n, device="cuda")

        def layer():
            rq = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu, group=None)
            rk = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="thd", cu_seqlens=cu, group=None)
            with torch.no_grad():
                return cpscope.context_parallel_attention(rq, rk, k, qkv_format="thd", cu_seqlens=cu, group=None)

        for _ in range(3):
            layer()
        torch.cuda.synchronize()
        L = 40
        t0 = time.perf_counter()
        for _ in range(L):
            layer()
        host = (time.perf_counter() - t0) / L * 1e3
        torch.cuda.synchronize()
        gpu = med(layer, iters=5)
        rows.append({"docs": docs, "host_ms_per_layer": host, "gpu_ms_per_layer": gpu})
        print("E", rows[-1], flush=True)
    RESULTS["E"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--parts", default="ABCDE")
    args = ap.parse_args()
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    for p in args.parts:
        try:
            globals()["part_" + p.lower()]()
        except Exception:  # noqa: BLE001
            RESULTS[p] = traceback.format_exc()[-1500:]
            print(p, RESULTS[p], flush=True)
        with open(os.path.join(args.out, "probe_gqa.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    print(json.dumps(RESULTS)[:6000])


if __name__ == "__main__":
    main()
