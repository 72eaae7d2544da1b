"""Dense (``[b, s, h, d]``) attention blocks with a window and / or a softcap on cuDNN's fused attention, through
the cuDNN frontend's Python graphs (the machinery of :mod:`cpscope.attention._cudnn_thd`: one handle per device,
cached graphs, the ordered execute).

Why: PyTorch's own cuDNN entry (``aten._scaled_dot_product_cudnn_attention``) has no band and no score modifier,
and flash-attention-2 (``aten._flash_attention_forward`` with ``window_size_*``) runs ~1.7x slower than cuDNN on
Hopper. The graph takes the tensors' strides as they are (``bshd`` or an ``sbhd`` view, GQA with fewer k/v heads, a
v head dim other than q/k's), writes ``out`` in a fresh ``[b, s, h, d_v]`` tensor and the log-sum-exp as
``[b, h, s]`` fp32, and its backward takes the **given** (merged) ``out`` and ``lse``.

Bands (see :mod:`cpscope.attention._cudnn_mods`): leading query rows that see no key (only when ``n_q > n_k``) and
leading keys that no query sees (a halo longer than the window) are left out of the kernel (``out = 0``,
``lse = -inf``, ``dq``/``dk``/``dv = 0`` there; views, no copies); the band of what remains is given relative to its
top-left diagonal, the alignment on which H200 showed cuDNN skipping the tiles outside a window; a left bound with
still more queries than keys turns the padding mask on (cuDNN's left bounds need ``s_q <= s_kv`` otherwise). Graphs
are cached per exact shape, strides, dtype, band, softcap and scale.

Example::

    out, lse = forward(q, k, v, scale=0.125, causal=True, window=(4095, 0), softcap=None)
    dq, dk, dv = backward(dout, q, k, v, out, lse, scale=0.125, causal=True, window=(4095, 0), softcap=None)
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import _cudnn_mods as _mods
from . import _cudnn_thd as _thd

__all__ = ["forward", "backward"]

_consts: dict[tuple, torch.Tensor] = {}  # small int32 device tensors (the padding mask's lengths), never written


def _const(values: tuple, device: torch.device) -> torch.Tensor:
    """A cached int32 ``[n, 1, 1, 1]`` device tensor holding ``values``."""
    key = (values, device)
    t = _consts.get(key)
    if t is None:
        t = _consts.setdefault(key, torch.tensor(values, dtype=torch.int32).view(-1, 1, 1, 1).to(device))
    return t


def _bhsd(t: torch.Tensor) -> tuple[list, list]:
    """cuDNN's logical ``[b, h, s, d]`` dims and strides of a ``[b, s, h, d]`` tensor (any strides, unit in d)."""
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    return [b, h, s, d], [sb, sh, ss, sd]


def _check(*named: tuple) -> None:
    for name, t in named:
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(f"cuDNN dense attention needs [b, s, h, d] tensors with unit stride in d; {name} has "
                             f"shape {tuple(t.shape)} and strides {t.stride()}")


class _Plan:
    """What a dense block runs: the query rows and keys in the kernel (leading rows that see no key and leading keys
    that no query sees are left out: both are views), and the band relative to the kernel block's top-left diagonal
    (one set of bounds for every batch row, cuDNN's best-supported alignment)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, causal: bool, window: Any, softcap: Optional[float]) -> None:
        self.n_q, self.n_k = q.shape[1], k.shape[1]
        band = _mods.band_of(causal, window)
        self.softcap = None if softcap is None else float(softcap)
        self.skip = band.masked_prefix(self.n_q, self.n_k) if band is not None else 0
        self.rows = self.n_q - self.skip
        shift = self.n_k - self.rows
        self.k0 = max(0, min(self.n_k, shift - band.left)) if band is not None and band.left != -1 else 0
        self.keys = self.n_k - self.k0
        self.band = band.top_left(self.keys - self.rows) if band is not None else None
        # cuDNN's left bound needs s_q <= s_kv unless the padding mask is on
        self.padded = self.band is not None and self.band.left != -1 and self.softcap is None and self.rows > self.keys

    @property
    def empty(self) -> bool:
        return self.rows == 0 or self.keys == 0

    def key(self) -> tuple:
        return (self.rows, self.keys, self.band, self.softcap, self.padded)

    def extras(self, b: int, device: torch.device) -> dict:
        """Device tensors the graph reads besides q/k/v...: the padding mask's lengths."""
        ex = {}
        if self.padded:
            ex["seq_q"], ex["seq_k"] = _const((self.rows,) * b, device), _const((self.keys,) * b, device)
        return ex

    def options(self, cudnn: Any, g: Any, named: dict, extras: dict, backward: bool) -> tuple[dict, dict]:
        """The sdpa options and the host tensors to bind; declares the graph tensors of ``extras`` in ``named``."""
        for n, t in extras.items():
            named[n] = g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=cudnn.data_type.INT32)
        lens = (named["seq_q"], named["seq_k"]) if "seq_q" in named else None
        return _mods.sdpa_options(cudnn, g, named, self.band, self.softcap, True, lens, backward=backward)


def _input(g: Any, named: dict, name: str, t: torch.Tensor, dtype: Any) -> None:
    dims, strides = _bhsd(t)
    named[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)


def _output(named: dict, name: str, gt: Any, t: torch.Tensor) -> None:
    dims, strides = _bhsd(t)
    gt.set_output(True).set_dim(dims).set_stride(strides)
    named[name] = gt


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
            window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One dense block: ``(out [b, s_q, h, d_v] contiguous, lse [b, h, s_q] fp32)``; rows that see no key give
    ``out = 0`` and ``lse = -inf``."""
    _check(("q", q), ("k", k), ("v", v))
    cudnn, dev = _thd._cudnn_module(), q.device
    plan = _Plan(q, k, causal, window, softcap)
    b, _, h, _ = q.shape
    out = torch.empty((b, plan.n_q, h, v.shape[3]), dtype=q.dtype, device=dev)
    lse = torch.empty((b, h, plan.n_q), dtype=torch.float32, device=dev)
    if plan.empty:
        return out.zero_(), lse.fill_(float("-inf"))
    if plan.skip:
        out[:, : plan.skip].zero_()
        lse[:, :, : plan.skip] = float("-inf")
    qs, ks, vs = q[:, plan.skip:], k[:, plan.k0:], v[:, plan.k0:]
    os_, stats = out[:, plan.skip:], lse[:, :, plan.skip:].unsqueeze(-1)
    extras = plan.extras(b, dev)
    key = ("dense-fwd", b, h, k.shape[2], q.shape[3], v.shape[3], qs.stride(), ks.stride(), vs.stride(),
           stats.stride(), q.dtype, plan.key(), float(scale), dev)

    def build() -> Any:
        g = _thd._new_graph(cudnn, q.dtype, dev)
        io, named = _thd._io_type(cudnn, q.dtype), {}
        for name, t in (("q", qs), ("k", ks), ("v", vs)):
            _input(g, named, name, t, io)
        opts, fixed = plan.options(cudnn, g, named, extras, backward=False)
        o, st = g.sdpa(name="sdpa", q=named["q"], k=named["k"], v=named["v"], generate_stats=True,
                       attn_scale=float(scale), **opts)
        _output(named, "o", o, os_)
        st.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(list(stats.shape)).set_stride(
            list(stats.stride()))
        named["stats"] = st
        return _thd._finish(cudnn, g, named, fixed)

    built = _thd._cached(key, build)
    built.run(dev, {"q": qs, "k": ks, "v": vs, "o": os_, "stats": stats, **extras})
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, *, scale: float, causal: bool, window: Optional[tuple[int, int]] = None,
             softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one dense block given the merged ``out`` and ``lse`` ([b, h, s_q] fp32) of its queries;
    ``dq``/``dk``/``dv`` contiguous ``[b, s, h, d]``."""
    _check(("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
    cudnn, dev = _thd._cudnn_module(), q.device
    plan = _Plan(q, k, causal, window, softcap)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=dev) for x in (q, k, v))
    if plan.empty:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if plan.skip:
        dq[:, : plan.skip].zero_()
    if plan.k0:
        dk[:, : plan.k0].zero_()
        dv[:, : plan.k0].zero_()
    sq, sk = slice(plan.skip, None), slice(plan.k0, None)
    qs, dos, os_, dqs = q[:, sq], dout[:, sq], out[:, sq], dq[:, sq]
    ks, vs, dks, dvs = k[:, sk], v[:, sk], dk[:, sk], dv[:, sk]
    stats = lse[:, :, sq].unsqueeze(-1).float()
    if plan.band is not None:  # a row with no key anywhere (lse -inf) gets no gradient: exp(s - inf) = 0
        stats = stats.masked_fill(stats == float("-inf"), float("inf"))
    extras = plan.extras(q.shape[0], dev)
    key = ("dense-bwd", q.shape[0], q.shape[2], k.shape[2], q.shape[3], v.shape[3], qs.stride(), ks.stride(),
           vs.stride(), os_.stride(), dos.stride(), stats.stride(), q.dtype, plan.key(), float(scale), dev)

    def build() -> Any:
        g = _thd._new_graph(cudnn, q.dtype, dev)
        io, named = _thd._io_type(cudnn, q.dtype), {}
        for name, t in (("q", qs), ("k", ks), ("v", vs), ("o", os_), ("do", dos)):
            _input(g, named, name, t, io)
        named["stats"] = g.tensor(name="stats", dim=list(stats.shape), stride=list(stats.stride()),
                                  data_type=cudnn.data_type.FLOAT)
        opts, fixed = plan.options(cudnn, g, named, extras, backward=True)
        gq, gk, gv = g.sdpa_backward(name="sdpa_backward", q=named["q"], k=named["k"], v=named["v"],
                                     o=named["o"], dO=named["do"], stats=named["stats"], attn_scale=float(scale),
                                     **opts)
        for name, gt, t in (("dq", gq, dqs), ("dk", gk, dks), ("dv", gv, dvs)):
            _output(named, name, gt, t)
        return _thd._finish(cudnn, g, named, fixed)

    built = _thd._cached(key, build)
    built.run(dev, {"q": qs, "k": ks, "v": vs, "o": os_, "do": dos, "stats": stats, "dq": dqs, "dk": dks,
                    "dv": dvs, **extras})
    return dq, dk, dv
