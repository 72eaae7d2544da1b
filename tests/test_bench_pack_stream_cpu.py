"""``benchmarks/bench_pack_stream.py --tiny`` on CPU: the script runs, its parity checks pass, and its JSON has every
row the GPU run reports (the GPU numbers come from the lead's H100 / H200 run)."""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_pack_stream as bps  # noqa: E402


def test_draw_packs_long_tail_and_exact_totals():
    packs = bps.draw_packs(100, 16384, max_docs=18, seed=0)
    assert all(p[0] == 0 and p[-1] == 16384 and all(b > a for a, b in zip(p[:-1], p[1:])) for p in packs)
    assert len({p for p in packs}) > 90 and max(len(p) - 1 for p in packs) <= 18


def test_tiny_run(tmp_path):
    out = bps.main(["--tiny", "--out", str(tmp_path)])
    assert out["ok"], out
    rows = out["streams"][0]["rows"]
    assert {"cpscope", "cpscope_again", "cpscope_defer", "cpscope_defer_again", "flex"} <= set(rows)
    assert rows["cpscope_defer"]["packs"] == 6 and "deferred_keys" in rows["cpscope_defer"]
    assert rows["cpscope"]["packs"] == 6 and rows["cpscope"]["total_ms"] > 0
    assert out["check_small"]["cpscope"]["ok"] and out["check_small"]["cpscope_defer"]["ok"]
    assert out["streams"][0]["parity_first_pack"]["cpscope_defer"]["ok"]
    if importlib.util.find_spec("transformers") is not None:  # the Llama rows need transformers (an extra)
        assert out["llama"]["parity"]["cpscope"]["ok"]
    else:
        assert "llama" not in out
    assert (tmp_path / "pack_stream.json").exists()
