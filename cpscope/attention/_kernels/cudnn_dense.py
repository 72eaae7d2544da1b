"""Dense (``[b, s, h, d]``) attention blocks with a window and / or a softcap on cuDNN's fused attention, through
the cuDNN frontend's Python graphs (the machinery of :mod:`.cudnn_frontend`: one handle per device, cached graphs,
the ordered execute).

Why: PyTorch's own cuDNN entry (``aten._scaled_dot_product_cudnn_attention``) has no band and no score modifier,
and flash-attention-2 (``aten._flash_attention_forward`` with ``window_size_*``) is slower than cuDNN on Hopper
(``docs/attention_kernels.md`` §2, §4). The graph takes the tensors' strides as they are (``bshd`` or an ``sbhd``
view, GQA with fewer k/v heads, a v head dim other than q/k's), writes ``out`` in a fresh ``[b, s, h, d_v]`` tensor
and the log-sum-exp as ``[b, h, s]`` fp32, and its backward takes the **given** (merged) ``out`` and ``lse``.

Bands (see :mod:`.cudnn_mods`), :func:`pieces`: leading query rows that see no key (only when
``n_q > n_k``) and leading keys that no query sees (a halo longer than the window) are left out of the kernel
(``out = 0``, ``lse = -inf``, ``dq``/``dk``/``dv = 0`` there; views, no copies), and the band of what remains is
given relative to its top-left diagonal. H200 showed cuDNN skipping the tiles outside a band whose right bound is 0
(the causal side) and those left of a left bound, but not those right of a positive right bound (a q chunk against
its own keys plus a halo before them ran as slowly as without the window; ``docs/attention_kernels.md`` §4):
so a band with a positive right bound runs as two kernels — the keys from ``right`` on with a causal band, and the
first ``right`` keys (the halo) with only a left bound for the rows that see them — merged through their log-sum-exp
(:func:`cpscope.attention._merge.merge_rows_`; dq of those rows added). A left bound with more queries than keys turns
the padding mask on (cuDNN's left bounds need ``s_q <= s_kv`` otherwise). Graphs are cached per exact shape,
strides, dtype, band, softcap and scale.

Example::

    out, lse = forward(q, k, v, scale=0.125, causal=True, window=(4095, 0), softcap=None)
    dq, dk, dv = backward(dout, q, k, v, out, lse, scale=0.125, causal=True, window=(4095, 0), softcap=None)
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional

import torch

from ..._tensor_cache import register_clear
from .._merge import merge_rows_
from .._mods import Band
from . import cudnn_frontend as fe
from .cudnn_mods import sdpa_options

__all__ = ["forward", "backward", "pieces", "clear_constants"]

_consts: dict[tuple, torch.Tensor] = {}  # small int32 device tensors (the padding mask's lengths), never written
_consts_lock = threading.Lock()


@register_clear  # cpscope.clear_caches() drops them too
def clear_constants() -> None:
    """Drop the cached length tensors of the dense graphs' padding masks (rebuilt on demand)."""
    with _consts_lock:
        _consts.clear()


def _const(values: tuple, device: torch.device) -> torch.Tensor:
    """A cached int32 ``[n, 1, 1, 1]`` device tensor holding ``values``."""
    key = (values, device)
    t = _consts.get(key)
    if t is None:
        t = torch.tensor(values, dtype=torch.int32).view(-1, 1, 1, 1).to(device)
        with _consts_lock:
            t = _consts.setdefault(key, t)
    return t


def _bhsd(t: "torch.Tensor | fe.Spec") -> tuple[list, list]:
    """cuDNN's logical ``[b, h, s, d]`` dims and strides of a ``[b, s, h, d]`` tensor (any strides, unit in d)."""
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    return [b, h, s, d], [sb, sh, ss, sd]


def _check(*named: tuple) -> None:
    for name, t in named:
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(f"cuDNN dense attention needs [b, s, h, d] tensors with unit stride in d; {name} has "
                             f"shape {tuple(t.shape)} and strides {t.stride()}")


class Piece(NamedTuple):
    """One kernel call of a dense block: query rows ``[r0, r1)``, keys ``[k0, k1)``, the band relative to the
    piece's top-left diagonal (None: every pair)."""

    r0: int
    r1: int
    k0: int
    k1: int
    band: Optional[Band]


def pieces(n_q: int, n_k: int, causal: bool, window: Any) -> list[Piece]:
    """The kernel calls of an ``n_q x n_k`` block (see the module docstring); the first covers every query row that
    sees a key, a second (if any) the same leading rows against the leading keys. Empty: no pair is seen."""
    band = Band.of(causal, window)
    if band is None:
        return [Piece(0, n_q, 0, n_k, None)] if n_q and n_k else []
    skip = band.masked_prefix(n_q, n_k)
    rows = n_q - skip
    k0 = max(0, min(n_k, n_k - rows - band.left)) if band.left != -1 else 0
    keys = n_k - k0
    if rows == 0 or keys == 0:
        return []
    tl = band.top_left(keys - rows)
    if tl.right != -1 and tl.right >= keys - 1:  # every key lies within the right bound of every row
        tl = Band(tl.left, -1)
    if tl.right in (-1, 0):
        return [Piece(skip, n_q, k0, n_k, None if tl == Band(-1, -1) else tl)]
    r = tl.right
    first = Piece(skip, n_q, k0 + r, n_k, Band(-1 if tl.left == -1 else tl.left + r, 0))
    seen = rows if tl.left == -1 else min(rows, r + tl.left)
    return [first, Piece(skip, skip + seen, k0, k0 + r, None if tl.left == -1 else Band(tl.left, -1))]


def _input(g: Any, named: dict, name: str, t: "torch.Tensor | fe.Spec", dtype: Any) -> None:
    dims, strides = _bhsd(t)
    named[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)


def _output(named: dict, name: str, gt: Any, t: "torch.Tensor | fe.Spec") -> None:
    dims, strides = _bhsd(t)
    gt.set_output(True).set_dim(dims).set_stride(strides)
    named[name] = gt


def _options(cudnn: Any, g: Any, named: dict, band, softcap, rows: int, keys: int, b: int, dev, backward: bool):
    """``(sdpa options, host tensors to bind, device tensors to bind)`` of one piece; declares the latter in
    ``named``: the padding mask's lengths where a left bound meets more queries than keys."""
    extras = {}
    if band is not None and band.left != -1 and softcap is None and rows > keys:
        extras = {"seq_q": _const((rows,) * b, dev), "seq_k": _const((keys,) * b, dev)}
    for n, t in extras.items():
        named[n] = g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=cudnn.data_type.INT32)
    lens = (named["seq_q"], named["seq_k"]) if extras else None
    opts, fixed = sdpa_options(cudnn, g, named, band, softcap, True, lens, backward=backward)
    return opts, fixed, extras


def _run_forward(q, k, v, out, stats, band, softcap, scale) -> None:
    """One piece's kernel: writes ``out`` (``[b, s, h, d_v]`` view) and ``stats`` (``[b, h, s, 1]`` view)."""
    cudnn, dev = fe.module(), q.device
    b, rows, h, _ = q.shape
    key = ("dense-fwd", b, rows, k.shape[1], h, k.shape[2], q.shape[3], v.shape[3], q.stride(), k.stride(),
           v.stride(), out.stride(), stats.stride(), q.dtype, band, softcap, float(scale), dev)
    dtype, keys = q.dtype, k.shape[1]
    spec = {n: fe.Spec.of(t) for n, t in (("q", q), ("k", k), ("v", v), ("o", out), ("stats", stats))}

    def build() -> Any:  # reads shapes only (fe.Spec): a build holds no tensor of the call (see fe.cached)
        g = fe.new_graph(cudnn, dtype, dev)
        io, named = fe.io_type(cudnn, dtype), {}
        for name in ("q", "k", "v"):
            _input(g, named, name, spec[name], io)
        opts, fixed, ex = _options(cudnn, g, named, band, softcap, rows, keys, b, dev, backward=False)
        o, st = g.sdpa(name="sdpa", q=named["q"], k=named["k"], v=named["v"], generate_stats=True,
                       attn_scale=float(scale), **opts)
        _output(named, "o", o, spec["o"])
        st.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(list(spec["stats"].shape)).set_stride(
            list(spec["stats"].stride()))
        named["stats"] = st
        built = fe.finish(cudnn, g, named, fixed)
        built.extras = dict(ex)
        return built

    built = fe.cached(key, build, dev)
    built.run(dev, {"q": q, "k": k, "v": v, "o": out, "stats": stats, **built.extras})


def _run_backward(dout, q, k, v, out, stats, dq, dk, dv, band, softcap, scale) -> None:
    """One piece's backward kernel: writes the ``dq``/``dk``/``dv`` views given the merged ``out`` / ``stats``."""
    cudnn, dev = fe.module(), q.device
    b, rows, h, _ = q.shape
    key = ("dense-bwd", b, rows, k.shape[1], h, k.shape[2], q.shape[3], v.shape[3], q.stride(), k.stride(),
           v.stride(), out.stride(), dout.stride(), stats.stride(), dq.stride(), dk.stride(), q.dtype, band,
           softcap, float(scale), dev)

    dtype, keys = q.dtype, k.shape[1]
    spec = {n: fe.Spec.of(t) for n, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("stats", stats),
                                          ("dq", dq), ("dk", dk), ("dv", dv))}

    def build() -> Any:  # reads shapes only (fe.Spec): a build holds no tensor of the call (see fe.cached)
        g = fe.new_graph(cudnn, dtype, dev)
        io, named = fe.io_type(cudnn, dtype), {}
        for name in ("q", "k", "v", "o", "do"):
            _input(g, named, name, spec[name], io)
        named["stats"] = g.tensor(name="stats", dim=list(spec["stats"].shape), stride=list(spec["stats"].stride()),
                                  data_type=cudnn.data_type.FLOAT)
        opts, fixed, ex = _options(cudnn, g, named, band, softcap, rows, keys, b, dev, backward=True)
        gq, gk, gv = g.sdpa_backward(name="sdpa_backward", q=named["q"], k=named["k"], v=named["v"],
                                     o=named["o"], dO=named["do"], stats=named["stats"], attn_scale=float(scale),
                                     **opts)
        for name, gt in (("dq", gq), ("dk", gk), ("dv", gv)):
            _output(named, name, gt, spec[name])
        built = fe.finish(cudnn, g, named, fixed)
        built.extras = dict(ex)
        return built

    built = fe.cached(key, build, dev)
    built.run(dev, {"q": q, "k": k, "v": v, "o": out, "do": dout, "stats": stats, "dq": dq, "dk": dk, "dv": dv,
                    **built.extras})


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
            window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One dense block: ``(out [b, s_q, h, d_v] contiguous, lse [b, h, s_q] fp32)``; rows that see no key give
    ``out = 0`` and ``lse = -inf``."""
    _check(("q", q), ("k", k), ("v", v))
    fe.io_type(fe.module(), q.dtype)  # the caller's error, raised before any graph is built
    softcap = None if softcap is None else float(softcap)
    b, n_q, h, _ = q.shape
    out = torch.zeros((b, n_q, h, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, n_q), float("-inf"), dtype=torch.float32, device=q.device)
    for i, p in enumerate(pieces(n_q, k.shape[1], causal, window)):
        qs, ks, vs = q[:, p.r0:p.r1], k[:, p.k0:p.k1], v[:, p.k0:p.k1]
        if i == 0:
            _run_forward(qs, ks, vs, out[:, p.r0:p.r1], lse[:, :, p.r0:p.r1].unsqueeze(-1), p.band, softcap, scale)
            continue
        o2 = torch.empty((b, p.r1 - p.r0, h, v.shape[3]), dtype=q.dtype, device=q.device)
        l2 = torch.empty((b, h, p.r1 - p.r0), dtype=torch.float32, device=q.device)
        _run_forward(qs, ks, vs, o2, l2.unsqueeze(-1), p.band, softcap, scale)
        merge_rows_(out, lse, o2, l2, rows=(p.r0, p.r1 - p.r0))
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, *, scale: float, causal: bool, window: Optional[tuple[int, int]] = None,
             softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one dense block given the merged ``out`` and ``lse`` ([b, h, s_q] fp32) of its queries;
    ``dq``/``dk``/``dv`` contiguous ``[b, s, h, d]``."""
    _check(("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
    fe.io_type(fe.module(), q.dtype)
    softcap = None if softcap is None else float(softcap)
    dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    stats = lse.float().unsqueeze(-1)
    if Band.of(causal, window) is not None:  # a row with no key anywhere (lse -inf): exp(s - inf) = 0
        stats = stats.masked_fill(stats == float("-inf"), float("inf"))
    for i, p in enumerate(pieces(q.shape[1], k.shape[1], causal, window)):
        rs, ksl = slice(p.r0, p.r1), slice(p.k0, p.k1)
        dqs = dq[:, rs] if i == 0 else torch.empty_like(q[:, rs], memory_format=torch.contiguous_format)
        _run_backward(dout[:, rs], q[:, rs], k[:, ksl], v[:, ksl], out[:, rs], stats[:, :, rs], dqs, dk[:, ksl],
                      dv[:, ksl], p.band, softcap, scale)
        if i:
            dq[:, rs] += dqs
    return dq, dk, dv
