#!/usr/bin/env python3
"""Sliding window + softcap (Gemma 2's attention) on one GPU: cpscope beside FlexAttention called directly, and the
transformers Gemma 2 model with ``attn_implementation="cpscope"`` / ``"flex_attention"`` / ``"sdpa"``, one run.

Attention rows (bf16, B=1, ``--heads`` q / ``--kv-heads`` k/v heads, head dim ``--dim``, forward + backward,
CUDA-event medians), per length of ``--seqlens``:

* ``bshd``: ``cpscope_ms`` (:func:`cpscope.context_parallel_attention` with ``window=(W - 1, 0)``, ``softcap``,
  the router's choice — FlexAttention's kernels where cuDNN refuses the graph) and ``flex_ms`` (``torch.compile``'d
  ``flex_attention`` on the same tensors, a causal sliding-window ``create_block_mask`` and a tanh score modifier),
  ``ratio = cpscope_ms / flex_ms``; at the first length also ``cpscope_exact_ms``, the same call with FlexAttention
  off in the router (what ran before it: the exact tiled math where cuDNN refuses);
* ``thd``: the same on a packed batch of documents (the document mask in both);
* what each timed step holds: the call and its backward, nothing else on either side — both block masks are built
  before the timed steps (cpscope keeps its mask with the pack, as it would for a loader that repeats a pack shape;
  ``flex_ms``'s is built once per row); a stream of new packs, where each pack builds its own, is
  ``bench_pack_stream.py``'s business;
* compile states (what made cpscope 1.19x flex at 16k but 1.0x at 64k before the fix, issue 31): ``flex_ms``'s
  ``torch.compile(flex_attention)`` shares one compile cache over the rows, so it runs a **static** graph at the
  first length and a **dynamic** one (dynamo's automatic dynamic shapes) from the second; cpscope's compiled call
  has seen ``--check-len`` tokens in the reference check first, so it is dynamic at every length. A dynamic graph
  cannot prove the lengths divisible by 128 and FlexAttention's kernels then bound-check every load
  (``IS_DIVISIBLE=False``); cpscope now tells them where the lengths divide. ``--dynamic-rows`` adds, at the first
  length, ``flex_dynamic_ms`` (direct FlexAttention compiled ``dynamic=True``: what cpscope ran before) and
  ``flex_dynamic_divisible_ms`` (the same with ``kernel_options={"IS_DIVISIBLE": True}``: what it runs now);
* ``parity``: cpscope's output and gradients against FlexAttention's (relative errors), and at ``--check-len``
  tokens against a float64 reference written here.

Gemma 2 rows (``--hf-seqlens``): a small random-weight ``Gemma2ForCausalLM`` (``--hf-layers`` layers alternating
sliding ``W`` / full, softcap ``--softcap``, ``--hf-heads`` / ``--hf-kv-heads`` heads of ``--dim``), one training
step (loss + backward) median per implementation and the ratios to ``flex_attention`` and ``sdpa`` (transformers may
refuse ``sdpa`` for Gemma 2: the refusal is recorded); the losses and gradients of ``cpscope`` against
``flex_attention``'s.

``--tiny``: a CPU crash test on tiny shapes (float32; FlexAttention forced first in the router; FlexAttention
itself runs forward only on CPU; Gemma 2 checked against ``attn_implementation="eager"``) — run by
``tests/test_bench_flex_features.py``.

    python benchmarks/bench_flex_features.py --out benchmarks/results --json flex_features_h200.json
    python benchmarks/bench_flex_features.py --hf-seqlens --dynamic-rows --json flex_features_h100.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import logging
import math
import os
import sys
import time
import types
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_util import Timer, attempt, env_info, rel_err, setup_logging, write_json  # noqa: E402

log = logging.getLogger("cpscope.bench")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--window", type=int, default=4096, help="keys a query sees, itself included")
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--docs", type=int, default=6, help="documents of the thd rows")
    p.add_argument("--check-len", type=int, default=2048)
    p.add_argument("--hf-seqlens", type=int, nargs="*", default=[8192, 16384])
    p.add_argument("--hf-layers", type=int, default=4)
    p.add_argument("--hf-hidden", type=int, default=2048)
    p.add_argument("--hf-heads", type=int, default=16)
    p.add_argument("--hf-kv-heads", type=int, default=8)
    p.add_argument("--hf-vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dynamic-rows", action="store_true",
                   help="at the first length: direct FlexAttention compiled dynamic=True, with and without "
                        "IS_DIVISIBLE (two more compiles per layout)")
    p.add_argument("--tiny", action="store_true", help="CPU crash test on tiny shapes")
    p.add_argument("--out", default="/tmp/cpscope-bench")
    p.add_argument("--json", default="flex_features.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.seqlens, args.window, args.heads, args.kv_heads, args.dim, args.docs = [256], 48, 4, 2, 16, 3
        args.check_len, args.hf_seqlens, args.hf_layers, args.hf_hidden = 128, [64], 2, 64
        args.hf_heads, args.hf_kv_heads, args.hf_vocab, args.iters = 4, 2, 128, 1
    return args


# ---- inputs and the two callers -----------------------------------------------------------------------------------

def _doc_lens(n: int, docs: int) -> list[int]:
    """``docs`` documents of uneven even lengths summing to ``n`` (a long tail: halves, quarters, ...)."""
    lens, left = [], n
    for i in range(docs - 1):
        x = max(2, (left // 2) // 2 * 2)
        lens.append(x)
        left -= x
    lens.append(left)
    return lens


def _direct_call(flex_fn, q4, k4, v4, score_mod, block_mask, gqa, options):
    """FlexAttention called plainly (what the ``--dynamic-rows`` compile, each in a code object of its own)."""
    return flex_fn(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)


def _fresh_compile(tag: str, **kw):
    """``_direct_call`` compiled with its own compile cache (``kw``: ``torch.compile``'s), shared with no row."""
    code = _direct_call.__code__.replace(co_name=f"_direct_call_{tag}")
    return torch.compile(types.FunctionType(code, _direct_call.__globals__, code.co_name), **kw)


def _flex_direct(args, n: int, dev: torch.device, cu: Optional[list[int]], compiled: Any = None,
                 options: Optional[dict] = None):
    """``fn(q4, k4, v4)`` -> out: compiled FlexAttention, a causal sliding-window (and documents) block mask, the
    softcap as its score modifier (``compiled``: a :func:`_fresh_compile` to call instead of the shared
    ``torch.compile(flex_attention)``; ``options``: its kernel options)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    w, cap = args.window, args.softcap
    doc = None
    if cu is not None:
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=dev),
                                      torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], device=dev))

    def mask(b, h, q, kv):
        m = (q >= kv) & (q - kv < w)
        return m & (doc[q] == doc[kv]) if doc is not None else m

    def capped(score, b, h, q, kv):
        return cap * torch.tanh(score / cap)

    bm = create_block_mask(mask, None, None, n, n, device=dev)
    if compiled is not None:
        return lambda q4, k4, v4: compiled(flex_attention, q4, k4, v4, capped, bm, q4.shape[1] != k4.shape[1],
                                           options)
    fn = flex_attention if dev.type == "cpu" else torch.compile(flex_attention)
    return lambda q4, k4, v4: fn(q4, k4, v4, score_mod=capped, block_mask=bm, enable_gqa=q4.shape[1] != k4.shape[1])


def _inputs(args, n: int, dev: torch.device, dtype: torch.dtype, packed: bool):
    g = torch.Generator(device=dev).manual_seed(n)
    shape = (lambda h: (n, h, args.dim)) if packed else (lambda h: (1, n, h, args.dim))
    mk = lambda h: torch.randn(*shape(h), device=dev, dtype=dtype, generator=g)  # noqa: E731
    return mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)


def _views(x: torch.Tensor, packed: bool) -> torch.Tensor:  # bshd / thd -> [b, h, s, d] views
    return (x.unsqueeze(0) if packed else x).transpose(1, 2)


def _policy(args):
    from cpscope.attention._policy import use_kernel_policy

    return use_kernel_policy(flex="first") if args.tiny else contextlib.nullcontext()


def _cpscope(args, packed: bool, cu: Optional[list[int]], dev: torch.device):
    import cpscope

    extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=dev)} if packed else {}

    def fn(q, k, v):
        with _policy(args):
            return cpscope.context_parallel_attention(q, k, v, qkv_format="thd" if packed else "bshd", causal=True,
                                                      window=(args.window - 1, 0), softcap=args.softcap, group=None,
                                                      **extra)
    return fn


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def _reference(q, k, v, window: int, cap: float) -> torch.Tensor:
    """float64 causal sliding-window softcapped attention, ``[1, s, h, d]``, one head at a time."""
    q, k, v = (x[0].double() for x in (q, k, v))
    n, h = q.shape[0], q.shape[1]
    g = h // k.shape[1]
    i = torch.arange(n, device=q.device)
    seen = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    outs = []
    for hh in range(h):
        s = (q[:, hh] @ k[:, hh // g].T) / math.sqrt(q.shape[-1])
        s = (cap * torch.tanh(s / cap)).masked_fill(~seen, float("-inf"))
        outs.append(torch.softmax(s, -1) @ v[:, hh // g])
    return torch.stack(outs, 1)[None]


# ---- attention rows -----------------------------------------------------------------------------------------------

def attention_row(args, n: int, layout: str, dev: torch.device, dtype: torch.dtype, timer: Timer,
                  first: bool) -> dict:
    from cpscope.attention._policy import use_kernel_policy

    packed = layout == "thd"
    cu = None
    if packed:
        cu = [0]
        for x in _doc_lens(n, args.docs):
            cu.append(cu[-1] + x)
    row: dict = {"layout": layout, "tokens": n, "window": args.window, "softcap": args.softcap,
                 "heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim, "docs": cu}
    q, k, v, do = _inputs(args, n, dev, dtype, packed)
    ours, theirs = _cpscope(args, packed, cu, dev), _flex_direct(args, n, dev, cu)
    train = dev.type == "cuda"  # FlexAttention has no CPU backward

    def parity() -> dict:
        a = _leaves(q, k, v)
        out = ours(*a)
        out.backward(do)
        b = _leaves(q, k, v) if train else [q, k, v]
        with torch.set_grad_enabled(train):
            ref = theirs(*(_views(x, packed) for x in b)).transpose(1, 2)
            ref = ref[0] if packed else ref
            if train:
                ref.backward(do)
        res = {"out": rel_err(out, ref)}
        if train:
            res.update({n_: rel_err(x.grad, y.grad) for n_, x, y in zip(("dq", "dk", "dv"), a, b)})
        res["ok"] = all(x < 2e-2 for x in res.values())
        return res

    row["parity_vs_flex"] = attempt(row, "parity", parity)

    def step(fn, views: bool):
        a = _leaves(q, k, v) if train or not views else [q, k, v]

        def go():
            for x in a:
                x.grad = None
            out = fn(*(_views(x, packed) for x in a)) if views else fn(*a)
            if train or not views:
                out.backward(do if not views else _views(do, packed))
        return go

    row["cpscope_ms"] = attempt(row, "cpscope", lambda: round(timer.median_ms(step(ours, False)), 3))
    if train:
        row["flex_ms"] = attempt(row, "flex", lambda: round(timer.median_ms(step(theirs, True)), 3))
    else:
        with torch.no_grad():
            row["flex_fwd_ms"] = attempt(row, "flex", lambda: round(timer.median_ms(step(theirs, True)), 3))
    if row.get("cpscope_ms") and row.get("flex_ms"):
        row["ratio"] = round(row["cpscope_ms"] / row["flex_ms"], 3)
    if first and train and args.dynamic_rows:  # direct FlexAttention in cpscope's compile state, before / after
        for name, options in (("flex_dynamic_ms", None), ("flex_dynamic_divisible_ms", {"IS_DIVISIBLE": True})):
            if options is not None and n % 128:
                continue
            fn = _flex_direct(args, n, dev, cu, _DYNAMIC.setdefault(name, _fresh_compile(name, dynamic=True)),
                              options)
            row[name] = attempt(row, name, lambda fn=fn: round(timer.median_ms(step(fn, True)), 3))
    if first and layout == "bshd":  # before: FlexAttention off in the router
        def exact():
            with use_kernel_policy(flex="off"):
                return round(timer.median_ms(step(_cpscope(argparse.Namespace(**{**vars(args), "tiny": False}),
                                                           packed, cu, dev), False)), 3)
        row["cpscope_exact_ms"] = attempt(row, "cpscope_exact", exact)
    return row


_DYNAMIC: dict[str, Any] = {}  # the --dynamic-rows' compiled calls (one compile cache each, over the layouts)


def reference_check(args, dev: torch.device, dtype: torch.dtype) -> dict:
    """cpscope (bf16 on CUDA) against float64 at ``--check-len`` tokens: output and gradients."""
    n = args.check_len
    w = min(args.window, n // 4)
    a2 = argparse.Namespace(**{**vars(args), "window": w})
    q, k, v, do = _inputs(args, n, dev, dtype, False)
    a = _leaves(q, k, v)
    out = _cpscope(a2, False, None, dev)(*a)
    out.backward(do)
    r = _leaves(*(x.double() for x in (q, k, v)))
    want = _reference(*r, w, args.softcap)
    want.backward(do.double())
    res = {"tokens": n, "window": w, "out": rel_err(out, want)}
    res.update({n_: rel_err(x.grad, y.grad) for n_, x, y in zip(("dq", "dk", "dv"), a, r)})
    res["ok"] = all(v_ < (2e-2 if dtype != torch.float32 else 1e-4) for k_, v_ in res.items()
                    if k_ not in ("tokens", "window"))
    return res


# ---- transformers Gemma 2 -----------------------------------------------------------------------------------------

def gemma_rows(args, dev: torch.device, dtype: torch.dtype, timer: Timer) -> list[dict]:
    import transformers

    import cpscope.integrations.hf as cphf

    rows = []
    for n in args.hf_seqlens:
        cfg = transformers.Gemma2Config(
            vocab_size=args.hf_vocab, hidden_size=args.hf_hidden, intermediate_size=2 * args.hf_hidden,
            num_attention_heads=args.hf_heads, num_key_value_heads=args.hf_kv_heads,
            head_dim=args.dim, num_hidden_layers=args.hf_layers,
            sliding_window=args.window, attn_logit_softcapping=args.softcap, final_logit_softcapping=30.0,
            query_pre_attn_scalar=args.dim, max_position_embeddings=max(n, 2 * args.window),
            layer_types=["sliding_attention", "full_attention"] * (args.hf_layers // 2) + ["sliding_attention"] * (
                args.hf_layers % 2))
        row: dict = {"model": "Gemma2ForCausalLM", "tokens": n, "layers": args.hf_layers, "hidden": args.hf_hidden,
                     "heads": args.hf_heads, "kv_heads": args.hf_kv_heads, "window": args.window,
                     "softcap": args.softcap}
        torch.manual_seed(0)
        models = {}
        impls = ("cpscope", "eager") if args.tiny else ("cpscope", "flex_attention", "sdpa")
        ref = impls[1]  # what cpscope's loss and gradients are checked against
        for impl in impls:
            def build(impl=impl):
                with torch.device(dev):
                    m = transformers.Gemma2ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                                     dtype=dtype)
                if models:
                    m.load_state_dict(next(iter(models.values())).state_dict())
                m.train()
                return m
            m = attempt(row, f"build_{impl}", build)
            if m is not None:
                models[impl] = m
        ids = torch.randint(0, args.hf_vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
        full = {"input_ids": ids, "labels": ids, "use_cache": False}
        batches = {"cpscope": cphf.shard_batch(dict(full), group=None)}
        losses, grads = {}, {}
        for impl, m in models.items():
            def step(m=m, impl=impl):
                m.zero_grad(set_to_none=True)
                with _policy(args):
                    loss = m(**batches.get(impl, full)).loss
                loss.backward()
                return loss
            loss = attempt(row, f"{impl}_step", step)
            if loss is None:
                continue
            losses[impl] = float(loss.detach())
            grads[impl] = torch.cat([p.grad.float().reshape(-1) for p in m.parameters() if p.grad is not None])
            row[f"{impl}_ms"] = attempt(row, impl, lambda step=step: round(timer.median_ms(step), 3))
        row["loss"], row["checked_against"] = losses, ref
        if "cpscope" in losses and ref in losses:
            row["loss_rel_diff"] = abs(losses["cpscope"] - losses[ref]) / abs(losses[ref])
            row["grad_rel_err"] = rel_err(grads["cpscope"], grads[ref])
            tol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 5e-2)
            row["ok"] = row["loss_rel_diff"] < tol[0] and row["grad_rel_err"] < tol[1]
        for impl in impls[1:]:
            if row.get("cpscope_ms") and row.get(f"{impl}_ms"):
                row[f"cpscope_vs_{impl}"] = round(row["cpscope_ms"] / row[f"{impl}_ms"], 3)
        rows.append(row)
        del models, grads
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- main ---------------------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    setup_logging(0)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    timer = Timer(dev, iters=args.iters, warmup=1 if args.tiny else 3, budget_s=1.0 if args.tiny else 4.0,
                  min_iters=1 if args.tiny else 3)
    from cpscope.attention._kernels import flex

    calls = {"forward": 0, "backward": 0, "attend": 0}  # which flex entries ran (CP1 calls: attend)
    reals = {name: getattr(flex, name) for name in calls}
    for name, real in reals.items():
        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        setattr(flex, name, spy)
    try:
        return _run(args, dev, dtype, timer, calls)
    finally:
        for name, real in reals.items():
            setattr(flex, name, real)


def _run(args, dev: torch.device, dtype: torch.dtype, timer: Timer, calls: dict) -> dict:
    from cpscope.attention._kernels import fallbacks, routing_table

    t0 = time.time()
    res: dict = {"env": env_info(dev), "args": vars(args), "attention": [], "gemma2": []}
    res["reference_check"] = attempt(res, "reference_check", lambda: reference_check(args, dev, dtype))
    for i, n in enumerate(args.seqlens):
        for layout in ("bshd", "thd"):
            row = attention_row(args, n, layout, dev, dtype, timer, first=i == 0)
            res["attention"].append(row)
            log.info("%s %6d: cpscope %s ms, flex %s ms (ratio %s), before %s ms, parity %s", layout, n,
                     row.get("cpscope_ms"), row.get("flex_ms", row.get("flex_fwd_ms")), row.get("ratio"),
                     row.get("cpscope_exact_ms"), row.get("parity_vs_flex"))
            if "flex_dynamic_ms" in row:
                log.info("%s %6d: flex compiled dynamic=True %s ms, dynamic + IS_DIVISIBLE %s ms", layout, n,
                         row.get("flex_dynamic_ms"), row.get("flex_dynamic_divisible_ms"))
    if args.hf_seqlens and importlib.util.find_spec("transformers") is None:
        res["skipped"] = {"gemma2": "transformers is not installed (pip install transformers)"}
        log.warning("Gemma 2 rows skipped: %s", res["skipped"]["gemma2"])
    elif args.hf_seqlens:
        res["gemma2"] = attempt(res, "gemma2", lambda: gemma_rows(args, dev, dtype, timer)) or []
        for row in res["gemma2"]:
            log.info("Gemma 2 %6d: cpscope %s ms, flex_attention %s ms, sdpa %s ms (x%s / x%s of flex / sdpa), "
                     "loss diff %s, grads %s", row["tokens"], row.get("cpscope_ms"), row.get("flex_attention_ms"),
                     row.get("sdpa_ms"), row.get("cpscope_vs_flex_attention"), row.get("cpscope_vs_sdpa"),
                     row.get("loss_rel_diff"), row.get("grad_rel_err"))
    res["flex_calls"] = dict(calls)
    res["routes"] = routing_table(dev, dtype)
    res["fallbacks"] = {str(k): v for k, v in fallbacks().items()}
    res["wall_s"] = round(time.time() - t0, 1)
    path = write_json(res, args.out, args.json)
    log.info("flex calls %s; fallbacks %s; wrote %s", calls, res["fallbacks"], path)
    return res


if __name__ == "__main__":
    main()
