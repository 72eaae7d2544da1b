"""cpscope.sentinel on GPUs (skipped without CUDA): no false alarm with the CUDA kernels in fp16 / bf16.

The CPU tests fix the tolerances against the exact CPU blocks; on CUDA the ring runs cuDNN / flash kernels (P rounded
to 16 bits) and the reference runs in float32. These tests run the seeded random calls of test_sentinel_fuzz.py —
packs up to a few thousand tokens, all layouts, causal and full, MHA / GQA / MQA, with gradients and recompute —
on one GPU (CP1) and on two (NCCL, CP1 and CP2), require zero mismatches, and print the worst error / tolerance per
check and dtype (the margin for docs/sentinel.md).

    python -m pytest -q -s tests/test_sentinel_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_sentinel_fuzz import _random_calls


def _show(worst: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items()))


@pytest.mark.gpu
def test_no_false_alarm_on_one_gpu():
    reports, summary = _random_calls(80, 3, device="cuda")
    print("\n1 GPU worst error/tolerance:", _show(summary["worst"]))
    assert reports == [], reports
    assert summary["checks"]["attention"] == 80 and summary["checks"]["attention-grad"] == 80


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_no_false_alarm_on_two_gpus_nccl():
    results = run_ranks(2, _random_calls, 80, 4, "cuda", backend="nccl")
    for rank, (reports, summary) in enumerate(results):
        print(f"\n2 GPUs rank {rank} worst error/tolerance:", _show(summary["worst"]))
        assert reports == [], reports
        assert summary["checks"]["attention"] == 80 and summary["checks"].get("agreement", 0) > 0
