"""Packed (``thd``) attention blocks on cuDNN's fused flash attention, through the cuDNN frontend's Python graphs.

Why: on Hopper, cuDNN's ragged SDPA kernels run a packed causal block faster than the flash-attention-2 varlen
kernels bundled with PyTorch, and PyTorch's own entry (``aten._cudnn_attention_forward`` with ``cum_seq``) rebuilds
its cuDNN graph on every call, so cpscope builds the graphs itself and caches them (figures:
``docs/attention_kernels.md`` §3, §13).

Layout (cuDNN "ragged" tensors): a packed contiguous ``[t, h, d]`` tensor (views are copied first) is described
as logical ``[B, h, S, d]`` with strides ``[-, d, h * d, 1]`` plus a *ragged offset* ``[B + 1]`` (int64, elements) giving where sequence
``b`` starts: ``cu[b] * stride_t``. Sequence lengths go in as ``[B, 1, 1, 1]`` int32 with the padding mask on.
The softmax statistics (log-sum-exp, fp32) are ragged too, token-major ``[t, h]`` (offset ``cu * h``); the ring
keeps lse as ``[h, t]``, so they are transposed on the way out and in (``h * t * 4`` bytes).

Causal blocks and windows (``window=(left, right)``, relative to each sequence's bottom-right-aligned diagonal, as
in flash-attention) use cuDNN's diagonal band: top-left aligned when every sequence has as many queries as keys
(the two alignments coincide), else bottom-right (per sequence, through the sequence lengths). A softcap turns the
band and the padding mask into a score modifier (:mod:`.cudnn_mods`). Query rows that see no key
(a sequence with more queries than keys) come out as ``out = 0``, ``lse = -inf``.

Graph cache: one graph per (direction, B, S buckets, heads, head dims, strides, dtype, band, softcap, scale, device);
``S`` (longest sequence), the backward's total-token bound and the number of sequences (padded with empty ones)
are rounded up to powers of two so that microbatches of similar shape share graphs. A forward + backward pair is
built once; a cached call adds little host time (``docs/attention_kernels.md`` §3).

With the policy's :attr:`~cpscope.attention.KernelPolicy.defer_builds`, a new key is built only when it
comes a second time (:mod:`.deferral`; the router runs the first block elsewhere).

The number of sequences is rounded up with empty ones where the policy says so
(:attr:`~cpscope.attention.KernelPolicy.bucket_batch`). The frontend machinery (handles, the graph
cache, building, executing) is :mod:`.cudnn_frontend`'s; the router (:mod:`.router`) decides which blocks come here.

Example::

    from cpscope.attention._kernels import cudnn_frontend, cudnn_thd
    if cudnn_frontend.available(q.device):
        out, lse = cudnn_thd.forward(q, k, v, vl, scale=d ** -0.5, causal=True)   # lse [h, t] fp32
        dq, dk, dv = cudnn_thd.backward(dout, q, k, v, out, lse, vl, scale=d ** -0.5, causal=True)
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .._mods import Band
from . import cudnn_frontend as fe, deferral
from .cudnn_mods import sdpa_options
from .._policy import kernel_policy

__all__ = ["forward", "backward"]


def _meta(vl: Any, device: torch.device) -> dict:
    """What the graphs need of one packing, kept on the :class:`~cpscope.attention._kernels.block.Varlen` itself (so it
    lives as long as the pack): host offsets (bucketed), sequence lengths ``[B,1,1,1]`` int32, offsets ``cu`` int64,
    scaled offsets by (role, multiplier), whether every sequence has as many queries as keys, and what bands derive
    from the packing (``derived``: score-modifier bounds, rows that see no key)."""
    bucket = kernel_policy().bucket_batch
    key = ("cudnn", device, bucket)
    meta = vl.memo.get(key)
    if meta is not None:
        return meta
    hq, hk = _host_cu(vl)
    if len(hq) != len(hk):
        raise ValueError(f"q and k/v pack different numbers of sequences: {len(hq) - 1} vs {len(hk) - 1}")
    square = all(b - a == e - c for a, b, c, e in zip(hq[:-1], hq[1:], hk[:-1], hk[1:]))
    if bucket:
        hq, hk = _pad_batch(hq), _pad_batch(hk)
    cq = torch.tensor(hq, dtype=torch.int64)
    ck = torch.tensor(hk, dtype=torch.int64)
    meta = {
        "host_q": hq, "host_k": hk, "square": square, "scaled": {}, "derived": {},
        "seq_q": (cq[1:] - cq[:-1]).to(torch.int32).view(-1, 1, 1, 1).to(device),
        "seq_k": (ck[1:] - ck[:-1]).to(torch.int32).view(-1, 1, 1, 1).to(device),
        "cu_q": cq.view(-1, 1, 1, 1).to(device), "cu_k": ck.view(-1, 1, 1, 1).to(device),
    }
    return vl.memo.setdefault(key, meta)


def _offsets(meta: dict, which: str, mult: int) -> torch.Tensor:
    """Ragged offset tensor ``cu * mult`` (int64 [B+1,1,1,1]) for ``which`` in {"q", "k"}; cached in ``meta``."""
    t = meta["scaled"].get((which, mult))
    if t is None:
        t = meta["scaled"].setdefault((which, mult), meta["cu_" + which] * mult)
    return t


def _host_cu(vl: Any) -> tuple[tuple, tuple]:
    hq, hk = getattr(vl, "cu_q_host", None), getattr(vl, "cu_k_host", None)
    if hq is None:
        hq = tuple(int(x) for x in vl.cu_q.tolist())  # one host sync; RingPlan passes host offsets to avoid it
    if hk is None:
        hk = hq if vl.cu_k is vl.cu_q else tuple(int(x) for x in vl.cu_k.tolist())
    return hq, hk


def _packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a packed contiguous ``[t, h, d]`` tensor (a copy only if it is a view such as a head slice: cuDNN's
    ragged kernels assume packed rows — a head-sliced view faulted with an illegal instruction on H200)."""
    return t if t.is_contiguous() else t.contiguous()


def _stride(t: torch.Tensor) -> tuple:
    """The strides of :func:`_packed` ``(t)``, without the copy (graph keys are made before anything is copied)."""
    if t.is_contiguous():
        return t.stride()
    _, h, d = t.shape
    return (h * d, d, 1)


def _pad_batch(cu: tuple) -> tuple:
    """``cu`` extended with empty sequences to a power-of-two count (see the policy's ``bucket_batch``)."""
    n = len(cu) - 1
    return cu + (cu[-1],) * (fe.pow2(n, 1) - n)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"cuDNN packed attention needs [t, h, d] tensors with unit stride in d; {name} has "
                             f"shape {tuple(t.shape)} and strides {t.stride()}")


def _lens(meta: dict) -> list[tuple[int, int]]:
    hq, hk = meta["host_q"], meta["host_k"]
    return [(b - a, e - c) for a, b, c, e in zip(hq[:-1], hq[1:], hk[:-1], hk[1:])]


def _band_extras(meta: dict, band: Optional[Band], softcap: Optional[float], device: torch.device) -> dict:
    """What a score modifier reads per sequence, as fp32 ``[B, 1, 1, 1]`` (see
    :class:`~.cudnn_mods.ScoreMod`): the lengths (``seq_qf``/``seq_kf``) and, for a band that is
    not the square causal one, its bounds (``wl``/``hi``); empty without a softcap."""
    if softcap is None:
        return {}
    key = ("score_mod", band)
    got = meta["derived"].get(key)
    if got is None:
        lens = _lens(meta)
        cols = {"seq_qf": [lq for lq, _ in lens], "seq_kf": [lk for _, lk in lens]}
        if band is not None and not (meta["square"] and band == Band(-1, 0)):
            lo, hi = zip(*(band.bounds(lq, lk) for lq, lk in lens))
            cols.update(wl=[1 - x for x in lo], hi=list(hi))
        got = {n: torch.tensor(x, dtype=torch.float32).view(-1, 1, 1, 1).to(device) for n, x in cols.items()}
        got = meta["derived"].setdefault(key, got)
    return got


def _masked_rows(meta: dict, band: Optional[Band], device: torch.device) -> Optional[torch.Tensor]:
    """Packed indices of the query rows that see no key (sequences with more queries than keys), or None."""
    if band is None or meta["square"] or band.right == -1:
        return None
    key = ("masked", band)
    if key not in meta["derived"]:
        rows = [i for (lq, lk), a in zip(_lens(meta), meta["host_q"]) for i in range(a, a + band.masked_prefix(lq, lk))]
        meta["derived"][key] = torch.tensor(rows, dtype=torch.long, device=device) if rows else None
    return meta["derived"][key]


def _options(cudnn: Any, g: Any, named: dict, b: int, square: bool, band: Optional[Band], softcap: Optional[float],
             extras: tuple, backward: bool) -> tuple[dict, dict]:
    """The sdpa options of a packed block of ``b`` sequences (padding mask or score modifier, band) and the host
    tensors to bind; declares the ``extras`` (names of :func:`_band_extras`' columns) in ``named``."""
    for n in extras:
        named[n] = fe.column(g, b, cudnn.data_type.FLOAT, n)
    bounds = (named["wl"], named["hi"]) if "wl" in extras else None
    mask_lens = (named["seq_qf"], named["seq_kf"]) if "seq_qf" in extras else None
    return sdpa_options(cudnn, g, named, band, softcap, square, lens=(named["seq_q"], named["seq_k"]),
                              bounds=bounds, backward=backward, mask_lens=mask_lens)


def _dims(t: "torch.Tensor | fe.Spec", b: int, s: int) -> tuple[list, list]:
    """Logical [B, h, S, d] dims and strides of a packed [t, h, d] tensor (batch stride unused with ragged offsets)."""
    st, sh, sd = t.stride()
    return [b, t.shape[1], s, t.shape[2]], [s * st, sh, st, sd]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vl: Any, *, scale: float, causal: bool,
            window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None, defer: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed block: ``(out [t_q, h, d_v] contiguous, lse [h, t_q] fp32)``, like the flash block; ``lse`` is a
    transposed view of cuDNN's token-major statistics (the backward reads it back without a copy). ``defer``: a
    graph not built yet whose key is new raises :class:`~.deferral.BuildDeferred` before anything is allocated
    (see :mod:`.deferral`)."""
    cudnn = fe.module()
    dev = q.device
    meta = _meta(vl, dev)
    _check(q, k, v)
    fe.io_type(cudnn, q.dtype)  # a dtype cuDNN cannot take is the caller's error, raised before any graph is built
    band, softcap = Band.of(causal, window), None if softcap is None else float(softcap)
    b = len(meta["host_q"]) - 1
    s_q, s_k = fe.pow2(vl.max_q), fe.pow2(vl.max_k)
    t_q, h, d = q.shape
    key = ("fwd", b, s_q, s_k, h, k.shape[1], d, v.shape[2], _stride(q), _stride(k), _stride(v), q.dtype, band,
           softcap, meta["square"], float(scale), dev)
    if defer:
        deferral.check(key)
    q, k, v = _packed(q), _packed(k), _packed(v)
    out = torch.empty((t_q, h, v.shape[2]), dtype=q.dtype, device=dev)
    stats = torch.empty((t_q, h), dtype=torch.float32, device=dev)
    extras = _band_extras(meta, band, softcap, dev)

    dtype, sq, sk, sv, so = q.dtype, *(fe.Spec.of(t) for t in (q, k, v, out))
    square, names = meta["square"], tuple(extras)

    def build() -> fe.Built:  # reads shapes only (fe.Spec): a build holds no tensor of the call (see fe.cached)
        g = fe.new_graph(cudnn, dtype, dev)
        i64, i32, io = cudnn.data_type.INT64, cudnn.data_type.INT32, fe.io_type(cudnn, dtype)
        named = {n: fe.column(g, b + 1, i64, n) for n in ("off_q", "off_k", "off_v", "off_o", "off_s")}
        named["seq_q"] = fe.column(g, b, i32, "seq_q")
        named["seq_k"] = fe.column(g, b, i32, "seq_k")
        named["q"] = fe.tensor(g, *_dims(sq, b, s_q), io, named["off_q"], "q")
        named["k"] = fe.tensor(g, *_dims(sk, b, s_k), io, named["off_k"], "k")
        named["v"] = fe.tensor(g, *_dims(sv, b, s_k), io, named["off_v"], "v")
        opts, fixed = _options(cudnn, g, named, b, square, band, softcap, names, backward=False)
        o, st = g.sdpa(name="sdpa", q=named["q"], k=named["k"], v=named["v"], generate_stats=True,
                       attn_scale=float(scale), **opts)
        o.set_output(True).set_dim(_dims(so, b, s_q)[0]).set_stride(_dims(so, b, s_q)[1])
        o.set_ragged_offset(named["off_o"])
        st.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim([b, h, s_q, 1]).set_stride(
            [s_q * h, 1, h, 1])
        st.set_ragged_offset(named["off_s"])
        named["o"], named["stats"] = o, st
        return fe.finish(cudnn, g, named, fixed)

    built = fe.cached(key, build, dev)
    built.run(dev, {
        "q": q, "k": k, "v": v, "o": out, "stats": stats, "seq_q": meta["seq_q"], "seq_k": meta["seq_k"],
        "off_q": _offsets(meta, "q", q.stride(0)), "off_k": _offsets(meta, "k", k.stride(0)),
        "off_v": _offsets(meta, "k", v.stride(0)), "off_o": _offsets(meta, "q", out.stride(0)),
        "off_s": _offsets(meta, "q", h), **extras,
    })
    masked = _masked_rows(meta, band, dev)
    if masked is not None:  # rows that see no key: whatever the kernel left there becomes out 0, lse -inf
        out.index_fill_(0, masked, 0.0)
        stats.index_fill_(0, masked, float("-inf"))
    return out, stats.t()  # [h, t] as a view of the token-major statistics: no transpose kernel (host time)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, vl: Any, *, scale: float, causal: bool, window: Optional[tuple[int, int]] = None,
             softcap: Optional[float] = None, defer: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one packed block given the merged ``out`` and ``lse`` ([h, t_q] fp32: cuDNN's forward view or a
    contiguous one, e.g. flash's); contiguous results. ``defer`` as :func:`forward`'s."""
    cudnn = fe.module()
    dev = q.device
    meta = _meta(vl, dev)
    _check(q, k, v)
    _check(dout, out, out)
    fe.io_type(cudnn, q.dtype)
    band, softcap = Band.of(causal, window), None if softcap is None else float(softcap)
    b = len(meta["host_q"]) - 1
    s_q, s_k = fe.pow2(vl.max_q), fe.pow2(vl.max_k)
    t_q, h, d = q.shape
    t_k = k.shape[0]
    key = ("bwd", b, s_q, s_k, fe.pow2(t_q), fe.pow2(t_k), h, k.shape[1], d, v.shape[2], _stride(q), _stride(k),
           _stride(v), _stride(out), _stride(dout), q.dtype, band, softcap, meta["square"], float(scale), dev)
    if defer:
        deferral.check(key)
    q, k, v, out, dout = (_packed(x) for x in (q, k, v, out, dout))
    stats = lse.t().contiguous()  # [t, h] token-major, as the forward wrote it (a no-op for the forward's view)
    if band is not None:  # a row with no key anywhere (lse -inf) gets no gradient: exp(s - inf) = 0
        stats = stats.masked_fill(stats == float("-inf"), float("inf"))
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=dev) for x in (q, k, v))
    extras = _band_extras(meta, band, softcap, dev)
    dtype, square, names = q.dtype, meta["square"], tuple(extras)
    spec = {n: fe.Spec.of(t) for n, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq),
                                          ("dk", dk), ("dv", dv))}

    def build() -> fe.Built:  # reads shapes only (fe.Spec): a build holds no tensor of the call (see fe.cached)
        g = fe.new_graph(cudnn, dtype, dev)
        i64, i32, io = cudnn.data_type.INT64, cudnn.data_type.INT32, fe.io_type(cudnn, dtype)
        roles = ("off_q", "off_k", "off_v", "off_o", "off_do", "off_dq", "off_dk", "off_dv", "off_s")
        named = {n: fe.column(g, b + 1, i64, n) for n in roles}
        named["seq_q"] = fe.column(g, b, i32, "seq_q")
        named["seq_k"] = fe.column(g, b, i32, "seq_k")
        for name, s in (("q", s_q), ("k", s_k), ("v", s_k), ("o", s_q), ("do", s_q)):
            t = spec[name]
            named[name] = fe.tensor(g, *_dims(t, b, s), io, named["off_" + name], name)
        named["stats"] = fe.tensor(g, [b, h, s_q, 1], [s_q * h, 1, h, 1], cudnn.data_type.FLOAT,
                                 named["off_s"], "stats")
        opts, fixed = _options(cudnn, g, named, b, square, band, softcap, names, backward=True)
        gq, gk, gv = g.sdpa_backward(
            name="sdpa_backward", q=named["q"], k=named["k"], v=named["v"], o=named["o"], dO=named["do"],
            stats=named["stats"], attn_scale=float(scale), max_total_seq_len_q=fe.pow2(t_q),
            max_total_seq_len_kv=fe.pow2(t_k), **opts)
        for name, gt, s in (("dq", gq, s_q), ("dk", gk, s_k), ("dv", gv, s_k)):
            dims, strides = _dims(spec[name], b, s)
            gt.set_output(True).set_dim(dims).set_stride(strides)
            gt.set_ragged_offset(named["off_" + name])
            named[name] = gt
        return fe.finish(cudnn, g, named, fixed)

    built = fe.cached(key, build, dev)
    off = functools.partial(_offsets, meta)
    built.run(dev, {
        "q": q, "k": k, "v": v, "o": out, "do": dout, "stats": stats, "dq": dq, "dk": dk, "dv": dv,
        "seq_q": meta["seq_q"], "seq_k": meta["seq_k"],
        "off_q": off("q", q.stride(0)), "off_k": off("k", k.stride(0)), "off_v": off("k", v.stride(0)),
        "off_o": off("q", out.stride(0)), "off_do": off("q", dout.stride(0)), "off_dq": off("q", dq.stride(0)),
        "off_dk": off("k", dk.stride(0)), "off_dv": off("k", dv.stride(0)), "off_s": off("q", h), **extras,
    })
    return dq, dk, dv
