"""Where the host time of one layer goes (RoPE q, k + attention forward) on one GPU: cProfile over many layers.

    python3 benchmarks/probe_host.py [--docs 4096] [--kernel auto|flash]
"""
import argparse, cProfile, io, pstats, time
import torch
import cpscope
from cpscope.attention import blocks

ap = argparse.ArgumentParser()
ap.add_argument("--docs", type=int, default=4096)
ap.add_argument("--kernel", default="auto")
ap.add_argument("--grad", action="store_true")
args = ap.parse_args()
blocks._VARLEN_KERNEL = args.kernel
total = 4096 * 32
n = total // args.docs
cu = torch.arange(0, total + 1, n, dtype=torch.int32)
q = torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=args.grad)
k = torch.randn(total, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=args.grad)
freqs = cpscope.rotary_freqs(64, n, device="cuda")


def layer():
    rq = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu, group=None)
    rk = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="thd", cu_seqlens=cu, group=None)
    with torch.set_grad_enabled(args.grad):
        return cpscope.context_parallel_attention(rq, rk, k, qkv_format="thd", cu_seqlens=cu, group=None)


for _ in range(5):
    layer()
torch.cuda.synchronize()
for name, fn in (("rope q+k", lambda: (cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu,
                  group=None), cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="thd", cu_seqlens=cu, group=None))),
                 ("attention", lambda: cpscope.context_parallel_attention(q, k, k, qkv_format="thd", cu_seqlens=cu,
                  group=None)), ("layer", layer)):
    with torch.set_grad_enabled(args.grad):
        fn(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        dt = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
    print(f"{name}: host {dt:.3f} ms per call ({args.docs} docs, kernel {args.kernel}, grad {args.grad})", flush=True)
pr = cProfile.Profile()
pr.enable()
for _ in range(50):
    layer()
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
