#!/usr/bin/env python3
"""Attention with sliding windows, softcapping, sinks and multi-latent head dims on one GPU: cpscope's block kernels
beside SDPA, FlexAttention and the shared single-GPU SDPA baseline, side by side in one run.

bf16, B=1, 32 q heads / 8 k/v heads, head dim 128, forward + backward (``out.backward(ones)``, as the shared
baseline), CUDA-event medians. TFLOP/s are counted on the unmasked area only (the (query, key) pairs a row sees;
``2 * pairs * heads * (4 d_qk + 3 d_v)`` for forward + backward). Rows, per length:

* ``baseline_sdpa_mha`` — ``measure_single`` of ``torch_cp_baseline.py`` (``--baseline``; 32-head MHA causal SDPA);
* ``sdpa_causal`` (GQA, ``enable_gqa``), ``cpscope_causal`` (the plain block: aten's cuDNN kernel),
  ``cpscope_causal_graph`` (the same through cpscope's cuDNN frontend graph with a causal band);
* ``flex_window`` (FlexAttention, ``--flex``), ``cpscope_window``, ``flash_window`` (FA2 with ``window_size``):
  a causal sliding window of ``--window`` keys (the diagonal included: ``window=(W - 1, 0)``);
* ``cpscope_causal_softcap`` / ``cpscope_window_softcap`` (tanh softcap ``--softcap``) beside their rows without,
  ``flex_causal`` / ``flex_causal_softcap`` (``--flex``, first length only), and at the first length the probes
  ``cpscope_full`` / ``cpscope_full_softcap`` (no mask: what the softcap costs where no tile is skipped);
* ``cpscope_causal_sinks`` (a sink logit per head merged through the block's log-sum-exp by cpscope's fused sink
  kernels) beside the same call without (``cpscope_causal_no_sinks``); at the first length also the same merge in
  torch ops (``cpscope_causal_sinks_torch``) and, where the public API takes ``sinks``, ``api_causal_sinks`` /
  ``api_causal`` (CP1);
* ``sdpa_mla`` (SDPA forced onto cuDNN) and ``cpscope_mla``: 32 heads, d_qk 192 / d_v 128, causal;
* ``halo_cp2_window``: a CP2 rank's windowed blocks — each of its two chunks (``S / 4`` queries) against its own
  keys plus a ``W - 1``-key halo of the previous chunk — and ``halo_cp2_causal``, the same shapes without the window;
* ``thd_causal`` / ``thd_window`` (at 64k): a packed long-tail batch of 12 documents on cuDNN's ragged kernels.

``--check`` first runs the parity cases of ``tests/attention/_kernel_cases.py`` (float64 references on the GPU).

    python benchmarks/bench_attention_features.py --check --flex --baseline torch_cp_baseline.py \\
        --seqlens 16384 65536 --out benchmarks/results --json attention_features_h200.json
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_util import Timer, attempt, env_info, kernel_profile, log, setup_logging, write_json  # noqa: E402

H, H_KV, D = 32, 8, 128
THD_LENS = [16384, 12288, 8192, 8192, 4096, 4096, 4096, 2048, 2048, 2048, 1024, 1024]  # 65536 tokens


def pairs(n_q: int, n_k: int, causal: bool, window: Optional[tuple]) -> int:
    """(query, key) pairs a block sees (bottom-right-aligned band, as the block contract)."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right == -1 else min(right, 0)
    i = torch.arange(n_q, dtype=torch.int64)
    diag = i + (n_k - n_q)
    lo = torch.zeros_like(i) if left == -1 else (diag - left).clamp(min=0)
    hi = torch.full_like(i, n_k - 1) if right == -1 else (diag + right).clamp(max=n_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def tflops(n_pairs: int, heads: int, d_qk: int, d_v: int, ms: Optional[float]) -> Optional[float]:
    if not ms:
        return None
    return round(2 * n_pairs * heads * (4 * d_qk + 3 * d_v) / (ms * 1e-3) / 1e12, 1)


class _Block(torch.autograd.Function):
    """One cpscope block as an autograd op (the backward given the block's own out and lse: CP1)."""

    @staticmethod
    def forward(ctx, q, k, v, fwd, bwd):
        out, lse = fwd(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd = bwd
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*ctx.bwd(dout.contiguous(), *ctx.saved_tensors), None, None)


class _SinkBlock(torch.autograd.Function):
    """A block with one sink logit per head, merged through its log-sum-exp (``fused``: cpscope's one-pass kernels,
    :mod:`cpscope.attention._sink_kernels`; else the same math in torch ops); the backward runs the block's with the
    final statistics, ``dsink = -sum exp(sink - lse') (dout . out')``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, fwd, bwd, fused):
        from cpscope.attention import _sink_kernels

        out, lse = fwd(q, k, v)  # lse [b, h, s]
        if fused:
            _sink_kernels.merge_sinks_(out, lse, sinks)
        else:
            new = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
            out = (out * torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)).to(out.dtype)
            lse = new
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.bwd, ctx.fused = bwd, fused
        return out

    @staticmethod
    def backward(ctx, dout):
        from cpscope.attention import _sink_kernels

        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.bwd(dout, q, k, v, out, lse)
        if ctx.fused:
            dsinks = _sink_kernels.sink_terms(dout, out, lse, sinks).sum((0, 1))
        else:
            delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # [b, h, s]
            dsinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * delta).sum((0, 2))
        return dq, dk, dv, dsinks.to(sinks.dtype), None, None, None


def block_fns(route: str, scale: float, causal: bool, window=None, softcap=None, vl=None):
    """``(fwd(q, k, v), bwd(dout, q, k, v, out, lse))`` of a cpscope block on ``route``: ``"plain"`` / ``"cudnn"``
    as the kernels router chooses by default (cuDNN where the block's kind allows it), ``"flash"`` with the kernel
    policy keeping cuDNN off (flash-attention-2, or the exact math with a softcap)."""
    from cpscope.attention._kernels import Placeholders, block_backward, block_forward
    from cpscope.attention._policy import use_kernel_policy

    ph = Placeholders()  # the dense forwards' placeholders for their backwards, kept for this row
    changes = {"dense_cudnn": False, "varlen": "flash"} if route == "flash" else {}
    kw = dict(scale=scale, causal=causal, varlen=vl, window=window, softcap=softcap, placeholders=ph)

    def fwd(q, k, v):
        with use_kernel_policy(**changes):
            return block_forward(q, k, v, **kw)

    def bwd(do, q, k, v, o, lse):
        with use_kernel_policy(**changes):
            return block_backward(do, q, k, v, o, lse, **kw)

    return fwd, bwd


def _leaves(dev, *shapes) -> list[torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    return [torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True) for s in shapes]


def _fwd_bwd(fwd: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        out = fwd()
        out.backward(torch.ones_like(out))

    return step


class Bench:
    """The rows of one run: each measured under a time budget, failures recorded and skipped."""

    def __init__(self, args, dev: torch.device) -> None:
        self.args, self.dev, self.rows, self.t0 = args, dev, [], time.perf_counter()
        self.timer = Timer(dev, iters=args.iters, warmup=3, budget_s=args.row_budget_s)
        self.flex = None

    def measure(self, name: str, seqlen: int, make: Callable[[], Callable[[], None]], n_pairs: int, heads: int = H,
                d_qk: int = D, d_v: int = D, profile: bool = False, **extra) -> Optional[dict]:
        if self.args.rows and name not in self.args.rows:
            return None
        if time.perf_counter() - self.t0 > self.args.budget_s:
            self.rows.append({"name": name, "seqlen": seqlen, "skipped": "time budget"})
            return None
        row = {"name": name, "seqlen": seqlen, "pairs": n_pairs, **extra}

        def go():
            step = make()
            row["ms"] = round(self.timer.median_ms(step), 3)
            row["tflops"] = tflops(n_pairs, heads, d_qk, d_v, row["ms"])
            if profile:
                row["kernels"] = attempt(row, "kernels", lambda: kernel_profile(step, self.dev))

        attempt(row, name, go)
        self.rows.append(row)
        log.info("%-24s S=%-6d %s ms  %s TFLOP/s %s", name, seqlen, row.get("ms"), row.get("tflops"),
                 "" if "errors" not in row else "FAILED")
        torch.cuda.empty_cache()
        return row

    def ms(self, name: str, seqlen: int) -> Optional[float]:
        for r in self.rows:
            if r["name"] == name and r["seqlen"] == seqlen:
                return r.get("ms")
        return None


# ----------------------------------------------------------------------------------------------------- the rows


def _cp_step(dev, s_q, s_k, route, causal, window=None, softcap=None, heads=(H, H_KV), dims=(D, D),
             fwd_only=False):
    def make():
        q, k, v = _leaves(dev, (1, s_q, heads[0], dims[0]), (1, s_k, heads[1], dims[0]), (1, s_k, heads[1], dims[1]))
        fwd, bwd = block_fns(route, dims[0] ** -0.5, causal, window, softcap)
        if fwd_only:
            return lambda: fwd(q.detach(), k.detach(), v.detach())
        return _fwd_bwd(lambda: _Block.apply(q, k, v, fwd, bwd))

    return make


def _sdpa_step(dev, s, heads=(H, H_KV), dims=(D, D), cudnn_only=False):
    def make():
        q, k, v = _leaves(dev, (1, heads[0], s, dims[0]), (1, heads[1], s, dims[0]), (1, heads[1], s, dims[1]))
        gqa = heads[0] != heads[1]

        def fwd():
            if not cudnn_only:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        return _fwd_bwd(fwd)

    return make


def _flex_step(bench: Bench, s: int, window: Optional[int], softcap: Optional[float]):
    def make():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if bench.flex is None:
            bench.flex = torch.compile(flex_attention, dynamic=False)

        def mask(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < window) if window is not None else qi >= ki

        bm = create_block_mask(mask, None, None, s, s, device=bench.dev)
        score = None
        if softcap is not None:
            def score(x, b, h, qi, ki):
                return softcap * torch.tanh(x / softcap)
        q, k, v = _leaves(bench.dev, (1, H, s, D), (1, H_KV, s, D), (1, H_KV, s, D))
        return _fwd_bwd(lambda: bench.flex(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True))

    return make


def _api_takes(name: str) -> bool:
    import cpscope

    return name in inspect.signature(cpscope.context_parallel_attention).parameters


def _sinks_steps(dev, s, fused=True):
    """``(with sinks, without)``: the public API at CP1 where it takes ``sinks``, else the block with the sink merge
    of :class:`_SinkBlock` beside the plain block; plus which of the two was measured."""
    if _api_takes("sinks") and fused is None:
        import cpscope

        def make(with_sinks: bool):
            def inner():
                q, k, v = _leaves(dev, (1, s, H, D), (1, s, H_KV, D), (1, s, H_KV, D))
                sinks = torch.randn(H, device=dev, dtype=torch.float32).requires_grad_(True)
                kw = {"sinks": sinks} if with_sinks else {}
                return _fwd_bwd(lambda: cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True,
                                                                           group=None, **kw))
            return inner
        return make(True), make(False), "public API, CP1"

    def with_sinks():
        q, k, v = _leaves(dev, (1, s, H, D), (1, s, H_KV, D), (1, s, H_KV, D))
        sinks = torch.randn(H, device=dev, dtype=torch.float32).requires_grad_(True)
        fwd, bwd = block_fns("plain", D ** -0.5, True)
        return _fwd_bwd(lambda: _SinkBlock.apply(q, k, v, sinks, fwd, bwd, fused))

    how = "the block + " + ("the fused sink kernels" if fused else "the sink merge in torch ops")
    return with_sinks, _cp_step(dev, s, s, "plain", True), how


def _halo_step(dev, s, w, window):
    c = s // 4

    def make():
        ins = [_leaves(dev, (1, c, H, D), (1, c + w - 1, H_KV, D), (1, c + w - 1, H_KV, D)) for _ in range(2)]
        fwd, bwd = block_fns("cudnn", D ** -0.5, True, window)

        def step():
            for q, k, v in ins:
                out = _Block.apply(q, k, v, fwd, bwd)
                out.backward(torch.ones_like(out))

        return step

    return make, 2 * pairs(c, c + w - 1, True, window)


def _thd_step(dev, window):
    from cpscope.attention._kernels import Varlen

    cu = [0]
    for n in THD_LENS:
        cu.append(cu[-1] + n)

    def make():
        t = cu[-1]
        q, k, v = _leaves(dev, (t, H, D), (t, H_KV, D), (t, H_KV, D))
        cut = torch.tensor(cu, dtype=torch.int32, device=dev)
        vl = Varlen(cut, cut, max(THD_LENS), max(THD_LENS), tuple(cu), tuple(cu))
        fwd, bwd = block_fns("cudnn" if window else "plain", D ** -0.5, True, window, None, vl)
        return _fwd_bwd(lambda: _Block.apply(q, k, v, fwd, bwd))

    return make, sum(pairs(n, n, True, window) for n in THD_LENS)


def run_rows(bench: Bench, s: int, first: bool, baseline: Any) -> None:
    args, dev = bench.args, bench.dev
    w, cap = args.window, args.softcap
    win = (w - 1, 0)
    causal_pairs, win_pairs, full_pairs = pairs(s, s, True, None), pairs(s, s, True, win), s * s
    m = bench.measure
    if baseline is not None and (not args.rows or "baseline_sdpa_mha" in args.rows):  # its own timing (median of 10 after 3 warm-ups), 32-head MHA causal SDPA
        row = {"name": "baseline_sdpa_mha", "seqlen": s, "pairs": causal_pairs, "note": "measure_single, MHA"}
        ms = attempt(row, "measure_single", lambda: baseline.measure_single(s))
        row.update(ms=round(ms, 3) if ms else None, tflops=tflops(causal_pairs, H, D, D, ms))
        bench.rows.append(row)
        torch.cuda.empty_cache()
    m("sdpa_causal", s, _sdpa_step(dev, s), causal_pairs)
    m("cpscope_causal", s, _cp_step(dev, s, s, "plain", True), causal_pairs, profile=first)
    m("cpscope_causal_graph", s, _cp_step(dev, s, s, "cudnn", True, (-1, 0)), causal_pairs)
    m("cpscope_window", s, _cp_step(dev, s, s, "cudnn", True, win), win_pairs, profile=first, window=win)
    if args.flex:
        m("flex_window", s, _flex_step(bench, s, w, None), win_pairs, window=win)
    m("flash_window", s, _cp_step(dev, s, s, "flash", True, win), win_pairs, window=win)
    m("cpscope_causal_softcap", s, _cp_step(dev, s, s, "cudnn", True, None, cap), causal_pairs, profile=first)
    m("cpscope_window_softcap", s, _cp_step(dev, s, s, "cudnn", True, win, cap), win_pairs, window=win)
    if first and not args.lean:
        m("cpscope_full", s, _cp_step(dev, s, s, "cudnn", False, (-1, -1)), full_pairs)
        m("cpscope_full_softcap", s, _cp_step(dev, s, s, "cudnn", False, None, cap), full_pairs)
        for name, sc in (("cpscope_causal_fwd", None), ("cpscope_causal_softcap_fwd", cap)):
            m(name, s, _cp_step(dev, s, s, "cudnn", True, (-1, 0), sc, fwd_only=True), causal_pairs,
              note="forward only (tflops counts forward + backward flops: not a rate)")
    with_s, without_s, how = _sinks_steps(dev, s)
    m("cpscope_causal_sinks", s, with_s, causal_pairs, how=how)
    m("cpscope_causal_no_sinks", s, without_s, causal_pairs, how=how)
    if first and not args.lean:
        m("cpscope_causal_sinks_torch", s, _sinks_steps(dev, s, fused=False)[0], causal_pairs,
          how="the block + the sink merge in torch ops")
        if _api_takes("sinks"):
            with_s, without_s, how = _sinks_steps(dev, s, fused=None)
            m("api_causal_sinks", s, with_s, causal_pairs, how=how)
            m("api_causal", s, without_s, causal_pairs, how=how)
    m("sdpa_mla", s, _sdpa_step(dev, s, heads=(H, H), dims=(192, 128), cudnn_only=True), causal_pairs,
      d_qk=192, d_v=128)
    m("cpscope_mla", s, _cp_step(dev, s, s, "plain", True, heads=(H, H), dims=(192, 128)), causal_pairs,
      d_qk=192, d_v=128)
    make, n = _halo_step(dev, s, w, win)
    m("halo_cp2_window", s, make, n, window=win, note="2 blocks: S/4 queries vs S/4 + W - 1 keys")
    c = s // 4
    m("halo_cp2_causal", s, _halo_causal(dev, c, w), 2 * pairs(c, c + w - 1, True, None))
    if s == 65536:
        make, n = _thd_step(dev, None)
        m("thd_causal", s, make, n)
        make, n = _thd_step(dev, win)
        m("thd_window", s, make, n, window=win)
    if args.flex and first and not args.lean:
        m("flex_causal", s, _flex_step(bench, s, None, None), causal_pairs)
        m("flex_causal_softcap", s, _flex_step(bench, s, None, cap), causal_pairs)


def _halo_causal(dev, c, w):
    def make():
        ins = [_leaves(dev, (1, c, H, D), (1, c + w - 1, H_KV, D), (1, c + w - 1, H_KV, D)) for _ in range(2)]
        fwd, bwd = block_fns("cudnn", D ** -0.5, True, (-1, 0))

        def step():
            for q, k, v in ins:
                out = _Block.apply(q, k, v, fwd, bwd)
                out.backward(torch.ones_like(out))

        return step

    return make


# ---------------------------------------------------------------------------------------------------- reporting


def targets(bench: Bench, seqlens: list[int]) -> list[dict]:
    """Each target of the block kernels, per length: the measured ratio and whether it is met."""
    out = []

    def ratio(a, b, limit, what, s):
        x, y = bench.ms(a, s), bench.ms(b, s)
        r = round(x / y, 3) if x and y else None
        out.append({"target": what, "seqlen": s, "ratio": r, "limit": limit, "met": None if r is None else r <= limit,
                    "rows": f"{a} / {b}"})

    for s in seqlens:
        ratio("cpscope_window", "flex_window", 0.8, "window <= 0.8x FlexAttention", s)
        ratio("cpscope_causal_sinks", "cpscope_causal_no_sinks", 1.03, "sinks <= 1.03x without", s)
        ratio("cpscope_causal_softcap", "cpscope_causal", 1.3, "softcap <= 1.3x without (causal)", s)
        ratio("cpscope_window_softcap", "cpscope_window", 1.3, "softcap <= 1.3x without (window)", s)
        ratio("cpscope_mla", "sdpa_mla", 1.05, "MLA <= 1.05x SDPA (cuDNN)", s)
    return out


def print_tables(result: dict) -> None:
    checks = result.get("checks") or {}
    if checks:
        bad = {n: c for n, c in checks.items() if not c.get("ok")}
        print(f"\n## parity: {len(checks) - len(bad)}/{len(checks)} cases within {1e-2} (float64 references)")
        for n, c in checks.items():
            errs = " ".join(f"{k}={c[k]:.1e}" for k in ("out", "lse", "dq", "dk", "dv") if isinstance(c.get(k), float))
            print(f"  {'ok  ' if c.get('ok') else 'FAIL'} {n:26s} {errs} {c.get('errors', '')}"[:400])
    print("\n## rows (ms fwd+bwd, TFLOP/s on the unmasked area)")
    for r in result["rows"]:
        err = "" if "errors" not in r else " ERR " + str(list(r["errors"].values())[0])[:150]
        print(f"  {r['name']:24s} S={r['seqlen']:<6d} {r.get('ms', '-')!s:>9} ms {r.get('tflops', '-')!s:>7} TF"
              f"{' ' + r.get('skipped', '') if r.get('skipped') else ''}{err}")
    print("\n## targets")
    for t in result["targets"]:
        print(f"  {t['target']:36s} S={t['seqlen']:<6d} {t['ratio']!s:>6} (limit {t['limit']}) "
              f"{'met' if t['met'] else ('NOT met' if t['met'] is False else '-')}")


def _load_baseline(path: Optional[str]) -> Optional[Any]:
    if not path or not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("_torch_cp_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _versions() -> dict:
    from cpscope.attention._kernels import cudnn_frontend

    info: dict = {"cudnn_frontend_available": cudnn_frontend.available(torch.device("cuda", 0))}
    mod = cudnn_frontend.module()
    if mod is not None:
        info["cudnn_frontend"] = getattr(mod, "__version__", "?")
        info["cudnn_backend"] = int(mod.backend_version())
    info["flash_window_args"] = "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)
    return info


def run_checks(dev: torch.device) -> dict:
    from cpscope.attention._kernels import cudnn_frontend, cudnn_mods
    from cpscope.attention._policy import use_kernel_policy

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/
    from tests.attention._kernel_cases import CASES, run_case

    res = {}
    for i, name in enumerate(CASES):
        row: dict = {}
        got = attempt(row, name, lambda: run_case(name, dev, seed=i))
        res[name] = got if got is not None else {"ok": False, **row}
    # probes of the score modifier's alternatives: its masked value -inf, the frontend's runtime scalars, and the
    # ordered execute with host scalars
    old_masked = cudnn_mods.MASKED
    for attr, value in (("MASKED", float("-inf")), ("cudnn_constants", "runtime"), ("fixed_form", "ordered")):
        policy = {} if attr == "MASKED" else {attr: value}
        try:
            if attr == "MASKED":
                cudnn_mods.MASKED = value
            cudnn_frontend.clear_cache()
            with use_kernel_policy(**policy):
                for name in ("dense_softcap_causal", "thd_softcap_window"):
                    row = {}
                    got = attempt(row, name, lambda: run_case(name, dev, seed=99))
                    res[f"{name}[{attr}={value}]"] = got if got is not None else {"ok": False, **row}
        finally:
            cudnn_mods.MASKED = old_masked
            cudnn_frontend.clear_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--window", type=int, default=4096, help="keys a query sees, its own included")
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--check", action="store_true", help="parity cases first")
    ap.add_argument("--no-rows", action="store_true", help="parity only")
    ap.add_argument("--flex", action="store_true", help="FlexAttention rows (torch.compile)")
    ap.add_argument("--lean", action="store_true", help="no probe rows (no-mask, forward-only, unfused sinks, "
                    "FlexAttention causal / softcap): the target rows only")
    ap.add_argument("--baseline", default=None, help="path of shared/tools/torch_cp_baseline.py")
    ap.add_argument("--rows", nargs="+", default=None, help="only these rows (names as in the docstring)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--row-budget-s", type=float, default=4.0)
    ap.add_argument("--budget-s", type=float, default=500.0, help="no new row starts after this many seconds")
    ap.add_argument("--out", default=".")
    ap.add_argument("--json", default="attention_features.json")
    args = ap.parse_args()
    setup_logging(0)
    logging.getLogger("torch._inductor").setLevel(logging.WARNING)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # the shared baseline's timer meets at a barrier
    result: dict = {"env": env_info(dev), "versions": attempt({}, "versions", _versions), "window": args.window,
                    "softcap": args.softcap, "shape": {"b": 1, "h": H, "h_kv": H_KV, "d": D}}
    bench = Bench(args, dev)
    if args.check:
        result["checks"] = run_checks(dev)
    baseline = _load_baseline(args.baseline)
    result["baseline"] = args.baseline if baseline is not None else f"not loaded ({args.baseline})"
    if not args.no_rows:
        for i, s in enumerate(args.seqlens):
            run_rows(bench, s, i == 0, baseline)
    from cpscope.attention._kernels import fallbacks

    result["rows"], result["targets"] = bench.rows, targets(bench, args.seqlens)
    result["cudnn_refused"] = {str(k): why for k, why in fallbacks().items()}  # rows that ran elsewhere
    path = write_json(result, args.out, args.json)
    print_tables(result)
    print(f"\nwrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
