"""Agreement: do all members of a group run the same thing? Per sampled call, one fixed-size digest per rank and one
``all_gather``; per group, once, a handshake on how the sentinel itself runs.

**The digest.** Every rank encodes what it is about to run — group size, members and their order, its own global
and CP rank, offsets (a hash of ``cu_seqlens``), local lengths, layout, ``causal``, the communication variant,
dtype, heads, softmax scale, which microbatch and which call — as a fixed-length int64 vector. The vectors are
all-gathered over the group (``comm.exchange``: the size never depends on the inputs, so the collective cannot hang
on a disagreement) and every rank compares them identically, so every rank reaches the same verdict. Only when
something differs does a second collective fetch the details (the offsets themselves, an error message) for the
report. This module encodes and compares; :mod:`.comm` runs the collectives.

**The handshake.** Sampling runs collectives that every member of a group must enter together, so every member must
have the sentinel on, with the same ``every``, the same policy and checks, at the same unit. At a group's first
sampled unit each member publishes these choices in the job's rendezvous store (``torch.distributed``'s default
store: no collective, so a member that is not there cannot leave another waiting inside one) and waits, at most
``timeout`` seconds, for every other member's. Every member then compares the same rows and raises the same
:class:`SentinelError`, naming the ranks and the choices that differ; a member that never publishes (the sentinel is
off there, or was switched on later) is named by the members that waited for it. Without a default store (a group
made another way) the handshake is one timed all-gather instead.

Example::

    rows = exchange(group, {"cp_size": 2, "offsets": hash64(cu), ...}, torch.device("cpu"))
    for d in disagreements(rows, members=group_ranks(group), fields=("cp_size", "offsets")):
        print(d.field, d.ranks, d.message)

    rows = handshake(scope, {"every": 100, "index": 0}, timeout=300.0)   # every member's choices, or SentinelError
"""
from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .._variants import COMM_CHOICES
from ..scope import CPScope
from .comm import collective_device, exchange, group_of, me
from .report import Mismatch, SentinelError

__all__ = ["hash64", "float_bits", "disagreements", "Disagreement", "FORMATS", "DTYPES", "comm_code", "LABELS",
           "handshake", "check_rows", "options_code", "OPTION_LABELS"]

FORMATS = {"bshd": 1, "sbhd": 2, "thd": 3}
DTYPES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
_COMMS = COMM_CHOICES  # codes 1.. in the order of cpscope's one list of variant names

# Human names of the fields, for the reports.
LABELS = {
    "valid": "inputs pass validation",
    "pending": "a mismatch found locally",
    "cp_size": "CP size",
    "members": "group members (global ranks, in order)",
    "step": "step",
    "microbatch": "microbatch index in the group",
    "call": "attention call index (layer)",
    "qkv_format": "layout (qkv_format)",
    "causal": "causal",
    "comm": "communication variant",
    "dtype": "dtype",
    "batch": "batch size",
    "local_len": "local length",
    "heads": "q heads",
    "kv_heads": "k/v heads",
    "head_dim": "head dim",
    "offsets": "offsets (cu_seqlens)",
    "docs": "documents",
    "scale": "softmax scale",
    "seqs": "documents of the microbatch (seqs)",
    "window": "sliding window",
    "softcap": "softcap",
    "sinks": "attention sinks given",
}


def hash64(values: Any) -> int:
    """A process-independent signed 64-bit hash of ``repr(values)`` (ints, tuples, strings)."""
    raw = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def float_bits(x: float) -> int:
    """The bits of a float64 as a signed int64 (exact comparison of softmax scales)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def comm_code(comm: Optional[str]) -> int:
    """A communication variant as an int64 digest field (small codes for the known names)."""
    name = "p2p" if comm is None else str(comm)
    return _COMMS.index(name) + 1 if name in _COMMS else hash64(name)


@dataclass(frozen=True)
class Disagreement:
    """One field that differs across the gathered rows, and the ranks off the majority."""

    field: str
    ranks: tuple[int, ...]  # global ranks that differ from the majority (all, when there is no majority)
    message: str
    figures: dict


def _show(name: str, value: int) -> str:
    if name == "qkv_format":
        return next((k for k, v in FORMATS.items() if v == value), str(value))
    if name == "dtype":
        return next((str(k).replace("torch.", "") for k, v in DTYPES.items() if v == value), str(value))
    if name == "comm":
        return _COMMS[value - 1] if 1 <= value <= len(_COMMS) else f"{value & 0xFFFFFFFFFFFFFFFF:#018x}"
    if name in ("window", "softcap") and value == -1:
        return "none"
    if name in ("scale", "softcap") and value != -1:
        return f"{struct.unpack('<d', struct.pack('<q', value))[0]:.6g}"
    if name in ("members", "offsets", "seqs", "window") and value != -1:
        return f"#{value & 0xFFFFFFFFFFFFFFFF:016x}"
    if name in ("causal", "sinks"):
        return str(bool(value))
    return str(value)


def disagreements(
    rows: list[dict[str, int]], *, members: Sequence[int], fields: Sequence[str]
) -> list[Disagreement]:
    """Compare the gathered rows: member order (row ``i`` is global rank ``members[i]``, CP rank ``i``), then each
    field of ``fields`` across ranks. Identical on every rank (it only reads the gathered rows)."""
    out: list[Disagreement] = []
    order_bad = [
        i for i, r in enumerate(rows)
        if ("global_rank" in r and i < len(members) and r["global_rank"] != members[i])
        or ("cp_rank" in r and r["cp_rank"] != i)
    ]
    if order_bad or len(rows) != len(members):
        seen = [(r.get("global_rank"), r.get("cp_rank")) for r in rows]
        out.append(Disagreement(
            "members", tuple(int(rows[i].get("global_rank", -1)) for i in order_bad),
            f"group position i holds (global rank, CP rank) {seen}, but group_ranks() lists {list(members)}: the "
            "ring's peers and cp_rank() disagree",
            {"gathered": seen, "group_ranks": list(members)},
        ))
    for name in fields:
        vals = [r[name] for r in rows]
        if len(set(vals)) <= 1:
            continue
        counts: dict[int, int] = {}
        for v in vals:
            counts[v] = counts.get(v, 0) + 1
        top = max(counts.values())
        majority = vals[0] if counts[vals[0]] == top else max(counts, key=counts.get)
        if list(counts.values()).count(top) > 1:  # no strict majority: name every rank
            odd = list(range(len(vals)))
        else:
            odd = [i for i, v in enumerate(vals) if v != majority]
        g = [int(rows[i].get("global_rank", members[i] if i < len(members) else i)) for i in range(len(rows))]
        per_rank = {g[i]: _show(name, vals[i]) for i in range(len(vals))}
        label = LABELS.get(name, name)
        text = ", ".join(f"rank {r}: {v}" for r, v in per_rank.items())
        out.append(Disagreement(name, tuple(g[i] for i in odd), f"{label} differs across the group — {text}",
                                {"values": per_rank}))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The handshake: the members of a group agree on the sentinel itself

_ROUNDS: dict[str, int] = {}  # handshakes so far per group name, in this process (every member counts alike)
_LOCK = threading.Lock()

# Human names of the handshake's fields, for the reports.
OPTION_LABELS = {"rows": "rows (checked per rank)", "every": "every", "index": "unit index (sampling counter)",
                 "policy": "on_mismatch", "on": "sentinel on",
                 "checks": "checks switched on (attention, gradients, positions, loss, labels)"}


def _store() -> Optional[Any]:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _group_name(scope: CPScope) -> str:
    name = getattr(scope.group, "group_name", None)
    return str(name) if name else "/".join(map(str, group_of(scope)))


def handshake(scope: CPScope, values: dict[str, int], *, timeout: float) -> list[dict[str, int]]:
    """Every member's ``values`` (same keys everywhere), in group order; ``SentinelError`` on every member that
    publishes when a member is missing after ``timeout`` seconds or the values differ."""
    members = list(group_of(scope))
    name = _group_name(scope)
    with _LOCK:
        n = _ROUNDS.get(name, 0)
        _ROUNDS[name] = n + 1
    store = _store()
    if store is None:
        rows = exchange(scope.group, values, collective_device(scope.group), timeout=timeout, what="handshake")
    else:
        rows = _through_store(store, f"cpscope-sentinel/{name}/{n}", members, values, timeout)
    check_rows(rows, members)
    return rows


def _through_store(store: Any, base: str, members: list[int], values: dict[str, int],
                   timeout: float) -> list[dict[str, int]]:
    store.set(f"{base}/{me()}", json.dumps(values))
    keys = [f"{base}/{r}" for r in members]
    try:  # waits in the store (no polling: at scale, thousands of ranks may wait at once)
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # a timeout (DistStoreError is one), or the store gone
        missing = [r for r in members if not store.check([f"{base}/{r}"])]
        if missing:
            raise SentinelError([Mismatch(
                "agreement", "sentinel on", r,
                f"rank {r} of the group {members} did not reach the sentinel's first check on this group within "
                f"{timeout:g} s: switch the sentinel on at the same point on every rank (before the loop), with "
                f"the same options — or rank {r} stalled or died", {"missing": missing, "timeout_s": timeout},
                group=tuple(members)) for r in missing]) from None
    return [json.loads(store.get(k).decode()) for k in keys]


def check_rows(rows: list[dict[str, int]], members: list[int]) -> None:
    """Raise the same :class:`SentinelError` on every member when the rows differ (they are the same rows there)."""
    fields = [f for f in rows[0] if f not in ("global_rank", "cp_rank")]
    problems = disagreements(rows, members=members, fields=fields)
    if not problems:
        return
    ms = []
    for p in problems:
        label = OPTION_LABELS.get(p.field, p.field)
        per_rank = ", ".join(f"rank {members[i]}: {r.get(p.field)}" for i, r in enumerate(rows))
        msg = (f"the ranks of the group {members} run the sentinel with another {label} — "
               f"{per_rank}: sampled units would run collectives on some ranks only; switch it on at the same point "
               "on every rank, with the same options")
        ms.extend(Mismatch("agreement", label, r, msg, p.figures, group=tuple(members)) for r in (p.ranks or (-1,)))
    raise SentinelError(ms)


def options_code(opts: Any) -> dict[str, int]:
    """The options that decide which collectives a sampled unit runs, as digest fields."""
    pol = opts.on_mismatch
    policy = 3 if callable(pol) else {"raise": 1, "log": 2}.get(pol, 0)
    checks = sum(int(bool(b)) << i for i, b in enumerate(
        (opts.attention, opts.gradients, opts.positions, opts.loss, opts.labels is not None)))
    return {"on": 1, "every": int(opts.every), "policy": policy, "checks": checks, "rows": int(opts.rows)}

