"""How ``python -m cpscope plan`` reports a prediction: one JSON-able dict (``--json``), rendered as text, or plotted.

Example::

    >>> _gib(3 * 2**30)
    3.0
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np

from ..hybrid import CostModel
from ._predict import Prediction
from ._shape import LINEAR_CHUNK, Assumptions, Hardware, ModelShape, NodeAwareCost

__all__ = ["plot", "render", "to_json"]


def _gib(x: float) -> float:
    return round(x / 2**30, 2)


def _cost_dict(cost: Any) -> dict[str, Any]:
    if isinstance(cost, CostModel):
        return {"type": type(cost).__name__, **asdict(cost)}
    return {"type": type(cost).__name__, **cost.describe()}


def _assumptions(shape: ModelShape, hw: Hardware, a: Assumptions, analytic: NodeAwareCost,
                 measured: bool) -> list[str]:
    time = [] if measured else [
        f"attention: causal flash attention in {shape.layer_mix().attention} layers, backward 2.5x forward, at "
        f"{a.attn_efficiency:.0%} of {hw.name}'s {hw.peak_flops / 1e12:.0f} TFLOP/s dense peak -> attn = "
        f"{analytic.attn:.3g} s per token²",
        f"other work: 6 x {shape.layers * shape.layer_matmul_params() + shape.vocab * shape.hidden:,} matmul "
        f"parameters FLOPs per token"
        + (f" + the chunked recurrence (chunk {LINEAR_CHUNK}) of {shape.linear_layers} linear-time layers"
           if shape.linear_layers else "")
        + f" at {a.linear_efficiency:.0%} of peak -> linear = {analytic.linear:.3g} s per token",
        f"ring K/V traffic: {a.exposed_comm:.0%} exposed, {hw.nvlink / 1e9:.0f} GB/s in a node, {hw.network / 1e9:.0f} "
        f"GB/s per GPU across nodes -> comm = {analytic.comm:.3g} / {analytic.comm_inter:.3g} s per token",
        f"ring step: {a.ring_step_ms} ms per attention layer and step (forward + backward; cpscope's ring as "
        f"measured on 2xH200)"
        + (f", {a.exchange_ms} ms per linear-time layer and peer (state-summary exchange, assumed)"
           if shape.linear_layers else "")
        + f" -> latency = {analytic.latency:.3g} s per step",
    ]
    return time + [
        "step time = the slowest rank's forward + backward of its microbatches; the gradient all-reduce, optimizer "
        "and data loading are the same for every schedule and left out (they pull every gain toward 1)",
        f"memory per rank = {a.state_bytes_per_param:g} bytes per parameter of model state + activations of the "
        f"largest microbatch ({shape.activation_bytes_per_token()} bytes per token and layer"
        f"{', full recompute' if a.recompute else ''}) + {a.logit_bytes:g} bytes per token and vocabulary entry; "
        f"no fragmentation, workspace or CP receive buffers",
    ]


def _step_summary(plan: Any, lengths: np.ndarray) -> dict[str, Any]:
    groups: Counter = Counter()
    docs: Counter = Counter()
    toks: Counter = Counter()
    for mb in plan.microbatches:
        key = (mb.cp, mb.comm if mb.cp > 1 else "-")
        groups[key] += 1
        docs[key] += len(mb.seqs)
        toks[key] += int(sum(lengths[i] for i in mb.seqs))
    return {"documents": int(lengths.size), "tokens": int(lengths.sum()), "max_len": int(lengths.max()),
            "hybrid_makespan_s": plan.makespan, "lower_bound_s": plan.lower_bound,
            "microbatches": [{"cp": cp, "comm": comm, "count": groups[(cp, comm)], "documents": docs[(cp, comm)],
                              "tokens": toks[(cp, comm)]} for cp, comm in sorted(groups, reverse=True)]}


def to_json(pred: Prediction, steps: Sequence[np.ndarray], *, source: str, shape: ModelShape, shape_from: str,
            hw: Hardware, assume: Assumptions, cost: Any, cost_from: str, analytic: NodeAwareCost,
            args: Any) -> dict[str, Any]:
    """The prediction as plain data (what ``--json`` prints and :func:`render` / :func:`plot` read)."""
    schedules = []
    for s in pred.schedules:
        d = s.as_dict()
        if s.memory is not None:
            d["memory_gib"] = {k: _gib(v) for k, v in s.memory.items()}
            d["fits_gpu_memory"] = s.memory["total"] <= hw.memory
        d.pop("memory")
        schedules.append(d)
    all_lengths = np.concatenate(list(steps))
    return {
        "inputs": {"lengths": source, "ranks": pred.n_ranks, "gpus_per_node": args.gpus_per_node,
                   "nodes": args.nodes, "capacity": pred.capacity, "steps": len(steps),
                   "documents_per_step": [int(x.size) for x in steps], "tokens_per_step": [int(x.sum()) for x in steps],
                   "length_mean": float(all_lengths.mean()), "length_median": float(np.median(all_lengths)),
                   "length_max": int(all_lengths.max()), "cp_sizes": pred.cp_sizes},
        "model": {**asdict(shape), "attention_layers": shape.layer_mix().attention, "params": shape.params(),
                  "from": shape_from},
        "hardware": {**asdict(hw), "memory_gib": _gib(hw.memory)},
        "cost_model": {"from": cost_from, **_cost_dict(cost)},
        "assumptions": _assumptions(shape, hw, assume, analytic, measured=cost is not analytic),
        "steps": [_step_summary(p, x) for p, x in zip(pred.plans, steps)],
        "schedules": schedules,
    }


def _plan_lines(result: dict[str, Any], show_steps: int) -> list[str]:
    out = []
    for i, st in enumerate(result["steps"][:show_steps]):
        out.append(f"step {i}: {st['documents']} documents, {st['tokens']:,} tokens (longest {st['max_len']:,}); "
                   f"hybrid {st['hybrid_makespan_s']:.3f} s, lower bound {st['lower_bound_s']:.3f} s")
        for mb in st["microbatches"]:
            comm = f" ({mb['comm']})" if mb["cp"] > 1 else ""
            out.append(f"  CP{mb['cp']}{comm}: {mb['count']} microbatch{'es' if mb['count'] > 1 else ''}, "
                       f"{mb['documents']} documents, {mb['tokens']:,} tokens")
    return out


def _table(result: dict[str, Any]) -> list[str]:
    tokens = float(np.mean(result["inputs"]["tokens_per_step"]))
    out = [f"{'schedule':<14} {'step s':>8} {'tokens/s':>11} {'tokens/rank':>11} {'memory/rank':>12}  "
           f"{'hybrid is':>9}"]
    for s in result["schedules"]:
        if not s["fits"]:
            out.append(f"{s['name']:<14} does not fit: {s['reason']}")
            continue
        mem = s.get("memory_gib", {}).get("total")
        flag = "" if s.get("fits_gpu_memory", True) else " > GPU"
        gain = "—" if s["cp"] is None else f"{s['gain']:.3f}x"
        out.append(f"{s['name']:<14} {s['step_s']:>8.3f} {tokens / s['step_s']:>11,.0f} "
                   f"{s['max_tokens_per_rank']:>11,} {('%.1f GiB' % mem) if mem is not None else '—':>12}{flag:<6}"
                   f"{gain:>9}")
    return out


def render(result: dict[str, Any], show_steps: int = 2) -> str:
    """The text report: inputs, the cost model and its assumptions, sample plans, the prediction table."""
    i, m, c = result["inputs"], result["model"], result["cost_model"]
    coef = {k: v for k, v in c.items() if k not in ("from", "type")}
    lines = [
        f"cluster: {i['ranks']} ranks ({i['nodes']} node(s) x {i['gpus_per_node']} GPUs, {result['hardware']['name']},"
        f" {result['hardware']['memory_gib']} GiB), CP sizes {i['cp_sizes']}, capacity {i['capacity']:,} tokens per "
        f"rank per microbatch",
        f"model: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads ({m['kv_heads']} k/v) x {m['head_dim']}"
        f", ffn {m['ffn_hidden']} ({m['mlp']}), vocab {m['vocab']}, {m['dtype']}: {m['params'] / 1e9:.2f} B parameters"
        f" ({m['from']})",
        *([f"  token mixers: {m['attention_layers']} attention layers (quadratic in the document length), "
           f"{m['linear_layers']} linear-time layers (linear attention, state space, short convolution)"]
          if m["linear_layers"] or m["attention_layers"] != m["layers"] else []),
        f"lengths: {i['lengths']}",
        f"  {i['steps']} steps of {i['documents_per_step']} documents; mean {i['length_mean']:,.0f}, median "
        f"{i['length_median']:,.0f}, longest {i['length_max']:,} tokens",
        f"cost model: {c['from']}",
        f"  {c['type']}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in coef.items()),
        "assumptions:",
        *(f"  - {a}" for a in result["assumptions"]),
        "",
        *_plan_lines(result, show_steps),
        "",
        f"prediction (mean over {i['steps']} steps; 'hybrid is' = static step / hybrid step):",
        *_table(result),
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Predicted step time per schedule and the document-length histogram, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = [s for s in result["schedules"] if s["fits"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.bar([s["name"] for s in fit], [s["step_s"] for s in fit],
           color=["tab:green"] + ["tab:blue"] * (len(fit) - 1))
    for k, s in enumerate(fit):
        a1.text(k, s["step_s"], "" if s["cp"] is None else f"{s['gain']:.2f}x", ha="center", va="bottom")
    a1.set_ylabel("predicted step (s)")
    a1.set_title(f"{result['inputs']['ranks']} ranks, capacity {result['inputs']['capacity']:,}")
    a1.tick_params(axis="x", rotation=45)
    per_cp: Counter = Counter()
    for st in result["steps"]:
        for mb in st["microbatches"]:
            per_cp[mb["cp"]] += mb["tokens"]
    a2.bar([f"CP{cp}" for cp in sorted(per_cp)], [per_cp[cp] for cp in sorted(per_cp)])
    a2.set_ylabel("tokens (all steps)")
    a2.set_title("hybrid: tokens per CP size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
