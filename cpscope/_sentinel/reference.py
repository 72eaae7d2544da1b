"""The sentinel's independent attention reference: plain masked softmax attention, forward and backward by hand.

Nothing here shares code with the ring (``cpscope.attention``): the reference is the textbook formula, evaluated for
a set of query rows against the keys of their documents in the packed global stream, in a wide dtype (float64 on
CPU, float32 on CUDA), document by document and chunked over query rows so that memory stays bounded
(``[heads, chunk, L]`` scores at a time for a document of length ``L``).

Canonical layout: every layout is seen as a packed stream of documents. ``thd`` is that already; ``bshd`` /
``sbhd`` with ``b`` rows of local length ``s`` under CP size ``cp`` is ``b`` documents of global length ``s·cp``
(``cu = 0, g, 2g, …``), which is exactly how the zigzag layout cuts them.

Backward (for rows ``i``, keys ``j``, ``P = softmax(scale·qKᵀ)`` masked, ``O = PV``)::

    dV_j = Σ_i P_ij dO_i            dP_ij = dO_i · V_j            D_i = dO_i · O_i
    dS_ij = P_ij (dP_ij − D_i)      dq_i = scale Σ_j dS_ij K_j     dK_j = scale Σ_i dS_ij q_i

Example::

    out = reference_rows(q_rows, rows, K, V, cu, causal=True, scale=0.125, dtype=torch.float64)
    out, dq, dK, dV = reference_rows(q_rows, rows, K, V, cu, causal=True, scale=0.125, dtype=torch.float64,
                                     dout=dout_rows)           # dK / dV: contributions of these rows only
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["canonical", "canonical_offsets", "segment_ids", "reference_rows", "compare", "error_floor",
           "reference_dtype", "Mods", "visible_keys"]

# Scores held at once by the reference: heads × rows × keys elements (≈ 256 MiB in float64).
_CHUNK_ELEMS = 1 << 25
# Probabilities kept from the forward check for the gradient check (≈ 64 MiB in float64); larger: recomputed.
_CACHE_ELEMS = 1 << 23


def reference_dtype(device: torch.device) -> torch.dtype:
    """float64 on CPU (exact); float32 on CUDA (float64 is slow there and float32 is ~1e3× finer than bf16)."""
    return torch.float32 if device.type == "cuda" else torch.float64


def canonical(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """``[rows, heads, d]`` view (or copy) of a ``bshd`` / ``sbhd`` / ``thd`` tensor, row-major by batch row."""
    if qkv_format == "thd":
        return x
    if qkv_format == "bshd":  # [b, s, h, d] -> [b*s, h, d]
        return x.reshape(-1, *x.shape[2:])
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])  # sbhd [s, b, h, d] -> [b*s, h, d]


def canonical_offsets(qkv_format: str, shape: Sequence[int], cp: int, cu: Optional[Sequence[int]]) -> tuple[int, ...]:
    """Global offsets of the canonical packed stream: ``cu`` for ``thd``, ``0, g, 2g, …`` (``g = s·cp``) otherwise."""
    if qkv_format == "thd":
        assert cu is not None
        return tuple(int(c) for c in cu)
    b, s = (shape[0], shape[1]) if qkv_format == "bshd" else (shape[1], shape[0])
    g = s * cp
    return tuple(range(0, b * g + 1, g)) if b else (0,)


def segment_ids(cu: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[T]`` int64: the document of every token of the packed global stream (empty documents hold none)."""
    cu_t = torch.tensor(list(cu), dtype=torch.long)
    lens = cu_t[1:] - cu_t[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel()), lens).to(device)


class Mods(NamedTuple):
    """Score and mask modifiers of a call: ``window`` ``(left, right)`` (``-1`` unbounded; a query at position
    ``i`` sees keys ``i − left … i + right`` of its document), ``softcap`` (scaled scores ``c·tanh(s / c)``), ``sinks``
    ``[h]`` (one logit per head in every softmax denominator, no value)."""

    window: Optional[tuple[int, int]] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None


class Reference(NamedTuple):
    """What :func:`reference_rows` returns (the gradient fields only when ``dout`` was given)."""

    out: torch.Tensor
    score_max: float
    dq: Optional[torch.Tensor] = None
    dk: Optional[torch.Tensor] = None
    dv: Optional[torch.Tensor] = None
    terms: Optional[tuple] = None


def reference_rows(
    q: torch.Tensor,
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: Sequence[int],
    *,
    causal: bool,
    scale: float,
    dtype: torch.dtype,
    dout: Optional[torch.Tensor] = None,
    cache: Optional[dict] = None,
    real: Optional[Sequence[int]] = None,
    mods: Optional[Mods] = None,
):
    """Attention of the query rows ``q`` (``[n, h, d]`` at global indices ``rows``) over the keys ``k``/``v``.

    ``k`` / ``v`` are ``[T, h_kv, d]`` / ``[T, h_kv, dv]`` (the whole packed stream of documents ``cu``; ``v`` may
    have its own head dim, as in multi-latent attention). A key ``j`` is visible to row
    ``i`` when both lie in one document and, if ``causal``, ``j ≤ i``. ``rows`` must be grouped by document in
    document order (the zigzag local order is). Each document is computed on its own keys only.
    Returns a :class:`Reference`: ``out`` ``[n, h, dv]`` and ``score_max`` (the largest ``|scale·q·k|``); with
    ``dout`` also ``dq`` ``[n, h, d]``, the contributions of these rows to ``dk`` / ``dv`` (``[T, h_kv, d / dv]``) — sum
    them over the ranks that hold the other rows — and the magnitudes of the terms each gradient element sums
    (``terms = (dq_t, dk_t, dv_t)``, same shapes; ``Σ |term|``, with the terms of ``dP`` and ``D`` in absolute value
    too): the scale of the rounding error any implementation makes, even when the terms cancel to a tiny gradient.
    All in ``dtype``.

    ``real``: real offsets of padded documents (TE's ``cu_seqlens``): only the first ``real[i+1] − real[i]``
    tokens of document ``i`` are keys; padding rows give zero output and ``dq``, no gradient to any key.
    ``mods``: a window, softcap or sinks (:class:`Mods`; the sinks' own gradient is not computed).

    ``cache``: a dict, filled by a forward call (the probabilities of every chunk, when they take at most
    ``_CACHE_ELEMS`` elements) and emptied by the backward call that is given it, which then skips recomputing them.
    """
    n, h, d = q.shape
    t_all, h_kv, dv = k.shape[0], k.shape[1], v.shape[-1]
    g = h // h_kv
    dev = q.device
    bounds = _document_rows(cu, rows)  # rows of document i: bounds[i]:bounds[i+1]
    ends = _key_ends(cu, real)  # the keys of document i: cu[i]:ends[i]
    if real is not None and dout is not None:
        dout = dout * _real_rows(cu, ends, rows)[:, None, None].to(dout.dtype)
    qq = q.to(dtype)
    out = torch.zeros(n, h, dv, dtype=dtype, device=dev)
    score_max = 0.0
    grads = None if dout is None else _Grads(dout.to(dtype), n, t_all, h, d, dv)
    if cache is not None and dout is None:
        size = sum(h * (bounds[i + 1] - bounds[i]) * (int(cu[i + 1]) - int(cu[i])) for i in range(len(cu) - 1))
        if size > _CACHE_ELEMS:
            cache = None
    for i in range(len(cu) - 1):
        r0, r1, k0, k1 = bounds[i], bounds[i + 1], int(cu[i]), ends[i]
        if r0 == r1 or k0 == k1:
            continue
        kk = k[k0:k1].to(dtype)
        vv = v[k0:k1].to(dtype)
        if g > 1:
            kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)  # [L, h, d]
        step = max(1, _CHUNK_ELEMS // max(1, h * (k1 - k0)))
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            hit = cache.pop(a, None) if cache is not None and dout is not None else None
            if hit is not None:  # the forward's probabilities and output of this chunk
                p, o, dcap = hit
            else:
                p, o, s_max, dcap = _chunk(qq[a:b], kk, vv, rows[a:b], k0, k1, causal=causal, scale=scale,
                                           mods=mods or Mods())
                score_max = max(score_max, s_max)
                if cache is not None and dout is None:
                    cache[a] = (p, o, dcap)
            out[a:b] = o
            if grads is not None:
                grads.add(a, b, k0, k1, p, o, qq[a:b], kk, vv, scale, dcap)
    if real is not None:
        out = out * _real_rows(cu, ends, rows)[:, None, None].to(out.dtype)
    if grads is None:
        return Reference(out, score_max)
    return Reference(out, score_max, *grads.result(h_kv, g))


def _key_ends(cu: Sequence[int], real: Optional[Sequence[int]]) -> list[int]:
    """Where the keys of each document end: ``cu[i+1]``, or ``cu[i]`` plus its real length when padded."""
    if real is None:
        return [int(c) for c in cu[1:]]
    return [int(cu[i]) + int(real[i + 1]) - int(real[i]) for i in range(len(cu) - 1)]


def _real_rows(cu: Sequence[int], ends: list[int], rows: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: which of the global rows ``rows`` are real tokens (not padding)."""
    cu_t = torch.tensor(list(cu), dtype=torch.long, device=rows.device)
    doc = (torch.searchsorted(cu_t, rows, right=True) - 1).clamp(0, len(ends) - 1)
    return rows < torch.tensor(ends, dtype=torch.long, device=rows.device)[doc]


def _document_rows(cu: Sequence[int], rows: torch.Tensor) -> list[int]:
    """``bounds`` such that the rows of document ``i`` are ``rows[bounds[i]:bounds[i+1]]``."""
    dev = rows.device
    cu_t = torch.tensor(list(cu), dtype=torch.long, device=dev)
    doc = torch.searchsorted(cu_t, rows, right=True) - 1  # [n] document of each row
    if rows.numel() and bool((doc[1:] < doc[:-1]).any()):
        raise ValueError("reference_rows: rows must be grouped by document, in document order")
    return torch.searchsorted(doc, torch.arange(len(cu), device=dev)).tolist()


def _chunk(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, rows: torch.Tensor, k0: int, k1: int, *,
           causal: bool, scale: float, mods: Mods) -> tuple[torch.Tensor, torch.Tensor, float, Optional[torch.Tensor]]:
    """Probabilities ``[h, c, L]``, output ``[c, h, d]``, the largest ``|score|`` and the softcap's derivative
    (``[h, c, L]`` or ``None``) of the query rows ``q`` (at global indices ``rows``) over the keys ``k0:k1`` of their
    document (``kk`` / ``vv`` ``[L, h, d]``)."""
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale  # [h, c, L]
    s_max = float(s.abs().amax())
    dcap = None
    if mods.softcap is not None:
        s = mods.softcap * torch.tanh(s / mods.softcap)
        dcap = 1 - (s / mods.softcap) ** 2
    visible = visible_keys(rows, torch.arange(k0, k1, device=q.device), causal, mods.window)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if mods.sinks is None:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # (padding rows under a window may see no key)
    else:
        sink = mods.sinks.to(s.dtype)[:, None, None]  # [h, 1, 1]
        m = torch.maximum(s.amax(-1, keepdim=True), sink)
        e = torch.exp(s - m)
        p = e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
    return p, torch.einsum("hij,jhd->ihd", p, vv), s_max, dcap


def visible_keys(rows: torch.Tensor, keys: torch.Tensor, causal: bool,
                 window: Optional[tuple[int, int]]) -> Optional[torch.Tensor]:
    """``[len(rows), len(keys)]`` bool: which keys of one document each row sees (causal, window), or ``None``."""
    vis = None
    if causal:
        vis = keys[None, :] <= rows[:, None]
    if window is not None:
        left, right = window
        for bound, ok in ((left, lambda: rows[:, None] - keys[None, :] <= left),
                          (right, lambda: keys[None, :] - rows[:, None] <= right)):
            if bound is not None and bound >= 0:
                vis = ok() if vis is None else vis & ok()
    return vis


class _Grads:
    """The reference's gradient accumulators and the magnitudes of their terms (see :func:`reference_rows`)."""

    def __init__(self, dout: torch.Tensor, n: int, t_all: int, h: int, d: int, dv: int) -> None:
        self.dout = dout  # [n, h, dv]
        self.dq = torch.zeros(n, h, d, dtype=dout.dtype, device=dout.device)
        self.dk = torch.zeros(t_all, h, d, dtype=dout.dtype, device=dout.device)
        self.dv = torch.zeros(t_all, h, dv, dtype=dout.dtype, device=dout.device)
        self.dq_t, self.dk_t, self.dv_t = torch.zeros_like(self.dq), torch.zeros_like(self.dk), torch.zeros_like(self.dv)

    def add(self, a: int, b: int, k0: int, k1: int, p: torch.Tensor, o: torch.Tensor, q: torch.Tensor,
            kk: torch.Tensor, vv: torch.Tensor, scale: float, dcap: Optional[torch.Tensor] = None) -> None:
        """Rows ``a:b`` (queries ``q``, probabilities ``p``, output ``o``) over the keys ``k0:k1``; ``dcap``: the
        softcap's derivative, applied to the scores' gradient."""
        do = self.dout[a:b]  # [c, h, d]
        dp = torch.einsum("ihd,jhd->hij", do, vv)
        delta = (do * o).sum(-1).transpose(0, 1)[:, :, None]  # [h, c, 1]
        ds = p * (dp - delta)
        if dcap is not None:
            ds = ds * dcap
        self.dq[a:b] = torch.einsum("hij,jhd->ihd", ds, kk) * scale
        self.dk[k0:k1] += torch.einsum("hij,ihd->jhd", ds, q) * scale
        self.dv[k0:k1] += torch.einsum("hij,ihd->jhd", p, do)
        dp_abs = torch.einsum("ihd,jhd->hij", do.abs(), vv.abs())  # Σ_d |dO_id V_jd| ≥ |dP_ij|
        delta_abs = (do * o).abs().sum(-1).transpose(0, 1)[:, :, None]  # Σ_d |dO_id O_id| ≥ |D_i|
        ds_abs = p * (dp_abs + delta_abs) * (1.0 if dcap is None else dcap)
        self.dq_t[a:b] = torch.einsum("hij,jhd->ihd", ds_abs, kk.abs()) * scale
        self.dk_t[k0:k1] += torch.einsum("hij,ihd->jhd", ds_abs, q.abs()) * scale
        self.dv_t[k0:k1] += torch.einsum("hij,ihd->jhd", p, do.abs())

    def result(self, h_kv: int, g: int) -> tuple:
        """``(dq, dk, dv, (dq_t, dk_t, dv_t))``, the q heads of one k/v head summed into it."""
        dk, dv, dk_t, dv_t = self.dk, self.dv, self.dk_t, self.dv_t
        if g > 1:  # the q heads of one group share a kv head: sum their contributions
            dk, dv, dk_t, dv_t = (x.view(x.shape[0], h_kv, g, x.shape[-1]).sum(2) for x in (dk, dv, dk_t, dv_t))
        return self.dq, dk, dv, (self.dq_t, dk_t, dv_t)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def error_floor(dtype: torch.dtype, longest: int, score_max: float) -> float:
    """Rounding error per unit of term magnitude that a correct implementation may make with ``dtype`` inputs over
    documents of up to ``longest`` tokens with scores up to ``score_max``: the inputs' own rounding (e.g.
    ``D = rowsum(dO∘O)`` from a rounded ``O``), plus what fp32 (fp64 for fp64 inputs) arithmetic loses — sums over
    a document, and ``exp(s − lse)``, whose relative error grows with the size of the scores (large logits, as in
    a model whose q·k has grown): ``2·u(dtype) + (128 + 16·√longest + 16·score_max)·u(compute)``.
    (docs/sentinel.md lists the worst error / tolerance measured on correct runs.)"""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    growth = 128 + 16 * math.sqrt(max(1, longest)) + 16 * score_max
    return 2 * unit_roundoff(dtype) + growth * unit_roundoff(compute)


def compare(got: torch.Tensor, ref: torch.Tensor, *, rtol: float, atol: float,
            terms: "torch.Tensor | float | None" = None) -> dict[str, float]:
    """Compare ``got`` with ``ref`` elementwise against ``tol = rtol·max|ref| + atol·terms``.

    Returns ``ratio`` (max of ``|got − ref| / tol``: > 1 is a mismatch; NaN counts as inf), and at the worst element
    ``abs_error`` and ``tolerance``, plus ``max_error`` = ``max |got − ref| / max |ref|`` and ``ref_max``.
    """
    if not ref.numel():
        return {"ratio": 0.0, "abs_error": 0.0, "tolerance": 0.0, "max_error": 0.0, "ref_max": 0.0}
    diff = (got.to(ref.dtype) - ref).abs()
    ref_max = ref.abs().max()
    tol = rtol * ref_max
    if terms is not None:
        tol = tol + atol * (terms if isinstance(terms, float) else terms.to(ref.dtype))
    tol = torch.as_tensor(tol, dtype=ref.dtype, device=ref.device).expand_as(diff)
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / tol)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, float("inf")), ratio)
    worst = int(ratio.reshape(-1).argmax())
    rm = float(ref_max)
    err_max = float(diff.max())
    return {
        "ratio": float(ratio.reshape(-1)[worst]),
        "abs_error": float(diff.reshape(-1)[worst]),
        "tolerance": float(tol.reshape(-1)[worst]),
        "max_error": (err_max / rm if rm > 0 else (0.0 if err_max == 0 else float("inf"))) if err_max == err_max
        else float("inf"),
        "ref_max": rm,
    }
