"""cpscope.sentinel raises no false alarm on correct training — fuzzed, fp32 and bf16, every check on every call.

* Hybrid training (the demo's loop: planner, CP1 / CP2 / CP4 microbatches in one step, GQA GPT) on 4 gloo ranks
  with ``every=1``: zero mismatches, and every check really ran (counts).
* Seeded random attention calls on 2 ranks: packs with empty, minimal (2·cp) and long documents, bshd / sbhd / thd,
  causal and full, MHA / GQA / MQA, CP1 and CP2, fp64 / fp32 / bf16, forward and backward, some through
  ``cpscope.checkpoint`` (recompute in backward) — zero mismatches. The worst error / tolerance seen per dtype is
  returned (it is the margin docs/sentinel.md reports).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import cpscope
from tests.distributed import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_hybrid as th  # noqa: E402

SMALL = dict(docs_per_step=8, median_len=40, sigma=0.9, min_len=6, max_len=128, capacity=32, vocab_size=64,
             hidden=32, n_layers=2, n_heads=4, n_kv_heads=2)


def _train(dtype: str, steps: int, seed: int):
    cfg = th.TrainConfig(mode="hybrid", steps=steps, seed=seed, dtype=dtype, **SMALL)
    with cpscope.sentinel(every=1) as s:
        res = th.train(cfg)
    return [str(m) for m in s.reports], s.summary().as_dict(), res.losses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_false_alarm_in_hybrid_training(dtype):
    results = run_ranks(4, _train, dtype, 10, 11)  # trained a little: the gradients shrink and start to cancel
    for reports, summary, losses in results:
        assert reports == [], reports
        checks = summary["checks"]
        for name in ("agreement", "attention", "attention-grad", "rope", "layout", "loss-normalisation"):
            assert checks.get(name, 0) > 0, (name, checks)
        assert summary["sampled"] == summary["microbatches"] > 0
        assert all(l == l for l in losses)  # finite
    assert sum(r[1]["checks"]["attention"] for r in results) >= 10 * 2 * 4  # steps x layers x (at least) ranks


def _random_calls(n_cases: int, seed: int, device: str = "cpu"):
    """Seeded random attention calls (every rank draws the same); ``device="cuda"``: fp16 / bf16 on this rank's GPU."""
    import torch.distributed as dist

    groups = cpscope.new_cp_groups([1, 2]) if dist.is_initialized() else {1: None}
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    rng = random.Random(seed)  # the same draws on every rank: shapes, layouts, sizes
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(1000 * seed + rank)  # each rank's own data: its shards differ
    with cpscope.sentinel(every=1) as s:
        for case in range(n_cases):
            cp = rng.choice(sorted(groups))
            fmt = rng.choice(["bshd", "sbhd", "thd"])
            causal = rng.random() < 0.7
            h, h_kv = rng.choice([(4, 4), (4, 2), (4, 1), (2, 2)])
            if dev.type == "cuda":
                dtype = rng.choice([torch.bfloat16, torch.bfloat16, torch.float16])
            else:
                dtype = rng.choice([torch.float64, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16])
            d = rng.choice([8, 16])
            unit = 2 * cp
            if fmt == "thd":
                lens = [unit * rng.choice([0, 1, 1, 2, 3, 8, 16] + ([256, 1024] if dev.type == "cuda" else []))
                        for _ in range(rng.randint(1, 4))]
                if sum(lens) == 0:
                    lens.append(unit)
                cu = [0]
                for n in lens:
                    cu.append(cu[-1] + n)
                shape_q, shape_kv = (cu[-1] // cp, h, d), (cu[-1] // cp, h_kv, d)
                kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
            else:
                b, s_local = rng.randint(1, 2), unit * rng.choice([1, 2, 6]) // cp
                seq = (b, s_local) if fmt == "bshd" else (s_local, b)
                shape_q, shape_kv = (*seq, h, d), (*seq, h_kv, d)
                kw = {}
            if rng.random() < 0.3:
                kw["softmax_scale"] = rng.uniform(0.05, 0.5)
            q = torch.randn(shape_q, generator=gen).to(dev, dtype).requires_grad_()
            k = torch.randn(shape_kv, generator=gen).to(dev, dtype).requires_grad_()
            v = torch.randn(shape_kv, generator=gen).to(dev, dtype).requires_grad_()
            w = torch.randn(shape_q, generator=gen).to(dev, dtype)
            recompute = rng.random() < 0.3

            def attend(q, k, v):
                return cpscope.context_parallel_attention(q, k, v, qkv_format=fmt, causal=causal, **kw)

            with cpscope.runtime_cp(groups[cp]), s.microbatch():
                out = cpscope.checkpoint(attend, q, k, v) if recompute else attend(q, k, v)
            (out * w).sum().backward()
    return [str(m) for m in s.reports], s.summary().as_dict()


def test_no_false_alarm_on_random_attention_calls():
    for reports, summary in run_ranks(2, _random_calls, 60, 7):
        assert reports == [], reports
        checks = summary["checks"]
        assert checks["attention"] == 60 and checks["attention-grad"] == 60 and checks.get("recompute", 0) > 0
        assert all(ratio <= 1.0 for ratio in summary["worst"].values()), summary["worst"]


def _cancelling_gradients(dtype_name: str):
    """V almost constant over the keys: dP_ij ≈ D_i, so dS and dq cancel to rounding noise (as in a trained model,
    where a correct fp32 ring is 1e-4 off *relative to |dq|*); the check must measure against the terms' size."""
    groups = cpscope.new_cp_groups([1, 2])
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(9 + 100 * torch.distributed.get_rank())  # each rank its own shards
    reports = []
    with cpscope.sentinel(every=1) as s:
        for cp in (1, 2):
            q = torch.randn(2, 16, 4, 16, generator=gen).to(dtype).requires_grad_()
            k = torch.randn(2, 16, 2, 16, generator=gen).to(dtype).requires_grad_()
            v = (1 + 1e-6 * torch.randn(2, 16, 2, 16, generator=gen)).to(dtype).requires_grad_()
            with cpscope.runtime_cp(groups[cp]), s.microbatch():
                out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
            (out * torch.randn(out.shape, generator=gen).to(dtype) * 1e-3).sum().backward()
        reports = [str(m) for m in s.reports]
    return reports, s.summary().checks, s.summary().worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_false_alarm_when_gradients_cancel(dtype):
    for reports, checks, worst in run_ranks(2, _cancelling_gradients, dtype):
        assert reports == [] and checks["attention-grad"] == 2, worst
