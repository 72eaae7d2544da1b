#!/usr/bin/env python3
"""A stream of new packs, the way a loader feeds hybrid CP at CP1: cpscope beside ``varlen_attn`` and FlexAttention.

Every pack has new document lengths (log-normal, 1 to ``--max-docs`` documents, ``--tokens`` tokens) and a new
offsets tensor, as a data loader makes them; nothing is warmed on a pack before it is timed. Per pack: forward +
backward (``torch.autograd.grad``), synchronised, host clock (per-pack work — plans, graph builds, block masks —
counts). Rows per token count:

* ``cpscope`` — ``context_parallel_attention(qkv_format="thd")`` at CP1, then ``cpscope_again``: the same packs a
  second time (new offsets tensors, the graph caches warm: what per-shape work costs is the difference);
* ``cpscope_defer`` — the same packs with ``use_kernel_policy(defer_builds=True)`` after the graph cache and the
  keys seen were cleared: a new cuDNN graph key runs on flash-attention-2 once and is built on its second sighting;
  then ``cpscope_defer_again`` (every key seen once: the recurring shapes build now). The row reports the graphs
  built and the keys seen once (``deferred_keys``);
* ``varlen_attn`` — ``torch.nn.attention.varlen.varlen_attn`` (causal; GQA natively where it takes it, else k/v
  expanded to the query heads inside each timed step, as its user must);
* ``flex`` — ``torch.compile(flex_attention)`` with a document-causal block mask built per pack
  (``create_block_mask`` counted in the pack's time); its compile (one throw-away pack) on its own line.

Each row reports the first call, the median, the total and the total after the first; the peak memory above the
inputs on the first call and over the stream, with Python's cyclic garbage collector **disabled** for the whole row;
and ``held_after_first_bytes`` / ``held_after_stream_bytes`` — memory that only ``gc.collect()`` gives back (a
reference cycle holding tensors). cpscope also reports its distinct cuDNN graph keys after the stream.

Then a transformers Llama (4 layers, hidden 2048, 16 / 4 heads x 128) on ``--hf-packs`` new packs of
``--hf-tokens`` tokens (``position_ids`` restarting per document): ``attn_implementation`` ``"cpscope"`` (the
batch through ``cpscope.integrations.hf.shard_batch``, timed), ``"sdpa"`` and ``"flex_attention"``; one step is
zero_grad, loss, backward. Same columns.

Correctness (same call, before the JSON is written): on the first pack of each stream every method's out / dq / dk /
dv against cpscope's (bf16: relative error <= 2e-2); on a small pack every method against a float64 per-document
reference on the same device (<= 1e-2); the Llama losses against each other (<= 1e-2) and gradients (<= 5e-2).
These run after the timed rows, so no check warms a timed call.

GPU (one H100 / H200)::

    PYTHONPATH=. python benchmarks/bench_pack_stream.py --out benchmarks/results --json pack_stream_h200.json

CPU smoke run (seconds; float32, varlen_attn skipped, FlexAttention eager)::

    PYTHONPATH=. python benchmarks/bench_pack_stream.py --tiny --out /tmp/x
"""
from __future__ import annotations

import argparse
import copy
import gc
import logging
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_util import attempt, env_info, rel_err, setup_logging, write_json  # noqa: E402

log = logging.getLogger("cpscope.bench")


# ---------------------------------------------------------------------------------------------------------- packs


def draw_packs(n: int, tokens: int, *, max_docs: int, seed: int, multiple: int = 16, sigma: float = 1.0
               ) -> list[tuple[int, ...]]:
    """``n`` packs of ``tokens`` tokens, each ``cu_seqlens`` (host tuple) of 1..``max_docs`` documents whose lengths
    follow a log-normal distribution (long tail), multiples of ``multiple``."""
    g = torch.Generator().manual_seed(seed)
    units = tokens // multiple
    packs = []
    for _ in range(n):
        docs = int(torch.randint(1, min(max_docs, units) + 1, (1,), generator=g))
        w = torch.empty(docs).log_normal_(0.0, sigma, generator=g)
        lens = [max(1, int(x)) for x in (w / w.sum() * units).floor().tolist()]
        while sum(lens) > units:  # the floors' minimum of 1 may overshoot: take from the longest
            lens[lens.index(max(lens))] -= 1
        lens[lens.index(max(lens))] += units - sum(lens)
        cu = [0]
        for x in lens:
            cu.append(cu[-1] + x * multiple)
        packs.append(tuple(cu))
    return packs


def _lens(cu: tuple[int, ...]) -> list[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


# -------------------------------------------------------------------------------------------------------- methods


class Inputs:
    """One stream's q / k / v / dout (``[t, h, d]`` leaves), reused by every pack: a pack changes the offsets."""

    def __init__(self, tokens: int, h: int, h_kv: int, d: int, dev: torch.device, dtype: torch.dtype, seed: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        mk = lambda heads: torch.randn(tokens, heads, d, device=dev, dtype=dtype, generator=g)  # noqa: E731
        self.q, self.k, self.v = (mk(x).requires_grad_(True) for x in (h, h_kv, h_kv))
        self.dout = mk(h)


def cpscope_fn(dev: torch.device) -> Callable:
    import cpscope

    def run(x: Inputs, cu: tuple[int, ...]):
        cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)  # a new offsets tensor per pack, as a loader's
        out = cpscope.context_parallel_attention(x.q, x.k, x.v, qkv_format="thd", cu_seqlens=cu_t,
                                                 max_seqlen=max(_lens(cu)), causal=True, group=None)
        return out, torch.autograd.grad(out, (x.q, x.k, x.v), x.dout)

    return run


def cpscope_defer_fn(dev: torch.device) -> Callable:
    """:func:`cpscope_fn` with the kernel policy's ``defer_builds`` on for each call."""
    from cpscope.attention._policy import use_kernel_policy

    inner = cpscope_fn(dev)

    def run(x: Inputs, cu: tuple[int, ...]):
        with use_kernel_policy(defer_builds=True):
            return inner(x, cu)

    return run


def _fresh_kernel_caches() -> None:
    """No cuDNN graph built and no graph key seen (the ``cpscope_defer`` row starts as a fresh process would)."""
    from cpscope.attention._kernels import cudnn_frontend, deferral

    cudnn_frontend.clear_cache()
    deferral.clear_seen()


def _deferred_keys() -> int:
    from cpscope.attention._kernels import deferral

    return len(deferral.seen_keys())


def varlen_fn(dev: torch.device) -> Callable:
    from bench_attention import _varlen_api

    call, how = _varlen_api()
    if call is None:
        raise RuntimeError(how)
    expand = how != "enable_gqa"  # this torch's varlen_attn takes no GQA: k/v expanded inside the timed step, as a
    # user of it must (its time and memory count; the gradients flow back to the grouped k/v)
    if expand:
        log.info("varlen_attn has no enable_gqa in torch %s: k/v expanded to the query heads inside each timed step",
                 torch.__version__)

    def run(x: Inputs, cu: tuple[int, ...]):
        cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
        m = max(_lens(cu))
        k, v = x.k, x.v
        if expand and x.q.shape[1] != k.shape[1]:
            g = x.q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        out = call(x.q, k, v, cu_t, cu_t, m, m)
        return out, torch.autograd.grad(out, (x.q, x.k, x.v), x.dout)

    return run


def flex_fn(dev: torch.device, compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def run(x: Inputs, cu: tuple[int, ...]):
        t = x.q.shape[0]
        lens = torch.tensor(_lens(cu), device=dev)
        doc = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens, output_size=t)

        def mask(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        bm = create_block_mask(mask, None, None, t, t, device=dev)  # per pack: part of the pack's time
        q, k, v = (y.unsqueeze(0).transpose(1, 2) for y in (x.q, x.k, x.v))  # [1, h, t, d] views
        gqa = x.k.shape[1] != x.q.shape[1]
        if dev.type == "cpu":  # FlexAttention has no backward on CPU: the forward only (the --tiny smoke run)
            with torch.no_grad():
                return flex(q.detach(), k.detach(), v.detach(), block_mask=bm, enable_gqa=gqa).transpose(1, 2)[0], ()
        out = flex(q, k, v, block_mask=bm, enable_gqa=gqa).transpose(1, 2)[0]
        return out, torch.autograd.grad(out, (x.q, x.k, x.v), x.dout)

    return run


# ---------------------------------------------------------------------------------------------------------- timing


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _alloc(dev: torch.device) -> Optional[int]:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None


def _held(dev: torch.device) -> Optional[int]:
    """Bytes that only the cyclic collector frees (allocated now minus after ``gc.collect()``)."""
    if dev.type != "cuda":
        return None
    before = torch.cuda.memory_allocated(dev)
    gc.collect()
    return before - torch.cuda.memory_allocated(dev)


def stream(name: str, run: Callable, x: Inputs, packs: list, dev: torch.device, keep_first: bool = True) -> dict:
    """Every pack once, timed one by one, the cyclic collector off; the first pack's results kept on the host."""
    row: dict[str, Any] = {"name": name, "packs": len(packs)}
    gc.collect()
    gc.disable()
    try:
        times, peaks = [], []
        for i, cu in enumerate(packs):
            base = _alloc(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            _sync(dev)
            t0 = time.perf_counter()
            out, grads = run(x, cu)
            _sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
            if dev.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(dev) - base)
            if i == 0 and keep_first:
                row["_first"] = [t.detach().to("cpu", copy=True) for t in (out, *grads)]
            del out, grads
            if i == 0:
                row["held_after_first_bytes"] = _held(dev)
                gc.disable()  # _held collected once: the rest of the stream runs without the collector again
        row["held_after_stream_bytes"] = _held(dev)
    finally:
        gc.enable()
    row.update(first_ms=times[0], median_ms=statistics.median(times), total_ms=sum(times),
               after_first_ms=sum(times[1:]), peak_first_bytes=peaks[0] if peaks else None,
               peak_stream_bytes=max(peaks) if peaks else None)
    return row


def _graph_keys() -> Optional[int]:
    from cpscope.attention._kernels import cudnn_frontend

    return len(cudnn_frontend.cached_graphs())  # both graph families (dense and packed) share this cache


def run_tokens(args, dev: torch.device, dtype: torch.dtype, tokens: int, out: dict) -> None:
    packs = draw_packs(args.packs, tokens, max_docs=args.max_docs, seed=args.seed + tokens)
    x = Inputs(tokens, args.heads, args.kv_heads, args.dim, dev, dtype, seed=tokens)
    res: dict[str, Any] = {"tokens": tokens, "docs": [len(p) - 1 for p in packs], "rows": {}, "errors": {}}
    out["streams"].append(res)
    rows = res["rows"]
    methods = [("cpscope", lambda: cpscope_fn(dev)), ("cpscope_defer", lambda: cpscope_defer_fn(dev)),
               ("varlen_attn", lambda: varlen_fn(dev))]
    if not args.no_flex:
        methods.append(("flex", lambda: flex_fn(dev, compiled=dev.type == "cuda")))
    for name, make in methods:
        def go(name=name, make=make):
            fn = make()
            if name == "flex":  # its compile on a pack outside the stream, reported on its own line
                warm = draw_packs(1, tokens, max_docs=args.max_docs, seed=args.seed - 1)
                _sync(dev)
                t0 = time.perf_counter()
                o, g = fn(x, warm[0])
                _sync(dev)
                res["flex_compile_ms"] = (time.perf_counter() - t0) * 1e3
                del o, g
            if name == "cpscope_defer":
                _fresh_kernel_caches()
            rows[name] = stream(name, fn, x, packs, dev)
            if name in ("cpscope", "cpscope_defer"):
                rows[name]["cudnn_graphs"] = _graph_keys()
                if name == "cpscope_defer":
                    rows[name]["deferred_keys"] = _deferred_keys()
                again = name + "_again"
                rows[again] = stream(again, fn, x, packs, dev, keep_first=False)
                rows[again]["cudnn_graphs"] = _graph_keys()
        attempt(res, name, go)
    # parity on the first pack: every method against cpscope's results (bf16 tolerance)
    ref = rows.get("cpscope", {}).get("_first")
    parity = res["parity_first_pack"] = {}
    for name, row in rows.items():
        got = row.pop("_first", None)
        if ref is None or got is None or name == "cpscope":
            continue
        errs = {k: rel_err(a, b) for k, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
        parity[name] = dict(errs, ok=all(e <= args.tol_pair for e in errs.values()))
    for name, row in rows.items():
        log.info("%5dk %-14s first %8.1f ms  median %7.2f ms  total %9.1f ms  after first %9.1f ms  peak %s / %s"
                 "  held %s", tokens // 1024, name, row["first_ms"], row["median_ms"], row["total_ms"],
                 row["after_first_ms"], _gib(row["peak_first_bytes"]), _gib(row["peak_stream_bytes"]),
                 _gib(row["held_after_first_bytes"]))
    if "flex_compile_ms" in res:
        log.info("%5dk flex compile %.0f ms (not in its stream)", tokens // 1024, res["flex_compile_ms"])


def _gib(b: Optional[int]) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------------- reference


def reference(x: Inputs, cu: tuple[int, ...]) -> list[torch.Tensor]:
    """float64 ``(out, dq, dk, dv)``: causal attention within each document, on the inputs' device."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (x.q, x.k, x.v))
    g = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)  # [h, n, d]
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        s = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        keep = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        outs.append((torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vs).transpose(0, 1))
    out = torch.cat(outs)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), x.dout.double())]


def check_small(args, dev: torch.device, dtype: torch.dtype) -> dict:
    """Every method against the float64 reference on one small pack (after the timed rows)."""
    tokens = args.check_tokens
    cu = draw_packs(1, tokens, max_docs=5, seed=args.seed + 7)[0]
    x = Inputs(tokens, args.heads, args.kv_heads, args.dim, dev, dtype, seed=3)
    ref = reference(x, cu)
    res: dict[str, Any] = {"tokens": tokens, "cu": list(cu), "errors": {}}
    methods = {"cpscope": lambda: cpscope_fn(dev), "cpscope_defer": lambda: cpscope_defer_fn(dev),
               "varlen_attn": lambda: varlen_fn(dev)}
    if not args.no_flex:
        methods["flex"] = lambda: flex_fn(dev, compiled=dev.type == "cuda")
    for name, make in methods.items():
        def go(make=make):
            o, g = make()(x, cu)
            errs = {k: rel_err(a, b) for k, a, b in zip(("out", "dq", "dk", "dv"), (o, *g), ref)}
            return dict(errs, ok=all(e <= args.tol_ref for e in errs.values()))
        res[name] = attempt(res, name, go)
    return res


# ---------------------------------------------------------------------------------------------------- transformers


def _hf_batch(cu: tuple[int, ...], vocab: int, dev: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, cu[-1]), generator=g).to(dev)
    pos = torch.cat([torch.arange(n) for n in _lens(cu)]).unsqueeze(0).to(dev)
    labels = ids.clone()
    labels[0, list(cu[1:-1])] = -100  # no target across a document boundary (shard_batch's shift does the same)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _doc_mask(cu: tuple[int, ...], impl: str, dev: torch.device, dtype: torch.dtype) -> Any:
    """The packed batch's document-causal mask for ``impl``: a 4-D additive mask for ``sdpa`` (transformers takes a
    4-D mask as given), a FlexAttention ``BlockMask`` for ``flex_attention``; built per pack (timed)."""
    t = cu[-1]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=dev), torch.tensor(_lens(cu), device=dev),
                                  output_size=t)
    if impl == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None, t, t,
                                 device=dev)
    i = torch.arange(t, device=dev)
    keep = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    return torch.zeros(1, 1, t, t, dtype=dtype, device=dev).masked_fill_(~keep, torch.finfo(dtype).min)


def run_hf(args, dev: torch.device, dtype: torch.dtype, out: dict) -> None:
    import transformers

    import cpscope.integrations.hf as cphf

    tokens = args.hf_tokens
    cfg = transformers.LlamaConfig(hidden_size=args.hf_hidden, intermediate_size=args.hf_intermediate,
                                   num_attention_heads=args.hf_heads, num_key_value_heads=args.hf_kv_heads,
                                   head_dim=args.hf_hidden // args.hf_heads, num_hidden_layers=args.hf_layers,
                                   vocab_size=args.hf_vocab, max_position_embeddings=max(tokens, 4096),
                                   attention_dropout=0.0)
    impls = ["cpscope", "sdpa"] + ([] if args.no_flex or dev.type != "cuda" else ["flex_attention"])
    torch.manual_seed(0)
    with torch.device(dev):
        base = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype)
    packs = draw_packs(args.hf_packs, tokens, max_docs=args.max_docs, seed=args.seed + 99)
    res: dict[str, Any] = {"tokens": tokens, "packs": len(packs), "rows": {}, "errors": {}}
    out["llama"] = res
    firsts: dict[str, Any] = {}
    for impl in impls:
        def go(impl=impl):
            with torch.device(dev):
                model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                                   dtype=dtype)
            model.load_state_dict(base.state_dict())
            model.train()

            class _X:  # the stream's "inputs": the model; each pack's batch is built untimed beforehand
                pass

            batches = [_hf_batch(cu, args.hf_vocab, dev, seed=i) for i, cu in enumerate(packs)]
            it = iter(batches)

            def step(_x, _cu):
                b = next(it)  # the batch of pack _cu
                if impl == "cpscope":
                    b = cphf.shard_batch(b, group=None)  # global cu_seq_lens: cpscope's document mask
                else:
                    b = dict(b, attention_mask=_doc_mask(_cu, impl, dev, dtype))
                model.zero_grad(set_to_none=True)
                loss = model(**b).loss
                loss.backward()
                grads = [torch.cat([p.grad.reshape(-1)[:4096].float() for p in model.parameters()])]
                return loss.detach().reshape(1), grads

            res["rows"][impl] = row = stream(impl, step, _X(), packs, dev)
            firsts[impl] = row.pop("_first")
            del model
        attempt(res, impl, go)
    del base
    ref = firsts.get("sdpa")
    res["parity"] = {}
    for impl, got in firsts.items():
        if ref is None or impl == "sdpa":
            continue
        loss, grad = rel_err(got[0], ref[0]), rel_err(got[1], ref[1])
        res["parity"][impl] = {"loss": loss, "grads": grad, "ok": loss <= 1e-2 and grad <= 5e-2}
    for impl, row in res["rows"].items():
        log.info("llama %dk %-15s first %8.1f ms  median %7.2f ms  after first %9.1f ms  peak %s / %s  held %s",
                 tokens // 1024, impl, row["first_ms"], row["median_ms"], row["after_first_ms"],
                 _gib(row["peak_first_bytes"]), _gib(row["peak_stream_bytes"]), _gib(row["held_after_first_bytes"]))


# ------------------------------------------------------------------------------------------------------------ main


def _ok(out: dict) -> bool:
    checks = [c for s in out["streams"] for c in s["parity_first_pack"].values()]
    checks += [c for c in out["check_small"].values() if isinstance(c, dict) and "ok" in c]
    checks += list(out.get("llama", {}).get("parity", {}).values())
    return bool(checks) and all(c["ok"] for c in checks)


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--packs", type=int, default=120)
    ap.add_argument("--max-docs", type=int, default=18)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-tokens", type=int, default=2048)
    ap.add_argument("--tol-pair", type=float, default=2e-2)
    ap.add_argument("--tol-ref", type=float, default=1e-2)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-packs", type=int, default=30)
    ap.add_argument("--hf-tokens", type=int, default=16384)
    ap.add_argument("--hf-layers", type=int, default=4)
    ap.add_argument("--hf-hidden", type=int, default=2048)
    ap.add_argument("--hf-intermediate", type=int, default=5632)
    ap.add_argument("--hf-heads", type=int, default=16)
    ap.add_argument("--hf-kv-heads", type=int, default=4)
    ap.add_argument("--hf-vocab", type=int, default=32000)
    ap.add_argument("--tiny", action="store_true", help="CPU, float32, tiny shapes: a smoke run in seconds")
    ap.add_argument("--out", default=".")
    ap.add_argument("--json", default="pack_stream.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.tokens, args.packs, args.max_docs, args.heads, args.kv_heads, args.dim = [256], 6, 5, 4, 2, 16
        args.check_tokens, args.hf_packs, args.hf_tokens, args.hf_layers = 128, 3, 128, 2
        args.hf_hidden, args.hf_intermediate, args.hf_heads, args.hf_kv_heads, args.hf_vocab = 64, 128, 4, 2, 128
    setup_logging(0)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cuda":
        torch.ones(1, device=dev).matmul(torch.ones(1, device=dev))  # CUDA context and cuBLAS before any row
    out: dict[str, Any] = {"env": env_info(dev), "args": vars(args), "dtype": str(dtype), "streams": []}
    for tokens in args.tokens:
        run_tokens(args, dev, dtype, tokens, out)
    if not args.no_hf:
        attempt(out, "llama", lambda: run_hf(args, dev, dtype, out))
    out["check_small"] = check_small(args, dev, dtype)
    out["ok"] = _ok(out)
    path = write_json(out, args.out, args.json)
    log.info("parity %s; results in %s", "ok" if out["ok"] else "FAILED", path)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["ok"] else 1)
