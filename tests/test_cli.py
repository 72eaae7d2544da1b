"""``python -m cpscope``: every command answers ``--help``, ``env`` runs, and ``plan``'s predicted gains equal the
planner simulation of ``benchmarks/bench_hybrid.py`` (within 5 %) on three length distributions."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from cpscope.cli import main, parser
from cpscope.cli import _env as env_cmd
from cpscope.cli import _lengths as lengths_mod
from cpscope.cli._plan import build
from cpscope.cli._predict import predict
from cpscope.cli._shape import PRESETS, memory_per_rank
from cpscope.hybrid import CostModel, plan_hybrid, plan_static

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpscope", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_plan_help_in_a_process():
    res = _cli("plan", "--help")  # one process per command costs the package's import (torch): one here
    assert res.returncode == 0, res.stderr
    assert "usage: python -m cpscope plan" in res.stdout
    for flag in ("--dist", "--lengths", "--dataset", "--gpus-per-node", "--calibration", "--plot", "--json"):
        assert flag in res.stdout


@pytest.mark.parametrize("argv", [["--help"], ["env", "--help"], ["plan", "--help"]])
def test_help_of_every_command(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0 and "usage: python -m cpscope" in capsys.readouterr().out


def test_env_runs_and_reports_every_package():
    res = _cli("env", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert {"torch", "triton", "cudnn frontend", "transformer_engine", "transformers", "trl", "accelerate",
            "megatron-core", "flash-linear-attention"} <= set(report["packages"])
    assert report["routes"] and all({"kind", "kernel", "why"} <= set(r) for r in report["routes"])


def test_env_missing_package_reads_not_installed():
    assert env_cmd._version(("no-such-distribution-xyz",), "no_such_module_xyz") == env_cmd.NOT_INSTALLED


@pytest.mark.parametrize("available", [True, False])
def test_routes_follow_the_router(monkeypatch, available):
    import torch

    from cpscope.attention._kernels import cudnn_frontend, routing_table

    monkeypatch.setattr(cudnn_frontend, "available", lambda device: available)
    dev = torch.device("cuda", 0)
    rows = {r["kind"]: r["kernel"] for r in env_cmd._routes(dev)}
    assert {k: r for k, (r, _) in routing_table(dev).items()}.items() <= rows.items()  # the router's own table
    assert rows["dense"] == "cudnn"
    assert rows["dense-window-split"] == "flash"  # never on cuDNN (parity check)
    assert rows["packed-softcap"] == "flex"  # FlexAttention's compiled kernels on CUDA
    assert rows["packed"] == ("cudnn" if available else "flash")
    assert rows["dense-softcap"] == ("cudnn" if available else "flex")
    assert env_cmd._routes(None)[0]["kernel"] == "exact"


def _args(*argv: str) -> SimpleNamespace:
    return parser().parse_args(["plan", *argv])


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hybrid", os.path.join(ROOT, "benchmarks", "bench_hybrid.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dist,mix", [("sft", "sft"), ("longtail", "long_tail"), ("uniform-long", "uniform_long")])
def test_plan_gain_matches_the_planner_simulation(tmp_path, dist, mix):
    """The gain the CLI prints against static CP (the memory minimum) is within 5 % of ``static / hybrid`` of
    ``bench_hybrid.py --simulate`` on the same batches (64 ranks, 2 documents per rank, seeds 0-2, its cost model)."""
    bench = _bench()
    ns = bench.argparse.Namespace(mixes=[mix], ranks=[64], seeds=[0, 1, 2], seqs_per_rank=2, capacity=16384,
                                  repeats=1, attn=2.5e-9, linear=1e-4, comm=2e-6, latency=1e-3, comm_cost=None,
                                  heads=32, kv_heads=8, layers=32, step_linear=6e-5)
    rows = [r for r in bench.run_simulation(ns)["rows"]]
    sim = np.mean([r["static"] for r in rows]) / np.mean([r["hybrid"] for r in rows])
    cal = tmp_path / "cost.json"
    cal.write_text(json.dumps({"cost_model": {"attn": 2.5e-9, "linear": 1e-4, "comm": 2e-6, "latency": 1e-3}}))
    result = build(_args("--dist", dist, "--gpus-per-node", "8", "--nodes", "8", "--docs-per-step", "128",
                         "--steps", "3", "--calibration", str(cal), "--cp-sizes", "pow2"))
    by_name = {s["name"]: s for s in result["schedules"]}
    compared = 0
    for i, r in enumerate(rows):  # per step (= seed): the static size the simulation picked for that batch
        static = by_name[f"static CP{r['static_cp']}"]
        if not static["fits"]:  # a smaller size than another step's longest document allows: not printed
            continue
        cli = static["steps_s"][i] / by_name["hybrid"]["steps_s"][i]
        assert abs(cli / r["static_vs_hybrid"] - 1) <= 0.05, (i, cli, r["static_vs_hybrid"])
        compared += 1
    assert compared >= 1
    if len({r["static_cp"] for r in rows}) == 1:  # the printed gain (mean over the steps)
        gain = by_name[f"static CP{rows[0]['static_cp']}"]["gain"]
        assert abs(gain / sim - 1) <= 0.05, (gain, sim)
        assert result["schedules"][1]["cp"] == rows[0]["static_cp"]  # listed first among the static sizes


def test_predict_equals_the_planners_and_flags_what_does_not_fit():
    steps = [np.array([65536, 8192, 4096, 2048, 1024, 512] * 4), np.array([32768, 4096] * 6)]
    cost = CostModel()
    pred = predict(steps, n_ranks=8, capacity=16384, cost=cost, memory=lambda t: {"total": float(t)})
    hyb = pred.schedule("hybrid")
    assert hyb.steps_s == [plan_hybrid(x, 8, 16384, cost).makespan for x in steps]
    cp8 = pred.schedule("static CP8")
    assert cp8.steps_s == [plan_static(x, 8, 16384, cost, cp=8).makespan for x in steps]
    assert cp8.gain == pytest.approx(np.mean(cp8.steps_s) / np.mean(hyb.steps_s))
    cp2 = pred.schedule("static CP2")
    assert not cp2.fits and "needs CP ≥ 4" in cp2.reason
    assert hyb.memory == {"total": float(hyb.max_tokens_per_rank)} and hyb.max_tokens_per_rank <= 16384


def test_memory_grows_with_tokens_and_recompute_lowers_it():
    from cpscope.cli._shape import Assumptions

    shape = PRESETS["llama3-8b"]
    small, big = memory_per_rank(shape, 4096), memory_per_rank(shape, 16384)
    assert big["activations"] == 4 * small["activations"] and big["states"] == small["states"]
    assert memory_per_rank(shape, 16384, Assumptions(recompute=True))["activations"] < big["activations"]


def test_length_sources(tmp_path):
    (tmp_path / "a.txt").write_text("100\n200\n# comment\n300\n")
    (tmp_path / "h.csv").write_text("length,count\n1024,3\n4096,1\n")
    (tmp_path / "h.json").write_text(json.dumps({"512": 2, "2048": 1}))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"ids": [1] * n}) for n in (7, 9)))
    assert sorted(lengths_mod.from_file(str(tmp_path / "a.txt")).lengths.tolist()) == [100, 200, 300]
    assert sorted(lengths_mod.from_file(str(tmp_path / "h.csv")).lengths.tolist()) == [1024] * 3 + [4096]
    assert sorted(lengths_mod.from_file(str(tmp_path / "h.json")).lengths.tolist()) == [512, 512, 2048]
    assert lengths_mod.from_file(str(tmp_path / "d.jsonl"), "ids").lengths.tolist() == [7, 9]
    pool = lengths_mod.from_file(str(tmp_path / "a.txt"), shuffle=False)
    assert [s.tolist() for s in pool.steps(2, 2, None)] == [[100, 200], [300, 100]]
    assert all(s.sum() >= 500 for s in pool.steps(2, None, 500))
    with pytest.raises(ValueError, match="needs --column"):
        lengths_mod.from_file(str(tmp_path / "d.jsonl"))
    (tmp_path / "bad.txt").write_text("12\n-3\n")
    with pytest.raises(ValueError, match="must be > 0"):
        lengths_mod.from_file(str(tmp_path / "bad.txt"))
    with pytest.raises(ValueError, match="unknown length file type"):
        (tmp_path / "x.yaml").write_text("1")
        lengths_mod.from_file(str(tmp_path / "x.yaml"))


def test_dataset_offline_is_a_clear_error(capsys):
    assert main(["plan", "--dataset", "no-such-org/no-such-dataset-xyz"]) == 2
    err = capsys.readouterr().err
    if importlib.util.find_spec("datasets") is None:  # without the package: the error says which one to install
        assert "--dataset needs the datasets package (pip install datasets)" in err, err
    else:
        assert "from the local cache" in err, err


def test_dataset_stays_offline_after_datasets_was_imported(capsys, monkeypatch):
    """datasets reads HF_*_OFFLINE once, at import: the loader must switch the imported module offline too (it
    once went to the network and waited for its timeout, 23 s) and leave the user's settings as they were."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    before = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE)
    assert main(["plan", "--dataset", "no-such-org/no-such-dataset-xyz"]) == 2
    err = capsys.readouterr().err
    assert "OfflineModeIsEnabled" in err, err  # refused offline, not a network attempt
    assert (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE) == before
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ


def test_plot_without_matplotlib_is_a_clear_error(capsys, tmp_path):
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed")
    assert main(["plan", "--dist", "sft", "--plot", str(tmp_path / "p.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_plan_json_and_text(capsys):
    assert main(["plan", "--dist", "longtail", "--gpus-per-node", "8", "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedules"][0]["name"] == "hybrid" and len(out["steps"]) == 2 and out["assumptions"]
    assert out["inputs"]["ranks"] == 8 and out["inputs"]["tokens_per_step"][0] >= 8 * 16384
    assert main(["plan", "--dist", "uniform-long", "--preset", "llama3-70b", "--nodes", "2", "--steps", "1"]) == 0
    text = capsys.readouterr().out
    assert "assumptions:" in text and "hybrid is" in text and "static CP" in text
