"""The attention check at scale: sampled query rows against a reference streamed over each rank's own keys.

The exact check (:mod:`.attention_numeric`) all-gathers K/V and computes every row; at long context that costs a
whole attention in float32 and the group's K/V until backward. Here, on a sampled call with more local rows than
``sentinel(rows=R)``:

1. every rank picks ``R`` of its rows (real tokens first; seeded by the step, microbatch, call and rank, so a rerun
   picks the same), and the group all-gathers those rows' queries — ``cp·R`` rows, a few hundred KiB;
2. each rank computes, in float32 / float64, the softmax statistics of all ``cp·R`` rows against **its own** keys
   only (chunks of keys, nothing kept), and one max- and one sum-all-reduce combine them (the log-sum-exp merge):
   the reference output of the sampled rows, with no K/V gathered or held;
3. in backward the same rows' ``dq`` comes the same way (their ``dO`` all-gathered, ``P`` recomputed from the
   kept log-sum-exp), and ``dk`` / ``dv``, which sum over every row, are checked through three identities that hold
   for exact attention and cost one pass over the local tensors: ``Σ_j ⟨dK_j, K_j⟩ = Σ_i ⟨dq_i, q_i⟩`` (scaling q
   and k together), ``Σ_j ⟨dV_j, V_j⟩ = Σ_i ⟨dO_i, O_i⟩`` and ``Σ_j dV_j = Σ_i dO_i`` per k/v head (softmax rows sum
   to 1), each over the group.

Extra memory: the ``cp·R`` rows' statistics and, until backward, references to the call's own q / k / v / output
(no copies: the attention keeps them anyway unless activations are recomputed). Detection power: docs/sentinel.md.

Example::

    out = sampled_numeric(tracker, call, run_call, cu, signature(call), mb.where(index))
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..attention import AttentionCall
from ..sharding import zigzag_indices
from .agree import hash64
from .attention_numeric import _SKIPPED, _Call, run_checked
from .comm import CollectiveTimeout, all_gather_list, all_reduce, collective_device
from .reference import Mods, canonical_offsets, compare, error_floor, reference_dtype, unit_roundoff, visible_keys
from .state import Tracker

__all__ = ["sampled_numeric"]

_KEYS_PER_CHUNK = 4096  # at least this many keys per streamed chunk ...
_CHUNK_ELEMENTS = 1 << 24  # ... and up to 2^24 elements a temporary ([h, cp·R, keys] scores; rows × h × d): 64 MiB
# in float32. Each chunk costs a fixed number of operations (kernel launches and host time on a GPU): few large chunks


def sampled_numeric(t: Tracker, call: AttentionCall, run: Callable[[AttentionCall], torch.Tensor],
                    cu: Optional[list], sig: tuple, where: dict) -> torch.Tensor:
    """Run ``call`` (``run``), check ``R`` sampled rows per rank, and tap its gradients when autograd is on."""
    offs = canonical_offsets(call.qkv_format, tuple(call.q.shape), call.scope.size, cu)
    return run_checked(t, call, run, _Sampled(t, call, offs, where), sig, where)


class _Sampled(_Call):
    """One sampled call checked on sampled rows (see the module docstring); the verdicts are :class:`_Call`'s."""

    def __init__(self, t: Tracker, call: AttentionCall, offs: tuple, where: dict) -> None:
        scope, fmt, q = call.scope, call.qkv_format, call.q
        dt = t.opts.reference_dtype or reference_dtype(q.device)
        keys = zigzag_indices(list(offs), scope.size, scope.rank, device=q.device)  # global index of local rows
        super().__init__(t, scope, fmt, bool(call.causal), float(call.scale), dt, keys, offs, None, None, None,
                         q.dtype, where)
        self.real = call.pack.real if call.pack is not None else None
        self.mods = Mods(call.window, call.softcap, call.sinks)
        self.keys = keys
        self.key_doc, self.key_ok = _key_layout(offs, self.real, keys)
        # the call's own tensors in their layout (no copies; rows are taken in chunks where needed)
        self.local_q, self.local_k, self.local_v = q.detach(), call.k.detach(), call.v.detach()
        self.n = int(keys.numel())
        self.sel = _pick(None if self.real is None else self.key_ok, self.n, t.opts.rows,
                         hash64((where.get("step"), where.get("microbatch"), where.get("call"), scope.rank)),
                         q.device)
        self.out_local: Optional[torch.Tensor] = None
        self.dout_local: Optional[torch.Tensor] = None

    def release(self) -> None:
        self.local_q = self.local_k = self.local_v = self.out_local = self.dout_local = None
        self.cache = {}

    def _all_gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        if self.scope.size == 1:
            return x
        dev = collective_device(self.scope.group, x.device)
        try:
            parts = all_gather_list(x.to(dev).contiguous(), self.scope.group, timeout=self.t.opts.timeout, what=what)
        except CollectiveTimeout as e:
            self.t.verdicts.pending_first(e)
        return torch.cat(parts).to(x.device)

    def _reduce(self, x: torch.Tensor, what: str, op: Any = None) -> torch.Tensor:
        if self.scope.size == 1:
            return x
        dev = collective_device(self.scope.group, x.device)
        y = x.to(dev)
        try:
            all_reduce(y, self.scope.group, timeout=self.t.opts.timeout, what=what, op=op)
        except CollectiveTimeout as e:
            self.t.verdicts.pending_first(e)
        return y.to(x.device)

    def forward_figures(self, out: torch.Tensor, *, keep: bool) -> dict:
        """The sampled rows' output against the streamed reference (``keep``: what backward needs)."""
        dt, sel = self.dt, self.sel
        qm = self._all_gather(_take(self.local_q, self.fmt, sel).to(dt), "sampled query rows")  # [M, h, d]
        self.gi = self._all_gather(self.keys.index_select(0, sel), "sampled row indices")  # [M]
        self.gdoc, _ = _key_layout(self.offs, self.real, self.gi)
        # inf / NaN inputs, max |V| (the magnitude of the output's terms) and the maxima in one reduction, one sync
        ok = torch.isfinite(self.local_k).all() & torch.isfinite(self.local_v).all() & torch.isfinite(qm).all()
        bad = (~ok).to(dt).reshape(1)
        v_max = self.local_v.abs().amax().to(dt).reshape(1) if self.local_v.numel() else qm.new_zeros(1)
        m, smax = _stream_max(self, qm)
        both = self._reduce(torch.cat([m.reshape(-1), smax.reshape(1), bad, v_max]), "reference maxima",
                            dist.ReduceOp.MAX)
        tail = both[-3:].tolist()
        m, self.score_max, nonfinite, v_max = both[:-3].view_as(m), tail[0], tail[1], tail[2]
        sink = self._sinks()
        if sink is not None:  # one more logit per head in every denominator
            m = torch.maximum(m, sink)
        self.finite = nonfinite == 0.0 and error_floor(self.dtype, self.longest, self.score_max) < 1.0
        if not self.finite:
            self.release()
            return {**_SKIPPED, "nonfinite": 1.0}
        l, acc = _stream_sums(self, qm, m)
        sums = self._reduce(torch.cat([l.reshape(-1), acc.reshape(-1)]), "reference sums")
        l, acc = sums[:l.numel()].view_as(l), sums[l.numel():].view_as(acc)  # [kv, g, M], [kv, g, M, dv]
        if sink is not None:
            l = l + torch.exp(sink - m)
        ref = torch.where(l[..., None] > 0, acc / l.clamp_min(1e-300)[..., None], torch.zeros_like(acc))
        self.qm, self.m = qm, m
        self.lse = torch.where(l > 0, m + torch.log(l.clamp_min(1e-300)), torch.full_like(m, float("inf")))
        self.ref_all = ref.permute(2, 0, 1, 3).reshape(qm.shape[0], -1, ref.shape[-1])  # [M, h, dv]
        n_sel, r = sel.numel(), self.scope.rank
        mine = self.ref_all[r * n_sel:(r + 1) * n_sel]
        got = _take(out.detach(), self.fmt, sel)
        if keep:
            self.out_local = out.detach()
        return {**compare(got, mine, rtol=self.t.tolerance(self.dtype, grad=False),
                          atol=error_floor(self.dtype, self.longest, self.score_max), terms=v_max), "nonfinite": 0.0}

    def _sinks(self) -> Optional[torch.Tensor]:
        """The call's sinks as ``[kv, g, 1]`` (``None`` without)."""
        sinks = self.mods.sinks
        if sinks is None:
            return None
        h_kv = self.local_k.shape[-2]
        return sinks.detach().to(self.dt).view(h_kv, -1, 1)

    def reference_grads(self, dout: torch.Tensor) -> None:
        """In backward (``_TapOut``): the sampled rows' reference ``dq``; ``dO`` kept for the identities."""
        if self.local_q is None or not self.t.opts.gradients or not self.finite:
            self.refs = "nonfinite" if not self.finite else None
            return
        self.dout_local = dout.detach()
        dom = self._all_gather(_take(self.dout_local, self.fmt, self.sel).to(self.dt), "sampled dO rows")
        if self.real is not None:
            dom = dom * _key_layout(self.offs, self.real, self.gi)[1][:, None, None].to(dom.dtype)
        dq, dq_t = _stream_dq(self, dom)
        both = self._reduce(torch.cat([dq.reshape(-1), dq_t.reshape(-1)]), "reference dq")
        dq, dq_t = both[:dq.numel()].view_as(dq), both[dq.numel():].view_as(dq_t)
        n_sel, r = self.sel.numel(), self.scope.rank
        self.refs = (dq[r * n_sel:(r + 1) * n_sel], dq_t[r * n_sel:(r + 1) * n_sel])

    def check_grads(self, grads: tuple, needs: tuple) -> None:
        """In backward (``_TapIn``): the sampled rows' ``dq``; ``dk`` / ``dv`` through the identities."""
        self.t.taps_due = max(0, self.t.taps_due - 1)
        refs, self.refs = self.refs, None
        items = []
        for i, name in enumerate(("dq", "dk", "dv")):
            if refs == "nonfinite":
                items.append((name, {**_SKIPPED, "nonfinite": 1.0}))
            elif refs is None or not needs[i] or grads[i] is None or self.dout_local is None:
                items.append((name, dict(_SKIPPED)))
            else:
                items.append((name, None))
        if any(res is None for _, res in items):
            figures = self._grad_figures(grads, refs)
            items = [(n, figures[n] if res is None else res) for n, res in items]
        self.release()
        self.verdict("attention-grad", items)

    def _grad_figures(self, grads: tuple, refs: tuple) -> dict:
        dq, dk, dv = (g.detach() for g in grads)
        rtol = self.t.tolerance(self.dtype, grad=True)
        atol = error_floor(self.dtype, self.longest, self.score_max)
        out = {"dq": {**compare(_take(dq, self.fmt, self.sel), refs[0], rtol=rtol, atol=atol, terms=refs[1]),
                      "nonfinite": 0.0}}
        sums = self._reduce(_identity_terms(self, dq, dk, dv), "gradient identities")
        out.update(_identity_figures(sums, self.dtype, self.longest, sinks=self.mods.sinks is not None))
        return out


def _key_layout(offs: tuple, real: Optional[tuple], idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The document of each global index ``idx`` and whether it is a real token (not padding)."""
    cu = torch.tensor(list(offs), dtype=torch.long, device=idx.device)
    doc = (torch.searchsorted(cu, idx, right=True) - 1).clamp(0, max(0, len(offs) - 2))
    if real is None:
        return doc, torch.ones_like(idx, dtype=torch.bool)
    lens = torch.tensor([b - a for a, b in zip(real[:-1], real[1:])], dtype=torch.long, device=idx.device)
    return doc, (idx - cu[doc]) < lens[doc]


def _pick(ok: Optional[torch.Tensor], rows: int, n: int, seed: int, device: torch.device) -> torch.Tensor:
    """``n`` of the ``rows`` local rows (real ones first; ``ok`` ``None``: all real, read on the host, no device
    sync), in local order, drawn with ``seed``."""
    gen = torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
    if ok is None:
        order = torch.randperm(rows, generator=gen)
    else:
        real = torch.nonzero(ok.cpu()).flatten()
        pad = torch.nonzero(~ok.cpu()).flatten()
        order = torch.cat([real[torch.randperm(real.numel(), generator=gen)],
                           pad[torch.randperm(pad.numel(), generator=gen)]])
    return order[:min(n, order.numel())].sort().values.to(device)


def _spans(n: int, per_row: int, step: int):
    """``(a, b)`` ranges of at most ``step`` canonical rows that stay inside one batch row (``per_row`` rows each):
    each one a view of a ``bshd`` / ``sbhd`` / ``thd`` tensor (:func:`_rows`)."""
    for start in range(0, n, per_row):
        end = min(n, start + per_row)
        for a in range(start, end, step):
            yield a, min(end, a + step)


def _rows(x: torch.Tensor, fmt: str, a: int, b: int) -> torch.Tensor:
    """Canonical rows ``a:b`` of one batch row (see :func:`_spans`), a view ``[b − a, h, d]``."""
    if fmt == "thd":
        return x[a:b]
    s = x.shape[1] if fmt == "bshd" else x.shape[0]
    i, a, b = a // s, a % s, a % s + (b - a)
    return x[i, a:b] if fmt == "bshd" else x[a:b, i]


def _per_row(rec: _Sampled) -> int:
    """Canonical rows per batch row of the call's layout (all of them in ``thd``)."""
    x = rec.local_k
    return rec.n if rec.fmt == "thd" else int(x.shape[1] if rec.fmt == "bshd" else x.shape[0]) or 1


def _chunks(rec: _Sampled, m_rows: int, heads: int):
    """Local keys in chunks (views, converted once): ``(k, v, visible [M, J])`` in the reference dtype; ``J`` keys
    such that the ``[heads, M, J]`` scores hold about :data:`_CHUNK_ELEMENTS` elements."""
    step = max(_KEYS_PER_CHUNK, _CHUNK_ELEMENTS // max(1, heads * m_rows))
    for a, b in _spans(rec.n, _per_row(rec), step):
        ki = rec.keys[a:b]
        vis = (rec.gdoc[:, None] == rec.key_doc[None, a:b])
        if rec.real is not None:
            vis &= rec.key_ok[None, a:b]
        more = visible_keys(rec.gi, ki, rec.causal, rec.mods.window)
        if more is not None:
            vis &= more
        yield _rows(rec.local_k, rec.fmt, a, b).to(rec.dt), _rows(rec.local_v, rec.fmt, a, b).to(rec.dt), vis


def _scores(rec: _Sampled, qm: torch.Tensor, k: torch.Tensor, raw: bool = False) -> torch.Tensor:
    """``[kv, g, M, J]`` scaled scores (grouped-query heads without expanding K), softcapped unless ``raw``."""
    m, h, d = qm.shape
    h_kv = k.shape[1]
    s = torch.einsum("mkgd,jkd->kgmj", qm.view(m, h_kv, h // h_kv, d), k) * rec.scale
    cap = rec.mods.softcap
    return s if cap is None or raw else cap * torch.tanh(s / cap)


def _stream_max(rec: _Sampled, qm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h_kv = rec.local_k.shape[-2]
    mx = qm.new_full((h_kv, qm.shape[1] // h_kv, qm.shape[0]), float("-inf"))
    smax = qm.new_zeros(())
    for k, _, vis in _chunks(rec, qm.shape[0], qm.shape[1]):
        raw = _scores(rec, qm, k, raw=True)
        smax = torch.maximum(smax, raw.abs().amax()) if raw.numel() else smax
        cap = rec.mods.softcap
        s = raw if cap is None else cap * torch.tanh(raw / cap)
        mx = torch.maximum(mx, s.masked_fill(~vis, float("-inf")).amax(-1) if s.shape[-1] else mx)
    return mx, smax


def _stream_sums(rec: _Sampled, qm: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    l = torch.zeros_like(m)
    acc = qm.new_zeros(*m.shape, rec.local_v.shape[-1])
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None]
    for k, v, vis in _chunks(rec, qm.shape[0], qm.shape[1]):
        p = torch.exp(_scores(rec, qm, k) - safe).masked_fill(~vis, 0.0)
        l += p.sum(-1)
        acc += torch.einsum("kgmj,jkd->kgmd", p, v)
    return l, acc


def _stream_dq(rec: _Sampled, dom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled rows' ``dq`` over this rank's keys, and the magnitudes of its terms (``[M, h, d]`` each)."""
    m_, h, dvh = dom.shape
    h_kv = rec.local_k.shape[-2]
    g = h // h_kv
    do = dom.view(m_, h_kv, g, dvh)
    ref = rec.ref_all.view(m_, h_kv, g, dvh)
    delta = (do * ref).sum(-1).permute(1, 2, 0)[..., None]  # [kv, g, M, 1]
    delta_abs = (do * ref).abs().sum(-1).permute(1, 2, 0)[..., None]
    lse = torch.where(torch.isfinite(rec.lse), rec.lse, torch.zeros_like(rec.lse))[..., None]
    dq = rec.qm.new_zeros(m_, h_kv, g, rec.qm.shape[-1])
    dq_t = torch.zeros_like(dq)
    cap = rec.mods.softcap
    do_abs = do.abs()
    for k, v, vis in _chunks(rec, m_, h):
        s = _scores(rec, rec.qm, k)
        p = torch.exp(s - lse).masked_fill(~vis, 0.0)
        if cap is not None:  # the scores' gradient through the cap: 1 − tanh²
            p = p * (1 - (s / cap) ** 2)
        dp = torch.einsum("mkgd,jkd->kgmj", do, v)
        dq += torch.einsum("kgmj,jkd->mkgd", p * (dp - delta), k) * rec.scale
        dp_abs = torch.einsum("mkgd,jkd->kgmj", do_abs, v.abs())
        dq_t += torch.einsum("kgmj,jkd->mkgd", p * (dp_abs + delta_abs), k.abs()) * rec.scale
    return dq.reshape(m_, h, -1), dq_t.reshape(m_, h, -1)


def _identity_terms(rec: _Sampled, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """This rank's parts of the three identities and their magnitudes, one vector (summed over the group). Each pair
    of local tensors is read in views of rows, converted once (bounded temporaries, a few operations a chunk)."""
    f = torch.float64 if rec.dt == torch.float64 else torch.float32
    h_kv, dvh = rec.local_v.shape[-2], rec.local_v.shape[-1]
    dots = torch.zeros(8, dtype=f, device=rec.keys.device)
    sums = torch.zeros(4, h_kv, dvh, dtype=f, device=rec.keys.device)  # Σ dV, Σ dO, and their magnitudes
    pairs = ((dk, rec.local_k), (dq, rec.local_q), (dv, rec.local_v), (rec.dout_local, rec.out_local))
    for i, (x, y) in enumerate(pairs):
        step = max(1, _CHUNK_ELEMENTS // max(1, x.shape[-2] * x.shape[-1]))  # rows per chunk
        for a, b in _spans(rec.n, _per_row(rec), step):
            xa, ya = _rows(x, rec.fmt, a, b).to(f), _rows(y, rec.fmt, a, b).to(f)
            if i == 3 and rec.real is not None:  # padding rows: no gradient flows from them
                xa = xa * rec.key_ok[a:b, None, None].to(f)
            # Σ|x| as a 1-norm: one read, no |x| temporary
            if i == 2:
                sums[0] += xa.sum(0)
                sums[2] += torch.linalg.vector_norm(xa, 1, dim=0)
            elif i == 3:
                heads = xa.reshape(b - a, h_kv, -1, dvh)
                sums[1] += heads.sum((0, 2))
                sums[3] += torch.linalg.vector_norm(heads, 1, dim=(0, 2))
            xy = xa * ya
            dots[i] += xy.sum()
            dots[4 + i] += torch.linalg.vector_norm(xy.reshape(-1), 1)
    return torch.cat([dots, sums.reshape(-1)])


def _take(x: torch.Tensor, fmt: str, idx: torch.Tensor) -> torch.Tensor:
    """Canonical rows ``idx`` (batch-major, as :func:`.reference.canonical` numbers them) of a ``bshd`` / ``sbhd``
    / ``thd`` tensor, ``[len(idx), h, d]`` — without copying the rest."""
    if fmt == "thd":
        return x.index_select(0, idx)
    s = x.shape[1] if fmt == "bshd" else x.shape[0]
    b, t = idx // s, idx % s
    return x[b, t] if fmt == "bshd" else x[t, b]


def _identity_figures(s: torch.Tensor, dtype: torch.dtype, longest: int, sinks: bool = False) -> dict:
    """``dk`` / ``dv`` figures from the summed identity terms (the same on every rank); with ``sinks`` the softmax
    rows over the keys do not sum to 1, so ``Σ dV = Σ dO`` is not used."""
    n = (s.numel() - 8) // 4
    dv_sum, do_sum, dv_mag, do_mag = (s[8 + i * n: 8 + (i + 1) * n] for i in range(4))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    # the inputs' rounding (each gradient element within u of its exact value) plus the kernels' accumulation
    slack = 4 * unit_roundoff(dtype) + (64 + 16 * longest ** 0.5) * unit_roundoff(compute)

    def figure(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> dict:
        err = (got - want).abs()
        tol = (slack * mag).clamp_min(torch.finfo(s.dtype).tiny)
        ratio = err / tol
        i = int(ratio.reshape(-1).argmax())
        ref = float(want.abs().max())
        return {"ratio": float(ratio.reshape(-1)[i]), "abs_error": float(err.reshape(-1)[i]),
                "tolerance": float(tol.reshape(-1)[i]), "max_error": float(err.max()) / ref if ref else 0.0,
                "ref_max": ref, "nonfinite": 0.0}

    dk = figure(s[0:1], s[1:2], s[4:5] + s[5:6])
    dv_dot = figure(s[2:3], s[3:4], s[6:7] + s[7:8])
    dv_tot = figure(dv_sum, do_sum, dv_mag + do_mag)
    return {"dk": dk, "dv": dv_dot if sinks or dv_dot["ratio"] >= dv_tot["ratio"] else dv_tot}
