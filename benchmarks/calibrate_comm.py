"""Calibrate the per-variant attention cost model on this machine (``comm="auto"`` and the hybrid planner use it).

Collective: run under ``torchrun``; every rank times every communication variant over its CP groups (all the
powers of two dividing the world size), the timings are max-reduced over the ranks, and every rank fits the
same :class:`cpscope.hybrid._comm_cost.CommCostModel`. The model goes to the cache
(``$CPSCOPE_CACHE_DIR`` or ``~/.cache/cpscope/``, written by ``LOCAL_RANK`` 0) and, with ``--out``, to a JSON
report with the fit's residuals and what ``"auto"`` picks on the timed configurations.

Two GPUs (bf16, 32 heads × 128, k/v heads 32 and 8, 16k–128k tokens, 1 or 8 documents)::

    torchrun --nproc_per_node=2 benchmarks/calibrate_comm.py --out benchmarks/results/comm_cost_h200x2.json

Eight GPUs, with the hierarchical variant over sub-groups of 2 (CP sizes 1–8)::

    torchrun --nproc_per_node=8 benchmarks/calibrate_comm.py --inner 2 --out benchmarks/results/comm_cost_h200x8.json

CPU dry run of the machinery (gloo; ``--stand-in`` times the ring under every variant name)::

    torchrun --nproc_per_node=2 benchmarks/calibrate_comm.py --stand-in --heads 4 --kv-heads 4 2 --head-dim 16 \\
        --tokens 256 1024 --docs 1 4 --repeats 3 --cache-dir /tmp/cpscope-cache --out /tmp/comm_cost_cpu.json
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cpscope  # noqa: E402
from cpscope.train._calibrate import calibrate  # noqa: E402
from tests._stand_in import ring_stand_in  # noqa: E402
from cpscope._variants import VARIANTS  # noqa: E402
from cpscope.hybrid._comm_cost import LOCAL, CommCostModel, cache_path  # noqa: E402
from cpscope.hybrid._cheapest_variant import choose, predict  # noqa: E402
from _results import dump  # noqa: E402


def auto_report(model: CommCostModel) -> list[dict[str, Any]]:
    """Per timed configuration (cp > 1, timed under several variants): each variant's measured and predicted
    seconds, ``"auto"``'s pick, and how much slower the pick measured than the fastest variant."""
    by_config: dict[tuple, dict[str, float]] = {}
    for s in model.samples:
        if s.variant == LOCAL:
            continue
        key = (s.dtype, s.cp, s.lengths, s.heads, s.kv_heads, s.head_dim, s.causal)
        by_config.setdefault(key, {})[s.variant] = s.seconds
    rows = []
    order = sorted(by_config, key=lambda k: (k[0], k[1], sum(k[2]), len(k[2]), -k[4], k[3], k[5], k[6]))
    for (dtype, cp, lengths, heads, kv, d, causal) in order:
        measured = by_config[(dtype, cp, lengths, heads, kv, d, causal)]
        kw = dict(cp=cp, heads=heads, kv_heads=kv, head_dim=d, dtype=dtype, causal=causal)
        pick = choose(model, lengths, candidates=tuple(measured), **kw)
        best = min(measured, key=measured.__getitem__)
        rows.append({"dtype": dtype, "cp": cp, "tokens": sum(lengths), "docs": len(lengths), "heads": heads,
                     "kv_heads": kv, "measured_s": measured,
                     "predicted_s": predict(model, lengths, candidates=tuple(measured), **kw),
                     "auto": pick, "fastest": best, "auto_vs_fastest": measured[pick] / measured[best]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536, 131072], help="global tokens per call")
    ap.add_argument("--docs", type=int, nargs="+", default=[1, 8], help="documents per call (thd)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--full", action="store_true", help="time non-causal attention instead of causal")
    ap.add_argument("--inner", type=int, default=None, help="a2a+p2p: size of the all-to-all sub-groups")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stand-in", action="store_true",
                    help="time the ring under every variant name (machinery dry run before the variants exist)")
    ap.add_argument("--cache-dir", default=None, help="cache folder (default $CPSCOPE_CACHE_DIR or ~/.cache/cpscope)")
    ap.add_argument("--out", default=None, help="JSON report (rank 0)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=10))
    try:
        world = dist.get_world_size()
        sizes, s = [], 1
        while world % s == 0 and s <= world:
            sizes.append(s)
            s *= 2
        groups = cpscope.new_cp_groups(sizes)
        model = calibrate(groups, variants=args.variants, heads=args.heads, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, tokens=args.tokens, docs=args.docs, dtype=args.dtype,
                          causal=not args.full, inner=args.inner, warmup=args.warmup, repeats=args.repeats,
                          attention=ring_stand_in if args.stand_in else None, directory=args.cache_dir)
        if dist.get_rank() == 0:
            rows = auto_report(model)
            resid = [{"variant": s.variant, "cp": s.cp, "tokens": sum(s.lengths), "docs": len(s.lengths),
                      "kv_heads": s.kv_heads, "measured_s": s.seconds, "rel_error": r}
                     for s, r in model.residuals()]
            print(f"cache: {cache_path(model.meta, args.cache_dir)}")
            for dt, per in model.coefficients.items():
                for v, c in per.items():
                    print(f"{dt:>9} {v:>10}: " + "  ".join(f"{x:.3e}" for x in c))
            print(f"fit: max |predicted/measured - 1| = {max(abs(r['rel_error']) for r in resid):.3f} over "
                  f"{len(resid)} samples")
            print(f"{'cp':>3} {'tokens':>7} {'docs':>4} {'kv':>3}  " + "  ".join(f"{v:>10}" for v in VARIANTS)
                  + f"  {'auto':>10} {'auto/best':>9}")
            for r in rows:
                times = "  ".join(f"{1e3 * r['measured_s'][v]:>8.2f}ms" if v in r["measured_s"] else f"{'-':>10}"
                                  for v in VARIANTS)
                print(f"{r['cp']:>3} {r['tokens']:>7} {r['docs']:>4} {r['kv_heads']:>3}  {times}  {r['auto']:>10} "
                      f"{r['auto_vs_fastest']:>9.3f}")
            if args.out:
                dump({"model": model.to_json(), "residuals": resid, "auto": rows}, args.out)
                print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
