"""The sentinel's attention check: which call is sampled, the local checks, the agreement digest of the group.

The core hands the sentinel a prepared :class:`cpscope.attention._api.AttentionCall` (validated once by the core:
its ``scale``, ``pack``, ``variant``, or the ``error`` of inputs that failed validation) and the function that runs
it. On a sampled call (forward only):

1. local checks: the scope the call runs under against the active one, RoPE's offsets against attention's;
0. **the core's digest first** (:func:`cpscope.attention._agreement.check_call` with its ``sentinel`` field set): a
   rank that does not sample the call (sentinel off there, switched on later, counters drifted) is named on every
   rank by :class:`cpscope.RanksDisagreeError` before any collective of the sentinel; then the unit's own
   collectives that waited for it (the handshake, the loop's pack checks);
2. **agreement**: one fixed-size digest per rank, all-gathered over the group (:mod:`.agree`): a rank whose inputs
   are invalid raises its ``ValueError``, the others learn it here and raise too, instead of waiting in the ring;
3. the numeric check (:mod:`.attention_numeric`): the output and the gradients against the reference.

Off or unsampled, the call runs untouched (no taps, no collectives). In backward (an activation recompute) the
call is checked against the scope recorded at its sampled forward (:mod:`.recompute`).

Example::

    out = checked_attention(tracker, call, run_call)       # what the attention slot does
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..attention import STAND_DOWN, AttentionCall, check_call, raise_differ
from ..attention import api_module as attention_api
from ..scope import CPScope
from . import recompute
from .agree import DTYPES, FORMATS, comm_code, disagreements, float_bits, hash64
from .attention_numeric import numeric
from .attention_sampled import sampled_numeric
from .comm import collective_device, describe, exchange, exchange_objects, group_of, me, same_scope, wait_for
from .report import Mismatch, logger
from .state import MicrobatchRecord, Tracker, cut_mismatch, in_backward

__all__ = ["checked_attention", "signature"]

_SHARED = ("members", "cp_size", "step", "microbatch", "call", "qkv_format", "causal", "comm", "dtype", "batch",
           "local_len", "heads", "kv_heads", "head_dim", "offsets", "docs", "scale", "window", "softcap", "sinks")
# A disagreement in these would make the ring deadlock or crash: raised whatever the policy.
_STRUCTURAL = {"members", "cp_size", "dtype", "batch", "local_len", "heads", "kv_heads", "head_dim"}


def _features(call: AttentionCall) -> dict[str, int]:
    """The mask and score modifiers of a call as digest fields (``window``, ``softcap``, ``sinks``; absent: -1)."""
    window = getattr(call, "window", None)
    softcap = getattr(call, "softcap", None)
    return {"window": -1 if window in (None, (-1, -1)) else hash64(tuple(int(w) for w in window)),
            "softcap": -1 if softcap is None else float_bits(softcap),
            "sinks": int(getattr(call, "sinks", None) is not None)}


def _reference_covers(call: AttentionCall) -> bool:
    """Whether the reference implements the call's attention: padding masks, windows, softcaps and sinks are; a
    feature it does not implement would be checked for agreement only."""
    return call.error is None


def signature(call: AttentionCall) -> tuple:
    """What a call is (layout, shapes, dtype, mask, offsets, scale): equal for a forward and its recompute."""
    pack = call.pack
    return ("attention", call.qkv_format, tuple(call.q.shape), tuple(call.k.shape), str(call.q.dtype),
            bool(call.causal), None if pack is None else hash64((pack.cu, pack.real)), call.scale)


def checked_attention(t: Tracker, call: AttentionCall, run: Callable[[AttentionCall], torch.Tensor]) -> torch.Tensor:
    """Run the prepared attention ``call`` (``run(call)``), checked when this call is sampled.

    Under CP > 1, ``run`` agrees the call's digest over the group (the core's default check) and runs it. A sampled
    call agrees that digest first itself, with "this call is sampled" in it (:func:`_gate`), and runs every
    collective of the sentinel only after every member was seen sampling it too; then it runs the call without a
    second agreement (``run_call``).
    """
    scope = call.scope
    if in_backward():
        if call.error is None:
            recompute.check(t, signature(call), call.v, scope, "attention")
        return run(call)
    mb = t.current("attention", scope)
    index = mb.calls
    mb.calls += 1
    if not mb.sampled:
        return run(call)
    differ = _gate(t, call, mb)
    if differ is None:  # peers that do not sample this call: run it as they do, no collective of ours
        return attention_api.run_call(call)
    if scope.size > 1:
        run = attention_api.run_call  # agreed already (or reported below); looked up now: tests plant bugs there
    due, mb.due = mb.due, []
    for fn in due:  # the unit's handshake and the loop's pack checks (every member samples this unit)
        fn()
    cu: Optional[list] = list(call.pack.cu) if call.error is None and call.qkv_format == "thd" else None
    expected = t.expected_scope(mb)
    vscope = expected or scope  # the group that runs this microbatch: where the verdict is agreed
    scope_ok = expected is None or same_scope(expected, scope)
    local = _local_checks(call, mb, expected, vscope, cu, index)
    foreign = t.cuts.foreign({"q": call.q, "k": call.k, "v": call.v}, scope)
    if foreign is not None:
        local.append(cut_mismatch("attention", foreign, scope, dict(mb.where(index), group=group_of(vscope))))
    mb.rope_layouts = []
    mb.unverified = 0  # the agreement below carries every pending mismatch of this rank
    t.verdicts.emit(local, consistent=vscope.size == 1)

    ok = True
    if vscope.size > 1:
        ok = _agree(t, vscope, call, cu, mb, index)
    elif call.error is not None:
        raise call.error
    else:
        t.verdicts.raise_pending()
    if differ:  # the core's digest differs and the sentinel's report did not raise (a policy that only logs)
        raise_differ(call, differ)
    if not (ok and scope_ok and t.opts.attention):
        return run(call)
    if not _reference_covers(call):
        t.verdicts.count("attention: agreement only")
        return run(call)
    # more local rows than the sentinel checks: sampled rows against a streamed reference; else every row, exactly
    check = sampled_numeric if canonical_rows(call) > t.opts.rows else numeric
    return check(t, call, run, cu, signature(call), mb.where(index))


def _gate(t: Tracker, call: AttentionCall, mb: MicrobatchRecord) -> Optional[tuple]:
    """The core's agreement digest of a sampled CP > 1 call, with its ``sentinel`` field set: ``()`` when every
    member samples the call and agrees, the fields that differ while every member samples it (reported by
    :func:`_agree` first), ``None`` when members that do not sample it run it unchecked (this rank stands down).

    A member whose sentinel is off, or that does not sample this call, has the field 0: every rank raises
    :class:`cpscope.RanksDisagreeError` naming it, before any collective of the sentinel — or, when those members
    repeat a call they saw agreed (no host read there), every rank raises it at the step boundary.
    """
    if call.scope.size == 1:
        return ()
    differ = check_call(call, sentinel=1, wait=lambda work, group: wait_for(
        work, group, "all_reduce (agreement digest of the core)", t.opts.timeout))
    if differ is not STAND_DOWN:
        return differ
    mb.sampled, mb.due = False, []
    t.stood_down = True
    t.verdicts.count("stood down: peers not sampling")
    logger.error("cpscope sentinel: the other ranks of %s do not sample this call (sentinel off there, or another "
                 "microbatch count): this rank runs it unchecked; every rank raises RanksDisagreeError at the step "
                 "boundary", describe(call.scope))
    return None


def canonical_rows(call: AttentionCall) -> int:
    """Local query rows of a call (tokens of ``thd``; ``b·s`` of ``bshd`` / ``sbhd``)."""
    shape = call.q.shape
    return int(shape[0]) if call.qkv_format == "thd" else int(shape[0]) * int(shape[1])


def _local_checks(call: AttentionCall, mb: MicrobatchRecord, expected: Optional[CPScope], vscope: CPScope,
                  cu: Optional[list], index: int) -> list[Mismatch]:
    """This rank's own findings: attention under another scope than the active one, RoPE with other offsets."""
    scope, fmt = call.scope, call.qkv_format
    where = dict(mb.where(index), group=group_of(vscope))
    if expected is not None and not same_scope(expected, scope):
        return [Mismatch(
            "attention", "scope", me(),
            f"attention ran under {describe(scope)} (an explicit group=, or a module's own scope) while the active "
            f"scope is {describe(expected)}", {"used": describe(scope), "active": describe(expected)}, **where)]
    if call.error is not None or not mb.rope_layouts:
        return []
    shape = tuple(call.q.shape)
    layout = ("thd", tuple(cu)) if fmt == "thd" else ("dense", (shape[1] if fmt == "bshd" else shape[0]) * scope.size)
    if layout in mb.rope_layouts:
        return []
    return [Mismatch(
        "rope", "offsets", me(),
        f"RoPE before this call rotated with offsets {_show_layout(mb.rope_layouts[0])} but attention runs with "
        f"{_show_layout(layout)}: positions and attention disagree on the layout",
        {"rope": mb.rope_layouts[0], "attention": layout}, **where)]


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


def _digest(t: Tracker, vscope: CPScope, call: AttentionCall, cu: Optional[list], mb: MicrobatchRecord, index: int,
            members: list) -> dict[str, int]:
    """This rank's fixed-size digest of the call (same keys on every rank, whatever the inputs)."""
    scope, q = call.scope, call.q
    shapes = _shape_fields(q, call.k, call.qkv_format)
    # the real offsets too: under one padded layout, other real lengths are other padding masks
    real = call.pack.real if call.error is None and call.pack is not None else None
    if cu is not None:
        offsets, docs = hash64((tuple(cu), real)), len(cu) - 1
    else:
        offsets, docs = hash64(("dense", shapes["local_len"] * scope.size, real)), shapes["batch"]
    comm = call.variant.name if call.variant is not None else (call.comm or scope.comm or "p2p")
    return {
        "valid": int(call.error is None), "pending": int(t.verdicts.has_pending), "global_rank": me(),
        "cp_rank": vscope.rank, "cp_size": scope.size, "members": hash64(tuple(members)),
        "step": -1 if mb.step is None else mb.step, "microbatch": mb.index, "call": index,
        "qkv_format": FORMATS.get(call.qkv_format, 0), "causal": int(bool(call.causal)), "comm": comm_code(comm),
        "dtype": DTYPES.get(getattr(q, "dtype", None), 0), **shapes, "offsets": offsets, "docs": docs,
        "scale": float_bits(call.scale) if call.scale is not None else -1, **_features(call), **_data_fields(call),
    }


def _data_fields(call: AttentionCall) -> dict[str, int]:
    """What the rank holds: a fingerprint of its q, k and v (equal only for equal data) and whether its q rows
    differ from each other. Ranks of a CP group that hold the same, non-constant rows did not zigzag-shard: every
    rank of a correct CP2 group holds other chunks of the sequence."""
    if call.error is not None:
        return {"data": 0, "distinct": 0}
    seq = 1 if call.qkv_format == "bshd" else 0
    parts = []
    with torch.no_grad():
        for t in (call.q, call.k, call.v):
            x = t.detach().double().flatten()
            w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
            parts.append(torch.stack([x.sum(), (x * x).sum(), (x * w).sum()]))
        q = call.q.detach()
        distinct = (q != q.narrow(seq, 0, 1)).any() if q.shape[seq] > 1 else torch.zeros((), dtype=torch.bool)
        host = torch.cat(parts + [distinct.double().reshape(1).to(parts[0].device)]).tolist()
    return {"data": hash64(tuple(host[:-1])), "distinct": int(host[-1])}


def _unsharded(rows: list[dict[str, int]], members: list, where: dict) -> list[Mismatch]:
    """Every rank holds the same non-constant q / k / v: the inputs were not zigzag-sharded (e.g. the full rows)."""
    if len(rows) < 2 or not all(r["valid"] and r["distinct"] for r in rows):
        return []
    if len({r["data"] for r in rows}) != 1:
        return []
    return [Mismatch(
        "sharding", "not sharded", -1,
        f"every rank of the group {list(members)} holds the same q, k and v rows: the inputs are not zigzag-sharded "
        "(each rank must hold its own chunks of the sequence: cut them with cpscope.zigzag_shard inside the "
        "runtime_cp scope); attention would treat them as one sequence of cp times their length",
        {"ranks": list(members)}, **where)]


def _agree(t: Tracker, vscope: CPScope, call: AttentionCall, cu: Optional[list], mb: MicrobatchRecord,
           index: int) -> bool:
    """The agreement collective over ``vscope``'s group; returns whether the numeric check may go on."""
    members = list(group_of(vscope))
    t.verdicts.count("agreement")
    rows = exchange(vscope.group, _digest(t, vscope, call, cu, mb, index, members),
                    collective_device(vscope.group, call.q.device), timeout=t.opts.timeout)
    problems = disagreements(rows, members=members, fields=_SHARED)
    invalid = [members[i] for i, r in enumerate(rows) if not r["valid"]]
    if not problems and not invalid:
        unsharded = _unsharded(rows, members, dict(mb.where(index), group=tuple(members)))
        if unsharded:  # the same verdict on every rank (it reads the gathered rows only)
            t.verdicts.emit(unsharded, consistent=True)
            return False
    if problems or invalid:
        _report_disagreement(t, vscope, call, cu, problems, invalid, dict(mb.where(index), group=tuple(members)))
        return False
    pending = [members[i] for i, r in enumerate(rows) if r["pending"]]
    if pending:
        t.verdicts.raise_pending([r for r in pending if r != me()])
    return True


def _report_disagreement(t: Tracker, vscope: CPScope, call: AttentionCall, cu: Optional[list], problems: list,
                         invalid: list, where: dict) -> None:
    """Fetch the details (offsets, error messages) and report; raises on every rank unless the policy only logs a
    difference the ring survives."""
    err = call.error
    members = where["group"]
    real = call.pack.real if err is None and call.pack is not None else None
    details = exchange_objects(vscope.group, {"cu": None if cu is None else cu[:17],
                                              "real": None if real is None else list(real[:17]),
                                              "error": None if err is None else str(err)})
    ms = []
    for p in problems:
        msg, figs = p.message, dict(p.figures)
        if p.field in ("offsets", "docs") and any(d["cu"] is not None for d in details):
            figs["cu_seqlens"] = {members[i]: d["cu"] for i, d in enumerate(details)}
            msg += " — cu_seqlens (first 17): " + ", ".join(
                f"rank {members[i]}: {d['cu']}" for i, d in enumerate(details))
        if p.field == "offsets" and any(d["real"] is not None for d in details):
            figs["real_offsets"] = {members[i]: d["real"] for i, d in enumerate(details)}
            msg += " — real offsets (first 17): " + ", ".join(
                f"rank {members[i]}: {d['real']}" for i, d in enumerate(details))
        for r in p.ranks or (-1,):
            ms.append(Mismatch("agreement", p.field, r, msg, figs, **where))
    for i, d in enumerate(details):
        if d["error"] is not None:
            ms.append(Mismatch("agreement", "invalid inputs", members[i],
                               f"rank {members[i]} refused its attention inputs: {d['error']}", {}, **where))
    structural = bool(invalid) or any(p.field in _STRUCTURAL for p in problems)
    if err is not None:
        try:
            t.verdicts.emit(ms, consistent=True, force_raise=True)
        except Exception:  # noqa: BLE001 - this rank's own ValueError is the better message
            pass
        raise err
    t.verdicts.emit(ms, consistent=True, force_raise=structural)
