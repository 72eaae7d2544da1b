"""The attention, host-time and transformers benchmark scripts on CPU, tiny shapes: they run, and their parity check
can fail.

The GPU numbers come from ``benchmarks/gpu_checks.sh`` on an H200; these tests keep the scripts from breaking when
the library changes under them (block signatures, the CPU kernel the host benchmark stubs out, the HF adapter), and
check that ``bench_attention``'s parity check compares against an independent reference that a wrong result fails.
"""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_attention as ba  # noqa: E402
import bench_host as bh  # noqa: E402
from _bench_util import Timer  # noqa: E402

DEV = torch.device("cpu")


def _ctx():
    return {"dev": DEV, "dtype": torch.bfloat16, "group": None, "world": 1, "te": False, "torch_cp": None,
            "timer": Timer(DEV, iters=1, warmup=1, budget_s=1.0, min_iters=1)}


def _args(**kw):
    base = dict(check=True, kernels=True, no_torch_cp=True)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("shape", [ba.Shape("bshd", seqlen=64, h=4, h_kv=2, d=16, name="bshd"),
                                   ba.Shape("thd", pack=[16, 32, 8, 8], h=4, h_kv=1, d=16, name="thd")],
                         ids=["bshd-gqa", "thd-mqa"])
def test_attention_row_times_and_checks(shape):
    row = ba.run_row(shape, _args(), _ctx())
    assert row["cpscope_cp1_ms"] is not None, row.get("errors")
    assert row["parity_cp1"]["ok"] and row["parity_cp1"]["max"] < 1e-2, row["parity_cp1"]
    if shape.fmt == "bshd":  # SDPA runs on CPU too; varlen_attn does not (its failure is recorded, not raised)
        assert row["sdpa_ms"] is not None and row["cp1_vs_base"] > 0
    else:
        assert "varlen" in row["errors"]


def test_parity_check_fails_on_a_wrong_result(monkeypatch):
    import cpscope.attention as attention

    real = attention.context_parallel_attention
    monkeypatch.setattr(attention, "context_parallel_attention", lambda *a, **k: real(*a, **k) * 1.05)
    shape = ba.Shape("thd", pack=[16, 32], h=4, h_kv=2, d=16, name="thd")
    res = ba.parity(shape, DEV, torch.bfloat16, None)
    assert not res["ok"] and res["out"] > 1e-2


def test_ring_block_rows():
    for shape in (ba.Shape("bshd", seqlen=64, h=4, h_kv=2, d=16, name="bshd"),
                  ba.Shape("thd", pack=[16, 32, 8, 8], h=4, h_kv=2, d=16, name="thd")):
        rows = ba.run_blocks(shape, _args(), _ctx(), {"main": "cpu"})
        assert [r["block"] for r in rows] == ["diag", "kv_front", "q_back"]
        for r in rows:
            assert "block" not in r.get("errors", {}), r["errors"]
            assert r["fwd_ms"] is not None and r["same_kernel_as_cp1"]
        assert [(r["q_tokens"], r["kv_tokens"]) for r in rows] == [(32, 32), (32, 16), (16, 32)]


def test_host_layer_with_stubbed_kernel(monkeypatch):
    from cpscope.attention._kernels import exact

    monkeypatch.setattr(exact, "forward", exact.forward)  # restored after the test
    calls = bh.install_cpu_stub()
    args = argparse.Namespace(tokens=256, heads=2, kv_heads=1, dim=8, dtype=torch.float32, packs=2, layers=3,
                              sleep_ms=0.0)
    prob = bh.Problem(args, DEV, 1)
    res = bh.measure(args, DEV, lambda v: prob.cpscope_layer(bh._cu(bh._pack(8, 256, v, 1), DEV), None), None)
    assert calls[0] > 0 and res["first_ms"] > 0 and res["next_ms"] > 0 and res["samples"] == 4
    floor = bh.measure(args, DEV, lambda v: prob.floor_layer(bh._pack(8, 256, v, 1)), None)
    assert floor["next_ms"] > 0
    assert bh._pack(4, 64, 3, 2) != bh._pack(4, 64, 0, 2) and sum(bh._pack(4, 64, 3, 2)) == 64


def test_hf_config_row():
    pytest.importorskip("transformers")
    import bench_hf

    args = argparse.Namespace(family="llama", hidden=64, heads=4, layers=1, intermediate=96, vocab=128, batch=1,
                              kernels=False, no_check=False)
    row = bench_hf.run_config(args, {**_ctx(), "dtype": torch.float32}, 2, 32)
    assert row["sdpa_ms"] and row["cpscope_cp1_ms"], row.get("errors")
    assert row["check"]["cpscope_cp1_ok"] and row["check"]["cpscope_cp1_loss_rel"] < 1e-5
