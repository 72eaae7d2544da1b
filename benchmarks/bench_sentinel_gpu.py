"""What a sampled step of ``cpscope.sentinel`` costs at long context: ``sentinel(every=1)`` vs off, same run.

One GPU (CP1), a transformers GQA decoder (Llama: 16 heads / 4 k/v heads × 128, 8 layers, hidden 2048, bf16,
random weights) at 32k and 64k tokens, ``attn_implementation="cpscope"``::

    python benchmarks/bench_sentinel_gpu.py --out benchmarks/results

A step is ``zero_grad``, ``loss = model(**batch).loss``, ``loss.backward()``. Each size runs "off" and "every=1"
interleaved (``--repeats`` pairs after warm-up, each timed between CUDA synchronisations), so the load hits both
alike; reported: median step time and peak memory (``torch.cuda.max_memory_allocated`` over one step, reset
before it) of each, their ratios (targets: time ≤ 1.5x, peak ≤ 1.1x), and the sentinel's summary (checks run,
worst error / tolerance, mismatches — there must be none). JSON: ``sentinel_gpu.json`` (with the command).

On CPU, a tiny model (2 layers, hidden 64, 256 tokens, float32), a crash test of the script::

    python benchmarks/bench_sentinel_gpu.py --tiny --out /tmp/x
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import dump  # noqa: E402


def _model(args, tokens: int, dev: torch.device, dtype: torch.dtype):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
        max_position_embeddings=max(tokens, 4096), attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(dev):
        try:
            model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="cpscope",
                                                               dtype=dtype)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="cpscope",
                                                               torch_dtype=dtype)
    assert model.config._attn_implementation == "cpscope"
    return model.train()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _one(model, batch: dict, dev: torch.device, sentinel_on: bool, rows: int) -> tuple[float, float, dict]:
    """One step: (seconds, peak bytes above the step's start, the sentinel's summary)."""
    import cpscope

    model.zero_grad(set_to_none=True)
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    s = cpscope.sentinel(every=1, rows=rows) if sentinel_on else None
    try:
        loss = model(**batch).loss
        loss.backward()
        _sync(dev)
    finally:
        summary = s.stop() if s is not None else None
    secs = time.perf_counter() - t0
    peak = float(torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else 0.0
    info = {} if summary is None else {"checks": dict(summary.checks), "mismatches": len(s.reports),
                                       "worst": {k: round(v, 4) for k, v in summary.worst.items()}}
    return secs, peak, info


def run_size(args, tokens: int, dev: torch.device, dtype: torch.dtype) -> dict:
    import cpscope.integrations.hf as cphf

    model = _model(args, tokens, dev, dtype)
    ids = torch.randint(0, args.vocab, (1, tokens), generator=torch.Generator().manual_seed(1)).to(dev)
    batch = cphf.shard_batch({"input_ids": ids, "labels": ids, "use_cache": False}, group=None)
    for _ in range(args.warmup):
        _one(model, batch, dev, False, args.rows)
        _one(model, batch, dev, True, args.rows)
    off_t, on_t, off_m, on_m, info = [], [], [], [], {}
    for i in range(args.repeats):
        for on in ((False, True) if i % 2 == 0 else (True, False)):  # alternate the order
            secs, peak, got = _one(model, batch, dev, on, args.rows)
            (on_t if on else off_t).append(secs)
            (on_m if on else off_m).append(peak)
            info = got or info
    off_s, on_s = statistics.median(off_t), statistics.median(on_t)
    off_p, on_p = max(off_m), max(on_m)
    row = {"tokens": tokens, "layers": args.layers, "heads": f"{args.heads}/{args.kv_heads}", "rows": args.rows,
           "off_ms": round(off_s * 1e3, 2), "every1_ms": round(on_s * 1e3, 2),
           "time_ratio": round(on_s / off_s, 3), "off_peak_gib": round(off_p / 2**30, 3),
           "every1_peak_gib": round(on_p / 2**30, 3),
           "peak_ratio": round(on_p / off_p, 3) if off_p else None, "sentinel": info}
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, default=64, help="sentinel(rows=): query rows checked per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU crash test: tiny model, float32")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--json", default="sentinel_gpu.json")
    args = p.parse_args()
    if args.tiny:
        args.tokens, args.layers, args.hidden, args.intermediate = [256], 2, 64, 128
        args.heads, args.kv_heads, args.vocab, args.warmup, args.repeats = 4, 2, 128, 1, 2
        args.rows = min(args.rows, 16)
    dev = torch.device("cpu") if args.tiny or not torch.cuda.is_available() else torch.device("cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    rows = []
    for tokens in args.tokens:
        row = run_size(args, tokens, dev, dtype)
        rows.append(row)
        print(f"{tokens:>6} tokens: off {row['off_ms']} ms, every=1 {row['every1_ms']} ms "
              f"(x{row['time_ratio']}); peak {row['off_peak_gib']} -> {row['every1_peak_gib']} GiB "
              f"(x{row['peak_ratio']}); checks {row['sentinel'].get('checks')}, mismatches "
              f"{row['sentinel'].get('mismatches')}", flush=True)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": str(dtype).replace("torch.", ""), "rows": rows,
           "targets": {"time_ratio": 1.5, "peak_ratio": 1.1}}
    os.makedirs(args.out, exist_ok=True)
    dump(out, os.path.join(args.out, args.json))
    print(f"wrote {os.path.join(args.out, args.json)}")


if __name__ == "__main__":
    main()
