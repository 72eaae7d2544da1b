"""``benchmarks/bench_agreement.py --tiny`` runs on CPU (one gloo process, the check forced per layer) and writes its
figures; its correctness check fails on a wrong attention."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run_writes_both_sizes_with_and_without_the_check(tmp_path):
    out = tmp_path / "agreement.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_agreement.py"), "--tiny",
                          "--layers", "2", "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["correctness"]["ok"] and data["correctness"]["max_abs_err_vs_float64"] < 1e-4, data["correctness"]
    assert [r["tokens"] for r in data["rows"]] == [32, 64]
    for row in data["rows"]:
        assert row["step_ms_with_check"] > 0 and row["step_ms_without_check"] > 0
        assert row["ratio"] == pytest.approx(row["step_ms_with_check"] / row["step_ms_without_check"])
    assert set(data["check_alone"]) == {"first_call_us", "repeated_call_host_us", "step_boundary_read_us"}
    assert "ratio" in res.stderr + res.stdout  # the one-line summaries


def _wrong_attention_is_caught() -> str:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_agreement as bench

    attend = bench._Attend(1, dist.group.WORLD)
    wrong = lambda q, k, v: attend(q, k, v) * 1.05  # noqa: E731
    try:
        bench._check_correctness(wrong, 1, torch.device("cpu"))
    except SystemExit as e:
        return str(e)
    return "not caught"


def test_the_correctness_check_fails_on_a_wrong_attention():
    (msg,) = run_ranks(1, _wrong_attention_is_caught)
    assert msg.startswith("correctness check failed"), msg
