#!/usr/bin/env python3
"""Every dtype on one GPU (issue 31): cpscope at CP1 in bf16, fp16 and fp32 beside SDPA in the same dtype, in one run.

B=1, 32 q heads / 8 k/v heads, head dim 128, causal, forward + backward (``out.backward(dout)``), CUDA-event
medians (:class:`_bench_util.Timer`). Rows, per length and dtype:

* ``sdpa_bshd`` — ``F.scaled_dot_product_attention(..., is_causal=True)`` on ``[b, h, s, d]`` views (fp32: its
  memory-efficient kernel, K/V heads expanded inside the step as cpscope does; bf16 / fp16: ``enable_gqa=True``,
  cuDNN or flash);
* ``cpscope_bshd`` — ``cpscope.context_parallel_attention(qkv_format="bshd", group=None)`` (fp32: aten's
  memory-efficient kernels through cpscope's router; bf16 / fp16: cuDNN);
* ``sdpa_thd`` — per-document causal SDPA over a long-tail pack of 12 documents (one call per document);
* ``cpscope_thd`` — the same pack in one ``thd`` call.

The summary gives, per length, ``fp32 cpscope / fp32 SDPA`` (target <= 1.1) and ``fp16 cpscope / bf16 cpscope``
(target ~1.0), for bshd and thd. ``--check`` first runs the GPU parity of every dtype against float64
(``tests/attention/test_dtypes_gpu.py``'s block cases and CP1 calls with window, softcap and sinks) and stops on a
failure.

    python benchmarks/bench_dtypes.py --check --seqlens 16384 65536 --out benchmarks/results --json dtypes_h100.json
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_util import Timer, attempt, env_info, log, setup_logging, write_json  # noqa: E402

H, H_KV, D = 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
THD_SHARES = [16, 12, 8, 8, 4, 4, 4, 2, 2, 2, 1, 1]  # a long tail: document lengths in 64ths of the pack


def _lens(total: int) -> list[int]:
    lens = [total * s // 64 for s in THD_SHARES]
    lens[0] += total - sum(lens)
    return lens


def _inputs(fmt: str, n: int, dtype: torch.dtype, dev: torch.device) -> tuple:
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (1, n) if fmt == "bshd" else (n,)
    mk = lambda h: torch.randn(*shape, h, D, device=dev, dtype=dtype, generator=g)  # noqa: E731
    return mk(H), mk(H_KV), mk(H_KV), mk(H)


def _sdpa(q, k, v):  # [b, s, h, d]
    if q.dtype == torch.float32:  # SDPA's memory-efficient kernel takes one head count: K/V expanded, as cpscope does
        k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], dim=2) for x in (k, v))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=k.shape[2] != q.shape[2])
    return o.transpose(1, 2)


def _step(row: str, fmt: str, n: int, dtype: torch.dtype, dev: torch.device):
    import cpscope

    q, k, v, do = _inputs(fmt, n, dtype, dev)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    cu_host = [0]
    for length in _lens(n):
        cu_host.append(cu_host[-1] + length)
    cu = torch.tensor(cu_host, dtype=torch.int32, device=dev)

    def step() -> None:
        for x in leaves:
            x.grad = None
        if row == "sdpa" and fmt == "bshd":
            out = _sdpa(*leaves)
        elif row == "sdpa":
            out = torch.cat([_sdpa(*(x[a:b][None] for x in leaves))[0] for a, b in zip(cu_host[:-1], cu_host[1:])])
        else:
            kw = {"cu_seqlens": cu} if fmt == "thd" else {}
            out = cpscope.context_parallel_attention(*leaves, qkv_format=fmt, group=None, **kw)
        out.backward(do)
    return step


def _routes(dev: torch.device) -> dict:
    from cpscope.attention._kernels import routing_table

    table = {name: routing_table(dev, dtype) for name, dtype in DTYPES.items()}
    return {name: {kind: t[kind][0] for kind in ("dense", "packed")} for name, t in table.items()}


def check() -> dict:
    """The GPU parity tests of every dtype (block cases and CP1 calls) against float64; raises on a failure."""
    import pytest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rc = pytest.main(["-q", "-m", "gpu", "-x", os.path.join(root, "tests/attention/test_dtypes_gpu.py")])
    if rc != 0:
        raise SystemExit(f"dtype parity failed (pytest exit code {rc}); no timings")
    return {"tests/attention/test_dtypes_gpu.py": "passed"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default="dtypes.json")
    args = ap.parse_args()
    setup_logging(0)
    dev = torch.device("cuda", 0)
    record: dict[str, Any] = {"env": env_info(dev), "rows": {}, "summary": {}, "routes": _routes(dev)}
    if args.check:
        record["check"] = check()
    timer = Timer(dev, iters=args.iters)
    for n in args.seqlens:
        for name in args.dtypes:
            for fmt in ("bshd", "thd"):
                for row in ("sdpa", "cpscope"):
                    key = f"{n}/{name}/{row}_{fmt}"
                    ms = attempt(record, key, lambda: timer.median_ms(_step(row, fmt, n, DTYPES[name], dev)))
                    record["rows"][key] = ms
                    log.info("%-32s %s ms", key, "failed" if ms is None else f"{ms:.2f}")
        rows = record["rows"]
        for fmt in ("bshd", "thd"):
            r32 = (rows.get(f"{n}/fp32/cpscope_{fmt}"), rows.get(f"{n}/fp32/sdpa_{fmt}"))
            r16 = (rows.get(f"{n}/fp16/cpscope_{fmt}"), rows.get(f"{n}/bf16/cpscope_{fmt}"))
            record["summary"][f"{n}/{fmt}"] = {
                "fp32_cpscope_over_fp32_sdpa": None if None in r32 else round(r32[0] / r32[1], 3),
                "fp16_cpscope_over_bf16_cpscope": None if None in r16 else round(r16[0] / r16[1], 3)}
            log.info("%s %s: %s", n, fmt, record["summary"][f"{n}/{fmt}"])
        torch.cuda.empty_cache()
    if args.out:
        log.info("wrote %s", write_json(record, args.out, args.json))


if __name__ == "__main__":
    main()
