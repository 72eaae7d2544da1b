"""The sentinel's attention check: agreement, the forward against a reference, the gradients through autograd taps.

On a sampled call (forward only):

1. the inputs are validated as the ring would (a rank whose inputs are invalid raises its ``ValueError``; the others
   learn it from the agreement collective and raise too, instead of waiting in the ring);
2. **agreement**: one fixed-size digest per rank, all-gathered over the group (``_sentinel_agree``);
3. K and V are all-gathered over the group and put back in global order; the reference
   (``_sentinel_reference``) gives this rank's rows; the ring's output is compared to them, the verdict
   all-gathered (every rank raises together);
4. with autograd on, identity taps wrap the ring: ``_TapOut`` receives dO and computes the reference gradients (the
   k/v contributions summed over the group), ``_TapIn`` receives the ring's dq, dk, dv and compares.

Off or unsampled, the ring runs untouched (no taps, no collectives). Nothing here reads the ContextVar in
backward: a recompute (in backward) is checked against the scope recorded at the forward of the same call.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .report import Mismatch
from .state import describe, fingerprint, group_of, in_backward, same_scope
from .agree import (
    DTYPES,
    FORMATS,
    collective_device,
    comm_code,
    disagreements,
    exchange,
    exchange_objects,
    float_bits,
    hash64,
)
from .reference import canonical, canonical_offsets, compare, error_floor, reference_dtype, reference_rows
from ..scope import CPScope

__all__ = ["checked_attention"]

_FIGURES = ("ratio", "abs_error", "tolerance", "max_error", "ref_max", "nonfinite")
_SKIPPED = dict.fromkeys(_FIGURES, 0.0)
_SHARED = ("members", "cp_size", "step", "microbatch", "call", "qkv_format", "causal", "comm", "dtype", "batch",
           "local_len", "heads", "kv_heads", "head_dim", "offsets", "docs", "scale")
# A disagreement in these would make the ring deadlock or crash: raised whatever the policy.
_STRUCTURAL = {"members", "cp_size", "dtype", "batch", "local_len", "heads", "kv_heads", "head_dim"}


def _me() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _layout_key(qkv_format: str, seq: int, cp: int, cu: Optional[list]) -> tuple:
    """Offsets a consumer works with, comparable between RoPE and attention: packed offsets, or the global length."""
    return ("thd", tuple(cu)) if qkv_format == "thd" else ("dense", seq * cp)


def _dense_seq(shape: tuple, qkv_format: str) -> int:
    return shape[1] if qkv_format == "bshd" else shape[0]


def _signature(call: Any) -> tuple:
    from .._checks import cu_seqlens_list

    cu = call.cu_seqlens
    return ("attention", call.qkv_format, tuple(call.q.shape), tuple(call.k.shape), str(call.q.dtype),
            bool(call.causal), None if cu is None else hash64(tuple(cu_seqlens_list(cu))), call.softmax_scale)


def checked_attention(s: Any, call: Any, run: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """Run the prepared attention ``call`` (``run(call)``), checked when this call is sampled."""
    scope = call.scope
    if in_backward():
        _recompute_check(s, call)
        return run(call)
    mb = s.current("attention", scope)
    index = mb.calls
    mb.calls += 1
    if not mb.sampled:
        return run(call)
    q, k, fmt, causal, err = call.q, call.k, call.qkv_format, bool(call.causal), call.error
    comm = call.variant.name if call.variant is not None else (call.comm or scope.comm or "p2p")
    cu: Optional[list] = list(call.pack.cu) if err is None and fmt == "thd" else None  # the layout offsets
    scale = call.scale
    expected = s.expected_scope(mb)
    vscope = expected or scope  # the group that runs this microbatch: where the verdict is agreed
    where = mb.where(index)
    me = _me()
    local = []
    scope_ok = expected is None or same_scope(expected, scope)
    if not scope_ok:
        local.append(Mismatch(
            "attention", "scope", me,
            f"attention ran under {describe(scope)} (an explicit group=, or a module's own scope) while the active "
            f"scope is {describe(expected)}", {"used": describe(scope), "active": describe(expected)},
            group=group_of(vscope), **where))
    elif err is None and mb.rope_layouts:
        layout = _layout_key(fmt, 0 if fmt == "thd" else _dense_seq(tuple(q.shape), fmt), scope.size, cu)
        if layout not in mb.rope_layouts:
            local.append(Mismatch(
                "rope", "offsets", me,
                f"RoPE before this call rotated with offsets {_show_layout(mb.rope_layouts[0])} but attention runs "
                f"with {_show_layout(layout)}: positions and attention disagree on the layout",
                {"rope": mb.rope_layouts[0], "attention": layout}, group=group_of(vscope), **where))
    mb.rope_layouts = []
    mb.unverified = 0  # the agreement below carries every pending mismatch of this rank
    s.emit(local, consistent=vscope.size == 1)

    ok = True
    if vscope.size > 1:
        ok = _agree(s, vscope, scope, q, k, fmt, causal, comm, cu, err, scale, mb, index)
    elif err is not None:
        raise err
    else:
        s.raise_pending()
    padded = call.cu_seqlens_padded is not None or (fmt != "thd" and call.cu_seqlens is not None)
    if not (ok and scope_ok and s.check_attention) or padded:  # padding masks: agreement only (no reference yet)
        return run(call)
    return _numeric(s, call, run, cu, float(scale), where)


def _show_layout(layout: tuple) -> str:
    kind, val = layout
    if kind == "thd":
        val = list(val)
        return f"cu_seqlens {val[:9]}{'…' if len(val) > 9 else ''}"
    return f"global length {val}"


def _shape_fields(q: torch.Tensor, k: torch.Tensor, fmt: str) -> dict[str, int]:
    try:
        if fmt == "thd":
            batch, local = 1, q.shape[0]
        else:
            batch, local = (q.shape[0], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[0])
        return {"batch": int(batch), "local_len": int(local), "heads": int(q.shape[-2]),
                "kv_heads": int(k.shape[-2]), "head_dim": int(q.shape[-1])}
    except (IndexError, AttributeError):
        return {"batch": -1, "local_len": -1, "heads": -1, "kv_heads": -1, "head_dim": -1}


def _agree(s: Any, vscope: CPScope, scope: CPScope, q: torch.Tensor, k: torch.Tensor, fmt: str, causal: bool,
           comm: str, cu: Optional[list], err: Optional[ValueError], scale: Optional[float], mb: Any,
           call: int) -> bool:
    """The agreement collective over ``vscope``'s group; returns whether the numeric check may go on."""
    members = list(group_of(vscope))
    me = _me()
    shapes = _shape_fields(q, k, fmt)
    if cu is not None:
        offsets, docs = hash64(tuple(cu)), len(cu) - 1
    else:
        offsets, docs = hash64(("dense", shapes["local_len"] * scope.size)), shapes["batch"]
    vals = {
        "valid": int(err is None), "pending": int(s.has_pending), "global_rank": me, "cp_rank": vscope.rank,
        "cp_size": scope.size, "members": hash64(tuple(members)), "step": -1 if mb.step is None else mb.step,
        "microbatch": mb.index, "call": call, "qkv_format": FORMATS.get(fmt, 0), "causal": int(causal),
        "comm": comm_code(comm), "dtype": DTYPES.get(getattr(q, "dtype", None), 0), **shapes,
        "offsets": offsets, "docs": docs, "scale": float_bits(scale) if scale is not None else -1,
    }
    s._summary.count("agreement")
    rows = exchange(vscope.group, vals, collective_device(vscope.group, q.device))
    problems = disagreements(rows, members=members, fields=_SHARED)
    invalid = [members[i] for i, r in enumerate(rows) if not r["valid"]]
    where = dict(mb.where(call), group=tuple(members))
    if problems or invalid:
        details = exchange_objects(vscope.group, {"cu": None if cu is None else cu[:17],
                                                  "error": None if err is None else str(err)})
        ms = []
        for p in problems:
            msg, figs = p.message, dict(p.figures)
            if p.field in ("offsets", "docs") and any(d["cu"] is not None for d in details):
                figs["cu_seqlens"] = {members[i]: d["cu"] for i, d in enumerate(details)}
                msg += " — cu_seqlens (first 17): " + ", ".join(
                    f"rank {members[i]}: {d['cu']}" for i, d in enumerate(details))
            for r in p.ranks or (-1,):
                ms.append(Mismatch("agreement", p.field, r, msg, figs, **where))
        for i, d in enumerate(details):
            if d["error"] is not None:
                ms.append(Mismatch("agreement", "invalid inputs", members[i],
                                   f"rank {members[i]} refused its attention inputs: {d['error']}", {}, **where))
        structural = bool(invalid) or any(p.field in _STRUCTURAL for p in problems)
        if err is not None:
            try:
                s.emit(ms, consistent=True, force_raise=True)
            except Exception:  # noqa: BLE001 - this rank's own ValueError is the better message
                pass
            raise err
        s.emit(ms, consistent=True, force_raise=structural)
        return False
    pending = [members[i] for i, r in enumerate(rows) if r["pending"]]
    if pending:
        s.raise_pending([r for r in pending if r != me])
    return True


def _numeric(s: Any, call: Any, run: Callable[[Any], torch.Tensor], cu: Optional[list], scale: float,
             where: dict) -> torch.Tensor:
    from ..sharding import zigzag_indices

    q, k, v, scope, fmt, causal = call.q, call.k, call.v, call.scope, call.qkv_format, bool(call.causal)

    cp, rank, dev = scope.size, scope.rank, q.device
    offs = canonical_offsets(fmt, tuple(q.shape), cp, cu)
    dt = s.reference_dtype or reference_dtype(dev)
    rows = zigzag_indices(list(offs), cp, rank, device=dev)
    kc, vc = canonical(k.detach(), fmt).to(dt), canonical(v.detach(), fmt).to(dt)
    if cp > 1:  # K/V of the whole group, back in global order
        kv = torch.stack([kc, vc]).contiguous()  # [2, n, h_kv, d]
        parts = [torch.empty_like(kv) for _ in range(cp)]
        dist.all_gather(parts, kv, group=scope.group)
        full = kv.new_empty((2, offs[-1], *kv.shape[2:]))  # [2, T, h_kv, d]
        for r, part in enumerate(parts):
            full[:, zigzag_indices(list(offs), cp, r, device=dev)] = part
        kf, vf = full[0], full[1]
    else:
        kf, vf = kc, vc
    rec = _Call(s, scope, fmt, causal, scale, dt, rows, offs, kf, vf, canonical(q.detach(), fmt), q.dtype, where)
    grads = s.check_gradients and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    sig, fp = _signature(call), fingerprint(v)
    if grads:
        q, k, v = _TapIn.apply(rec, q, k, v)
        call = dataclasses.replace(call, q=q, k=k, v=v)
    out = run(call)
    with torch.no_grad():
        # inputs already inf / NaN (a diverged run): not attention's doing; counted, not compared
        rec.finite = bool(torch.isfinite(rec.q).all()) and bool(torch.isfinite(kf).all()) and bool(
            torch.isfinite(vf).all())
        if rec.finite:
            ref = reference_rows(rec.q, rows, kf, vf, offs, causal=causal, scale=scale, dtype=dt,
                                 cache=rec.cache if grads else None)
            rec.score_max = ref.score_max
            # scores so large that exp(s − lse) has no correct digit left in the ring's arithmetic (|s| ≳ 1e6 in
            # fp32): the model has diverged; nothing to compare
            rec.finite = error_floor(rec.dtype, rec.longest, ref.score_max) < 1.0
        if rec.finite:
            v_max = float(vf.abs().max()) if vf.numel() else 0.0  # |out| ≤ max |V|: the magnitude of its terms
            res = {**compare(canonical(out.detach(), fmt), ref.out, rtol=s.tolerance(rec.dtype, grad=False),
                             atol=error_floor(rec.dtype, rec.longest, ref.score_max), terms=v_max), "nonfinite": 0.0}
        else:
            res = {**_SKIPPED, "nonfinite": 1.0}
    rec.verdict("attention", [("out", res)])
    s.records.put(sig, fp, (scope, where))
    if grads:
        out = _TapOut.apply(rec, out)
    else:
        rec.release()
    return out


def _recompute_check(s: Any, call: Any) -> None:
    """In backward (activation recompute): the scope must be the one its forward ran under (recorded then)."""
    scope = call.scope
    sig = _signature(call)
    if not s.records.has_signature(sig):
        return
    hit = s.records.get(sig, fingerprint(call.v))
    if hit is None:
        return
    forward_scope, where = hit
    s._summary.count("recompute")
    if same_scope(forward_scope, scope):
        return
    s.emit([Mismatch(
        "recompute", "scope", _me(),
        f"an activation recompute in backward ran attention under {describe(scope)}, but the forward of this call "
        f"ran under {describe(forward_scope)}: the recompute read the scope at backward time instead of re-entering "
        "the forward's (use cpscope.checkpoint, or context_fn=cpscope.scope_context_fn())",
        {"recompute": describe(scope), "forward": describe(forward_scope)}, group=group_of(forward_scope),
        **where)], consistent=True)


class _Call:
    """One sampled attention call: the reference inputs (detached) and, after dO arrives, its gradients."""

    def __init__(self, s: Any, scope: CPScope, fmt: str, causal: bool, scale: float, dt: torch.dtype,
                 rows: torch.Tensor, offs: tuple, kf: torch.Tensor, vf: torch.Tensor, q: torch.Tensor,
                 dtype: torch.dtype, where: dict) -> None:
        self.s, self.scope, self.fmt, self.causal, self.scale, self.dt = s, scope, fmt, causal, scale, dt
        self.rows, self.offs, self.kf, self.vf, self.q, self.dtype, self.where = rows, offs, kf, vf, q, dtype, where
        self.members = group_of(scope)
        self.longest = max((b - a for a, b in zip(offs[:-1], offs[1:])), default=0)
        self.score_max = 0.0
        self.finite = True
        self.cache: dict = {}  # the reference's forward probabilities, for its backward
        self.refs: Optional[tuple] = None

    def release(self) -> None:
        self.kf = self.vf = self.q = None
        self.cache = {}

    def reference_grads(self, dout: torch.Tensor) -> None:
        """In backward (from ``_TapOut``): dq of this rank's rows, dk/dv of its keys (summed over the group)."""
        if self.kf is None:
            return
        do = canonical(dout.detach(), self.fmt)
        finite = self.finite and bool(torch.isfinite(do).all())
        if finite:
            ref = reference_rows(self.q, self.rows, self.kf, self.vf, self.offs, causal=self.causal,
                                 scale=self.scale, dtype=self.dt, dout=do, cache=self.cache)
            dq, dk, dv, (dq_t, dk_t, dv_t) = ref.dq, ref.dk, ref.dv, ref.terms
        else:  # keep the collective: zeros, and a flag that makes every rank skip this comparison
            dq = torch.zeros_like(self.q, dtype=self.dt)
            dk = dv = dk_t = dv_t = torch.zeros_like(self.kf)
        if self.scope.size > 1:  # every rank's rows contribute to every key
            kv = torch.stack([dk, dv, dk_t, dv_t])
            buf = torch.cat([kv.reshape(-1), kv.new_tensor([0.0 if finite else 1.0])])
            dist.all_reduce(buf, group=self.scope.group)
            finite = float(buf[-1]) == 0.0
            dk, dv, dk_t, dv_t = buf[:-1].view_as(kv).unbind(0)
        if not finite:
            self.refs = "nonfinite"
            self.release()
            return
        pick = self.rows
        self.refs = ((dq, dq_t), (dk.index_select(0, pick), dk_t.index_select(0, pick)),
                     (dv.index_select(0, pick), dv_t.index_select(0, pick)))
        self.release()

    def check_grads(self, grads: tuple, needs: tuple) -> None:
        """In backward (from ``_TapIn``): the ring's dq, dk, dv against the reference's."""
        items = []
        refs, self.refs = self.refs, None
        rtol = self.s.tolerance(self.dtype, grad=True)
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

    def verdict(self, check: str, items: list[tuple[str, dict]]) -> None:
        """Agree over the group on the comparison (every rank learns every rank's figures) and report."""
        s = self.s
        s._summary.count(check)
        vec = [float(res[f]) for (_, res) in items for f in _FIGURES]
        if self.scope.size > 1:
            mine = torch.tensor(vec, dtype=torch.float64, device=collective_device(self.scope.group, self.rows.device))
            parts = [torch.empty_like(mine) for _ in range(self.scope.size)]
            dist.all_gather(parts, mine, group=self.scope.group)
            per_rank = [p.tolist() for p in parts]
        else:
            per_rank = [vec]
        ms = []
        dname = str(self.dtype).replace("torch.", "")
        n = len(_FIGURES)
        for gi, vals in enumerate(per_rank):
            rank = self.members[gi] if gi < len(self.members) else gi
            for j, (name, _) in enumerate(items):
                res = dict(zip(_FIGURES, vals[n * j: n * j + n]))
                if res["nonfinite"]:
                    s.nonfinite(f"{check} {name}", rank)
                    continue
                ratio = res["ratio"]
                s._summary.worst_ratio(f"{check} {name} {dname}", ratio if ratio == ratio else math.inf)
                if not ratio <= 1.0:  # also NaN
                    what = "output" if name == "out" else f"gradient {name}"
                    ms.append(Mismatch(
                        check, name, rank,
                        f"attention {what} of rank {rank} differs from the reference: max error "
                        f"{res['max_error']:.3g} of max |ref| {res['ref_max']:.3g}; worst element off by "
                        f"{res['abs_error']:.3g} against a tolerance of {res['tolerance']:.3g} "
                        f"({ratio:.3g}x; {dname}, rtol {s.tolerance(self.dtype, grad=name != 'out'):.2g}); layer "
                        f"(call) {self.where.get('call')}, {describe(self.scope)} group {list(self.members)}",
                        {**res, "rtol": s.tolerance(self.dtype, grad=name != "out"), "dtype": dname,
                         "score_max": self.score_max},
                        group=tuple(self.members), **self.where))
        s.emit(ms, consistent=True)


class _TapIn(torch.autograd.Function):
    """Identity on (q, k, v); its backward receives exactly the gradients the ring produced for them."""

    @staticmethod
    def forward(ctx: Any, rec: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):  # type: ignore[override]
        ctx.rec = rec
        outs = (q.view_as(q), k.view_as(k), v.view_as(v))
        frozen = [o for o, t in zip(outs, (q, k, v)) if not t.requires_grad]
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
    """Identity on the ring's output; its backward hands dO to the reference before the ring's backward runs."""

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
