#!/usr/bin/env python3
"""A GDN layer and a Mamba2 layer through cpscope.linear at CP1 against the kernel called directly (GPU, bf16).

The kernel is flash-linear-attention's (``chunk_gated_delta_rule``; ``chunk_simple_gla`` for Mamba2's SSD, with the
same dt / softplus / D handling as cpscope) when ``fla`` is installed, else cpscope's torch path (then both sides
are the same code). For 16k and 64k tokens, one sequence and a pack of uneven documents: first a parity check
(cpscope vs direct, forward output and input gradients), then forward+backward time of each, and the ratio
(target <= 1.02x). Prints one JSON line per case.

Usage (one H100/H200)::

    python benchmarks/bench_linear_gpu.py                     # 16k and 64k, packed and unpacked
    python benchmarks/bench_linear_gpu.py --tokens 16384 --iters 5
"""
from __future__ import annotations

import argparse
import json
import logging

import torch
import torch.nn.functional as F

from cpscope.linear import _fla, gated_delta_rule, mamba2_scan

log = logging.getLogger("bench_linear_gpu")


def _cu(tokens: int, packed: bool, dev: torch.device) -> torch.Tensor:
    lens = [tokens] if not packed else [tokens // 2, tokens // 4, tokens // 8, tokens // 8]
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)


def gdn_case(tokens: int, dev: torch.device, dtype: torch.dtype) -> tuple:
    H, HV, K, V = 16, 32, 128, 128
    mk = lambda *s: torch.randn(*s, device=dev, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(1, tokens, H, K), mk(1, tokens, H, K), mk(1, tokens, HV, V)
    g = (-F.softplus(torch.randn(1, tokens, HV, device=dev)) * 0.1).to(torch.float32).requires_grad_()
    beta = torch.rand(1, tokens, HV, device=dev, dtype=dtype).requires_grad_()
    return (q, k, v, g, beta), V


def run_gdn(inputs: tuple, cu: torch.Tensor, direct: bool) -> torch.Tensor:
    q, k, v, g, beta = inputs
    if direct and _fla.usable(q):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())[0]
    return gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, group=None)


def mamba_case(tokens: int, dev: torch.device, dtype: torch.dtype) -> tuple:
    H, P, G, N = 64, 64, 8, 128
    mk = lambda *s: torch.randn(*s, device=dev, dtype=dtype).requires_grad_()  # noqa: E731
    x, dt, B, C = mk(1, tokens, H, P), mk(1, tokens, H), mk(1, tokens, G, N), mk(1, tokens, G, N)
    A = (-torch.rand(H, device=dev) - 0.5).requires_grad_()
    D = torch.randn(H, device=dev).requires_grad_()
    dt_bias = torch.randn(H, device=dev).requires_grad_()
    return (x, dt, A, B, C, D, dt_bias), P


def run_mamba(inputs: tuple, cu: torch.Tensor, direct: bool) -> torch.Tensor:
    x, dt, A, B, C, D, dt_bias = inputs
    if direct and _fla.usable(x):
        d = F.softplus(dt.float() + dt_bias)
        rep = x.shape[2] // B.shape[2]
        Bh, Ch = (t.repeat_interleave(rep, dim=2) for t in (B, C))
        y = _fla.simple_gla(Ch[0], Bh[0], (x.float() * d[..., None]).to(x.dtype)[0], (d * A)[0], cu, False)[0]
        return (y.float() + x[0].float() * D[:, None]).to(x.dtype)[None]
    return mamba2_scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu, group=None)


def _time(fn, inputs: tuple, iters: int) -> float:
    grad = None
    for _ in range(2):  # warm-up (Triton autotune)
        out = fn()
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn().backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _parity(run, inputs: tuple, cu: torch.Tensor) -> dict:
    outs, grads = [], []
    for direct in (False, True):
        for t in inputs:
            t.grad = None
        out = run(inputs, cu, direct)
        out.float().pow(2).mean().backward()
        outs.append(out.float())
        grads.append([t.grad.float().clone() for t in inputs if t.grad is not None])
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))  # noqa: E731
    return {"out": rel(outs[0], outs[1]), "grads": max(rel(a, b) for a, b in zip(grads[0], grads[1]))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    for name, make, run in (("gdn", gdn_case, run_gdn), ("mamba2", mamba_case, run_mamba)):
        for tokens in args.tokens:
            for packed in (False, True):
                inputs, _ = make(tokens, dev, dtype)
                cu = _cu(tokens, packed, dev)
                parity = _parity(run, inputs, cu)
                t_direct = _time(lambda: run(inputs, cu, True), inputs, args.iters)
                t_cp = _time(lambda: run(inputs, cu, False), inputs, args.iters)
                t_direct = min(t_direct, _time(lambda: run(inputs, cu, True), inputs, args.iters))  # interleave
                print(json.dumps({
                    "layer": name, "tokens": tokens, "packed": packed, "kernel": "fla" if _fla.available() else "torch",
                    "direct_ms": round(t_direct, 3), "cpscope_ms": round(t_cp, 3), "ratio": round(t_cp / t_direct, 4),
                    "parity": parity, "device": torch.cuda.get_device_name(),
                }), flush=True)
                del inputs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
