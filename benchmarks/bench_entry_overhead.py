"""Eager host time of cpscope's public entry points against those of a baseline revision, in one process.

The entry points (``cpscope/rope/_api.py``, ``cpscope/attention/_api.py``, ``cpscope/attention/_module.py``) of
``--baseline`` are loaded from git beside the checkout's own, under private module names, on top of the checkout's
other modules; then every case runs both versions interleaved (the order alternates between repeats) and reports
the median of the per-repeat ratios ``checkout / baseline`` of CPU time of the timing thread (``time.thread_time``,
so other processes of a shared machine do not count; one intra-op thread). Tiny CP1 calls, where host time is all
there is:

* ``rope_bshd``   — ``apply_rotary_pos_emb`` on a ``[1, 8, 2, 16]`` tensor
* ``rope_thd16``  — ``apply_rotary_pos_emb`` on ``[256, 2, 16]``, 16 documents (one cached pack)
* ``attn_bshd``   — ``context_parallel_attention`` on ``[1, 8, 2, 16]`` q/k/v that require grad
* ``module_thd``  — ``ContextParallelAttention(qkv_format="thd")`` on ``[64, 2, 16]``, 4 documents

It measures what the code around the kernels costs when nothing is compiled (what a ``torch.compile`` test in an
entry point adds, for example), not the kernels.

Usage::

    python benchmarks/bench_entry_overhead.py --baseline c0042e7 --json benchmarks/results/entry_overhead_cpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from types import ModuleType
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpscope  # noqa: E402
from cpscope.attention import _api as new_attn, _module as new_module  # noqa: E402
from cpscope.rope import _api as new_rope  # noqa: E402


def _load(rev: str, rel: str, name: str, redirect: dict[str, ModuleType]) -> ModuleType:
    """``rel`` of revision ``rev`` as module ``name`` (in the package of the file), with ``redirect`` standing in
    for the named modules while it imports."""
    try:
        src = subprocess.check_output(["git", "-C", ROOT, "show", f"{rev}:{rel}"], stderr=subprocess.DEVNULL).decode()
    except subprocess.CalledProcessError:  # a revision from before the modules were underscored: rel without "_"
        head, _, tail = rel.rpartition("/")
        src = subprocess.check_output(["git", "-C", ROOT, "show", f"{rev}:{head}/{tail.lstrip('_')}"]).decode()
    # such a revision imports its siblings by their old names: let those name the checkout's private modules
    old_names = {k.replace("._", ".", 1): v for k, v in sys.modules.items()
                 if k.startswith("cpscope.") and k.count("._") == 1 and v is not None}
    redirect = {**{k: v for k, v in old_names.items() if k not in sys.modules}, **redirect}
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__package__ = name.rsplit(".", 1)[0]
    saved = {k: sys.modules.get(k) for k in redirect}
    sys.modules.update(redirect)
    sys.modules[name] = mod
    try:
        exec(compile(src, f"{rev}:{rel}", "exec"), mod.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


def _cases(rope: ModuleType, attn: ModuleType, module: ModuleType) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    freqs = cpscope.rotary_freqs(16, 512)
    xb, xt = torch.randn(1, 8, 2, 16), torch.randn(256, 2, 16)
    cu16 = torch.arange(0, 257, 16, dtype=torch.int32)
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    qt, kt, vt = (torch.randn(64, 2, 16, requires_grad=True) for _ in range(3))
    cu4 = torch.arange(0, 65, 16, dtype=torch.int32)
    mod = module.ContextParallelAttention(qkv_format="thd", causal=True)
    return {
        "rope_bshd": lambda: rope.apply_rotary_pos_emb(xb, freqs, qkv_format="bshd"),
        "rope_thd16": lambda: rope.apply_rotary_pos_emb(xt, freqs, qkv_format="thd", cu_seqlens=cu16),
        "attn_bshd": lambda: attn.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True),
        "module_thd": lambda: mod(qt, kt, vt, cu_seqlens=cu4),
    }


def _time(fn: Callable[[], Any], number: int) -> float:
    for _ in range(max(number // 20, 5)):
        fn()
    t0 = time.thread_time()
    for _ in range(number):
        fn()
    return (time.thread_time() - t0) / number * 1e6  # µs per call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision whose entry points are the baseline")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--number", type=int, default=2000, help="calls per sample")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the kernels on this thread only: its CPU time is the whole call's
    old_rope = _load(args.baseline, "cpscope/rope/_api.py", "cpscope.rope._baseline_api", {})
    old_attn = _load(args.baseline, "cpscope/attention/_api.py", "cpscope.attention._baseline_api", {})
    old_module = _load(args.baseline, "cpscope/attention/_module.py", "cpscope.attention._baseline_module",
                       {"cpscope.attention._api": old_attn, "cpscope.attention.api": old_attn})
    versions = {"baseline": _cases(old_rope, old_attn, old_module), "checkout": _cases(new_rope, new_attn,
                                                                                      new_module)}
    rows = []
    for name in versions["checkout"]:
        samples: dict[str, list[float]] = {"baseline": [], "checkout": []}
        ratios = []
        for r in range(args.repeats):
            order = ("baseline", "checkout") if r % 2 else ("checkout", "baseline")
            got = {tag: _time(versions[tag][name], args.number) for tag in order}
            for tag, us in got.items():
                samples[tag].append(us)
            ratios.append(got["checkout"] / got["baseline"])
        row = {"case": name, "baseline_us": round(statistics.median(samples["baseline"]), 3),
               "checkout_us": round(statistics.median(samples["checkout"]), 3),
               "ratio": round(statistics.median(ratios), 4),
               "ratio_min_max": [round(min(ratios), 4), round(max(ratios), 4)]}
        rows.append(row)
        print(row, flush=True)
    if args.json:
        from _results import dump

        head = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).decode().strip()
        dump({"baseline": args.baseline, "code": head, "torch": torch.__version__, "repeats": args.repeats,
              "number": args.number, "loadavg": [round(x, 2) for x in os.getloadavg()], "rows": rows}, args.json)


if __name__ == "__main__":
    main()
