"""Plots of the attention, ring-block, transformers and host-time JSONs (any machine with matplotlib).

    python benchmarks/plot_results.py FILE [FILE ...] --out PLOT.png     # one plot of these files
    python benchmarks/plot_results.py --in OUT --out OUT                  # every plot of a run's folder

The kind of plot follows from the JSON's content: ``bench_attention.py`` rows at CP1 (cpscope time / baseline time
per case and k/v heads) or at CP2 (speedups over one GPU, beside PyTorch ``context_parallel`` and TE), its
``--blocks`` rows (ring block / same-shape baseline time), ``bench_hf.py`` rows (tokens/s) and ``bench_host.py``
rows (host ms per layer vs documents per pack, one panel per file). With ``--in``, every JSON of the folder is read
and one PNG per kind is written to ``--out``: ``attention_cp1.png``, ``attention_cp2.png``, ``ring_blocks.png``,
``hf_decoder.png``, ``host_time.png``.

Example (the host-time plot of ``benchmarks/results/``)::

    python benchmarks/plot_results.py benchmarks/results/host_time_cpu.json \
        benchmarks/results/host_time_cpu_gloo.json --out benchmarks/results/host_time_cpu.png
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


def kind_of(d: dict) -> Optional[str]:
    """Which plot a result JSON feeds (``None``: none of them)."""
    rows = d.get("rows") or []
    if d.get("blocks"):
        return "ring_blocks"
    if rows and "next_ms" in rows[0]:
        return "host_time"
    if rows and ("sdpa_tok_s" in rows[0] or "cpscope_cp1_tok_s" in rows[0]):
        return "hf_decoder"
    if rows and "case" in rows[0]:
        return "attention_cp2" if d.get("gpus", 1) > 1 and any("cp_speedup" in r for r in rows) else "attention_cp1"
    return None


def plot(kind: str, files: dict[str, dict], path: str) -> None:
    """Draw ``kind`` from ``files`` (name -> JSON) into ``path``."""
    first = next(iter(files.values()))
    if kind == "attention_cp1":
        plot_attention_cp1(first, path)
    elif kind == "attention_cp2":
        plot_attention_cp2(first, path)
    elif kind == "ring_blocks":
        plot_blocks(first, path)
    elif kind == "hf_decoder":
        plot_hf(list(files.values()), path)
    else:
        plot_host(files, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="result JSONs of one kind")
    ap.add_argument("--in", dest="src", help="a folder: plot every kind found there")
    ap.add_argument("--out", required=True, help="the PNG (with FILE arguments) or a folder (with --in)")
    args = ap.parse_args()
    if bool(args.files) == bool(args.src):
        ap.error("give either result files or --in FOLDER")
    paths = args.files or sorted(glob.glob(os.path.join(args.src, "*.json")))
    by_kind: dict[str, dict[str, dict]] = {}
    for p in paths:
        d = _load(p)
        k = kind_of(d) if isinstance(d, dict) else None
        if k:
            by_kind.setdefault(k, {})[os.path.splitext(os.path.basename(p))[0]] = d
        elif args.files:
            ap.error(f"{p}: not a result this script plots")
    if args.files:
        if len(by_kind) != 1:
            ap.error(f"the files are of different kinds: {sorted(by_kind)}")
        kind, files = next(iter(by_kind.items()))
        plot(kind, files, args.out)
        print(args.out)
        return
    os.makedirs(args.out, exist_ok=True)
    for kind, files in sorted(by_kind.items()):
        plot(kind, files, p := os.path.join(args.out, kind + ".png"))
        print(p)
    if not by_kind:
        print("no result JSON found under " + args.src)


if __name__ == "__main__":
    main()
