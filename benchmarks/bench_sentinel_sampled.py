"""What the sentinel's sampled-rows check adds to one attention call, and how it grows with the tokens (CPU).

One attention call (CP1, ``bshd``, causal; 16 query / 4 k/v heads × 128, the GPU benchmark's shapes), forward and
backward, with ``sentinel(every=1, rows=64, reference_dtype=float32)`` (the reference dtype the sentinel uses on
CUDA) and without, alternated; the attention itself is a cheap stand-in (``v`` repeated over the query heads), so
the difference is the sentinel's own work — the sampled rows' reference, ``dq`` and the ``dk`` / ``dv``
identities — and not the CPU ring. The stand-in's output is not attention: a huge ``rtol`` keeps the comparisons
from reporting (the same code runs; only the verdict is never a mismatch)::

    python benchmarks/bench_sentinel_sampled.py --tokens 4096 16384 --ops-tokens 32768 65536 --before REV \\
        --json benchmarks/results/sentinel_sampled_cpu.json

``--before REV`` also times ``cpscope/_sentinel/attention_sampled.py`` as it was at git revision ``REV``, in the
same process, alternated with the current one (off / before / now in rotating order, ``--repeats`` rounds, the
median of each), so both see the same load. Per mode: the median extra milliseconds over off, the ratio of the
extra time (before / now), and the number of ATen operations the sentinel runs per call (``torch.profiler``: on a
GPU each is at least one kernel launch and its host time, which is what a check of 64 rows costs there).
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import dump  # noqa: E402

H, HKV, D = 16, 4, 128


def _stand_in(q, k, v, *, plan, group, **kw):
    """A cheap differentiable [b, s, h, d] output from ``v`` (not attention; the sentinel's work is what is timed)."""
    return v.repeat_interleave(q.shape[-2] // v.shape[-2], dim=-2) + 0 * q[..., : v.shape[-1]]


def _load_before(rev: str):
    """``attention_sampled`` as it was at ``rev``, imported beside the current one (same package)."""
    src = subprocess.run(["git", "-C", _ROOT, "show", f"{rev}:cpscope/_sentinel/attention_sampled.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "attention_sampled_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("cpscope._sentinel.attention_sampled_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(tokens: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, tokens, n, D, generator=g).to(dtype).requires_grad_() for n in (H, HKV, HKV)]


def _one(tokens: int, dtype: torch.dtype, impl, args) -> float:
    """Seconds of one forward + backward; ``impl`` ``None``: sentinel off, else the sampled check to use."""
    import cpscope
    import cpscope._sentinel.attention_check as check

    q, k, v = _inputs(tokens, dtype)
    s = None
    if impl is not None:
        check.sampled_numeric = impl
        s = cpscope.sentinel(every=1, rows=args.rows, on_mismatch="log", reference_dtype=torch.float32,
                             rtol={dtype: (1e30, 1e30)})
    t0 = time.perf_counter()
    try:
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
        out.float().square().sum().backward()
    finally:
        if s is not None:
            summary = s.stop()
            assert summary.checks.get("attention") == 1 and summary.checks.get("attention-grad") == 1, summary.checks
            assert not s.reports, s.reports
    return time.perf_counter() - t0


def _ops(tokens: int, dtype: torch.dtype, impl, args) -> int:
    """ATen operations of one call (top level: what a GPU would launch), minus those of the call unchecked."""
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for mode in (None, impl):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _one(tokens, dtype, mode, args)
        counts.append(sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None))
    return counts[1] - counts[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--before", default=None, help="git revision of attention_sampled.py to compare with")
    p.add_argument("--ops-tokens", type=int, nargs="*", default=[],
                   help="more sizes at which only the operations are counted (no timing)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("cpscope.sentinel").setLevel(logging.ERROR)
    import cpscope.attention._api as api
    import cpscope._sentinel.attention_sampled as now

    api.ring_attention = _stand_in
    dtype = getattr(torch, args.dtype)
    impls = {"now": now.sampled_numeric}
    if args.before:
        impls = {"before": _load_before(args.before).sampled_numeric, **impls}
    rows = []
    for tokens in args.tokens:
        modes = [None, *impls]
        for m in modes:  # warm-up
            _one(tokens, dtype, impls.get(m), args)
        times: dict = {m: [] for m in modes}
        for r in range(args.repeats):
            for m in modes[r % len(modes):] + modes[:r % len(modes)]:  # rotate the order
                times[m].append(_one(tokens, dtype, impls.get(m), args))
        off = statistics.median(times[None])
        row = {"tokens": tokens, "off_ms": round(off * 1e3, 2)}
        for m in impls:
            row[f"{m}_extra_ms"] = round((statistics.median(times[m]) - off) * 1e3, 2)
            row[f"{m}_ops"] = _ops(tokens, dtype, impls[m], args)
        if "before" in impls:
            row["extra_ratio_before_over_now"] = round(row["before_extra_ms"] / max(row["now_extra_ms"], 1e-9), 2)
        rows.append(row)
        print(row, flush=True)
    ops = []
    for tokens in args.ops_tokens:
        ops.append({"tokens": tokens, **{f"{m}_ops": _ops(tokens, dtype, impls[m], args) for m in impls}})
        print(ops[-1], flush=True)
    out = {"device": "cpu", "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype,
           "shape": f"bshd [1, T, {H}/{HKV}, {D}], CP1, causal", "rows_checked": args.rows,
           "reference_dtype": "float32", "before": args.before, "repeats": args.repeats, "rows": rows,
           "ops_only": ops}
    if args.json:
        dump(out, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
