#!/usr/bin/env python3
"""GDN, KDA and Mamba2 layers through cpscope.linear at CP1 against the kernel called directly: parity, then time.

On a GPU with flash-linear-attention installed the kernel is fla's (``chunk_gated_delta_rule``, ``chunk_kda``;
``chunk_simple_gla`` for Mamba2's SSD, with the dt / softplus / group / ``D`` handling a direct caller writes
himself); cpscope dispatches to the same kernel. Otherwise (``--tiny`` on CPU) the kernel is cpscope's torch chunk
code. For each layer, size and layout (one sequence; a pack of four uneven documents):

1. parity, forward and the gradient of every input: cpscope vs the direct call (same kernel: expected equal), and at
   ``--check-tokens`` cpscope vs cpscope's torch path (fp32 chunk code) on the same inputs;
2. time of forward + backward, the two calls interleaved over ``--rounds`` rounds of ``--iters`` iterations; the
   ratio of the medians (target <= 1.02) and the range of the per-round ratios.

Each row is printed as a JSON line; ``--out`` writes them all (with the device and versions) to one JSON file.

Usage::

    python benchmarks/bench_linear_gpu.py --out benchmarks/results/linear_gpu_h200.json        # 16k and 64k
    python benchmarks/bench_linear_gpu.py --tiny                                                 # CPU smoke run
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's cpscope

from cpscope.linear import _fla, gated_delta_rule, _kernels as kernels, _mamba2 as mamba2, mamba2_scan  # noqa: E402

log = logging.getLogger("bench_linear_gpu")

# layer shapes: Qwen3-Next's gated DeltaNet, Kimi Linear's KDA, Nemotron-H's Mamba2
FULL = {"gdn": dict(H=16, HV=32, K=128, V=128), "kda": dict(H=32, HV=32, K=128, V=128),
        "mamba2": dict(H=64, P=64, G=8, N=128)}
TINY = {"gdn": dict(H=2, HV=4, K=16, V=16), "kda": dict(H=2, HV=2, K=16, V=16), "mamba2": dict(H=4, P=16, G=2, N=16)}


def doc_lens(tokens: int, packed: bool) -> list[int]:
    return [tokens // 2, tokens // 4, tokens // 8, tokens // 8] if packed else [tokens]


def make(kind: str, tokens: int, dims: dict, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, device=dev, generator=gen)  # noqa: E731
    if kind in ("gdn", "kda"):
        H, HV, K, V = dims["H"], dims["HV"], dims["K"], dims["V"]
        g = -(0.02 + 0.15 * u(1, tokens, HV)) if kind == "gdn" else -(0.02 + 0.15 * u(1, tokens, HV, K))
        t = dict(q=r(1, tokens, H, K).to(dtype), k=r(1, tokens, H, K).to(dtype), v=r(1, tokens, HV, V).to(dtype),
                 g=g.float(), beta=(0.05 + 0.9 * u(1, tokens, HV)).to(dtype))
    else:
        H, P, G, N = dims["H"], dims["P"], dims["G"], dims["N"]
        t = dict(x=r(1, tokens, H, P).to(dtype), dt=(0.5 * r(1, tokens, H) - 1.0).to(dtype),
                 B=r(1, tokens, G, N).to(dtype), C=r(1, tokens, G, N).to(dtype), A=-(0.2 + u(H)), D=r(H),
                 dt_bias=0.3 * r(H))
    return {n: x.requires_grad_() for n, x in t.items()}


# ---- the three callers ----------------------------------------------------------------------------------------

def via_cpscope(kind: str, t: dict, cu: Optional[torch.Tensor], cu_cpu: Optional[torch.Tensor]) -> torch.Tensor:
    if kind in ("gdn", "kda"):
        return gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=cu, use_qk_l2norm=True,
                                group=None)
    return mamba2_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["dt_bias"], cu_seqlens=cu,
                       group=None)


def _mamba_inputs(t: dict) -> tuple:
    """What a direct caller of an SSD kernel computes around it (the dt handling of transformers' Mamba2)."""
    d = F.softplus(t["dt"].float() + t["dt_bias"])
    rep = t["x"].shape[2] // t["B"].shape[2]
    Bh, Ch = (t[n].repeat_interleave(rep, dim=2, output_size=t["x"].shape[2]) for n in ("B", "C"))
    return Ch, Bh, (t["x"].float() * d[..., None]).to(t["x"].dtype), d * t["A"]


def direct_kernels(kind: str, t: dict) -> kernels.Kernels:
    """fla where it runs these inputs forward and backward, else the torch chunk code (as cpscope picks: fla refuses
    its gated backward — GDN, Mamba2 — on Hopper with Triton < 3.7.1 and no tilelang)."""
    x = next(iter(t.values()))
    return kernels.FLA if _fla.usable(x, gated_backward=kind != "kda") else kernels.TORCH


def via_kernel(kind: str, t: dict, cu: Optional[torch.Tensor], cu_cpu: Optional[torch.Tensor],
               kern: kernels.Kernels = kernels.TORCH) -> torch.Tensor:
    """The kernel called directly (``kern``, chosen once by :func:`direct_kernels`), with the caller's offsets."""
    if kind in ("gdn", "kda"):
        o, _ = kern.delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True,
                               cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        return o.to(t["v"].dtype)
    y, _ = kern.simple_gla(*_mamba_inputs(t), scale=1.0, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return (y.float() + t["x"].float() * t["D"][:, None]).to(t["x"].dtype)


def via_torch_path(kind: str, t: dict, cu: Optional[torch.Tensor], cu_cpu: Optional[torch.Tensor]) -> torch.Tensor:
    """cpscope's torch path (fp32 chunk code) on the same inputs, whatever the device."""
    if kind in ("gdn", "kda"):
        o, _ = kernels.TORCH.delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        return o.to(t["v"].dtype)
    from cpscope.linear._pieces import runs_of_input
    from cpscope.scope import CPScope

    runs = runs_of_input(1, t["x"].shape[1], cu, CPScope(None, 1, 0), t["x"].device, where="bench")
    prep = mamba2.prepare(kernels.TORCH, t["x"], t["dt"], t["A"], t["B"], t["C"], t["dt_bias"], True,
                          (0.0, float("inf")))
    return mamba2.finish(mamba2.local_scan(kernels.TORCH, runs, *prep)[0], t["x"], t["D"])


# ---- parity and time ------------------------------------------------------------------------------------------

def outputs_and_grads(fn: Callable, kind: str, t: dict, cu: Any, cu_cpu: Any, seed: int = 1) -> list[torch.Tensor]:
    for x in t.values():
        x.grad = None
    out = fn(kind, t, cu, cu_cpu)
    w = torch.randn(out.shape, device=out.device, generator=torch.Generator(device=out.device).manual_seed(seed))
    (out.float() * w).sum().backward()
    return [out.detach().float()] + [x.grad.detach().float().clone() for x in t.values()]


def rel_errors(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    """Relative RMS error ``‖got − want‖ / ‖want‖`` of the output and of each gradient."""
    return {n: float((a - b).norm() / b.norm().clamp(min=1e-30)) for n, a, b in zip(["out", *names], got, want)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_pair(fns: list[Callable[[], torch.Tensor]], dev: torch.device, iters: int, rounds: int
              ) -> list[list[float]]:
    """Per-round ms of fwd + bwd of each fn, the fns interleaved round by round (after a warm-up of each)."""
    grads = []
    for fn in fns:  # warm-up (Triton autotuning) and a fixed output gradient
        for _ in range(2):
            out = fn()
            out.backward(torch.ones_like(out))
        grads.append(torch.ones_like(out))
    ms: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            _sync(dev)
            start = time.perf_counter()
            for _ in range(iters):
                fns[i]().backward(grads[i])
            _sync(dev)
            ms[i].append((time.perf_counter() - start) * 1e3 / iters)
    return ms


def run_case(kind: str, tokens: int, packed: bool, args: argparse.Namespace, dev: torch.device,
             dtype: torch.dtype) -> dict:
    dims = (TINY if args.tiny else FULL)[kind]
    t = make(kind, tokens, dims, dev, dtype)
    lens = doc_lens(tokens, packed)
    cu_cpu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long) if packed else None
    cu = None if cu_cpu is None else cu_cpu.to(device=dev, dtype=torch.int32)  # one offsets tensor, every call
    names = list(t)
    kern = direct_kernels(kind, t)
    direct = functools.partial(via_kernel, kern=kern)
    row: dict[str, Any] = {"layer": kind, "tokens": tokens, "packed": packed, "docs": len(lens), "kernel": kern.name,
                           "dtype": str(dtype)}
    ref = outputs_and_grads(direct, kind, t, cu, cu_cpu)
    mine = outputs_and_grads(via_cpscope, kind, t, cu, cu_cpu)
    row["parity_vs_direct"] = rel_errors(mine, ref, names)
    if tokens <= args.check_tokens:
        row["parity_vs_torch_path"] = rel_errors(mine, outputs_and_grads(via_torch_path, kind, t, cu, cu_cpu), names)
    del ref, mine
    ms = time_pair([lambda: direct(kind, t, cu, cu_cpu), lambda: via_cpscope(kind, t, cu, cu_cpu)], dev,
                   args.iters, args.rounds)
    direct_ms, mine_ms = statistics.median(ms[0]), statistics.median(ms[1])
    per_round = [b / a for a, b in zip(*ms)]
    row.update(direct_ms=round(direct_ms, 4), cpscope_ms=round(mine_ms, 4), ratio=round(mine_ms / direct_ms, 4),
               ratio_range=[round(min(per_round), 4), round(max(per_round), 4)])
    row["ok"] = parity_ok(row, args)
    return row


def parity_ok(row: dict, args: argparse.Namespace) -> bool:
    """cpscope equals the direct call (the same kernel) to ``--tol-direct`` and the torch path to ``--tol-torch``."""
    ok = max(row["parity_vs_direct"].values()) <= args.tol_direct
    if "parity_vs_torch_path" in row:
        ok = ok and max(row["parity_vs_torch_path"].values()) <= args.tol_torch
    return ok


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 16384 65536 (--tiny: 256)")
    ap.add_argument("--layers", nargs="+", default=["gdn", "mamba2", "kda"], choices=list(FULL))
    ap.add_argument("--iters", type=int, default=None, help="iterations per round (default 10; --tiny 1)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; --tiny 2)")
    ap.add_argument("--check-tokens", type=int, default=16384, help="largest size also checked against the torch path")
    ap.add_argument("--tol-direct", type=float, default=1e-3, help="relative RMS, cpscope vs the direct call")
    ap.add_argument("--tol-torch", type=float, default=3e-2, help="relative RMS, cpscope vs the fp32 torch path")
    ap.add_argument("--tiny", action="store_true", help="small shapes; runs on CPU (the torch kernels)")
    ap.add_argument("--out", default=None, help="write every row (and the device, versions) to this JSON file")
    args = ap.parse_args(argv)
    tokens = args.tokens or ([256] if args.tiny else [16384, 65536])
    args.iters = args.iters or (1 if args.tiny else 10)
    args.rounds = args.rounds or (2 if args.tiny else 7)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for kind in args.layers:
        for n in tokens:
            for packed in (False, True):
                row = run_case(kind, n, packed, args, dev, dtype)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    if args.out:
        meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "torch": torch.__version__, "fla": _version("flash-linear-attention"),
                "argv": sys.argv[1:] if argv is None else argv}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


def _version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
