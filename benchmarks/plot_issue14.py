"""Plots of issue #14's benchmark JSONs (made on any machine with matplotlib, after the GPU run).

    python benchmarks/plot_issue14.py --in OUT --out docs/      # reads what exists of:
        attention_bench.json, attention_bench_cp2.json, attention_blocks.json, hf_bench.json, hf_bench_cp2.json,
        host_bench_gpu.json, host_bench_gpu_cp2.json, host_bench_cpu*.json

Writes ``issue14_attention_cp1.png`` (cpscope CP1 time / baseline time per case and k/v heads), ``_cp2.png``
(speedups over one GPU), ``_blocks.png`` (ring block / same-shape baseline time), ``_hf.png`` (tokens/s) and
``_host.png`` (host ms per layer vs documents per pack, with the 0.3 ms target). Only plots whose JSON exists.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _bars(ax, groups: list[str], series: dict[str, list], ylabel: str, title: str) -> None:
    n = max(len(series), 1)
    w = 0.8 / n
    for i, (label, vals) in enumerate(series.items()):
        xs = [j - 0.4 + w * (i + 0.5) for j in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in vals], w, label=label)
        for x, v in zip(xs, vals):
            if v is None:
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot_attention_cp1(d: dict, path: str) -> None:
    rows = d["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    kvs = list(dict.fromkeys(r["h_kv"] for r in rows))
    series = {f"{rows[0]['h']}/{kv} heads": [next((r.get("cp1_vs_base") for r in rows
                                                 if r["case"] == c and r["h_kv"] == kv), None) for c in cases]
              for kv in kvs}
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, cases, series, "cpscope time / baseline time", "CP1, causal fwd+bwd, bf16: cpscope vs SDPA (bshd) / "
          "varlen_attn (thd)")
    ax.axhline(1.0, c="k", lw=0.8)
    ax.axhline(1.02, c="r", ls="--", lw=0.8, label="target 1.02 (GQA 16k/64k)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_attention_cp2(d: dict, path: str) -> None:
    rows = d["rows"]
    labels = [f"{r['case']} {r['h']}/{r['h_kv']}" for r in rows]
    series = {"cpscope": [r.get("cp_speedup") for r in rows], "torch context_parallel": [r.get("torch_cp_speedup")
                                                                                        for r in rows],
              "TE p2p": [r.get("te_cp_speedup") for r in rows]}
    fig, ax = plt.subplots(figsize=(10, 4))
    _bars(ax, labels, series, "speedup over one GPU", f"CP{d['gpus']}, causal fwd+bwd, bf16")
    ax.axhline(d["gpus"], c="k", ls="--", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_blocks(d: dict, path: str) -> None:
    rows = d["blocks"]
    labels = [f"{r['case']} {r['h']}/{r['h_kv']}" for r in rows if r["block"] == "diag"]
    series = {kind: [r.get("vs_baseline") for r in rows if r["block"] == kind] for kind in ("diag", "kv_front",
                                                                                             "q_back")}
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, labels, series, "block time / same-shape baseline", "ring blocks of a CP2 rank on one GPU, fwd+bwd")
    ax.axhline(1.0, c="k", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hf(ds: list[dict], path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, series = [], {"sdpa": [], "cpscope CP1": [], "cpscope CP2": []}
    for d in ds:
        for r in d["rows"]:
            key = f"{r['heads']}/{r['kv_heads']}, {r['tokens'] // 1024}k"
            if d["gpus"] > 1:
                key += f" ({d['gpus']} GPUs)"
            labels.append(key)
            series["sdpa"].append(r.get("sdpa_tok_s"))
            series["cpscope CP1"].append(r.get("cpscope_cp1_tok_s"))
            series["cpscope CP2"].append(r.get("cpscope_cp_tok_s"))
    if not any(v is not None for v in series["cpscope CP2"]):
        series.pop("cpscope CP2")
    _bars(ax, labels, series, "tokens / s (fwd+bwd)", "transformers decoder, sdpa vs cpscope")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_host(ds: dict[str, dict], path: str) -> None:
    """One panel per JSON (e.g. gpu, gpu_cp2, cpu): host ms per layer vs documents, per CP mode."""
    fig, axes = plt.subplots(1, len(ds), figsize=(4.5 * len(ds), 4), squeeze=False)
    for ax, (tag, d) in zip(axes[0], ds.items()):
        rows = d["rows"]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            rs = [r for r in rows if r["mode"] == mode and r.get("next_ms") is not None]
            if rs:
                line, = ax.plot([r["docs"] for r in rs], [r["next_ms"] for r in rs], "o-",
                                label=f"{mode}, later layers")
                ax.plot([r["docs"] for r in rs], [r["first_ms"] for r in rs], "x:", c=line.get_color(),
                        label=f"{mode}, first layer")
        fl = [r for r in rows if r["mode"] == "cp1" and r.get("floor_next_ms") is not None]
        if fl:
            ax.plot([r["docs"] for r in fl], [r["floor_next_ms"] for r in fl], "s--", c="gray",
                    label="plain-PyTorch floor (CP1)")
        ax.axhline(0.3, c="r", ls="--", lw=0.8, label="target 0.3 ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("documents per pack")
        ax.set_ylabel("host ms per layer")
        e = d.get("env", {})
        ax.set_title(f"{tag}: {e.get('device', 'CPU')}, {d['rows'][0].get('tokens')} tokens", fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("host time per layer: RoPE q, k + attention forward", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in", dest="src", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    made = []
    a1 = _load(os.path.join(args.src, "attention_bench.json"))
    if a1 and a1.get("rows"):
        plot_attention_cp1(a1, p := os.path.join(args.out, "issue14_attention_cp1.png"))
        made.append(p)
    a2 = _load(os.path.join(args.src, "attention_bench_cp2.json"))
    if a2 and a2.get("rows") and a2.get("gpus", 1) > 1:
        plot_attention_cp2(a2, p := os.path.join(args.out, "issue14_attention_cp2.png"))
        made.append(p)
    b = _load(os.path.join(args.src, "attention_blocks.json"))
    if b and b.get("blocks"):
        plot_blocks(b, p := os.path.join(args.out, "issue14_attention_blocks.png"))
        made.append(p)
    hf = [d for d in (_load(os.path.join(args.src, n)) for n in ("hf_bench.json", "hf_bench_cp2.json"))
          if d and d.get("rows")]
    if hf:
        plot_hf(hf, p := os.path.join(args.out, "issue14_hf.png"))
        made.append(p)
    hosts = {os.path.basename(f)[len("host_bench_"):-5] or "host": _load(f)
             for f in sorted(glob.glob(os.path.join(args.src, "host_bench*.json")))}
    hosts = {k: v for k, v in hosts.items() if v and v.get("rows")}
    if hosts:
        plot_host(hosts, p := os.path.join(args.out, "issue14_host.png"))
        made.append(p)
    print("\n".join(made) if made else "no JSON found under " + args.src)


if __name__ == "__main__":
    main()
