"""``python -m cpscope plan``: will hybrid CP pay on my length distribution? — the plan of a few sample steps and the
predicted step time, memory per rank and gain against every static CP size, before any GPU is rented.

Inputs: document lengths (a file, a local dataset, or a built-in distribution: :mod:`cpscope.cli._lengths`), a
cluster (``--gpus-per-node`` × ``--nodes`` ranks), a model shape (``--preset``, ``--hf-config`` or ``--layers --hidden
--heads ...``; a hybrid model's linear-attention, state-space and short-convolution layers with ``--linear-layers``:
they cost linear, not quadratic, time in the document length and send no K/V around the ring) and a GPU (``--gpu``). The time model is :func:`cpscope.cli._shape.analytic_cost` (FLOPs at assumed efficiencies,
printed), or a measured one with ``--calibration``: the JSON :func:`cpscope.train.calibrate` writes (a per-call
attention model, priced per microbatch with its communication variant) or any JSON with a ``cost_model`` of
:class:`~cpscope.hybrid.CostModel` coefficients (what ``benchmarks/bench_hybrid.py`` writes). The prediction
itself is :func:`cpscope.cli._predict.predict`.

Examples::

    python -m cpscope plan --dist sft --gpus-per-node 8 --nodes 8 --preset llama3-8b
    python -m cpscope plan --dist sft --gpus-per-node 8 --preset llama3-8b --linear-layers 24   # 3 linear : 1 attn
    python -m cpscope plan --dist longtail --gpus-per-node 8 --hf-config path/to/Qwen3-Next/config.json
    python -m cpscope plan --lengths lengths.txt --column n_tokens --gpus-per-node 8 --preset llama3-70b --json
    python -m cpscope plan --dataset my_local_ds --column text --tokenizer meta-llama/Llama-3.1-8B --plot plan.png
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from ..hybrid import CostModel
from ..hybrid import CommCostModel
from ..hybrid import StepCost
from . import _lengths as lengths_mod
from ._predict import predict
from ._report import plot, render, to_json
from ._shape import HARDWARE, PRESETS, Assumptions, ModelShape, analytic_cost, memory_per_rank

__all__ = ["NAME", "HELP", "DESCRIPTION", "add_arguments", "run"]  # the command protocol of cpscope.cli

NAME = "plan"
HELP = "predict hybrid CP's step time, memory and gain against static CP for a length distribution"
DESCRIPTION = __doc__.split("\n\nInputs:")[0] + "\n\n" + "Examples::" + __doc__.split("Examples::")[1]

_SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab", "mlp", "dtype",
                "linear_layers", "attention_layers")
_FULL_SHAPE = _SHAPE_FLAGS[:9]  # what a shape from flags alone is made of (the layer counts have defaults)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("document lengths (one source)").add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", help=".txt / .csv / .json / .jsonl / .parquet of lengths or a "
                     "length,count histogram")
    src.add_argument("--dataset", metavar="NAME", help="a datasets dataset, from the local cache only")
    src.add_argument("--dist", choices=sorted(lengths_mod.DISTRIBUTIONS), help="a built-in synthetic distribution")
    g = p.add_argument_group("reading lengths")
    g.add_argument("--column", help="the column / field of lengths, token ids or text (with --tokenizer)")
    g.add_argument("--split", default="train", help="dataset split (default train)")
    g.add_argument("--dataset-config", default=None, help="dataset configuration name")
    g.add_argument("--tokenizer", help="a transformers tokenizer (local files only) for a text column")
    g.add_argument("--max-docs", type=int, default=None, help="read at most this many dataset rows")
    g.add_argument("--seed", type=int, default=0, help="shuffle / distribution seed (step i of --dist: seed + i)")
    g.add_argument("--no-shuffle", action="store_true", help="cut steps from a file in its own order")
    b = p.add_argument_group("global batch and memory")
    b.add_argument("--steps", type=int, default=3, help="sample steps to plan (default 3)")
    b.add_argument("--docs-per-step", type=int, default=None, help="documents per global batch")
    b.add_argument("--tokens-per-rank", type=int, default=None,
                   help="tokens per rank per step (global batch = ranks × this; default: --capacity)")
    b.add_argument("--capacity", type=int, default=16384, help="tokens one rank holds in a microbatch (16384)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--max-cp", type=int, default=None, help="largest CP size (default: all ranks)")
    c.add_argument("--cp-sizes", choices=("divisors", "pow2"), default="divisors")
    c.add_argument("--gpu", choices=sorted(HARDWARE), default="h100", help="the GPU's peak, memory, bandwidths")
    _model_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--show-steps", type=int, default=2, help="steps whose plan is printed (default 2)")
    o.add_argument("--json", action="store_true", help="print the prediction as JSON")
    o.add_argument("--plot", metavar="PNG", help="write a plot (needs matplotlib)")


def _model_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model shape (a preset, a transformers config, a full shape, or one of the first two "
                             "with some overridden)")
    source = m.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), help="default llama3-8b when no shape is given")
    source.add_argument("--hf-config", metavar="FILE", help="a transformers config.json (or its folder): the shape, "
                        "and its attention / linear-time layers from layer_types")
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "ffn-hidden", "vocab"):
        m.add_argument(f"--{flag}", type=int, default=None)
    m.add_argument("--linear-layers", type=int, default=None,
                   help="how many of the --layers blocks are linear attention / state space / short convolution "
                   "(linear time in the document length; default 0, or the --hf-config's)")
    m.add_argument("--attention-layers", type=int, default=None,
                   help="how many blocks attend (default layers - linear-layers; more for blocks holding both)")
    m.add_argument("--mlp", choices=("swiglu", "gelu"), default=None)
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    a = p.add_argument_group("time and memory model (assumptions; see docs/cli.md)")
    d = Assumptions()
    a.add_argument("--calibration", metavar="FILE", help="a measured cost model: cpscope.train.calibrate's JSON or a "
                   "JSON with a cost_model of CostModel coefficients")
    a.add_argument("--attn-efficiency", type=float, default=d.attn_efficiency)
    a.add_argument("--linear-efficiency", type=float, default=d.linear_efficiency)
    a.add_argument("--exposed-comm", type=float, default=d.exposed_comm)
    a.add_argument("--ring-step-ms", type=float, default=d.ring_step_ms,
                   help="fixed ms per attention layer and ring step, forward + backward")
    a.add_argument("--exchange-ms", type=float, default=d.exchange_ms,
                   help="fixed ms per linear-time layer and CP peer (its state-summary exchange), forward + backward")
    a.add_argument("--state-bytes-per-param", type=float, default=d.state_bytes_per_param)
    a.add_argument("--recompute", action="store_true", help="full activation checkpointing")
    a.add_argument("--gpu-memory-gib", type=float, default=None, help="override the GPU's memory")


def _hf_config(path: str) -> ModelShape:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--hf-config: no such file {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-config: {p} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--hf-config: {p} holds a {type(data).__name__}, not a transformers config object")
    return ModelShape.from_hf_config(data)


def _shape(args: argparse.Namespace) -> tuple[ModelShape, str]:
    given = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    if getattr(args, "hf_config", None):
        shape = replace(_hf_config(args.hf_config), **given)
        return shape, f"transformers config {args.hf_config}" + (f" with {given}" if given else "")
    if args.preset or not set(given) & set(_FULL_SHAPE):
        name = args.preset or "llama3-8b"
        shape = replace(PRESETS[name], **given)
        return shape, f"preset {name}" + (f" with {given}" if given else "")
    missing = [f"--{k}" for k in ("layers", "hidden", "heads") if k not in given]
    if missing:
        raise ValueError(f"a model shape needs {', '.join(missing)} (or --preset, one of {sorted(PRESETS)})")
    heads = given["heads"]
    if "head_dim" not in given and given["hidden"] % heads:
        raise ValueError(f"--hidden {given['hidden']} is not divisible by --heads {heads}: give --head-dim")
    shape = ModelShape(**{"kv_heads": heads, "head_dim": given["hidden"] // heads, "ffn_hidden": 4 * given["hidden"],
                          "vocab": 32000, **given})
    return shape, "the flags given" + ("" if set(_FULL_SHAPE) <= set(given) else " (the rest derived, see shape)")


def _load_cost(path: str, shape: ModelShape, linear: float) -> tuple[Any, str]:
    """``(cost, description)`` from a calibration file (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such calibration file: {path}")
    data = json.loads(p.read_text())
    if isinstance(data, dict) and "coefficients" in data and "features" in data:
        comm = CommCostModel.from_json(data)
        attention = shape.layer_mix().attention
        if attention == 0:
            raise ValueError(f"{path} models attention calls, but the model has no attention layer "
                             f"(--linear-layers {shape.linear_layers} of {shape.layers}); plan without --calibration")
        step = StepCost(comm, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype,
                        layers=attention, linear=linear)
        meta = {k: comm.meta.get(k) for k in ("device", "world_size", "cp_sizes", "torch")}
        return step, (f"measured per-call attention model {path} ({meta}; variants {list(step.variants)}) × "
                      f"{attention} attention layers, + {linear:.3g} s per token of other work (analytic)")
    coef = data.get("cost_model", data) if isinstance(data, dict) else None
    keys = ("attn", "linear", "comm", "latency")
    if not isinstance(coef, dict) or not all(k in coef for k in keys):
        raise ValueError(f"{path}: not a calibration (cpscope.train.calibrate's JSON) nor a JSON with a cost_model "
                         f"holding {list(keys)}")
    cost = CostModel(**{k: float(coef[k]) for k in keys})
    return cost, f"measured CostModel from {path}"


def _check(args: argparse.Namespace) -> None:
    for name in ("steps", "capacity", "gpus_per_node", "nodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    for name in ("docs_per_step", "tokens_per_rank", "max_cp", "max_docs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    if args.docs_per_step is not None and args.tokens_per_rank is not None:
        raise ValueError("give --docs-per-step or --tokens-per-rank, not both")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``plan`` computes for ``args``, as the JSON-able dict that ``--json`` prints."""
    _check(args)
    n_ranks = args.gpus_per_node * args.nodes
    shape, shape_from = _shape(args)
    hw = HARDWARE[args.gpu]
    if args.gpu_memory_gib is not None:
        hw = replace(hw, memory=args.gpu_memory_gib * 2**30)
    assume = Assumptions(args.attn_efficiency, args.linear_efficiency, args.exposed_comm, args.ring_step_ms,
                         args.state_bytes_per_param, recompute=args.recompute, exchange_ms=args.exchange_ms)
    analytic = analytic_cost(shape, hw, gpus_per_node=args.gpus_per_node, assume=assume)
    if args.calibration:
        cost, cost_from = _load_cost(args.calibration, shape, analytic.linear)
    else:
        cost, cost_from = analytic, f"analytic: {shape.layers}-layer model on {hw.name} (assumptions below)"
    if args.dist:
        source: Any = lengths_mod.Synthetic(args.dist, args.seed)
    elif args.lengths:
        source = lengths_mod.from_file(args.lengths, args.column, seed=args.seed, shuffle=not args.no_shuffle)
    else:
        source = lengths_mod.from_dataset(args.dataset, split=args.split, column=args.column, tokenizer=args.tokenizer,
                                          config=args.dataset_config, max_docs=args.max_docs, seed=args.seed,
                                          shuffle=not args.no_shuffle)
    tokens = None if args.docs_per_step else n_ranks * (args.tokens_per_rank or args.capacity)
    steps = source.steps(args.steps, args.docs_per_step, tokens)
    pred = predict(steps, n_ranks=n_ranks, capacity=args.capacity, cost=cost, max_cp=args.max_cp,
                   cp_sizes=args.cp_sizes, memory=lambda tokens: memory_per_rank(shape, tokens, assume))
    return to_json(pred, steps, source=source.source, shape=shape, shape_from=shape_from, hw=hw, assume=assume,
                   cost=cost, cost_from=cost_from, analytic=analytic, args=args)


def run(args: argparse.Namespace, out: Optional[Any] = None) -> int:
    """The ``plan`` command: text (or ``--json``) on stdout, a plot with ``--plot``."""
    result = build(args)
    text = json.dumps(result, indent=1) if args.json else render(result, show_steps=args.show_steps)
    print(text, file=out)
    if args.plot:
        plot(result, args.plot)
    return 0
