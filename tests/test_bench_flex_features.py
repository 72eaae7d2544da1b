"""``benchmarks/bench_flex_features.py --tiny`` on CPU: the window + softcap benchmark runs end to end (attention rows,
the float64 check, the Gemma 2 rows against ``attn_implementation="eager"``) through the FlexAttention route, and its
float64 check fails on a wrong result. The GPU numbers come from the full run (``docs/attention_kernels.md``)."""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_flex_features as bf  # noqa: E402


def test_tiny_run(tmp_path):
    res = bf.main(["--tiny", "--out", str(tmp_path), "--json", "flex.json"])
    assert (tmp_path / "flex.json").exists()
    assert res["reference_check"]["ok"], res["reference_check"]
    assert len(res["attention"]) == 2 and not res.get("errors"), res.get("errors")
    for row in res["attention"]:
        assert row["cpscope_ms"] and row["parity_vs_flex"]["ok"], row
    assert res["attention"][0]["cpscope_exact_ms"]  # the route before: FlexAttention off
    assert res["flex_calls"]["attend"] > 0  # the calls went through FlexAttention
    if importlib.util.find_spec("transformers") is None:  # the core-only pass: the Gemma 2 rows say why they are absent
        assert not res["gemma2"] and "transformers" in res["skipped"]["gemma2"], res
        return
    (gemma,) = res["gemma2"]
    assert gemma["ok"] and gemma["checked_against"] == "eager" and gemma["cpscope_ms"], gemma


def test_reference_check_fails_on_a_wrong_result(monkeypatch):
    import torch

    from cpscope.attention._kernels import flex

    real = flex.attend
    monkeypatch.setattr(flex, "attend", lambda *a, **k: real(*a, **k) * 1.05)
    args = bf.parse_args(["--tiny"])
    res = bf.reference_check(args, torch.device("cpu"), torch.float32)
    assert not res["ok"] and res["out"] > 1e-2
