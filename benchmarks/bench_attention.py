"""Attention benchmark, one process per run: cpscope beside its baselines, MHA and GQA, bshd and thd, CP1 and CP.

One GPU (CP1: cpscope vs SDPA with ``enable_gqa`` / ``torch.nn.attention.varlen.varlen_attn`` / TE, plus the ring's
block shapes on one GPU)::

    python benchmarks/bench_attention.py --check --kernels --blocks --out OUT

Two GPUs (CP2: vs single-GPU SDPA / varlen, PyTorch ``context_parallel``, TE CP2 ``p2p``; cpscope CP1 beside)::

    torchrun --nproc_per_node=2 benchmarks/bench_attention.py --check --kernels --out OUT

Crash test on CPU (tiny shapes, fp64 references; ``torchrun --nproc_per_node=2 ... --device cpu`` for gloo CP2)::

    python benchmarks/bench_attention.py --device cpu --dry-run --check --kernels --blocks --out /tmp/x

Shapes: B=1, H=32 query heads × D=128, k/v heads ``--kv-heads`` (default 32 8 4), bf16, causal, forward + backward
(``o.backward(dout)``, grads reset to ``None`` each step). bshd ``--seqlens`` (default 4k 16k 64k); thd: 128k tokens
packed as ``--packs`` (16 long-tail documents / 64×2k / 512×256).

Method: medians with CUDA events after warm-up (:class:`_bench_util.Timer`: 3 warm-ups, ≤ 10 timed calls, fewer
when a measurement would exceed ``--budget-s``), every method of a row in the same process, back to back.
``--check``: every timed cpscope row is also run on random inputs and compared with a float32 reference on the GPU
(SDPA memory-efficient kernel, k/v heads repeated; per document for thd) — float64 on CPU — relative error
‖a−b‖/‖b‖ of out, dq, dk, dv, limit 1e-2 (bf16). ``--kernels``: the attention kernels of one call of each method,
from the profiler (``cudnn`` / ``flash`` / …). ``--blocks``: the ring's CP2 block shapes (diagonal, ``kv_front``,
``q_back``) through ``cpscope.attention._kernels.block_forward/backward`` on one GPU, their kernels and times beside
SDPA (or varlen) on the same shapes and beside the kernels of cpscope's CP1 call.

Baselines that cannot do GQA get k/v expanded to H heads before timing (not timed) and say so in the row's
``notes``: PyTorch ``context_parallel`` (its 32-head MHA time, from ``--baseline``'s ``measure_torch_cp``), and
``varlen_attn`` where this torch has no ``enable_gqa``. TE rows run only where ``transformer_engine`` imports.
A failing measurement is logged, stored under the row's ``errors`` and skipped; the JSON (``attention_bench.json``)
is rewritten after every row, and the tables print at the end (rank 0).
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
import math
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_util import (  # noqa: E402
    Timer, attempt, barrier, env_info, fmt, init_world, kernel_profile, rel_err, sync, write_json, zigzag_rows,
)

log = logging.getLogger("cpscope.bench")

H, D = 32, 128
# 16 long-tail documents, 131072 tokens, longest 36864; every length divisible by 2*cp for cp <= 8
THD_LENS = [36864, 20480, 14336, 10240, 8192, 7168, 6144, 5120, 4096, 4096, 3072, 3072, 2048, 2048, 2048, 2048]
PACKS = {"longtail16": THD_LENS, "64x2k": [2048] * 64, "512x256": [256] * 512}
REL_TOL = 1e-2
_BASELINE_CANDIDATES = ("shared/tools/torch_cp_baseline.py", "../shared/tools/torch_cp_baseline.py",
                        ".device-in/torch_cp_baseline.py", "/work/shared/tools/torch_cp_baseline.py")


def init_cp_world():
    """NCCL process group under torchrun, this rank's GPU, one CP group over the whole world, its cp_stream created.

    Returns ``(device, rank, world, group)`` (kept for ``profile_ring.py``)."""
    return init_world("cuda")


# ------------------------------------------------------------------------------------------------------- inputs


class Shape:
    """One row's problem: layout, global length / pack, heads, and the derived offsets."""

    def __init__(self, fmt_: str, *, seqlen: int = 0, pack: Optional[list[int]] = None, h: int = H, h_kv: int = H,
                 d: int = D, name: str = "") -> None:
        self.fmt, self.h, self.h_kv, self.d = fmt_, h, h_kv, d
        if fmt_ == "thd":
            assert pack is not None
            self.cu = [0]
            for n in pack:
                self.cu.append(self.cu[-1] + n)
            self.total, self.max_len, self.pack = self.cu[-1], max(pack), pack
        else:
            self.cu, self.total, self.max_len, self.pack = [0, seqlen], seqlen, seqlen, None
        self.name = name

    def tensors(self, dev, dtype, cp: int = 1, seed: int = 0, grad: bool = True):
        """Random local q, k, v (``cp``: this rank's share) and a dout, in cpscope's layout."""
        g = torch.Generator(device=dev).manual_seed(seed)
        n = self.total // cp
        lead = (n,) if self.fmt == "thd" else (1, n)
        mk = lambda heads: torch.randn(*lead, heads, self.d, device=dev, dtype=dtype, generator=g)  # noqa: E731
        q, k, v, dout = mk(self.h), mk(self.h_kv), mk(self.h_kv), mk(self.h)
        return [t.requires_grad_(grad) for t in (q, k, v)] + [dout]

    def cu_tensor(self, dev):
        return torch.tensor(self.cu, dtype=torch.int32, device=dev)


def _fwd_bwd(leaves: list[torch.Tensor], dout: torch.Tensor, fwd: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        for t in leaves:
            t.grad = None
        fwd().backward(dout)

    return step


def _peak_gib(fn: Callable[[], Any], dev) -> tuple[Any, Optional[float]]:
    if dev.type != "cuda":
        return fn(), None
    sync(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    res = fn()
    sync(dev)
    return res, round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)


# ---------------------------------------------------------------------------------------------------- baselines


def sdpa_step(s: Shape, dev, dtype) -> Callable[[], None]:
    """Single-device SDPA over the whole sequence, ``[1, H, S, D]`` (its native layout), GQA via ``enable_gqa``."""
    q, k, v, dout = (t.transpose(1, 2).contiguous().detach() for t in s.tensors(dev, dtype))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    gqa = s.h != s.h_kv
    return _fwd_bwd([q, k, v], dout,
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa))


def _varlen_api() -> tuple[Optional[Callable], str]:
    """(a causal ``varlen_attn`` caller, how GQA is passed), or (None, why not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return None, f"torch.nn.attention.varlen.varlen_attn unavailable: {e}"
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch >= 2.10: (-1, 0) is causal, (-1, -1) full
        mask = lambda causal: {"window_size": (-1, 0) if causal else (-1, -1)}  # noqa: E731
    elif "is_causal" in params:  # torch 2.9
        mask = lambda causal: {"is_causal": causal}  # noqa: E731
    else:
        return None, f"varlen_attn{inspect.signature(varlen_attn)} has no causal argument this script knows"
    native_gqa = "enable_gqa" in params

    def call(q, k, v, cu_q, cu_k, max_q, max_k, causal=True):
        kw = mask(causal)
        if native_gqa and q.shape[1] != k.shape[1]:
            kw["enable_gqa"] = True
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    return call, "enable_gqa" if native_gqa else "expand"


def varlen_step(s: Shape, dev, dtype, notes: list) -> Callable[[], None]:
    """Single-device ``varlen_attn`` over the whole pack; k/v expanded (untimed) where it has no ``enable_gqa``."""
    call, how = _varlen_api()
    if call is None:
        raise RuntimeError(how)
    q, k, v, dout = s.tensors(dev, dtype)
    if how == "expand" and s.h != s.h_kv:
        g = s.h // s.h_kv
        k, v = (t.detach().repeat_interleave(g, dim=1).requires_grad_(True) for t in (k, v))
        notes.append(f"varlen_attn: k/v expanded to {s.h} heads before timing (no enable_gqa in this torch)")
    cu = s.cu_tensor(dev)
    return _fwd_bwd([q, k, v], dout, lambda: call(q, k, v, cu, cu, s.max_len, s.max_len))


def cpscope_step(s: Shape, dev, dtype, group) -> Callable[[], None]:
    from cpscope.attention import context_parallel_attention

    cp = 1 if group is None else group.size()
    q, k, v, dout = s.tensors(dev, dtype, cp)
    kw = {"cu_seqlens": s.cu_tensor(dev)} if s.fmt == "thd" else {}
    return _fwd_bwd([q, k, v], dout, lambda: context_parallel_attention(q, k, v, qkv_format=s.fmt, causal=True,
                                                                        group=group, **kw))


def _load_torch_cp_baseline(path: Optional[str]) -> tuple[Optional[Any], str]:
    cands = [path] if path else [os.environ.get("CPSCOPE_TORCH_CP_BASELINE", ""), *_BASELINE_CANDIDATES]
    for p in cands:
        if p and os.path.isfile(p):
            spec = importlib.util.spec_from_file_location("_torch_cp_baseline", p)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod, p
    return None, f"torch_cp_baseline.py not found (tried {[c for c in cands if c]})"


# ------------------------------------------------------------------------------------------------------- parity


def reference(s: Shape, q, k, v, dout) -> list[torch.Tensor]:
    """Full-sequence out, dq, dk, dv in float32 (CUDA: SDPA memory-efficient kernel) / float64 (CPU), k/v heads
    repeated (their gradients summed back by autograd); thd: per document (equal lengths batched)."""
    dt = torch.float32 if q.is_cuda else torch.float64
    g = s.h // s.h_kv
    leaves = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
    qq, kk, vv = leaves[0], leaves[1].repeat_interleave(g, dim=-2), leaves[2].repeat_interleave(g, dim=-2)

    def attn(a, b, c):  # [n, s, h, d] -> [n, s, h, d]
        if a.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                o = F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2),
                                                   is_causal=True)
        else:
            o = F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2),
                                               is_causal=True)
        return o.transpose(1, 2)

    if s.fmt == "thd":
        lens = s.pack
        if len(set(lens)) == 1:
            n, L = len(lens), lens[0]
            out = attn(*(t.reshape(n, L, *t.shape[1:]) for t in (qq, kk, vv))).reshape(qq.shape)
        else:
            out = torch.cat([attn(qq[None, a:b], kk[None, a:b], vv[None, a:b])[0]
                             for a, b in zip(s.cu[:-1], s.cu[1:])])
    else:
        out = attn(qq, kk, vv)
    out.backward(dout.to(dt))
    return [out.detach()] + [t.grad for t in leaves]


def parity(s: Shape, dev, dtype, group, seed: int = 7) -> dict:
    """cpscope (CP over ``group``, or CP1) vs :func:`reference` on this rank's zigzag rows; ``ok`` iff all ≤ 1e-2."""
    from cpscope.attention import context_parallel_attention

    cp = 1 if group is None else group.size()
    rank = 0 if group is None else dist.get_rank(group)
    q, k, v, dout = s.tensors(dev, dtype, 1, seed=seed, grad=False)
    want = reference(s, q, k, v, dout)
    idx = zigzag_rows(s.cu, cp, rank).to(dev)
    dim = 0 if s.fmt == "thd" else 1
    loc = [t.index_select(dim, idx).detach().clone().requires_grad_(True) for t in (q, k, v)]
    kw = {"cu_seqlens": s.cu_tensor(dev)} if s.fmt == "thd" else {}
    out = context_parallel_attention(*loc, qkv_format=s.fmt, causal=True, group=group, **kw)
    out.backward(dout.index_select(dim, idx))
    got = [out] + [t.grad for t in loc]
    errs = {n: rel_err(a, b.index_select(dim, idx)) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    errs["max"] = max(errs.values())
    errs["ok"] = errs["max"] <= REL_TOL
    del want, got, loc, out
    return errs


# ------------------------------------------------------------------------------------------------------- a row


def run_row(s: Shape, args, ctx: dict) -> dict:
    """Every method of one case, back to back; ``None`` (with ``errors``) for those that failed or do not apply."""
    dev, dtype, group, world, timer = ctx["dev"], ctx["dtype"], ctx["group"], ctx["world"], ctx["timer"]
    row: dict = {"case": s.name, "fmt": s.fmt, "tokens": s.total, "h": s.h, "h_kv": s.h_kv, "gpus": world,
                 "notes": []}
    t0 = time.time()
    kernels: dict = {}
    if ctx["te"]:
        from _te_baseline import measure_te_bshd, measure_te_thd

    def measure(key: str, make: Callable[[], Callable[[], None]], *, peak: bool = False, profile_key: str = ""):
        def go():
            step = make()
            ms, gib = _peak_gib(lambda: timer.median_ms(step), dev) if peak else (timer.median_ms(step), None)
            if gib is not None:
                row[f"peak_gib_{key}"] = gib
            if args.kernels and profile_key:
                kernels[profile_key] = attempt(row, f"kernels_{profile_key}", lambda: kernel_profile(step, dev))
            return round(ms, 3)

        row[f"{key}_ms"] = attempt(row, key, go)
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # single-device baselines (on every rank: each times the whole problem on its own GPU)
    if s.fmt == "bshd":
        measure("sdpa", lambda: sdpa_step(s, dev, dtype), peak=True, profile_key="sdpa")
    else:
        measure("varlen", lambda: varlen_step(s, dev, dtype, row["notes"]), peak=True, profile_key="varlen")
    if ctx["te"]:
        if s.fmt == "bshd":
            row["te_ms"] = attempt(row, "te", lambda: round(measure_te_bshd(
                s.total, None, s.h, s.d, kv_heads=s.h_kv, timer=timer), 3))
        else:
            row["te_ms"] = attempt(row, "te", lambda: round(measure_te_thd(
                s.pack, None, s.h, s.d, kv_heads=s.h_kv, timer=timer), 3))
    measure("cpscope_cp1", lambda: cpscope_step(s, dev, dtype, None), peak=True, profile_key="cpscope_cp1")
    if args.check:
        row["parity_cp1"] = attempt(row, "parity_cp1", lambda: parity(s, dev, dtype, None))
    if world > 1:
        if s.fmt == "bshd" and not args.no_torch_cp:
            row["torch_cp_ms"] = ctx["torch_cp"](s)
            if s.h != s.h_kv:
                row["notes"].append(f"torch context_parallel: k/v expanded to {s.h} heads (its MHA time)")
        if ctx["te"]:
            if s.fmt == "bshd":
                row["te_cp_ms"] = attempt(row, "te_cp", lambda: round(measure_te_bshd(
                    s.total, group, s.h, s.d, kv_heads=s.h_kv, timer=timer), 3))
            else:
                row["te_cp_ms"] = attempt(row, "te_cp", lambda: round(measure_te_thd(
                    s.pack, group, s.h, s.d, kv_heads=s.h_kv, timer=timer), 3))
        measure("cpscope_cp", lambda: cpscope_step(s, dev, dtype, group), peak=True, profile_key="cpscope_cp")
        if args.check:
            row["parity_cp"] = attempt(row, "parity_cp", lambda: parity(s, dev, dtype, group))
    if kernels:
        row["kernels"] = kernels
    # ratios (time / time: < 1 means cpscope is faster)
    base = row.get("sdpa_ms") or row.get("varlen_ms")
    mine1, mine = row.get("cpscope_cp1_ms"), row.get("cpscope_cp_ms")
    if base and mine1:
        row["cp1_vs_base"] = round(mine1 / base, 3)
    if row.get("te_ms") and mine1:
        row["cp1_vs_te"] = round(mine1 / row["te_ms"], 3)
    if world > 1 and mine:
        if base:
            row["cp_speedup"] = round(base / mine, 3)
        if mine1:
            row["cp_speedup_own_cp1"] = round(mine1 / mine, 3)
        if row.get("torch_cp_ms") and base:
            row["torch_cp_speedup"] = round(base / row["torch_cp_ms"], 3)
        if row.get("te_cp_ms"):
            row["te_cp_speedup"] = round((row.get("te_ms") or base) / row["te_cp_ms"], 3)
            row["cp_vs_te_cp"] = round(mine / row["te_cp_ms"], 3)
    row["wall_s"] = round(time.time() - t0, 1)
    return row


# ------------------------------------------------------------------------------------------------------ blocks


def _block_tensors(s: Shape, kind: str, dev, dtype, seed: int = 3):
    """A CP2 rank's block of ``kind`` for problem ``s``: ``(q, k, v, dout, varlen, causal)``.

    Dense: local length ``n = S/2``, halves ``n/2``. Varlen: per document the local tokens are the front chunk then
    the back chunk; ``kv_front`` takes the K/V fronts, ``q_back`` the Q backs (gathered, as the ring does)."""
    from cpscope.attention._kernels import Varlen

    q, k, v, dout = (t.detach() for t in s.tensors(dev, dtype, cp=2, seed=seed, grad=False))
    if s.fmt != "thd":
        c = q.shape[1] // 2
        if kind == "kv_front":
            k, v = k[:, :c].contiguous(), v[:, :c].contiguous()
        elif kind == "q_back":
            q, dout = q[:, c:].contiguous(), dout[:, c:].contiguous()
        return q, k, v, dout, None, kind == "diag"
    loc = [x // 2 for x in s.cu]  # local offsets of a CP2 rank
    half = [x // 4 for x in s.cu]
    front = torch.cat([torch.arange(a, a + (b - a) // 2) for a, b in zip(loc[:-1], loc[1:])]).to(dev)
    back = torch.cat([torch.arange(a + (b - a) // 2, b) for a, b in zip(loc[:-1], loc[1:])]).to(dev)
    m_loc, m_half = s.max_len // 2, s.max_len // 4
    t_loc, t_half = torch.tensor(loc, dtype=torch.int32, device=dev), torch.tensor(half, dtype=torch.int32, device=dev)
    if kind == "diag":
        vl = Varlen(t_loc, t_loc, m_loc, m_loc, tuple(loc), tuple(loc))
    elif kind == "kv_front":
        k, v = k.index_select(0, front), v.index_select(0, front)
        vl = Varlen(t_loc, t_half, m_loc, m_half, tuple(loc), tuple(half))
    else:
        q, dout = q.index_select(0, back), dout.index_select(0, back)
        vl = Varlen(t_half, t_loc, m_half, m_loc, tuple(half), tuple(loc))
    return q, k, v, dout, vl, kind == "diag"


def run_blocks(s: Shape, args, ctx: dict, cp1_kernels: Optional[dict]) -> list[dict]:
    """The ring's CP2 block shapes on one device: kernels and fwd / bwd times beside the same shape's baseline."""
    from cpscope.attention._kernels import Placeholders, block_backward, block_forward

    dev, dtype, timer = ctx["dev"], ctx["dtype"], ctx["timer"]
    scale = 1.0 / math.sqrt(s.d)
    out_rows = []
    for kind in ("diag", "kv_front", "q_back"):
        row: dict = {"case": s.name, "fmt": s.fmt, "h": s.h, "h_kv": s.h_kv, "block": kind, "notes": []}
        t0 = time.time()

        def go():
            q, k, v, dout, vl, causal = _block_tensors(s, kind, dev, dtype)
            row["q_tokens"], row["kv_tokens"] = int(q.shape[-3]), int(k.shape[-3])
            kw = dict(scale=scale, causal=causal, varlen=vl, placeholders=Placeholders())  # one call's placeholders
            o, lse = block_forward(q, k, v, **kw)
            fwd = lambda: block_forward(q, k, v, **kw)  # noqa: E731
            bwd = lambda: block_backward(dout, q, k, v, o, lse, **kw)  # noqa: E731
            row["fwd_ms"] = round(timer.median_ms(fwd), 3)
            row["bwd_ms"] = round(timer.median_ms(bwd), 3)
            row["fwd_bwd_ms"] = round(row["fwd_ms"] + row["bwd_ms"], 3)
            if args.kernels:
                row["kernels"] = attempt(row, "kernels", lambda: kernel_profile(lambda: (fwd(), bwd()), dev))

        attempt(row, "block", go)

        def baseline():  # the same shape through SDPA (dense) / varlen_attn (thd), autograd fwd+bwd
            q, k, v, dout, vl, causal = _block_tensors(s, kind, dev, dtype)
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            if s.fmt != "thd":
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                step = _fwd_bwd([q, k, v], dout, lambda: F.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=s.h != s.h_kv).transpose(1, 2))
                row["baseline"] = "sdpa"
            else:
                call, how = _varlen_api()
                if call is None:
                    raise RuntimeError(how)
                if how == "expand" and s.h != s.h_kv:
                    k, v = (t.detach().repeat_interleave(s.h // s.h_kv, 1).requires_grad_(True) for t in (k, v))
                    row["notes"].append("varlen_attn: k/v expanded before timing")
                step = _fwd_bwd([q, k, v], dout, lambda: call(q, k, v, vl.cu_q, vl.cu_k, vl.max_q, vl.max_k,
                                                              causal=causal))
                row["baseline"] = "varlen_attn"
            row["baseline_fwd_bwd_ms"] = round(timer.median_ms(step), 3)
            if args.kernels:
                row["baseline_kernels"] = attempt(row, "baseline_kernels", lambda: kernel_profile(step, dev))

        attempt(row, "baseline", baseline)
        if row.get("fwd_bwd_ms") and row.get("baseline_fwd_bwd_ms"):
            row["vs_baseline"] = round(row["fwd_bwd_ms"] / row["baseline_fwd_bwd_ms"], 3)
        mine = (row.get("kernels") or {}).get("main")
        if cp1_kernels is not None:
            row["cp1_kernel"] = cp1_kernels.get("main")
            row["same_kernel_as_cp1"] = mine is not None and mine == cp1_kernels.get("main")
        row["wall_s"] = round(time.time() - t0, 1)
        out_rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out_rows


# ------------------------------------------------------------------------------------------------------ output


def _summary(row: dict) -> dict:
    """A row for the log: times, ratios, parity maxima, kernel classes and the names of failed measurements."""
    s = {k: v for k, v in row.items() if k not in ("kernels", "errors", "notes") and not k.startswith("parity")}
    for k in ("parity_cp1", "parity_cp"):
        if row.get(k):
            s[k] = f"{row[k]['max']:.1e} {'ok' if row[k]['ok'] else 'FAIL'}"
    if row.get("kernels"):
        s["kernels"] = {k: (v or {}).get("main") for k, v in row["kernels"].items()}
    if row.get("errors"):
        s["failed"] = sorted(row["errors"])
    return s


def _err(p: Optional[dict]) -> str:
    if not p:
        return "-"
    return f"{p['max']:.1e}{'' if p['ok'] else ' FAIL'}"


def _kern(row: dict, key: str) -> str:
    k = (row.get("kernels") or {}).get(key) or {}
    return k.get("main") or "-"


def print_tables(out: dict) -> None:
    rows, world = out["rows"], out["gpus"]
    if rows:
        print(f"\n## CP1 (one GPU): time ratio cpscope / baseline (< 1: cpscope faster); TE {out['te_status']}")
        print("| case | heads q/kv | baseline ms | TE ms | cpscope ms | cpscope/base | cpscope/TE | kernels "
              "base→cpscope | parity |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = r.get("sdpa_ms") if r["fmt"] == "bshd" else r.get("varlen_ms")
        bk = _kern(r, "sdpa" if r["fmt"] == "bshd" else "varlen")
        print(f"| {r['case']} | {r['h']}/{r['h_kv']} | {fmt(base)} | {fmt(r.get('te_ms'))} | "
              f"{fmt(r.get('cpscope_cp1_ms'))} | {fmt(r.get('cp1_vs_base'))} | {fmt(r.get('cp1_vs_te'))} | "
              f"{bk}→{_kern(r, 'cpscope_cp1')} | {_err(r.get('parity_cp1'))} |")
    if world > 1 and rows:
        print(f"\n## CP{world}: speedup over one GPU (same run)")
        print("| case | heads q/kv | 1 GPU ms | torch CP ms (x) | TE CP ms (x) | cpscope CP1 ms | cpscope CP ms (x) | "
              "x own CP1 | cpscope/TE CP | kernel | parity |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            base = r.get("sdpa_ms") if r["fmt"] == "bshd" else r.get("varlen_ms")
            print(f"| {r['case']} | {r['h']}/{r['h_kv']} | {fmt(base)} | {fmt(r.get('torch_cp_ms'))} "
                  f"({fmt(r.get('torch_cp_speedup'))}) | {fmt(r.get('te_cp_ms'))} ({fmt(r.get('te_cp_speedup'))}) | "
                  f"{fmt(r.get('cpscope_cp1_ms'))} | {fmt(r.get('cpscope_cp_ms'))} ({fmt(r.get('cp_speedup'))}) | "
                  f"{fmt(r.get('cp_speedup_own_cp1'))} | {fmt(r.get('cp_vs_te_cp'))} | {_kern(r, 'cpscope_cp')} | "
                  f"{_err(r.get('parity_cp'))} |")
    if out.get("blocks"):
        print("\n## Ring blocks of a CP2 rank on one GPU (block_forward/backward) vs the same shape's baseline")
        print("| case | heads q/kv | block | q×kv tokens | fwd ms | bwd ms | baseline fwd+bwd ms | block/base | "
              "kernel block / base / CP1 call | same as CP1 |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in out["blocks"]:
            bk = (r.get("baseline_kernels") or {}).get("main") or "-"
            mk = (r.get("kernels") or {}).get("main") or "-"
            print(f"| {r['case']} | {r['h']}/{r['h_kv']} | {r['block']} | {r.get('q_tokens', '-')}×"
                  f"{r.get('kv_tokens', '-')} | {fmt(r.get('fwd_ms'))} | {fmt(r.get('bwd_ms'))} | "
                  f"{fmt(r.get('baseline_fwd_bwd_ms'))} | {fmt(r.get('vs_baseline'))} | {mk} / {bk} / "
                  f"{r.get('cp1_kernel') or '-'} | {r.get('same_kernel_as_cp1', '-')} |")
    notes = sorted({n for r in rows + out.get("blocks", []) for n in r.get("notes", [])})
    errs: dict = {}  # (what, message) -> rows it happened in
    for r in rows + out.get("blocks", []):
        for k, v in (r.get("errors") or {}).items():
            where = f"{r['case']} {r['h']}/{r['h_kv']}" + (f" {r['block']}" if r.get("block") else "")
            errs.setdefault((k, (v.splitlines() or [""])[0][:160]), []).append(where)
    for n in notes:
        print("note:", n)
    for (k, msg), where in errs.items():
        print(f"error: {k}: {msg} — in {len(where)} row(s): {', '.join(where[:4])}{' …' if len(where) > 4 else ''}")
    bad = [(r["case"], r["h_kv"], k) for r in rows for k in ("parity_cp1", "parity_cp")
           if r.get(k) and not r[k]["ok"]]
    if out["args"].get("check"):
        print("parity:", "all timed cpscope rows within 1e-2" if not bad else f"FAILED {bad}")


# -------------------------------------------------------------------------------------------------------- main


def _pack(name: str, dry_run: bool) -> list[int]:
    """The pack's document lengths; ``dry_run``: at most 64 documents of 1/256 the length (≥ 8, multiples of 8)."""
    if not dry_run:
        return list(PACKS[name])
    return [max(8, n // 256 // 8 * 8) for n in PACKS[name][:64]]


def _cases(args) -> list[Shape]:
    """Rows in table order: per layout, per length / pack, per k/v head count."""
    cases = []
    for fmt_ in args.formats:
        sizes = args.seqlens if fmt_ == "bshd" else args.packs
        for size in sizes:
            for h_kv in args.kv_heads:
                if fmt_ == "bshd":
                    name = f"bshd-{size // 1024}k" if size >= 1024 else f"bshd-{size}"
                    cases.append(Shape("bshd", seqlen=size, h=args.heads, h_kv=h_kv, d=args.dim, name=name))
                else:
                    pack = _pack(size, args.dry_run)
                    cases.append(Shape("thd", pack=pack, h=args.heads, h_kv=h_kv, d=args.dim, name=f"thd-{size}"))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (crash test; numbers meaningless)")
    ap.add_argument("--formats", nargs="+", default=["bshd", "thd"], choices=["bshd", "thd"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--packs", nargs="+", default=list(PACKS), choices=list(PACKS))
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8, 4])
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--dim", type=int, default=D)
    ap.add_argument("--check", action="store_true", help="parity of every timed cpscope row vs an fp32/fp64 reference")
    ap.add_argument("--kernels", action="store_true", help="profile one call per method: attention kernel classes")
    ap.add_argument("--blocks", action="store_true", help="the ring's CP2 block shapes on one device (world 1 only)")
    ap.add_argument("--no-rows", action="store_true", help="skip the bshd/thd rows (e.g. --blocks alone)")
    ap.add_argument("--blocks-seqlens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--blocks-packs", nargs="+", default=["longtail16"], choices=list(PACKS))
    ap.add_argument("--blocks-kv-heads", type=int, nargs="+", default=None, help="default: --kv-heads")
    ap.add_argument("--baseline", default=None, help="path to torch_cp_baseline.py (PyTorch context_parallel)")
    ap.add_argument("--no-torch-cp", action="store_true")
    ap.add_argument("--no-te", action="store_true", help="skip TransformerEngine even where it is installed")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=2.5, help="time cap of one measurement (fewer iterations)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--json", default="attention_bench.json", help="file name under --out")
    args = ap.parse_args()
    if args.dry_run:
        args.seqlens, args.blocks_seqlens = [128, 256], [256]
        args.heads, args.dim, args.kv_heads = 4, 16, [4, 2, 1]
        args.iters, args.warmup = 2, 1
    te_ok, te_status = False, "off (--no-te)"
    if args.device == "cuda" and not args.no_te:
        # TE is imported before anything runs on the GPU (see _te_baseline.te_available for the cuDNN it must share)
        from _te_baseline import te_available

        te_ok = te_available()
        te_status = "on" if te_ok else "off (transformer_engine not importable; rows without TE)"
    elif args.device == "cpu":
        te_status = "off (CPU)"
    dev, rank, world, group = init_world(args.device)
    dtype = torch.bfloat16
    timer = Timer(dev, iters=args.iters, warmup=args.warmup, budget_s=args.budget_s)
    out: dict = {"gpus": world, "env": env_info(dev), "args": vars(args), "te_status": te_status, "rows": [],
                 "blocks": []}
    try:
        from cpscope.attention._kernels import cudnn_frontend

        out["env"]["cudnn_frontend_thd"] = bool(cudnn_frontend.available(dev)) if dev.type == "cuda" else False
    except Exception as e:  # noqa: BLE001 - informative only
        out["env"]["cudnn_frontend_thd"] = f"error: {e}"
    try:  # which varlen_attn this torch has (its GQA / causal arguments changed between 2.9 and 2.12)
        from torch.nn.attention.varlen import varlen_attn

        out["env"]["varlen_attn"] = f"varlen_attn{inspect.signature(varlen_attn)}; GQA: {_varlen_api()[1]}"
    except Exception as e:  # noqa: BLE001 - informative only
        out["env"]["varlen_attn"] = f"unavailable: {e}"
    log.info("world %d, device %s, TE %s, env %s", world, dev, te_status, out["env"])

    torch_cp_cache: dict = {}
    base_mod, base_where = (None, "single process") if world == 1 else _load_torch_cp_baseline(args.baseline)
    if world > 1 and base_mod is None and not args.no_torch_cp:
        log.warning("PyTorch context_parallel rows off: %s", base_where)
    out["torch_cp_baseline"] = base_where if world > 1 else None

    def torch_cp(s: Shape) -> Optional[float]:  # once per length; MHA (k/v expanded for GQA rows)
        if base_mod is None:
            return None
        if s.total not in torch_cp_cache:
            rec: dict = {}
            torch_cp_cache[s.total] = attempt(rec, "torch_cp", lambda: round(base_mod.measure_torch_cp(s.total), 3))
            torch_cp_cache[(s.total, "err")] = rec.get("errors")
        return torch_cp_cache[s.total]

    ctx = {"dev": dev, "dtype": dtype, "group": group, "world": world, "timer": timer, "te": te_ok,
           "torch_cp": torch_cp}
    cases = [] if args.no_rows else _cases(args)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    it = tqdm(cases, desc="rows", disable=rank != 0 or tqdm is None, mininterval=5) if tqdm else cases
    for s in it:
        row = run_row(s, args, ctx)
        if (s.total, "err") in torch_cp_cache and torch_cp_cache[(s.total, "err")]:
            row.setdefault("errors", {}).update(torch_cp_cache[(s.total, "err")])
        out["rows"].append(row)
        if rank == 0:
            log.info("row %s", _summary(row))
            write_json(out, args.out, args.json)
        barrier()
    if args.blocks and world == 1:
        bkv = args.blocks_kv_heads or args.kv_heads
        bcases = [Shape("bshd", seqlen=S, h=args.heads, h_kv=h, d=args.dim, name=f"bshd-{S // 1024}k"
                        if S >= 1024 else f"bshd-{S}") for S in args.blocks_seqlens for h in bkv]
        bcases += [Shape("thd", pack=_pack(p, args.dry_run), h=args.heads, h_kv=h, d=args.dim,
                         name=f"thd-{p}") for p in args.blocks_packs for h in bkv]
        for s in bcases:
            cp1, rec = None, {}
            if args.kernels:  # the kernels of cpscope's CP1 call on the whole problem
                cp1 = attempt(rec, "cp1_kernels", lambda: kernel_profile(cpscope_step(s, dev, dtype, None), dev))
            brows = run_blocks(s, args, ctx, cp1)
            for r in brows:
                r.setdefault("errors", {}).update(rec.get("errors", {}))
            out["blocks"].extend(brows)
            write_json(out, args.out, args.json)
    elif args.blocks:
        log.info("--blocks runs on one process only (world 1); skipped under world %d", world)
    if rank == 0:
        path = write_json(out, args.out, args.json)
        print_tables(out)
        print("wrote", path)
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
