"""The attention call against the sentinel's reference: the output in forward, dq / dk / dv through autograd taps.

On a sampled call whose group agreed (:mod:`.attention_check`):

1. K and V are all-gathered over the group and put back in global order; the reference (:mod:`.reference`) gives
   this rank's rows; the call's output is compared to them and the figures all-gathered (every rank raises together);
2. with autograd on, identity taps wrap the call: :class:`_TapOut` receives dO and computes the reference gradients
   (the k/v contributions summed over the group), :class:`_TapIn` receives the call's dq, dk, dv and compares.

Nothing here reads the ContextVar: backward uses the scope of the call, kept on the tap's record.

Example::

    out = numeric(tracker, call, run_call, cu, signature(call), mb.where(index))
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch

from ..attention import AttentionCall
from ..scope import CPScope
from ..sharding import zigzag_indices
from . import recompute
from .comm import (CollectiveTimeout, all_gather_list, all_reduce, collective_device, describe, gather_zigzag, group_of,
                   me)
from .reference import Mods, canonical, canonical_offsets, compare, error_floor, reference_dtype, reference_rows
from .report import Mismatch
from .state import Tracker

__all__ = ["numeric", "run_checked"]

_FIGURES = ("ratio", "abs_error", "tolerance", "max_error", "ref_max", "nonfinite")
_SKIPPED = dict.fromkeys(_FIGURES, 0.0)


def numeric(t: Tracker, call: AttentionCall, run: Callable[[AttentionCall], torch.Tensor], cu: Optional[list],
            sig: tuple, where: dict) -> torch.Tensor:
    """Run ``call`` (``run``), compare its output with the reference, and tap its gradients when autograd is on."""
    q, k, v, scope, fmt = call.q, call.k, call.v, call.scope, call.qkv_format
    offs = canonical_offsets(fmt, tuple(q.shape), scope.size, cu)
    dt = t.opts.reference_dtype or reference_dtype(q.device)
    rows = zigzag_indices(list(offs), scope.size, scope.rank, device=q.device)
    d = k.shape[-1]
    kv = torch.cat([canonical(k.detach(), fmt).to(dt), canonical(v.detach(), fmt).to(dt)], dim=-1)  # [n, h_kv, d+dv]
    kv = gather_zigzag(kv, offs, scope, timeout=t.opts.timeout)  # [T, h_kv, d+dv]: the group's K/V, global order
    rec = _Call(t, scope, fmt, bool(call.causal), float(call.scale), dt, rows, offs, kv[..., :d], kv[..., d:],
                canonical(q.detach(), fmt), q.dtype, where)
    rec.real = call.pack.real if call.pack is not None else None  # padded documents: their real offsets
    rec.mods = Mods(call.window, call.softcap, None if call.sinks is None else call.sinks.detach())
    return run_checked(t, call, run, rec, sig, where)


def run_checked(t: Tracker, call: AttentionCall, run: Callable[[AttentionCall], torch.Tensor], rec: "_Call",
                sig: tuple, where: dict) -> torch.Tensor:
    """Run ``call`` between the taps of ``rec`` (when a backward will run), judge its output, record it for its
    recompute; returns the (tapped) output."""
    q, k, v = call.q, call.k, call.v
    # taps whenever a backward will run: the gradient check, and the group verdict on this microbatch's recomputes
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if grads:
        t.taps_due += 1
        q, k, v = _TapIn.apply(rec, q, k, v)
        call = dataclasses.replace(call, q=q, k=k, v=v)
    out = run(call)
    with torch.no_grad():
        res = rec.forward_figures(out, keep=grads)
    rec.verdict("attention", [("out", res)])
    recompute.remember(t, sig, call.v, call.scope, where)
    if grads:
        return _TapOut.apply(rec, out)
    rec.release()
    return out


class _Call:
    """One sampled attention call: the reference inputs (detached) and, after dO arrives, its gradients."""

    def __init__(self, t: Tracker, scope: CPScope, fmt: str, causal: bool, scale: float, dt: torch.dtype,
                 rows: torch.Tensor, offs: tuple, kf: torch.Tensor, vf: torch.Tensor, q: torch.Tensor,
                 dtype: torch.dtype, where: dict) -> None:
        self.t, self.scope, self.fmt, self.causal, self.scale, self.dt = t, scope, fmt, causal, scale, dt
        self.rows, self.offs, self.kf, self.vf, self.q, self.dtype, self.where = rows, offs, kf, vf, q, dtype, where
        self.members = group_of(scope)
        self.longest = max((b - a for a, b in zip(offs[:-1], offs[1:])), default=0)
        self.score_max = 0.0
        self.finite = True
        self.cache: dict = {}  # the reference's forward probabilities, for its backward
        self.refs: Any = None
        self.real: Optional[tuple] = None
        self.mods = Mods()

    def release(self) -> None:
        self.kf = self.vf = self.q = None
        self.cache = {}

    def forward_figures(self, out: torch.Tensor, *, keep: bool) -> dict:
        """The output's figures against the reference (``keep``: keep the probabilities for the gradients)."""
        kf, vf = self.kf, self.vf
        # inputs already inf / NaN (a diverged run): not attention's doing; counted, not compared
        self.finite = bool(torch.isfinite(self.q).all()) and bool(torch.isfinite(kf).all()) and bool(
            torch.isfinite(vf).all())
        if self.finite:
            ref = reference_rows(self.q, self.rows, kf, vf, self.offs, causal=self.causal, scale=self.scale,
                                 dtype=self.dt, cache=self.cache if keep else None, real=self.real,
                                 mods=self.mods)
            self.score_max = ref.score_max
            # scores so large that exp(s − lse) has no correct digit left in the call's arithmetic (|s| ≳ 1e6 in
            # fp32): the model has diverged; nothing to compare
            self.finite = error_floor(self.dtype, self.longest, ref.score_max) < 1.0
        if not self.finite:
            return {**_SKIPPED, "nonfinite": 1.0}
        v_max = float(vf.abs().max()) if vf.numel() else 0.0  # |out| ≤ max |V|: the magnitude of its terms
        return {**compare(canonical(out.detach(), self.fmt), ref.out, rtol=self.t.tolerance(self.dtype, grad=False),
                          atol=error_floor(self.dtype, self.longest, ref.score_max), terms=v_max), "nonfinite": 0.0}

    def reference_grads(self, dout: torch.Tensor) -> None:
        """In backward (from ``_TapOut``): dq of this rank's rows, dk/dv of its keys (summed over the group)."""
        if self.kf is None or not self.t.opts.gradients:
            self.release()
            return
        do = canonical(dout.detach(), self.fmt)
        finite = self.finite and bool(torch.isfinite(do).all())
        if finite:
            ref = reference_rows(self.q, self.rows, self.kf, self.vf, self.offs, causal=self.causal,
                                 scale=self.scale, dtype=self.dt, dout=do, cache=self.cache, real=self.real,
                                 mods=self.mods)
            dq, dk, dv, (dq_t, dk_t, dv_t) = ref.dq, ref.dk, ref.dv, ref.terms
        else:  # keep the collective: zeros, and a flag that makes every rank skip this comparison
            dq = torch.zeros_like(self.q, dtype=self.dt)
            dk = dk_t = torch.zeros_like(self.kf)
            dv = dv_t = torch.zeros_like(self.vf)
        if self.scope.size > 1:  # every rank's rows contribute to every key
            parts = [dk, dv, dk_t, dv_t]
            buf = torch.cat([x.reshape(-1) for x in parts] + [dk.new_tensor([0.0 if finite else 1.0])])
            try:
                all_reduce(buf, self.scope.group, timeout=self.t.opts.timeout, what="reference gradients")
            except CollectiveTimeout as e:
                self.t.verdicts.pending_first(e)
            finite = float(buf[-1]) == 0.0
            dk, dv, dk_t, dv_t = (x.view_as(p) for x, p in zip(buf[:-1].split([p.numel() for p in parts]), parts))
        if not finite:
            self.refs = "nonfinite"
            self.release()
            return
        pick = self.rows
        self.refs = ((dq, dq_t), (dk.index_select(0, pick), dk_t.index_select(0, pick)),
                     (dv.index_select(0, pick), dv_t.index_select(0, pick)))
        self.release()

    def check_grads(self, grads: tuple, needs: tuple) -> None:
        """In backward (from ``_TapIn``): the call's dq, dk, dv against the reference's."""
        self.t.taps_due = max(0, self.t.taps_due - 1)
        items = []
        refs, self.refs = self.refs, None
        rtol = self.t.tolerance(self.dtype, grad=True)
        atol = error_floor(self.dtype, self.longest, self.score_max)
        for i, (name, got) in enumerate(zip(("dq", "dk", "dv"), grads)):
            if refs == "nonfinite":
                items.append((name, {**_SKIPPED, "nonfinite": 1.0}))
                continue
            if refs is None or not needs[i] or got is None:
                items.append((name, dict(_SKIPPED)))
                continue
            ref, terms = refs[i]
            items.append((name, {**compare(canonical(got.detach(), self.fmt), ref, rtol=rtol, atol=atol, terms=terms),
                                 "nonfinite": 0.0}))
        self.verdict("attention-grad", items)

    def _gather_figures(self, vec: list[float]) -> list[list[float]]:
        if self.scope.size == 1:
            return [vec]
        mine = torch.tensor(vec, dtype=torch.float64, device=collective_device(self.scope.group, self.rows.device))
        try:
            parts = all_gather_list(mine, self.scope.group, timeout=self.t.opts.timeout, what="attention figures")
        except CollectiveTimeout as e:
            self.t.verdicts.pending_first(e)
        return [p.tolist() for p in parts]

    def verdict(self, check: str, items: list[tuple[str, dict]]) -> None:
        """Agree over the group on the comparison (every rank learns every rank's figures) and report."""
        v = self.t.verdicts
        v.count(check)
        # the last figure: this rank holds a mismatch found locally (a recompute), raised on every rank below
        per_rank = self._gather_figures([float(res[f]) for (_, res) in items for f in _FIGURES] + [
            float(v.has_pending)])
        ms = []
        n = len(_FIGURES)
        for gi, vals in enumerate(per_rank):
            rank = self.members[gi] if gi < len(self.members) else gi
            for j, (name, _) in enumerate(items):
                res = dict(zip(_FIGURES, vals[n * j: n * j + n]))
                if res["nonfinite"]:
                    v.nonfinite(f"{check} {name}", rank)
                    continue
                ms.extend(self._judge(check, name, rank, res))
        pending = [self.members[i] for i, vals in enumerate(per_rank) if vals[-1] and i < len(self.members)]
        if pending:  # a cause found on some rank (a recompute under another scope) goes first, on every rank
            v.emit(ms, consistent=False)
            v.raise_pending([r for r in pending if r != me()])
        v.emit(ms, consistent=True)

    def _judge(self, check: str, name: str, rank: int, res: dict) -> list[Mismatch]:
        """One rank's figures of one tensor: recorded in the summary, a mismatch when beyond the tolerance."""
        dname = str(self.dtype).replace("torch.", "")
        ratio = res["ratio"]
        self.t.verdicts.summary.worst_ratio(f"{check} {name} {dname}", ratio if ratio == ratio else math.inf)
        if ratio <= 1.0:  # (NaN is a mismatch)
            return []
        what = "output" if name == "out" else f"gradient {name}"
        rtol = self.t.tolerance(self.dtype, grad=name != "out")
        return [Mismatch(
            check, name, rank,
            f"attention {what} of rank {rank} differs from the reference: max error {res['max_error']:.3g} of max "
            f"|ref| {res['ref_max']:.3g}; worst element off by {res['abs_error']:.3g} against a tolerance of "
            f"{res['tolerance']:.3g} ({ratio:.3g}x; {dname}, rtol {rtol:.2g}); layer (call) {self.where.get('call')}, "
            f"{describe(self.scope)} group {list(self.members)}",
            {**res, "rtol": rtol, "dtype": dname, "score_max": self.score_max},
            group=tuple(self.members), **self.where)]


class _TapIn(torch.autograd.Function):
    """Identity on (q, k, v); its backward receives exactly the gradients the call produced for them."""

    @staticmethod
    def forward(ctx: Any, rec: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):  # type: ignore[override]
        ctx.rec = rec
        outs = (q.view_as(q), k.view_as(k), v.view_as(v))
        frozen = [o for o, x in zip(outs, (q, k, v)) if not x.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):  # type: ignore[override]
        rec, ctx.rec = ctx.rec, None
        if rec is not None:
            rec.check_grads((dq, dk, dv), ctx.needs_input_grad[1:])
        return None, dq, dk, dv


class _TapOut(torch.autograd.Function):
    """Identity on the call's output; its backward hands dO to the reference before the call's backward runs."""

    @staticmethod
    def forward(ctx: Any, rec: _Call, out: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.rec = rec
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        rec, ctx.rec = ctx.rec, None
        if rec is not None:
            rec.reference_grads(dout)
        return None, dout
