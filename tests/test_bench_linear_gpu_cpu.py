"""benchmarks/bench_linear_gpu.py on CPU (``--tiny``: the torch kernels stand in for fla): it runs every layer and
layout, writes its JSON, and its parity check can fail. The GPU figures come from the command in docs/linear.md."""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_linear_gpu as bl  # noqa: E402


def test_tiny_run_writes_rows(tmp_path) -> None:
    out = tmp_path / "linear.json"
    rows = bl.main(["--tiny", "--tokens", "64", "--layers", "gdn", "mamba2", "--out", str(out)])
    assert [(r["layer"], r["packed"]) for r in rows] == [("gdn", False), ("gdn", True), ("mamba2", False),
                                                        ("mamba2", True)]
    for r in rows:
        assert r["ok"] and r["kernel"] == "torch" and r["ratio"] > 0, r
        assert set(r["parity_vs_direct"]) >= {"out", "q"} or set(r["parity_vs_direct"]) >= {"out", "x", "dt_bias"}
    saved = json.loads(out.read_text())
    assert saved["meta"]["device"] == "cpu" and len(saved["rows"]) == 4


def test_parity_check_can_fail() -> None:
    args = argparse.Namespace(tol_direct=1e-3, tol_torch=3e-2)
    good = {"parity_vs_direct": {"out": 0.0, "q": 1e-5}, "parity_vs_torch_path": {"out": 1e-3}}
    assert bl.parity_ok(good, args)
    assert not bl.parity_ok({**good, "parity_vs_direct": {"out": 0.0, "q": 0.2}}, args)
    assert not bl.parity_ok({**good, "parity_vs_torch_path": {"out": 0.5}}, args)
    t = bl.make("gdn", 32, bl.TINY["gdn"], bl.torch.device("cpu"), bl.torch.float32)
    a = bl.outputs_and_grads(bl.via_cpscope, "gdn", t, None, None)
    b = [x.clone() for x in a]
    b[0] += 0.1 * b[0].norm() / b[0].numel() ** 0.5
    assert bl.rel_errors(b, a, list(t))["out"] > 0.05  # a wrong output shows in the measure
